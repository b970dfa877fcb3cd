//! Figure 7: the HTTP service under load. N sessions at once, each created
//! over HTTP and sent one message whose answer comes from the Anthropic
//! client talking to the loopback fake provider, which answers after
//! 100 ms; the runs are stored in SQLite (in memory, one per worker) or in
//! one PostgreSQL all workers share, and streamed back as server-sent
//! events.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use markov_executor::Agent;
use markov_providers::Anthropic;
use markov_server::{Limits, Server, create_api_key};
use markov_store::testing::TempPostgres;
use markov_store::{KeyStore, PostgresStore, SqliteStore, Store, WorkerId};
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

/// What the fake model does with each message of figure 7.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    /// Answers the message with text: a message is one step (one model
    /// call). Figure 7's scenario.
    Text,
    /// Answers the message with one call of the `echo` tool, then, after
    /// its result, with text: a message is two steps (two model calls,
    /// each after [`MODEL_LATENCY`]). The peers' side-by-side scenario.
    ToolCall,
}

impl Scenario {
    /// Model calls (steps) per message.
    pub(crate) fn steps_per_message(self) -> usize {
        match self {
            Scenario::Text => 1,
            Scenario::ToolCall => 2,
        }
    }

    /// The fake provider's answers for this scenario.
    fn answer(self) -> fn(&Recorded) -> Reply {
        match self {
            Scenario::Text => answer,
            Scenario::ToolCall => answer_with_tool_call,
        }
    }
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

/// [`Scenario::ToolCall`]'s answer after [`MODEL_LATENCY`]: a call after a
/// tool's result (the last message holds a `tool_result` block) gets the
/// text "ok"; any other call gets one `echo` call of "hi". Streamed when
/// asked to, as [`answer`].
fn answer_with_tool_call(request: &Recorded) -> Reply {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if follows_a_tool_result(&request.body) {
        return answer(request);
    }
    let id = format!(
        "toolu_{}",
        CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    );
    let input = json!({"text": "hi"});
    let reply = if request.body["stream"] == json!(true) {
        Reply::sse(&anthropic::tool_use_events(&id, "echo", &input))
    } else {
        Reply::json(200, anthropic::tool_use(&id, "echo", &input))
    };
    reply.delayed(MODEL_LATENCY)
}

/// Whether a Messages API request's last message holds a tool's result.
fn follows_a_tool_result(body: &serde_json::Value) -> bool {
    body["messages"]
        .as_array()
        .and_then(|messages| messages.last())
        .and_then(|last| last["content"].as_array())
        .is_some_and(|blocks| blocks.iter().any(|b| b["type"] == "tool_result"))
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
    let (server, key) = bench_server(agent, store, WorkerId::new("bench"), None, None).await;
    let listener = markov_server::bind("127.0.0.1:0").await.expect("a port");
    let base = format!("http://{}", listener.local_addr().expect("an address"));
    tokio::spawn(server.serve(listener));

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("a client");
    // Every session first, then every message at once: N sessions held.
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(new_session(&client, &base, &key).await);
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
    let runtime = markov_bench::two_thread_runtime();
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

/// Where a worker process keeps its sessions.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WorkerStore {
    /// SQLite in memory: a worker of its own, sharing nothing.
    Memory,
    /// A SQLite file.
    Sqlite(String),
    /// A PostgreSQL database the workers share, and the API key made in it
    /// once for all of them (its key store is shared too).
    Postgres { url: String, key: String },
}

/// How a worker process serves (`serve-worker <provider> [options]`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WorkerOptions {
    pub(crate) store: WorkerStore,
    /// The server's lease on a session (the server's default unless set).
    pub(crate) lease: Option<Duration>,
    /// Gives the agent the `record` tool, which records its executions in
    /// this directory (see `failover.rs`).
    pub(crate) effects: Option<PathBuf>,
    /// Gives the agent the `echo` tool ([`Scenario::ToolCall`]).
    pub(crate) echo: bool,
    /// Serves the floor (`floor.rs`) instead of markov.
    pub(crate) floor: bool,
}

impl WorkerOptions {
    /// SQLite in memory, the server's lease, no tool.
    pub(crate) fn memory() -> Self {
        WorkerOptions {
            store: WorkerStore::Memory,
            lease: None,
            effects: None,
            echo: false,
            floor: false,
        }
    }

    /// Reads `[sqlite <path> | postgres <url> <key>] [lease-ms <ms>]
    /// [effects <dir>] [echo] [floor]`.
    pub(crate) fn parse(mut args: &[&str]) -> Option<Self> {
        let mut options = Self::memory();
        while !args.is_empty() {
            args = match args {
                ["sqlite", path, rest @ ..] => {
                    options.store = WorkerStore::Sqlite((*path).to_owned());
                    rest
                }
                ["postgres", url, key, rest @ ..] => {
                    options.store = WorkerStore::Postgres {
                        url: (*url).to_owned(),
                        key: (*key).to_owned(),
                    };
                    rest
                }
                ["lease-ms", ms, rest @ ..] => {
                    options.lease = Some(Duration::from_millis(ms.parse().ok()?));
                    rest
                }
                ["effects", dir, rest @ ..] => {
                    options.effects = Some(PathBuf::from(dir));
                    rest
                }
                ["echo", rest @ ..] => {
                    options.echo = true;
                    rest
                }
                ["floor", rest @ ..] => {
                    options.floor = true;
                    rest
                }
                _ => return None,
            };
        }
        Some(options)
    }

    /// The arguments [`parse`](Self::parse) reads back.
    pub(crate) fn args(&self) -> Vec<String> {
        let mut args = Vec::new();
        match &self.store {
            WorkerStore::Memory => {}
            WorkerStore::Sqlite(path) => args.extend(["sqlite".to_owned(), path.clone()]),
            WorkerStore::Postgres { url, key } => {
                args.extend(["postgres".to_owned(), url.clone(), key.clone()]);
            }
        }
        if let Some(lease) = self.lease {
            args.extend(["lease-ms".to_owned(), lease.as_millis().to_string()]);
        }
        if let Some(dir) = &self.effects {
            args.extend(["effects".to_owned(), dir.display().to_string()]);
        }
        if self.echo {
            args.push("echo".to_owned());
        }
        if self.floor {
            args.push("floor".to_owned());
        }
        args
    }
}

/// The server of one worker process: the demo-less agent of figure 7 over
/// the provider at `provider_url`, on a free loopback port, which it prints
/// (`port=N`) before it serves until it is killed.
pub(crate) fn worker(provider_url: &str, options: &WorkerOptions) -> std::process::ExitCode {
    answer_heap_requests();
    // The bundled price table is decoded once per process, at the first
    // priced call (about 40 ms of a core): done here, before the worker
    // serves, so that the CPU the figure counts over the messages is the
    // messages' own and does not depend on N.
    let usage = markov_core::model::Usage {
        input_tokens: 1,
        ..Default::default()
    };
    let _ = markov_context::Prices::table().cost("anthropic", "claude-sonnet-4-5", &usage);
    let runtime = markov_bench::two_thread_runtime();
    runtime.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let model = Anthropic::builder()
            .api_key("sk-ant-bench")
            .base_url(provider_url)
            .max_retries(0)
            .timeout(Duration::from_secs(300))
            .build()
            .expect("the client builds");
        let mut agent = Agent::builder("load").instructions("Answer.").model(model);
        if let Some(dir) = &options.effects {
            agent = agent
                .tool(crate::failover::Record::new(dir.clone()))
                .tool(crate::failover::Notify::new(dir.clone()));
        }
        if options.echo {
            agent = agent.tool(markov_bench::Echo);
        }
        let agent = agent.build().expect("the agent builds");
        let worker = WorkerId::random();
        let (server, key) = match &options.store {
            WorkerStore::Memory => {
                let store = Arc::new(SqliteStore::in_memory().expect("a database"));
                bench_server(agent, store, worker, None, options.lease).await
            }
            WorkerStore::Sqlite(path) => {
                let store = Arc::new(SqliteStore::open(path).expect("a database file"));
                bench_server(agent, store, worker, None, options.lease).await
            }
            WorkerStore::Postgres { url, key } => {
                let store = Arc::new(PostgresStore::connect(url).await.expect("the database"));
                bench_server(agent, store, worker, Some(key.clone()), options.lease).await
            }
        };
        let listener = markov_server::bind("127.0.0.1:0").await.expect("a port");
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
pub(crate) fn answer_heap_requests() {
    std::thread::spawn(|| {
        use std::io::BufRead;
        let mut window = None;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line == "exit" {
                // A clean exit, for a profiler that writes its data then.
                std::process::exit(0);
            } else if line == "heap-open" {
                window = Some(crate::counting::Window::open());
            } else if let Some(path) = line.strip_prefix("heap ") {
                let net = window.as_ref().map_or(0, crate::counting::Window::net);
                let _ = std::fs::write(path, net.to_string());
            }
        }
    });
}

/// The client process: `n` sessions spread over `bases`, one message each,
/// all at once; prints one `result ...` line. A message completes when its
/// stream ends the run after `model_calls` stored steps, none with a tool's
/// error; its added latency is its time less `model_calls` times
/// [`MODEL_LATENCY`].
pub(crate) fn clients(n: usize, bases: &[&str], model_calls: u32) -> std::process::ExitCode {
    let model = MODEL_LATENCY * model_calls;
    let runtime = markov_bench::two_thread_runtime();
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
            let id = new_session(&client, base, key).await;
            urls.push((format!("{base}/sessions/{id}/messages"), key.to_owned()));
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
                // Done, after one stored step per model call, no tool's
                // result an error.
                let steps = stream.matches("event: step").count();
                (stream.contains("event: done")
                    && steps == model_calls as usize
                    && !stream.contains("\"is_error\":true"))
                .then(|| sent.elapsed().saturating_sub(model))
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

/// The number `name=<number>` in a client process's `result ...` line; 0
/// when it is missing.
pub(crate) fn result_field(line: &str, name: &str) -> f64 {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
        .unwrap_or(0.0)
}

/// A server worker process (`serve-worker <args>`) and where to reach it:
/// `http://127.0.0.1:<port>#<key>`, from the line it prints once it
/// listens.
pub(crate) fn start_worker(
    exe: &std::path::Path,
    provider: &str,
    options: &WorkerOptions,
) -> (std::process::Child, String) {
    start_worker_with(std::process::Command::new(exe), provider, options)
}

/// The environment variable that names where `server-processes` writes a
/// callgrind profile of its first worker over the messages (see
/// `docs/PERFORMANCE.md`).
const CALLGRIND: &str = "MARKOV_BENCH_CALLGRIND";

/// [`start_worker`] with `command` as the worker's program (the bench
/// binary itself, or a profiler running it).
fn start_worker_with(
    mut command: std::process::Command,
    provider: &str,
    options: &WorkerOptions,
) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = command
        .arg("serve-worker")
        .arg(provider)
        .args(options.args())
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

/// Asks a worker to exit (an `exit` line on its stdin) and waits up to
/// `limit` for it.
fn exit_within(child: &mut std::process::Child, limit: Duration) {
    use std::io::Write;
    if let Some(stdin) = child.stdin.as_mut() {
        let _ = stdin.write_all(b"exit\n");
        let _ = stdin.flush();
    }
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("the profiled worker did not exit within {limit:?}: killed, its profile lost");
}

/// `VmHWM` of another process, in kB.
pub(crate) fn vm_hwm_of(pid: u32) -> u64 {
    crate::proc_status_kb_of(&pid.to_string(), "VmHWM").unwrap_or(0)
}

/// CPU used by the processes `pids`, together.
pub(crate) fn cpu_of(pids: &[u32]) -> Duration {
    pids.iter()
        .filter_map(|pid| crate::process_cpu(&pid.to_string()))
        .sum()
}

/// The part of [`cpu_of`] spent in the kernel on the processes' behalf
/// (`stime`: system calls, and on loopback the receiving side's TCP work).
pub(crate) fn kernel_cpu_of(pids: &[u32]) -> Duration {
    pids.iter()
        .filter_map(|pid| crate::process_cpu_split(&pid.to_string()))
        .map(|cpu| cpu.kernel)
        .sum()
}

/// Where figure 7's workers keep their sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    /// Each worker its own SQLite database in memory.
    Sqlite,
    /// One PostgreSQL (`TempPostgres`: loopback, `fsync=off`) for all.
    Postgres,
    /// Not markov: the floor server of `floor.rs`, each worker its own
    /// SQLite in memory.
    Floor,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
            Backend::Floor => "floor",
        }
    }
}

/// A PostgreSQL server's processes: the postmaster (the first line of
/// `postmaster.pid`) and its children, the backends of the connections.
pub(crate) fn postgres_pids(server: &TempPostgres) -> Vec<u32> {
    let Some(main) = std::fs::read_to_string(server.dir().join("data/postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next()?.trim().parse::<u32>().ok())
    else {
        return Vec::new();
    };
    let mut pids = vec![main];
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let parent = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let after = &stat[stat.rfind(')')? + 2..];
                    after.split_whitespace().nth(1)?.parse::<u32>().ok()
                });
            if parent == Some(main) {
                pids.push(pid);
            }
        }
    }
    pids
}

/// The CPU each of `pids` has used so far.
pub(crate) fn cpu_by_pid(pids: &[u32]) -> HashMap<u32, Duration> {
    pids.iter()
        .filter_map(|&pid| Some((pid, crate::process_cpu(&pid.to_string())?)))
        .collect()
}

/// The CPU `pids` used since `before` (a process new since counts whole).
pub(crate) fn cpu_since(before: &HashMap<u32, Duration>, pids: &[u32]) -> Duration {
    cpu_by_pid(pids)
        .into_iter()
        .map(|(pid, now)| now.saturating_sub(before.get(&pid).copied().unwrap_or_default()))
        .sum()
}

/// A PostgreSQL for the workers: a server of its own, a fresh database in
/// it, and the one API key every worker accepts. `None` (and a line that
/// says why) when PostgreSQL cannot be started.
pub(crate) async fn shared_postgres(figure: &str) -> Option<(TempPostgres, String, String)> {
    let server = match TempPostgres::start() {
        Ok(server) => server,
        Err(error) => {
            println!("bench={figure} backend=postgres skipped=\"{error}\"");
            return None;
        }
    };
    let url = server.new_database().expect("a database");
    let store = PostgresStore::connect(&url).await.expect("the database");
    let key = create_api_key(&store, "bench", &[])
        .await
        .expect("a key")
        .key;
    Some((server, url, key))
}

/// Figure 7 with every part in a process of its own: the fake provider
/// here, `workers` server processes, one client process (and, on
/// PostgreSQL, the database's processes). One process cannot hold four
/// sockets for each of 10 000 sessions under a 20 000 descriptor limit;
/// split this way, none needs more than two per session. `scenario` says
/// what the model does with a message. `None` when the backend is
/// PostgreSQL and it cannot be started.
pub(crate) fn multi_process(
    n: usize,
    workers: usize,
    backend: Backend,
    scenario: Scenario,
) -> Option<ProcessesFigure> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let runtime = markov_bench::two_thread_runtime();
    let exe = std::env::current_exe().expect("the bench binary");
    runtime.block_on(async move {
        let provider = FakeServer::start().await;
        provider
            .answer_with(scenario.answer())
            .recording(Recording::Off);
        let (postgres, mut options) = match backend {
            Backend::Sqlite => (None, WorkerOptions::memory()),
            Backend::Floor => (
                None,
                WorkerOptions {
                    floor: true,
                    ..WorkerOptions::memory()
                },
            ),
            Backend::Postgres => {
                let (server, url, key) = shared_postgres("server_processes").await?;
                let options = WorkerOptions {
                    store: WorkerStore::Postgres { url, key },
                    ..WorkerOptions::memory()
                };
                (Some(server), options)
            }
        };
        options.echo = scenario == Scenario::ToolCall;
        let mut children = Vec::new();
        let mut bases = Vec::new();
        // The first worker under callgrind when asked, counting nothing
        // until the messages start.
        let profile = std::env::var_os(CALLGRIND);
        for i in 0..workers.max(1) {
            let (child, base) = match (&profile, i) {
                (Some(out), 0) => {
                    let mut valgrind = Command::new("valgrind");
                    valgrind
                        .arg("--tool=callgrind")
                        .arg("--instr-atstart=no")
                        .arg(format!(
                            "--callgrind-out-file={}",
                            std::path::Path::new(out).display()
                        ))
                        .arg(&exe)
                        .stderr(Stdio::null());
                    start_worker_with(valgrind, &provider.base_url(), &options)
                }
                _ => start_worker(&exe, &provider.base_url(), &options),
            };
            bases.push(base);
            children.push(child);
        }
        let profiled = profile.as_ref().and_then(|_| children.first()).map(std::process::Child::id);
        let worker_pids: Vec<u32> = children.iter().map(std::process::Child::id).collect();
        let database_pids = move || postgres.as_ref().map(postgres_pids).unwrap_or_default();
        let (result, (workers_cpu, workers_kernel_cpu), provider_cpu, database_cpu) = {
            let exe = exe.clone();
            let bases = bases.join(",");
            let worker_pids = worker_pids.clone();
            tokio::task::spawn_blocking(move || {
                let mut client = Command::new(exe)
                    .args([
                        "load-clients",
                        &n.to_string(),
                        &bases,
                        &scenario.steps_per_message().to_string(),
                    ])
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("the clients run");
                let out = client.stdout.take().expect("the client's output");
                // CPU is counted over the messages, from the client's
                // `start` (its sessions are created) to its result.
                let mut before = (Duration::ZERO, Duration::ZERO, HashMap::new(), Duration::ZERO);
                let mut result = String::new();
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if line == "start" {
                        if let Some(pid) = profiled {
                            // Taken up when the worker next runs: at the
                            // first message.
                            let _ = Command::new("callgrind_control")
                                .args(["-i", "on", &pid.to_string()])
                                .stdout(Stdio::null())
                                .stderr(Stdio::null())
                                .spawn();
                        }
                        before = (
                            cpu_of(&worker_pids),
                            crate::process_cpu("self").unwrap_or_default(),
                            cpu_by_pid(&database_pids()),
                            kernel_cpu_of(&worker_pids),
                        );
                    } else if line.starts_with("result") {
                        result = line;
                    }
                }
                let workers = (
                    cpu_of(&worker_pids).saturating_sub(before.0),
                    kernel_cpu_of(&worker_pids).saturating_sub(before.3),
                );
                let provider = crate::process_cpu("self")
                    .unwrap_or_default()
                    .saturating_sub(before.1);
                let database = cpu_since(&before.2, &database_pids());
                let _ = client.wait();
                (result, workers, provider, database)
            })
            .await
            .expect("the clients finished")
        };
        let workers_hwm_kb: u64 = worker_pids.iter().map(|&pid| vm_hwm_of(pid)).sum();
        for (i, mut child) in children.into_iter().enumerate() {
            if profiled.is_some() && i == 0 {
                // Asked to exit, so that callgrind writes its profile.
                exit_within(&mut child, Duration::from_secs(120));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let line = if result.is_empty() { "result failed" } else { result.as_str() };
        let field = |name: &str| result_field(line, name);
        let figure = ProcessesFigure {
            backend,
            sessions: n,
            workers,
            steps_per_message: scenario.steps_per_message(),
            completed: field("completed") as usize,
            wall_ms: field("wall_ms"),
            p50_ms: field("p50_ms"),
            p99_ms: field("p99_ms"),
            workers_mb: workers_hwm_kb as f64 / 1024.0,
            clients_mb: field("client_vm_hwm_kb") / 1024.0,
            workers_cpu,
            workers_kernel_cpu,
            client_cpu: Duration::from_millis(field("client_cpu_ms") as u64),
            provider_cpu,
            database_cpu,
        };
        // The tool-call scenario says so, and how messages relate to steps;
        // figure 7's line stays as it was.
        let tool_call = match scenario {
            Scenario::Text => String::new(),
            Scenario::ToolCall => format!(
                " scenario=tool_call steps_per_message={} messages_per_s={:.0}",
                figure.steps_per_message,
                figure.steps_per_s() / figure.steps_per_message as f64
            ),
        };
        println!(
            "bench=server_processes store={} sessions={n} workers={workers} completed={} wall_ms={:.0} steps_per_s={:.0} added_p50_ms={:.1} added_p99_ms={:.1} workers_vm_hwm_mb={:.1} clients_vm_hwm_mb={:.1} cpu_per_step_us_workers={:.0} cpu_per_step_us_workers_kernel={:.0} cpu_per_step_us_clients={:.0} cpu_per_step_us_provider={:.0} cpu_per_step_us_database={:.0}{tool_call}",
            backend.name(),
            figure.completed,
            figure.wall_ms,
            figure.steps_per_s(),
            figure.p50_ms,
            figure.p99_ms,
            figure.workers_mb,
            figure.clients_mb,
            figure.cpu_per_step_us(figure.workers_cpu),
            figure.cpu_per_step_us(figure.workers_kernel_cpu),
            figure.cpu_per_step_us(figure.client_cpu),
            figure.cpu_per_step_us(figure.provider_cpu),
            figure.cpu_per_step_us(figure.database_cpu),
        );
        Some(figure)
    })
}

/// `markov-bench server-beside-floor <N> <W> <ROUNDS>`: the workers' CPU
/// per step of markov's server and of the floor (`floor.rs`), measured
/// alternately in one sitting, `rounds` runs each, and their ratio.
///
/// This machine's speed drifts by a quarter within a session (the floor
/// alone has measured 121 to 172 µs a step at N = 10 000), so a figure in
/// microseconds is only comparable with one measured beside it; the ratio
/// of the two medians moves much less with the machine (though not
/// nothing: the floor slows more than markov's server when it slows).
pub(crate) fn beside_floor(n: usize, workers: usize, rounds: usize) {
    let mut markov = Vec::with_capacity(rounds);
    let mut floor = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        for (backend, into) in [(Backend::Sqlite, &mut markov), (Backend::Floor, &mut floor)] {
            match multi_process(n, workers, backend, Scenario::Text) {
                Some(figure) if figure.completed == n => {
                    into.push(figure.cpu_per_step_us(figure.workers_cpu));
                }
                Some(figure) => eprintln!(
                    "a {} run completed {} of {n} messages: left out",
                    backend.name(),
                    figure.completed
                ),
                None => eprintln!("a {} run did not start: left out", backend.name()),
            }
        }
    }
    if markov.is_empty() || floor.is_empty() {
        eprintln!("no run of one of the two completed: no ratio");
        return;
    }
    markov.sort_by(f64::total_cmp);
    floor.sort_by(f64::total_cmp);
    let (markov_median, floor_median) =
        (crate::quantile(&markov, 0.5), crate::quantile(&floor, 0.5));
    let range = |values: &[f64]| {
        format!(
            "{:.0}-{:.0}",
            values.first().copied().unwrap_or_default(),
            values.last().copied().unwrap_or_default()
        )
    };
    println!(
        "bench=server_beside_floor sessions={n} workers={workers} rounds={rounds} cpu_per_step_us_markov={markov_median:.0} markov_range={} cpu_per_step_us_floor={floor_median:.0} floor_range={} ratio={:.2}",
        range(&markov),
        range(&floor),
        markov_median / floor_median
    );
}

/// Figure 7 with the parts in their own processes.
#[derive(Debug)]
pub(crate) struct ProcessesFigure {
    pub(crate) backend: Backend,
    pub(crate) sessions: usize,
    pub(crate) workers: usize,
    /// Model calls per message: 1, or 2 with a tool call.
    pub(crate) steps_per_message: usize,
    /// Messages whose answer's stream was read to its end.
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
    /// The part of `workers_cpu` spent in the kernel on their behalf.
    pub(crate) workers_kernel_cpu: Duration,
    pub(crate) client_cpu: Duration,
    pub(crate) provider_cpu: Duration,
    /// The PostgreSQL server's processes (zero on SQLite).
    pub(crate) database_cpu: Duration,
}

impl ProcessesFigure {
    /// The steps of the completed messages.
    fn steps(&self) -> usize {
        self.completed * self.steps_per_message
    }

    /// `cpu` per completed step, in microseconds.
    pub(crate) fn cpu_per_step_us(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() * 1e6 / self.steps().max(1) as f64
    }

    pub(crate) fn steps_per_s(&self) -> f64 {
        if self.wall_ms > 0.0 {
            self.steps() as f64 / (self.wall_ms / 1e3)
        } else {
            0.0
        }
    }
}

/// A server for load: one principal's key (`key`, made in the shared key
/// store already, or a new one), limits that let the load through (the
/// figure measures the service, not its rate limit), and `lease` if set.
async fn bench_server<S: Store + KeyStore + 'static>(
    agent: Agent,
    store: Arc<S>,
    worker: WorkerId,
    key: Option<String>,
    lease: Option<Duration>,
) -> (Server, String) {
    let key = match key {
        Some(key) => key,
        None => {
            create_api_key(&*store, "bench", &[])
                .await
                .expect("a key")
                .key
        }
    };
    let mut limits = Limits::default();
    limits.requests_per_minute = std::num::NonZeroU32::MAX;
    limits.max_connections = 1 << 20;
    let mut server = Server::builder()
        .agent(agent)
        .store(store)
        .worker(worker)
        .limits(limits);
    if let Some(lease) = lease {
        server = server.lease(lease);
    }
    (server.build().expect("the server builds"), key)
}

/// Creates a session at `base` as the holder of `key`: its id (empty when
/// the answer names none).
pub(crate) async fn new_session(client: &reqwest::Client, base: &str, key: &str) -> String {
    let created = client
        .post(format!("{base}/sessions"))
        .bearer_auth(key)
        .send()
        .await
        .expect("created");
    let body: serde_json::Value = created.json().await.expect("json");
    body["id"].as_str().unwrap_or_default().to_owned()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::{Backend, ProcessesFigure, WorkerOptions, follows_a_tool_result};

    #[test]
    fn a_worker_reads_back_the_echo_tool_among_its_options() {
        let options = WorkerOptions {
            lease: Some(Duration::from_millis(1_500)),
            echo: true,
            ..WorkerOptions::memory()
        };
        let args = options.args();
        assert_eq!(args, ["lease-ms", "1500", "echo"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_eq!(WorkerOptions::parse(&args), Some(options));
        assert_eq!(WorkerOptions::parse(&[]), Some(WorkerOptions::memory()));
        assert_eq!(WorkerOptions::parse(&["echo", "twice"]), None);
    }

    #[test]
    fn the_tool_call_scenario_answers_with_text_only_after_the_tools_result() {
        let user = json!({"messages": [{"role": "user", "content": "hi"}]});
        let result = json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": "echo", "input": {"text": "hi"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "hi"}]},
        ]});
        let user_blocks =
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]});
        assert!(!follows_a_tool_result(&user));
        assert!(!follows_a_tool_result(&user_blocks));
        assert!(!follows_a_tool_result(&json!({})));
        assert!(follows_a_tool_result(&result));
    }

    #[test]
    fn a_message_with_a_tool_call_counts_two_steps() {
        let figure = |steps_per_message| ProcessesFigure {
            backend: Backend::Sqlite,
            sessions: 100,
            workers: 1,
            steps_per_message,
            completed: 100,
            wall_ms: 500.0,
            p50_ms: 0.0,
            p99_ms: 0.0,
            workers_mb: 0.0,
            clients_mb: 0.0,
            workers_cpu: Duration::from_millis(100),
            workers_kernel_cpu: Duration::ZERO,
            client_cpu: Duration::ZERO,
            provider_cpu: Duration::ZERO,
            database_cpu: Duration::ZERO,
        };
        let (text, tool_call) = (figure(1), figure(2));
        assert_eq!(text.steps_per_s(), 200.0);
        assert_eq!(tool_call.steps_per_s(), 400.0);
        assert_eq!(text.cpu_per_step_us(text.workers_cpu), 1_000.0);
        assert_eq!(tool_call.cpu_per_step_us(tool_call.workers_cpu), 500.0);
    }
}
