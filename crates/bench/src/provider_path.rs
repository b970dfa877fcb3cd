//! Figure 12: a step through a real provider client. The scenario of
//! figure 1 (K tool steps, then a text), but the model is the Anthropic
//! client talking over loopback to the testkit's fake provider, which runs
//! in a process of its own (`markov-bench fake-provider <K>`) and answers at
//! once, keeping its connection alive. What this process spends per step is
//! markov's side of a model call: building and sending the request, reading
//! and decoding the answer, the step itself.
//!
//! The client's CPU is read from `/proc/self/stat` (all of the process's
//! threads, those that ended included); the fake's CPU is not in it. Wall
//! time per step includes the fake's work, which grows with the request
//! (it parses every body it receives), so only the CPU figure says what the
//! client costs at large K.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use markov_bench::{Scenario, USER_MESSAGE, run_turn, tool_call};
use markov_executor::{Agent, StandardExecutor};
use markov_providers::Anthropic;
use markov_testkit::Recording;
use markov_testkit::http::{FakeServer, Recorded, Reply, anthropic};
use serde_json::json;

use crate::CpuSplit;

/// How the client asks: a plain call, or a streamed one (as the server does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    Plain,
    Streamed,
}

impl Call {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Call::Plain => "plain",
            Call::Streamed => "streamed",
        }
    }
}

/// One run of figure 12.
#[derive(Debug)]
pub(crate) struct ProviderPathFigure {
    pub(crate) call: Call,
    pub(crate) k: usize,
    pub(crate) steps: usize,
    pub(crate) wall_per_step_us: f64,
    /// This process's CPU per step, user and kernel.
    pub(crate) cpu: CpuPerStep,
    /// Allocations per step in this process (counted in a pass of its own,
    /// so counting costs the timed pass nothing).
    pub(crate) allocations_per_step: f64,
    /// Connections the client opened to the fake, as the fake counted them.
    pub(crate) connections: usize,
    /// The floor under the step: the same requests' bytes written to the
    /// same fake and its answers read, with nothing built or decoded.
    pub(crate) floor: Floor,
}

/// CPU per step, in µs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuPerStep {
    /// In the process's own code.
    pub(crate) user_us: f64,
    /// In the kernel on its behalf.
    pub(crate) kernel_us: f64,
}

/// `time` spread over `steps`, in µs.
fn per_step_us(time: Duration, steps: usize) -> f64 {
    time.as_secs_f64() * 1e6 / steps.max(1) as f64
}

/// This process's CPU so far (zero where `/proc` cannot be read).
fn cpu_now() -> CpuSplit {
    crate::process_cpu_split("self").unwrap_or_default()
}

impl CpuPerStep {
    fn of(cpu: CpuSplit, steps: usize) -> CpuPerStep {
        CpuPerStep {
            user_us: per_step_us(cpu.user, steps),
            kernel_us: per_step_us(cpu.kernel, steps),
        }
    }

    /// User and kernel together.
    pub(crate) fn total_us(&self) -> f64 {
        self.user_us + self.kernel_us
    }
}

/// `total (own + kernel)`, as figure 12's table shows it.
impl std::fmt::Display for CpuPerStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = format!(
            "{:.1} ({:.1} + {:.1})",
            self.total_us(),
            self.user_us,
            self.kernel_us
        );
        f.pad(&text)
    }
}

/// What the bare exchange of a step's bytes costs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Floor {
    pub(crate) wall_per_step_us: f64,
    pub(crate) cpu: CpuPerStep,
}

/// The fake's answer to a request of a turn of `k` tool steps: the next
/// tool call while fewer than `k` were made (one per assistant message so
/// far), then `"done"`; streamed when the request asks for a stream.
fn answer(request: &Recorded, k: usize) -> Reply {
    let made = request.body["messages"].as_array().map_or(0, |messages| {
        messages
            .iter()
            .filter(|m| m["role"] == json!("assistant"))
            .count()
    });
    let streamed = request.body["stream"] == json!(true);
    if made < k {
        let (name, input) = tool_call(made);
        let id = format!("toolu_{made}");
        if streamed {
            Reply::sse(&anthropic::tool_use_events(&id, name, &input))
        } else {
            Reply::json(200, anthropic::tool_use(&id, name, &input))
        }
    } else if streamed {
        Reply::sse(&anthropic::text_events("done"))
    } else {
        Reply::json(200, anthropic::text("done"))
    }
}

/// `markov-bench fake-provider <K>`: serves the fake of a turn of `k` tool
/// steps on a free loopback port, prints `url=<base> ` and then, when its
/// standard input closes, `connections=<n>` and exits.
pub(crate) fn fake_provider(k: usize) -> ExitCode {
    let runtime = io_runtime();
    runtime.block_on(async move {
        let server = FakeServer::start().await;
        server
            .answer_with(move |request| answer(request, k))
            .recording(Recording::Off);
        println!("url={}", server.base_url());
        // Served until the bench closes our input.
        let _ = tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            std::io::stdin().read_to_end(&mut sink)
        })
        .await;
        println!("connections={}", server.connections());
    });
    ExitCode::SUCCESS
}

/// A one-thread runtime with sockets and timers.
fn io_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// The fake provider for `k`, started as a child process, and its URL.
fn start_fake(k: usize) -> (Child, String) {
    let exe = std::env::current_exe().expect("the bench binary");
    let mut child = Command::new(exe)
        .args(["fake-provider", &k.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the fake provider starts");
    let mut line = String::new();
    if let Some(out) = child.stdout.as_mut() {
        let _ = BufReader::new(out).read_line(&mut line);
    }
    let url = line.trim().trim_start_matches("url=").to_owned();
    (child, url)
}

/// Stops the fake and reads the connections it counted.
fn stop_fake(mut child: Child) -> usize {
    drop(child.stdin.take());
    let mut rest = String::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_string(&mut rest);
    }
    let _ = child.wait();
    rest.lines()
        .find_map(|l| l.strip_prefix("connections=")?.trim().parse().ok())
        .unwrap_or(0)
}

/// Figure 12 for one way of calling and one K: `turns` turns of `k` tool
/// steps, each on a fresh machine, after one turn of warm-up; then the
/// same turns' bytes exchanged bare (the floor), and a shorter pass that
/// counts allocations.
pub(crate) fn figure(call: Call, k: usize, turns: usize) -> ProviderPathFigure {
    let (child, url) = start_fake(k);
    let runtime = io_runtime();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let agent = |url: &str| {
        let client = Anthropic::builder()
            .api_key("sk-ant-bench")
            .base_url(url)
            .max_retries(0)
            .timeout(Duration::from_secs(120))
            .build()
            .expect("the client builds");
        let executor = match call {
            Call::Plain => StandardExecutor::new(client),
            Call::Streamed => StandardExecutor::new(client).with_streaming(|_| {}),
        };
        Agent::on_charter_with_executor(
            Scenario::new().charter().clone(),
            std::sync::Arc::new(executor),
        )
        .build()
        .expect("the benchmark agent builds")
    };
    let turn = |agent: &Agent| {
        let mut machine = agent.machine();
        machine.enqueue_user(USER_MESSAGE);
        runtime.block_on(run_turn(&mut machine, k))
    };
    let measured = agent(&url);
    turn(&measured);
    let cpu_before = cpu_now();
    let start = Instant::now();
    let steps: usize = (0..turns).map(|_| turn(&measured)).sum();
    let wall = start.elapsed();
    let cpu = cpu_now().since(cpu_before);

    let window = crate::counting::Window::open();
    let counted_turns = (turns / 10).max(1);
    let counted_steps: usize = (0..counted_turns).map(|_| turn(&measured)).sum();
    let allocations = window.close().allocations;
    drop(measured);

    // The floor: one turn's requests as the client wrote them (recorded by
    // a fake in this process), sent again byte for byte to the same fake.
    let requests = runtime.block_on(async {
        let recorder = FakeServer::start().await;
        recorder.answer_with(move |request| answer(request, k));
        let mut machine = agent(&recorder.base_url()).machine();
        machine.enqueue_user(USER_MESSAGE);
        run_turn(&mut machine, k).await;
        recorder.requests()
    });
    let raw: Vec<Vec<u8>> = requests.iter().map(raw_request).collect();
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    let floor_before = cpu_now();
    let floor_start = Instant::now();
    let floor_steps = runtime
        .block_on(exchange_bare(&addr, &raw, turns))
        .expect("the bare exchange with the fake");
    let floor_wall = floor_start.elapsed();
    let floor_cpu = cpu_now().since(floor_before);

    // The bare exchange opened one connection of its own.
    let connections = stop_fake(child).saturating_sub(1);
    let figure = ProviderPathFigure {
        call,
        k,
        steps,
        wall_per_step_us: per_step_us(wall, steps),
        cpu: CpuPerStep::of(cpu, steps),
        allocations_per_step: allocations as f64 / counted_steps.max(1) as f64,
        connections,
        floor: Floor {
            wall_per_step_us: per_step_us(floor_wall, floor_steps),
            cpu: CpuPerStep::of(floor_cpu, floor_steps),
        },
    };
    println!(
        "bench=provider_path call={} k={} steps={} wall_per_step_us={:.1} client_cpu_per_step_us={:.1} client_user_us={:.1} client_kernel_us={:.1} allocations_per_step={:.0} connections={} floor_wall_per_step_us={:.1} floor_cpu_per_step_us={:.1} floor_user_us={:.1} floor_kernel_us={:.1}",
        figure.call.as_str(),
        figure.k,
        figure.steps,
        figure.wall_per_step_us,
        figure.cpu.total_us(),
        figure.cpu.user_us,
        figure.cpu.kernel_us,
        figure.allocations_per_step,
        figure.connections,
        figure.floor.wall_per_step_us,
        figure.floor.cpu.total_us(),
        figure.floor.cpu.user_us,
        figure.floor.cpu.kernel_us,
    );
    figure
}

/// A recorded request as bytes on the wire: its line, the headers a
/// minimal client sends, and its body (the recorded JSON written again,
/// as long as the client's: neither adds whitespace).
fn raw_request(request: &Recorded) -> Vec<u8> {
    let body = serde_json::to_vec(&request.body).expect("JSON writes");
    let mut raw = format!(
        "{} {} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        request.method,
        request.path,
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(&body);
    raw
}

/// Writes each request to one kept-alive connection to `addr` and reads
/// its whole answer, `turns` times over, with nothing built or decoded:
/// what any HTTP/1.1 client pays per step on this machine. Answers the
/// number of exchanges.
async fn exchange_bare(addr: &str, requests: &[Vec<u8>], turns: usize) -> std::io::Result<usize> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await?;
    socket.set_nodelay(true)?;
    let mut buffer = Vec::with_capacity(64 * 1024);
    for _ in 0..turns {
        for request in requests {
            socket.write_all(request).await?;
            buffer.clear();
            while !answer_complete(&buffer) {
                if socket.read_buf(&mut buffer).await? == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the fake closed the connection mid-answer",
                    ));
                }
            }
        }
    }
    Ok(turns * requests.len())
}

/// Whether `bytes` hold a whole answer of the fake: a head, then a body of
/// its `content-length` or a chunked body through its last chunk.
fn answer_complete(bytes: &[u8]) -> bool {
    let Some(head_end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&bytes[..head_end]).to_ascii_lowercase();
    let body = &bytes[head_end + 4..];
    match head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|n| n.trim().parse::<usize>().ok())
    {
        Some(length) => body.len() >= length,
        None => body.ends_with(b"0\r\n\r\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::{CpuPerStep, answer_complete};

    #[test]
    fn cpu_per_step_shows_its_total_then_its_parts_in_a_padded_cell() {
        let cpu = CpuPerStep {
            user_us: 74.04,
            kernel_us: 39.1,
        };
        assert_eq!(format!("{cpu:>22}"), "   113.1 (74.0 + 39.1)");
    }

    #[test]
    fn an_answer_is_complete_by_its_length_or_its_last_chunk() {
        let head = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n";
        assert!(!answer_complete(b"HTTP/1.1 200 OK\r\ncontent-len"));
        assert!(!answer_complete(format!("{head}abcd").as_bytes()));
        assert!(answer_complete(format!("{head}abcde").as_bytes()));
        let chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n";
        assert!(!answer_complete(chunked.as_bytes()));
        assert!(answer_complete(format!("{chunked}0\r\n\r\n").as_bytes()));
    }

    #[test]
    fn process_cpu_is_read_and_grows_with_work() {
        let before = crate::process_cpu("self").expect("Linux reports utime and stime");
        // Busy until the kernel has counted a tick of it (bounded, so a
        // reading that never moves fails rather than hangs).
        let start = std::time::Instant::now();
        let mut x = 0u64;
        let mut after = before;
        while after == before && start.elapsed() < std::time::Duration::from_secs(20) {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            after = crate::process_cpu("self").expect("Linux reports utime and stime");
        }
        assert!(after > before, "{before:?} then {after:?}");
    }
}
