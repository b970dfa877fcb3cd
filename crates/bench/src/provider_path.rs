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
    pub(crate) cpu_per_step_us: f64,
    /// Connections the client opened to the fake, as the fake counted them.
    pub(crate) connections: usize,
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
/// steps, each on a fresh machine, after one turn of warm-up.
pub(crate) fn figure(call: Call, k: usize, turns: usize) -> ProviderPathFigure {
    let (child, url) = start_fake(k);
    let runtime = io_runtime();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = Anthropic::builder()
        .api_key("sk-ant-bench")
        .base_url(&url)
        .max_retries(0)
        .timeout(Duration::from_secs(120))
        .build()
        .expect("the client builds");
    let executor = match call {
        Call::Plain => StandardExecutor::new(client),
        Call::Streamed => StandardExecutor::new(client).with_streaming(|_| {}),
    };
    let agent = Agent::on_charter(Scenario::new().charter().clone())
        .executor(executor)
        .build()
        .expect("the benchmark agent builds");
    let turn = |agent: &Agent| {
        let mut machine = agent.machine();
        machine.enqueue_user(USER_MESSAGE);
        runtime.block_on(run_turn(&mut machine, k))
    };
    turn(&agent);
    let cpu_before = crate::process_cpu("self");
    let start = Instant::now();
    let steps: usize = (0..turns).map(|_| turn(&agent)).sum();
    let wall = start.elapsed();
    let cpu = crate::process_cpu("self")
        .zip(cpu_before)
        .map_or(Duration::ZERO, |(after, before)| {
            after.saturating_sub(before)
        });
    drop(agent);
    let connections = stop_fake(child);
    let per_step = |d: Duration| d.as_secs_f64() * 1e6 / steps.max(1) as f64;
    let figure = ProviderPathFigure {
        call,
        k,
        steps,
        wall_per_step_us: per_step(wall),
        cpu_per_step_us: per_step(cpu),
        connections,
    };
    println!(
        "bench=provider_path call={} k={} steps={} wall_per_step_us={:.1} client_cpu_per_step_us={:.1} connections={}",
        figure.call.as_str(),
        figure.k,
        figure.steps,
        figure.wall_per_step_us,
        figure.cpu_per_step_us,
        figure.connections
    );
    figure
}

#[cfg(test)]
mod tests {

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
