//! The multi-worker figure: W server processes on one PostgreSQL, N
//! sessions spread over them, each running `turns` turns one after
//! another; with W > 1, one worker is killed (SIGKILL) once half of the
//! turns are done. Its runs in progress are continued by the others once
//! their leases expire, and its clients go on with another worker.
//!
//! Every turn is two steps: the fake provider answers the first model call
//! of a turn with two calls naming the session and the turn, of the
//! `record` tool and of the `notify` tool, and the second with text.
//! `record` is an at-least-once side effect outside the server: one file
//! per execution in a directory, written under a scratch name and linked
//! (atomically, refused if it exists) under the call's idempotency key (as
//! an outside API that deduplicates by key would), written and synced
//! before the tool returns. `notify` is an at-most-once side effect that
//! honours no key: one file per execution, under a name of its own. After
//! the run the figure checks that every (session, turn) was recorded
//! exactly once and notified at most once — by the session and turn the
//! tools were given, never by call ids, which a real provider changes on
//! every answer — and that every session's stored history is exactly its
//! turns' messages, in order: a notification never made, or made by a
//! worker that died before its result was stored, answered `INTERRUPTED`.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use markov_core::async_trait;
use markov_core::tool::{Delivery, Tool, ToolContext};
use markov_store::{PostgresStore, Store};
use markov_testkit::Recording;
use markov_testkit::http::{FakeServer, Recorded, Reply, anthropic, sse_event};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::Stats;
use crate::server::{
    MODEL_LATENCY, WorkerOptions, WorkerStore, cpu_by_pid, cpu_of, cpu_since, postgres_pids,
    result_field, shared_postgres, start_worker, vm_hwm_of,
};

/// The workers' lease: short, so that a dead worker's sessions are
/// continued within seconds (the servers look every half lease).
pub(crate) const LEASE: Duration = Duration::from_secs(3);

/// How long a client waits for a turn another worker continues, or for a
/// session leased by a dead worker, before it gives the session up.
const FAILOVER_BOUND: Duration = Duration::from_secs(120);

#[derive(Debug, Deserialize, JsonSchema)]
pub(crate) struct RecordArgs {
    /// The session, as the user's message names it.
    session: String,
    /// The turn, as the user's message names it.
    turn: u32,
}

/// Records one execution per call: a file named by the call's idempotency
/// key, holding the session and the turn, in a directory every worker
/// shares; a second execution under the same key changes nothing (and is
/// counted in a `repeats-` file).
#[derive(Debug)]
pub(crate) struct Record {
    dir: PathBuf,
}

impl Record {
    pub(crate) fn new(dir: PathBuf) -> Self {
        Record { dir }
    }
}

/// A name a file can have, one per key (hexadecimal).
fn file_name(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

#[async_trait]
impl Tool for Record {
    const NAME: &'static str = "record";
    type Args = RecordArgs;
    type Output = String;
    type Error = std::io::Error;

    fn description(&self) -> String {
        "Records that a turn happened".into()
    }

    async fn call(&self, args: RecordArgs, cx: &ToolContext<'_>) -> Result<String, std::io::Error> {
        let key = cx
            .idempotency_key()
            .ok_or_else(|| std::io::Error::other("no idempotency key"))?;
        let path = self.dir.join(format!("effect-{}", file_name(key)));
        // Written whole under a name of its own, then linked under the
        // key's name: the link is the effect, atomic, and refused if the
        // key's effect exists (a crash between creating the file and
        // writing it would otherwise leave an empty effect).
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let scratch = self.dir.join(format!(
            "scratch-{}-{}",
            std::process::id(),
            WRITES.fetch_add(1, Ordering::Relaxed)
        ));
        let mut file = std::fs::File::create(&scratch)?;
        writeln!(
            file,
            "{} {} {}",
            args.session,
            args.turn,
            std::process::id()
        )?;
        file.sync_all()?;
        let linked = std::fs::hard_link(&scratch, &path);
        std::fs::remove_file(&scratch)?;
        match linked {
            Ok(()) => {}
            // Executed already under this key (a crash after the effect,
            // before its result was recorded): an outside API that
            // deduplicates by key does nothing; counted apart.
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
                let mut repeats = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.join(format!("repeats-{}", std::process::id())))?;
                writeln!(repeats, "{} {}", args.session, args.turn)?;
            }
            Err(error) => return Err(error),
        }
        Ok(format!("recorded turn {}", args.turn))
    }
}

/// Notifies that a turn happened: one file per execution, named by the
/// process and a counter, never by a key (it honours none), holding the
/// session and the turn. At most once: a call a dead worker started is
/// answered `INTERRUPTED` by the worker that continues the session, never
/// run again.
#[derive(Debug)]
pub(crate) struct Notify {
    dir: PathBuf,
}

impl Notify {
    pub(crate) fn new(dir: PathBuf) -> Self {
        Notify { dir }
    }
}

#[async_trait]
impl Tool for Notify {
    const NAME: &'static str = "notify";
    const DELIVERY: Option<Delivery> = Some(Delivery::AtMostOnce);
    type Args = RecordArgs;
    type Output = String;
    type Error = std::io::Error;

    fn description(&self) -> String {
        "Notifies that a turn happened".into()
    }

    async fn call(
        &self,
        args: RecordArgs,
        _cx: &ToolContext<'_>,
    ) -> Result<String, std::io::Error> {
        static SENT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{}-{}",
            std::process::id(),
            SENT.fetch_add(1, Ordering::Relaxed)
        );
        let scratch = self.dir.join(format!("scratch-notice-{name}"));
        let mut file = std::fs::File::create(&scratch)?;
        writeln!(file, "{} {}", args.session, args.turn)?;
        file.sync_all()?;
        // The rename is the effect: whole or not at all.
        std::fs::rename(&scratch, self.dir.join(format!("notice-{name}")))?;
        Ok(format!("notified turn {}", args.turn))
    }
}

/// The user's message of `turn` in `session`.
fn user_text(session: &str, turn: usize) -> String {
    format!("session {session} turn {turn}")
}

/// The model's last answer of a turn.
fn final_text(turn: u64) -> String {
    format!("turn {turn} recorded")
}

/// The text of a wire message's content (a string or text blocks).
fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b["text"].as_str())
            .collect(),
        _ => String::new(),
    }
}

/// An answer with a `tool_use` block for each of `calls` (id, name), all
/// with `input`, as an event stream.
fn tool_uses_events(calls: &[(String, &str)], input: &Value) -> String {
    let mut events = vec![sse_event(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": format!("msg_{}", calls.first().map_or("", |(id, _)| id.as_str())),
            "type": "message", "role": "assistant", "content": [],
            "model": markov_testkit::http::MODEL, "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 120, "output_tokens": 1}
        }}),
    )];
    for (index, (id, name)) in calls.iter().enumerate() {
        events.push(sse_event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
        ));
        events.push(sse_event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
        ));
        events.push(sse_event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }
    events.push(sse_event(
        "message_delta",
        json!({"type": "message_delta",
               "delta": {"stop_reason": "tool_use", "stop_sequence": null},
               "usage": {"output_tokens": 30}}),
    ));
    events.push(sse_event("message_stop", json!({"type": "message_stop"})));
    events.concat()
}

/// The fake provider: a call whose last message is the user's text is
/// answered with a `record` and a `notify` call naming the session and
/// turn that text names (fresh call ids every time, as real providers do),
/// a call after the tools' results with the turn's final text; both after
/// [`MODEL_LATENCY`], streamed when asked to.
fn answer(request: &Recorded) -> Reply {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let messages = request.body["messages"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let last = messages.last().map(|m| &m["content"]);
    let after_result = last
        .and_then(Value::as_array)
        .is_some_and(|blocks| blocks.iter().any(|b| b["type"] == "tool_result"));
    // The turn this call is in: the last user text.
    let (session, turn) = messages
        .iter()
        .rev()
        .map(|m| content_text(&m["content"]))
        .find_map(|text| {
            let rest = text.strip_prefix("session ")?;
            let (session, turn) = rest.split_once(" turn ")?;
            Some((session.to_owned(), turn.parse::<u64>().ok()?))
        })
        .unwrap_or_default();
    let streamed = request.body["stream"] == json!(true);
    let reply = if after_result {
        let text = final_text(turn);
        if streamed {
            Reply::sse(&anthropic::text_events(&text))
        } else {
            Reply::json(200, anthropic::text(&text))
        }
    } else {
        let calls = [
            (
                format!("toolu_{}", CALLS.fetch_add(1, Ordering::Relaxed)),
                "record",
            ),
            (
                format!("toolu_{}", CALLS.fetch_add(1, Ordering::Relaxed)),
                "notify",
            ),
        ];
        let input = json!({"session": session, "turn": turn});
        if streamed {
            Reply::sse(&tool_uses_events(&calls, &input))
        } else {
            let blocks = calls
                .iter()
                .map(|(id, name)| json!({"type": "tool_use", "id": id, "name": name, "input": input}))
                .collect();
            Reply::json(200, anthropic::message(&calls[0].0, blocks, "tool_use"))
        }
    };
    reply.delayed(MODEL_LATENCY)
}

/// One run of the figure.
#[derive(Debug)]
pub(crate) struct FailoverFigure {
    pub(crate) sessions: usize,
    pub(crate) turns: usize,
    pub(crate) workers: usize,
    pub(crate) killed: bool,
    pub(crate) completed_turns: usize,
    pub(crate) wall_ms: f64,
    /// Turn latency minus the model's (two calls), over the turns whose
    /// worker stayed up.
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    /// Turns whose stream broke with their worker, and the longest any of
    /// them took to be finished elsewhere (from its message).
    pub(crate) streams_lost: usize,
    pub(crate) failover_max_ms: f64,
    /// Turn messages sent again: their worker died before it stored them.
    pub(crate) resent: usize,
    /// Runs the surviving workers claimed and continued.
    pub(crate) runs_continued: u64,
    /// The workers' peak resident memory less their memory before the
    /// sessions, per session.
    pub(crate) memory_per_session_kb: f64,
    pub(crate) workers_cpu: Duration,
    pub(crate) client_cpu: Duration,
    pub(crate) provider_cpu: Duration,
    pub(crate) database_cpu: Duration,
    /// What the check found wrong (empty: every turn executed once, every
    /// history as expected).
    pub(crate) problems: Vec<String>,
    /// Executions a repeated idempotency key turned into no-ops.
    pub(crate) deduplicated: usize,
    /// Executions of the at-most-once `notify` tool (at most one per turn).
    pub(crate) notified: usize,
    /// Its calls answered `INTERRUPTED` (started by a worker that died
    /// before their result was stored; never run again).
    pub(crate) interrupted: usize,
}

impl FailoverFigure {
    pub(crate) fn steps(&self) -> usize {
        self.completed_turns * 2
    }

    pub(crate) fn steps_per_s(&self) -> f64 {
        self.steps() as f64 / (self.wall_ms / 1e3).max(1e-9)
    }

    pub(crate) fn cpu_per_step_us(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() * 1e6 / self.steps().max(1) as f64
    }

    pub(crate) fn total_cpu(&self) -> Duration {
        self.workers_cpu + self.client_cpu + self.provider_cpu + self.database_cpu
    }
}

/// Worker processes, killed (SIGKILL) and reaped when dropped, so that
/// none outlives the figure, even one that fails.
#[derive(Debug)]
struct Workers(Vec<std::process::Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The number of effect files in `dir`.
fn effects(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("effect-"))
            .count()
    })
}

/// Runs the figure once: `workers` workers, the first killed half-way when
/// there are several. `None` when PostgreSQL cannot be started.
pub(crate) fn figure(sessions: usize, turns: usize, workers: usize) -> Option<FailoverFigure> {
    let runtime = markov_bench::two_thread_runtime();
    let exe = std::env::current_exe().expect("the bench binary");
    let dir =
        std::env::temp_dir().join(format!("markov-failover-{}-{workers}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    let figure = runtime.block_on(run(&exe, &dir, sessions, turns, workers.max(1)));
    let _ = std::fs::remove_dir_all(&dir);
    figure
}

async fn run(
    exe: &Path,
    dir: &Path,
    sessions: usize,
    turns: usize,
    workers: usize,
) -> Option<FailoverFigure> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let provider = FakeServer::start().await;
    provider.answer_with(answer).recording(Recording::Off);
    let (postgres, url, key) = shared_postgres("failover").await?;
    let options = WorkerOptions {
        store: WorkerStore::Postgres {
            url: url.clone(),
            key,
        },
        lease: Some(LEASE),
        effects: Some(dir.to_owned()),
        echo: false,
        floor: false,
    };
    let mut children = Workers(Vec::new());
    let mut bases = Vec::new();
    for _ in 0..workers {
        let (child, base) = start_worker(exe, &provider.base_url(), &options);
        bases.push(base);
        children.0.push(child);
    }
    let pids: Vec<u32> = children.0.iter().map(std::process::Child::id).collect();
    let idle_kb: u64 = pids
        .iter()
        .map(|pid| crate::proc_status_kb_of(&pid.to_string(), "VmRSS").unwrap_or(0))
        .sum();
    let kill = workers > 1;
    let victim = kill.then(|| Workers(vec![children.0.remove(0)]));
    let survivors = children;

    let mut client = Command::new(exe)
        .args([
            "failover-clients",
            &sessions.to_string(),
            &turns.to_string(),
            &bases.join(","),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("the clients run");
    let out = client.stdout.take().expect("the client's output");
    let (lines_tx, mut lines_rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    // CPU is counted from the client's `start` (its sessions are made).
    let mut before: Option<(Duration, Duration, HashMap<u32, Duration>)> = None;
    let mut victim = victim;
    // The victim's CPU and peak memory, read just before it dies.
    let mut victim_cpu = Duration::ZERO;
    let mut victim_kb = 0;
    let mut result = String::new();
    let half = sessions * turns / 2;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            line = lines_rx.recv() => match line {
                Some(line) if line == "start" => {
                    before = Some((
                        cpu_of(&pids),
                        crate::process_cpu("self").unwrap_or_default(),
                        cpu_by_pid(&postgres_pids(&postgres)),
                    ));
                }
                Some(line) if line.starts_with("result") => result = line,
                Some(_) => {}
                None => break,
            },
            _ = tick.tick(), if victim.is_some() && before.is_some() => {
                if effects(dir) >= half && let Some(child) = victim.take() {
                    let pid = child.0[0].id();
                    victim_cpu = crate::process_cpu(&pid.to_string()).unwrap_or_default();
                    victim_kb = vm_hwm_of(pid);
                    // SIGKILL, on drop.
                    drop(child);
                    println!("bench=failover event=killed worker_pid={pid} effects={}", effects(dir));
                }
            }
        }
    }
    let _ = client.wait();
    let (cpu_before, provider_before, database_before) = before.unwrap_or_default();
    let survivor_pids: Vec<u32> = survivors.0.iter().map(std::process::Child::id).collect();
    let workers_cpu = (cpu_of(&survivor_pids) + victim_cpu).saturating_sub(cpu_before);
    let provider_cpu = crate::process_cpu("self")
        .unwrap_or_default()
        .saturating_sub(provider_before);
    let database_cpu = cpu_since(&database_before, &postgres_pids(&postgres));
    let peak_kb: u64 = survivor_pids.iter().map(|&pid| vm_hwm_of(pid)).sum::<u64>() + victim_kb;

    // What the survivors continued, by their own count.
    let http = reqwest::Client::new();
    let mut runs_continued = 0;
    for base in &bases[usize::from(kill)..] {
        let (base, key) = base.split_once('#').unwrap_or_default();
        let metrics = match http
            .get(format!("{base}/metrics"))
            .bearer_auth(key)
            .send()
            .await
        {
            Ok(response) => response.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        runs_continued += metrics
            .lines()
            .find_map(|l| l.strip_prefix("markov_runs_continued_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
    }
    drop(survivors);

    let field = |name: &str| result_field(&result, name);
    let ids: Vec<String> = result
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix("sessions="))
        .map(|ids| {
            ids.split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    let mut problems = Vec::new();
    if result.is_empty() {
        problems.push("the clients printed no result".to_owned());
    }
    if ids.len() != sessions {
        problems.push(format!("{} sessions made of {sessions}", ids.len()));
    }
    let failed = field("failed") as usize;
    if failed > 0 {
        problems.push(format!("{failed} sessions' clients gave up"));
    }
    let completed = field("completed") as usize;
    if completed != sessions * turns {
        problems.push(format!(
            "{completed} turns completed of {}",
            sessions * turns
        ));
    }
    let (more, deduplicated, notices) = check_effects(dir, &ids, turns);
    problems.extend(more);
    let (more, interrupted) = check_histories(&url, &ids, turns, &notices).await;
    problems.extend(more);
    let notified = notices.values().sum();
    drop(postgres);

    let figure = FailoverFigure {
        sessions,
        turns,
        workers,
        killed: kill,
        completed_turns: completed,
        wall_ms: field("wall_ms"),
        p50_ms: field("p50_ms"),
        p99_ms: field("p99_ms"),
        streams_lost: field("streams_lost") as usize,
        failover_max_ms: field("failover_max_ms"),
        resent: field("resent") as usize,
        runs_continued,
        memory_per_session_kb: peak_kb.saturating_sub(idle_kb) as f64 / sessions.max(1) as f64,
        workers_cpu,
        client_cpu: Duration::from_millis(field("client_cpu_ms") as u64),
        provider_cpu,
        database_cpu,
        problems,
        deduplicated,
        notified,
        interrupted,
    };
    println!(
        "bench=failover sessions={sessions} turns={turns} workers={workers} killed={} completed_turns={} wall_ms={:.0} steps_per_s={:.0} added_p50_ms={:.1} added_p99_ms={:.1} streams_lost={} failover_max_ms={:.0} resent={} runs_continued={} memory_per_session_kb={:.1} cpu_per_step_us_total={:.0} cpu_per_step_us_workers={:.0} cpu_per_step_us_clients={:.0} cpu_per_step_us_provider={:.0} cpu_per_step_us_database={:.0} deduplicated={} notified={} interrupted={} exactly_once={} problems={}",
        figure.killed,
        figure.completed_turns,
        figure.wall_ms,
        figure.steps_per_s(),
        figure.p50_ms,
        figure.p99_ms,
        figure.streams_lost,
        figure.failover_max_ms,
        figure.resent,
        figure.runs_continued,
        figure.memory_per_session_kb,
        figure.cpu_per_step_us(figure.total_cpu()),
        figure.cpu_per_step_us(figure.workers_cpu),
        figure.cpu_per_step_us(figure.client_cpu),
        figure.cpu_per_step_us(figure.provider_cpu),
        figure.cpu_per_step_us(figure.database_cpu),
        figure.deduplicated,
        figure.notified,
        figure.interrupted,
        figure.problems.is_empty(),
        figure.problems.len(),
    );
    for problem in figure.problems.iter().take(20) {
        println!("bench=failover problem=\"{problem}\"");
    }
    Some(figure)
}

/// Every (session, turn) of `ids` × 1..=`turns` recorded exactly once and
/// notified at most once, and nothing else; with the executions a repeated
/// key made no-ops, and the notifications of each (session, turn).
fn check_effects(
    dir: &Path,
    ids: &[String],
    turns: usize,
) -> (Vec<String>, usize, BTreeMap<(String, usize), usize>) {
    let mut executed: BTreeMap<(String, usize), usize> = BTreeMap::new();
    let mut notices: BTreeMap<(String, usize), usize> = BTreeMap::new();
    let mut deduplicated = 0;
    let mut problems = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        if name.starts_with("repeats-") {
            deduplicated += text.lines().count();
            continue;
        }
        // A scratch file a killed worker left before linking it: no effect.
        if name.starts_with("scratch-") {
            continue;
        }
        let counts = if name.starts_with("notice-") {
            &mut notices
        } else {
            &mut executed
        };
        let mut fields = text.split_whitespace();
        match (fields.next(), fields.next().and_then(|t| t.parse().ok())) {
            (Some(session), Some(turn)) => {
                *counts.entry((session.to_owned(), turn)).or_default() += 1;
            }
            _ => problems.push(format!("an unreadable effect {name}: {text:?}")),
        }
    }
    for ((id, turn), n) in &notices {
        if *n > 1 {
            problems.push(format!(
                "session {id} turn {turn} notified {n} times by an at-most-once tool"
            ));
        }
        if !ids.contains(id) || !(1..=turns).contains(turn) {
            problems.push(format!(
                "a notification of no turn asked for: session {id} turn {turn}"
            ));
        }
    }
    for id in ids {
        for turn in 1..=turns {
            match executed.remove(&(id.clone(), turn)) {
                Some(1) => {}
                Some(n) => problems.push(format!("session {id} turn {turn} executed {n} times")),
                None => problems.push(format!("session {id} turn {turn} never executed")),
            }
        }
    }
    for ((id, turn), n) in executed {
        problems.push(format!(
            "an execution of no turn asked for: session {id} turn {turn} ({n}×)"
        ));
    }
    (problems, deduplicated, notices)
}

/// Every session's stored history: for each turn, the user's text, one
/// `record` and one `notify` call of that session and turn, their results,
/// and the turn's final text — nothing missing, nothing twice. `record`'s
/// result is its success; `notify`'s is its success when it ran and its
/// result was stored, else `INTERRUPTED`: never a success without its
/// effect (`notices`). With the number of `INTERRUPTED` results.
async fn check_histories(
    url: &str,
    ids: &[String],
    turns: usize,
    notices: &BTreeMap<(String, usize), usize>,
) -> (Vec<String>, usize) {
    let store = match PostgresStore::connect(url).await {
        Ok(store) => store,
        Err(error) => return (vec![format!("the store for the check: {error}")], 0),
    };
    let mut problems = Vec::new();
    let mut interrupted = 0;
    for id in ids {
        let stored = match store.load(&markov_store::SessionId::new(id.as_str())).await {
            Ok(stored) => stored,
            Err(error) => {
                problems.push(format!("session {id}: {error}"));
                continue;
            }
        };
        if stored.run.is_some() {
            problems.push(format!("session {id}: a run is still in progress"));
        }
        let history = serde_json::to_value(&stored.snapshot.history).unwrap_or_default();
        let mut got: Vec<String> = history
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(describe)
            .collect();
        // A notification answered `INTERRUPTED` is right whether or not it
        // took effect; one that succeeded must have taken effect.
        for (turn, line) in (1..=turns).zip(got.iter_mut().skip(2).step_by(4)) {
            if line.ends_with(" | interrupted") {
                interrupted += 1;
                *line = format!("user result recorded turn {turn} | result notified turn {turn}");
            } else if notices.get(&(id.clone(), turn)).copied().unwrap_or(0) == 0 {
                problems.push(format!(
                    "session {id} turn {turn}: notified without an effect: {line}"
                ));
            }
        }
        let expected: Vec<String> = (1..=turns)
            .flat_map(|turn| {
                [
                    format!("user text {}", user_text(id, turn)),
                    format!("assistant record {id} {turn} | notify {id} {turn}"),
                    format!("user result recorded turn {turn} | result notified turn {turn}"),
                    format!("assistant text {}", final_text(turn as u64)),
                ]
            })
            .collect();
        if got != expected {
            problems.push(format!(
                "session {id}: history {got:?}, expected {expected:?}"
            ));
        }
    }
    (problems, interrupted)
}

/// One stored message, in a line the check compares.
fn describe(message: &Value) -> String {
    let role = message["role"].as_str().unwrap_or("?");
    let items: Vec<Value> = match &message["items"] {
        Value::String(text) => vec![json!({"type": "text", "text": text})],
        Value::Array(items) => items.clone(),
        _ => Vec::new(),
    };
    let parts: Vec<String> = items
        .iter()
        .map(|item| match item["type"].as_str() {
            Some("text") => format!("text {}", item["text"].as_str().unwrap_or("")),
            Some("tool_use") => format!(
                "{} {} {}",
                item["name"].as_str().unwrap_or(""),
                item["input"]["session"].as_str().unwrap_or(""),
                item["input"]["turn"]
            ),
            Some("tool_result") => {
                let content = item["content"].as_str().unwrap_or("");
                let kind = serde_json::from_str::<Value>(content)
                    .ok()
                    .map(|v| v["error"]["type"].clone());
                if kind == Some(json!("INTERRUPTED")) {
                    "interrupted".to_owned()
                } else if item["is_error"] == json!(true) {
                    format!("failed result {content}")
                } else {
                    format!("result {content}")
                }
            }
            other => format!("{other:?}"),
        })
        .collect();
    format!("{role} {}", parts.join(" | "))
}

/// The client process: `sessions` sessions spread over `bases`, each sent
/// `turns` messages one after another. A turn whose stream breaks (its
/// worker died) goes on with the next worker: the client waits there until
/// no run of the session is in progress, then sends the turn again if its
/// message was never stored, and the next turn there. Prints `start`, then
/// one `result ...` line with the sessions' ids.
pub(crate) fn clients(sessions: usize, turns: usize, bases: &[&str]) -> std::process::ExitCode {
    let runtime = markov_bench::two_thread_runtime();
    let bases: Vec<(String, String)> = bases
        .iter()
        .filter_map(|b| b.split_once('#'))
        .map(|(b, k)| (b.to_owned(), k.to_owned()))
        .collect();
    if bases.is_empty() {
        return std::process::ExitCode::from(2);
    }
    let bases = Arc::new(bases);
    let (outcomes, ids, wall, cpu) = runtime.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(FAILOVER_BOUND)
            .build()
            .expect("a client");
        let mut ids = Vec::with_capacity(sessions);
        for i in 0..sessions {
            let (base, key) = &bases[i % bases.len()];
            ids.push(crate::server::new_session(&client, base, key).await);
        }
        println!("start");
        let _ = std::io::stdout().flush();
        let cpu_before = crate::process_cpu("self").unwrap_or_default();
        let start = Instant::now();
        let runs = ids.iter().enumerate().map(|(i, id)| {
            let (client, bases, id) = (client.clone(), Arc::clone(&bases), id.clone());
            tokio::spawn(async move { session(&client, &bases, i % bases.len(), &id, turns).await })
        });
        let outcomes: Vec<Outcome> = futures::future::join_all(runs)
            .await
            .into_iter()
            .map(Result::unwrap_or_default)
            .collect();
        let wall = start.elapsed();
        let cpu = crate::process_cpu("self")
            .unwrap_or_default()
            .saturating_sub(cpu_before);
        (outcomes, ids, wall, cpu)
    });
    let added: Vec<Duration> = outcomes
        .iter()
        .flat_map(|o| o.added.iter().copied())
        .collect();
    let added = Stats::of(&added);
    let failover_max = outcomes
        .iter()
        .map(|o| o.failover_max)
        .max()
        .unwrap_or_default();
    println!(
        "result completed={} failed={} streams_lost={} resent={} failover_max_ms={} wall_ms={:.0} p50_ms={:.1} p99_ms={:.1} client_cpu_ms={} sessions={}",
        outcomes.iter().map(|o| o.completed).sum::<usize>(),
        outcomes.iter().filter(|o| o.failed).count(),
        outcomes.iter().map(|o| o.streams_lost).sum::<usize>(),
        outcomes.iter().map(|o| o.resent).sum::<usize>(),
        failover_max.as_millis(),
        wall.as_secs_f64() * 1e3,
        added.median_us / 1e3,
        added.p99_us / 1e3,
        cpu.as_millis(),
        ids.join(",")
    );
    std::process::ExitCode::SUCCESS
}

/// What one session's client saw.
#[derive(Debug, Default)]
struct Outcome {
    completed: usize,
    /// Added latency of the turns whose worker stayed up.
    added: Vec<Duration>,
    streams_lost: usize,
    resent: usize,
    failover_max: Duration,
    failed: bool,
}

/// Runs one session's turns, moving to the next worker when its own dies.
async fn session(
    client: &reqwest::Client,
    bases: &[(String, String)],
    mut worker: usize,
    id: &str,
    turns: usize,
) -> Outcome {
    let mut outcome = Outcome::default();
    for turn in 1..=turns {
        let sent = Instant::now();
        let mut lost = false;
        loop {
            if sent.elapsed() > FAILOVER_BOUND {
                eprintln!("session {id} turn {turn}: gave up after {FAILOVER_BOUND:?}");
                outcome.failed = true;
                return outcome;
            }
            let (base, key) = &bases[worker];
            let response = client
                .post(format!("{base}/sessions/{id}/messages"))
                .bearer_auth(key)
                .json(&json!({"text": user_text(id, turn)}))
                .send()
                .await;
            let stream = match response {
                // Leased still (by the dead worker, until its lease
                // expires, or by the one finishing its run): wait.
                Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Ok(r) => r.text().await.ok(),
                Err(_) => None,
            };
            if stream.as_deref().is_some_and(|s| s.contains("event: done")) {
                break;
            }
            // The worker died with the turn (or before it): go on with the
            // next one, once no run of the session is in progress.
            if !lost {
                outcome.streams_lost += 1;
                lost = true;
            }
            worker = (worker + 1) % bases.len();
            match settled(client, bases, &mut worker, id, sent).await {
                Some(messages) if messages == 4 * turn => break,
                Some(messages) if messages == 4 * (turn - 1) => {
                    // The dead worker never stored the message: again.
                    outcome.resent += 1;
                }
                Some(messages) => {
                    eprintln!("session {id} turn {turn}: {messages} messages after failover");
                    outcome.failed = true;
                    return outcome;
                }
                None => {
                    outcome.failed = true;
                    return outcome;
                }
            }
        }
        outcome.completed += 1;
        if lost {
            outcome.failover_max = outcome.failover_max.max(sent.elapsed());
        } else {
            outcome
                .added
                .push(sent.elapsed().saturating_sub(2 * MODEL_LATENCY));
        }
    }
    outcome
}

/// Waits (from `sent`, at most [`FAILOVER_BOUND`]) until the session shows
/// no run in progress on any worker, asking `worker` (the next one when it
/// does not answer); returns its number of messages then.
async fn settled(
    client: &reqwest::Client,
    bases: &[(String, String)],
    worker: &mut usize,
    id: &str,
    sent: Instant,
) -> Option<usize> {
    while sent.elapsed() < FAILOVER_BOUND {
        let (base, key) = &bases[*worker];
        let shown = client
            .get(format!("{base}/sessions/{id}"))
            .bearer_auth(key)
            .send()
            .await;
        match shown {
            Ok(response) if response.status().is_success() => {
                let session: Value = response.json().await.unwrap_or_default();
                if session["interrupted"] == json!(false) && session["running"] == json!(false) {
                    return session["history"].as_array().map(Vec::len);
                }
            }
            Ok(_) => {}
            Err(_) => *worker = (*worker + 1) % bases.len(),
        }
        // Each look reads the session's whole history: hundreds of clients
        // asking often would load the survivors more than the runs do.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!("session {id}: no worker finished its turn within {FAILOVER_BOUND:?}");
    None
}
