//! Figure 7: the HTTP service under load. N sessions at once, each created
//! over HTTP and sent one message whose answer comes from the Anthropic
//! client talking to the loopback fake provider, which answers after
//! 100 ms; the runs are stored in SQLite (in memory) and streamed back as
//! server-sent events.

use std::sync::Arc;
use std::time::{Duration, Instant};

use markov_executor::Agent;
use markov_providers::Anthropic;
use markov_server::{Limits, Server, create_api_key};
use markov_store::{SqliteStore, WorkerId};
use markov_testkit::Recording;
use markov_testkit::http::{FakeServer, Recorded, Reply, anthropic};
use serde_json::json;

use crate::Stats;

/// The fake provider's latency.
pub(crate) const MODEL_LATENCY: Duration = Duration::from_millis(100);

/// One load run.
#[derive(Debug)]
pub(crate) struct ServerFigure {
    pub(crate) sessions: usize,
    pub(crate) completed: usize,
    pub(crate) wall: Duration,
    /// Latency of a message (request to end of stream) minus the model's.
    pub(crate) added: Stats,
    pub(crate) vm_hwm_kb: u64,
}

/// The fake provider's answer after [`MODEL_LATENCY`]: streamed when the
/// request asks for a stream (the server streams its model calls).
pub(crate) fn answer(request: &Recorded) -> Reply {
    let reply = if request.body["stream"] == json!(true) {
        Reply::sse(&anthropic::text_events("ok"))
    } else {
        Reply::json(200, anthropic::text("ok"))
    };
    reply.delayed(MODEL_LATENCY)
}

async fn load(n: usize) -> ServerFigure {
    let provider = FakeServer::start().await;
    provider.answer_with(answer).recording(Recording::Off);
    let _ = rustls::crypto::ring::default_provider().install_default();
    let model = Anthropic::builder()
        .api_key("sk-ant-bench")
        .base_url(provider.base_url())
        .max_retries(0)
        .timeout(Duration::from_secs(120))
        .build()
        .expect("the client builds");
    let agent = Agent::builder("load")
        .instructions("Answer.")
        .model(model)
        .build()
        .expect("the agent builds");
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let (server, key) = bench_server(agent, store, WorkerId::new("bench")).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let base = format!("http://{}", listener.local_addr().expect("an address"));
    tokio::spawn(server.serve(listener));

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("a client");
    // Every session first, then every message at once: N sessions held.
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let created = client
            .post(format!("{base}/sessions"))
            .bearer_auth(&key)
            .send()
            .await
            .expect("created");
        let body: serde_json::Value = created.json().await.expect("json");
        ids.push(body["id"].as_str().unwrap_or_default().to_owned());
    }
    let start = Instant::now();
    let runs = ids.into_iter().map(|id| {
        let client = client.clone();
        let url = format!("{base}/sessions/{id}/messages");
        let key = key.clone();
        tokio::spawn(async move {
            let sent = Instant::now();
            let stream = client
                .post(url)
                .bearer_auth(&key)
                .json(&json!({"text": "hi"}))
                .send()
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            if !stream.contains("event: done") {
                // A figure of failed runs would measure nothing: say why.
                eprintln!(
                    "a run failed: {}",
                    stream.lines().take(3).collect::<Vec<_>>().join(" | ")
                );
                return None;
            }
            Some(sent.elapsed().saturating_sub(MODEL_LATENCY))
        })
    });
    let results = futures::future::join_all(runs).await;
    let wall = start.elapsed();
    let added: Vec<Duration> = results
        .into_iter()
        .filter_map(|r| r.ok().flatten())
        .collect();
    ServerFigure {
        sessions: n,
        completed: added.len(),
        wall,
        added: Stats::of(&added),
        vm_hwm_kb: crate::proc_status_kb("VmHWM").unwrap_or(0),
    }
}

/// Figure 7 for each N, on a 2-worker runtime.
pub(crate) fn server_figures(ns: &[usize]) -> Vec<ServerFigure> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    ns.iter()
        .map(|&n| {
            let figure = runtime.block_on(load(n));
            println!(
                "bench=server sessions={} completed={} wall_ms={:.0} steps_per_s={:.0} added_p50_ms={:.1} added_p99_ms={:.1} vm_hwm_mb={:.1}",
                figure.sessions,
                figure.completed,
                figure.wall.as_secs_f64() * 1e3,
                figure.completed as f64 / figure.wall.as_secs_f64(),
                figure.added.median_us / 1e3,
                figure.added.p99_us / 1e3,
                figure.vm_hwm_kb as f64 / 1024.0
            );
            figure
        })
        .collect()
}

/// The server of one worker process: the demo-less agent of figure 7 over
/// the provider at `provider_url`, on a free loopback port, which it prints
/// (`port=N`) before it serves until it is killed.
pub(crate) fn worker(provider_url: &str, database: Option<&str>) -> std::process::ExitCode {
    answer_heap_requests();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let model = Anthropic::builder()
            .api_key("sk-ant-bench")
            .base_url(provider_url)
            .max_retries(0)
            .timeout(Duration::from_secs(300))
            .build()
            .expect("the client builds");
        let agent = Agent::builder("load")
            .instructions("Answer.")
            .model(model)
            .build()
            .expect("the agent builds");
        let store = Arc::new(match database {
            Some(path) => SqliteStore::open(path).expect("a database file"),
            None => SqliteStore::in_memory().expect("a database"),
        });
        let (server, key) = bench_server(agent, store, WorkerId::random()).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        // One line: where to send requests, and with which key.
        println!(
            "port={} key={key}",
            listener.local_addr().expect("an address").port()
        );
        let _ = server.serve(listener).await;
    });
    std::process::ExitCode::SUCCESS
}

/// Lets the process that started this worker read its live heap: on a
/// `heap-open` line on stdin the counting allocator starts counting from
/// zero; on `heap <path>` the bytes allocated and not freed since are
/// written to `path`. Nothing is counted until asked, so the figures that
/// do not ask pay nothing for it.
fn answer_heap_requests() {
    std::thread::spawn(|| {
        use std::io::BufRead;
        let mut window = None;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line == "heap-open" {
                window = Some(crate::counting::Window::open());
            } else if let Some(path) = line.strip_prefix("heap ") {
                let net = window.as_ref().map_or(0, crate::counting::Window::net);
                let _ = std::fs::write(path, net.to_string());
            }
        }
    });
}

/// The client process: `n` sessions spread over `bases`, one message each,
/// all at once; prints one `result ...` line.
pub(crate) fn clients(n: usize, bases: &[&str]) -> std::process::ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let (completed, wall, added, cpu) = runtime.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .expect("a client");
        let mut urls = Vec::with_capacity(n);
        for i in 0..n {
            let (base, key) = bases[i % bases.len()]
                .split_once('#')
                .expect("a worker is `<base>#<key>`");
            let created = client
                .post(format!("{base}/sessions"))
                .bearer_auth(key)
                .send()
                .await
                .expect("created");
            let body: serde_json::Value = created.json().await.expect("json");
            urls.push((
                format!(
                    "{base}/sessions/{}/messages",
                    body["id"].as_str().unwrap_or_default()
                ),
                key.to_owned(),
            ));
        }
        // The parent reads CPU counters from here on.
        println!("start");
        let cpu_before = crate::process_cpu("self").unwrap_or_default();
        let start = Instant::now();
        let runs = urls.into_iter().map(|(url, key)| {
            let client = client.clone();
            tokio::spawn(async move {
                let sent = Instant::now();
                let stream = client
                    .post(url)
                    .bearer_auth(&key)
                    .json(&json!({"text": "hi"}))
                    .send()
                    .await
                    .ok()?
                    .text()
                    .await
                    .ok()?;
                stream
                    .contains("event: done")
                    .then(|| sent.elapsed().saturating_sub(MODEL_LATENCY))
            })
        });
        let results = futures::future::join_all(runs).await;
        let wall = start.elapsed();
        let added: Vec<Duration> = results
            .into_iter()
            .filter_map(|r| r.ok().flatten())
            .collect();
        let cpu = crate::process_cpu("self")
            .unwrap_or_default()
            .saturating_sub(cpu_before);
        (added.len(), wall, Stats::of(&added), cpu)
    });
    println!(
        "result completed={completed} wall_ms={:.0} p50_ms={:.1} p99_ms={:.1} client_vm_hwm_kb={} client_cpu_ms={}",
        wall.as_secs_f64() * 1e3,
        added.median_us / 1e3,
        added.p99_us / 1e3,
        crate::proc_status_kb("VmHWM").unwrap_or(0),
        cpu.as_millis()
    );
    std::process::ExitCode::SUCCESS
}

/// A server worker process (`serve-worker <args>`) and where to reach it:
/// `http://127.0.0.1:<port>#<key>`, from the line it prints once it
/// listens.
pub(crate) fn start_worker(exe: &std::path::Path, args: &[&str]) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(exe)
        .arg("serve-worker")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("a worker starts");
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    let (port, key) = line
        .trim()
        .trim_start_matches("port=")
        .split_once(" key=")
        .map(|(p, k)| (p.to_owned(), k.to_owned()))
        .unwrap_or_default();
    (child, format!("http://127.0.0.1:{port}#{key}"))
}

/// `VmHWM` of another process, in kB.
pub(crate) fn vm_hwm_of(pid: u32) -> u64 {
    crate::proc_status_kb_of(&pid.to_string(), "VmHWM").unwrap_or(0)
}

/// CPU used by the processes `pids`, together.
fn cpu_of(pids: &[u32]) -> Duration {
    pids.iter()
        .filter_map(|pid| crate::process_cpu(&pid.to_string()))
        .sum()
}

/// Figure 7 with every part in a process of its own: the fake provider
/// here, `workers` server processes, one client process. One process
/// cannot hold four sockets for each of 10 000 sessions under a 20 000
/// descriptor limit; split this way, none needs more than two per session.
pub(crate) fn multi_process(n: usize, workers: usize) -> ProcessesFigure {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let exe = std::env::current_exe().expect("the bench binary");
    runtime.block_on(async move {
        let provider = FakeServer::start().await;
        provider.answer_with(answer).recording(Recording::Off);
        let mut children = Vec::new();
        let mut bases = Vec::new();
        for _ in 0..workers.max(1) {
            let (child, base) = start_worker(&exe, &[&provider.base_url()]);
            bases.push(base);
            children.push(child);
        }
        let worker_pids: Vec<u32> = children.iter().map(std::process::Child::id).collect();
        let (result, workers_cpu, provider_cpu) = {
            let exe = exe.clone();
            let bases = bases.join(",");
            let worker_pids = worker_pids.clone();
            tokio::task::spawn_blocking(move || {
                let mut client = Command::new(exe)
                    .args(["load-clients", &n.to_string(), &bases])
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("the clients run");
                let out = client.stdout.take().expect("the client's output");
                // CPU is counted over the messages, from the client's
                // `start` (its sessions are created) to its result.
                let mut before = (Duration::ZERO, Duration::ZERO);
                let mut result = String::new();
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if line == "start" {
                        before = (cpu_of(&worker_pids), crate::process_cpu("self").unwrap_or_default());
                    } else if line.starts_with("result") {
                        result = line;
                    }
                }
                let workers = cpu_of(&worker_pids).saturating_sub(before.0);
                let provider = crate::process_cpu("self")
                    .unwrap_or_default()
                    .saturating_sub(before.1);
                let _ = client.wait();
                (result, workers, provider)
            })
            .await
            .expect("the clients finished")
        };
        let workers_hwm_kb: u64 = worker_pids.iter().map(|&pid| vm_hwm_of(pid)).sum();
        for mut child in children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let line = if result.is_empty() { "result failed" } else { result.as_str() };
        let field = |name: &str| -> f64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
                .unwrap_or(0.0)
        };
        let figure = ProcessesFigure {
            sessions: n,
            workers,
            completed: field("completed") as usize,
            wall_ms: field("wall_ms"),
            p50_ms: field("p50_ms"),
            p99_ms: field("p99_ms"),
            workers_mb: workers_hwm_kb as f64 / 1024.0,
            clients_mb: field("client_vm_hwm_kb") / 1024.0,
            workers_cpu,
            client_cpu: Duration::from_millis(field("client_cpu_ms") as u64),
            provider_cpu,
        };
        println!(
            "bench=server_processes sessions={n} workers={workers} completed={} wall_ms={:.0} steps_per_s={:.0} added_p50_ms={:.1} added_p99_ms={:.1} workers_vm_hwm_mb={:.1} clients_vm_hwm_mb={:.1} cpu_per_step_us_workers={:.0} cpu_per_step_us_clients={:.0} cpu_per_step_us_provider={:.0}",
            figure.completed,
            figure.wall_ms,
            figure.steps_per_s(),
            figure.p50_ms,
            figure.p99_ms,
            figure.workers_mb,
            figure.clients_mb,
            figure.cpu_per_step_us(figure.workers_cpu),
            figure.cpu_per_step_us(figure.client_cpu),
            figure.cpu_per_step_us(figure.provider_cpu),
        );
        figure
    })
}

/// Figure 7 with the parts in their own processes.
#[derive(Debug)]
pub(crate) struct ProcessesFigure {
    pub(crate) sessions: usize,
    pub(crate) workers: usize,
    pub(crate) completed: usize,
    pub(crate) wall_ms: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    /// Peak resident memory of the server workers, summed.
    pub(crate) workers_mb: f64,
    pub(crate) clients_mb: f64,
    /// CPU over the messages: the server workers together, the client
    /// process, the fake provider (this process).
    pub(crate) workers_cpu: Duration,
    pub(crate) client_cpu: Duration,
    pub(crate) provider_cpu: Duration,
}

impl ProcessesFigure {
    /// `cpu` per completed step, in microseconds.
    pub(crate) fn cpu_per_step_us(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() * 1e6 / self.completed.max(1) as f64
    }

    pub(crate) fn steps_per_s(&self) -> f64 {
        if self.wall_ms > 0.0 {
            self.completed as f64 / (self.wall_ms / 1e3)
        } else {
            0.0
        }
    }
}

/// A server for load: one principal's key, and limits that let the load
/// through (the figure measures the service, not its rate limit).
async fn bench_server(agent: Agent, store: Arc<SqliteStore>, worker: WorkerId) -> (Server, String) {
    let key = create_api_key(&*store, "bench", &[])
        .await
        .expect("a key")
        .key;
    let mut limits = Limits::default();
    limits.requests_per_minute = std::num::NonZeroU32::MAX;
    limits.max_connections = 1 << 20;
    let server = Server::builder()
        .agent(agent)
        .store(store)
        .worker(worker)
        .limits(limits)
        .build()
        .expect("the server builds");
    (server, key)
}
