//! Figure 6: durable sessions. The cost of persisting one step (an
//! assistant message with a tool call and the user message with its result,
//! plus the run's progress) to a session whose history already holds about
//! K messages, and the time to load a session of K = 1 000 back into a
//! machine.

use std::time::{Duration, Instant};

use markov_bench::{Scenario, model, run_turn};
use markov_executor::serialize::serialize_machine;
use markov_executor::{Agent, RunOptions, RunState, StandardExecutor};
use markov_store::testing::TempPostgres;
use markov_store::{PostgresStore, SessionId, SqliteStore, StepRecord, Store, WorkerId};

use crate::Stats;

/// One backend at one K.
#[derive(Debug)]
pub(crate) struct StoreFigure {
    pub(crate) backend: &'static str,
    pub(crate) k: usize,
    /// Messages in the session before the timed appends.
    pub(crate) messages: usize,
    pub(crate) append: Stats,
}

/// Loading a session back into a machine.
#[derive(Debug)]
pub(crate) struct LoadFigure {
    pub(crate) backend: &'static str,
    pub(crate) messages: usize,
    /// Reading the rows into a snapshot.
    pub(crate) load_ms: f64,
    /// Turning the snapshot into a machine.
    pub(crate) restore_ms: f64,
}

/// A scratch directory, removed on drop.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let dir = std::env::temp_dir().join(format!("markov-bench-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether the appends carry a step trace (`markov-bench store-traced`).
pub(crate) static TRACED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A step's trace as a durable machine records it: one model call with a
/// 2 KB system prompt and three tools (kept once by content hash), the
/// policy's decision on its one tool call, a context view's shape with its
/// summary (kept once by content hash), the history range, usage and
/// latency.
fn step_trace(history: u64) -> markov_store::StepTrace {
    let tools = ["search", "fetch", "finish"].map(|name| tool(name, 0));
    step_trace_offering(history, std::sync::Arc::from(tools))
}

/// A tool whose schema has `fields` string properties besides `x` (an MCP
/// server's tools run to a few hundred bytes of schema each).
fn tool(name: &str, fields: usize) -> markov_core::tool::ToolDefinition {
    let mut properties = serde_json::Map::new();
    properties.insert("x".into(), serde_json::json!({"type": "string"}));
    for i in 0..fields {
        properties.insert(
            format!("field_{i}"),
            serde_json::json!({"type": "string", "description": format!("The {name} tool's field {i}.")}),
        );
    }
    markov_core::tool::ToolDefinition {
        name: markov_core::ToolName::new(name).expect("a valid tool name"),
        description: format!("The {name} tool: does what its name says, with care."),
        input_schema: serde_json::json!({"type": "object", "properties": properties}),
        terminal: false,
        needs_approval: false,
        delivery: None,
    }
}

/// [`step_trace`] with the call offering `tools`.
fn step_trace_offering(
    history: u64,
    tools: std::sync::Arc<[markov_core::tool::ToolDefinition]>,
) -> markov_store::StepTrace {
    markov_store::StepTrace {
        index: 0,
        recorded_at: 0,
        yield_reason: markov_executor::YieldReason::ToolUse,
        done: false,
        model: Some("bench-model".into()),
        usage: markov_core::model::Usage::default(),
        step_ms: 1,
        history_from: history.saturating_sub(2),
        history_to: history,
        calls: vec![markov_executor::ModelCall {
            instance: "root".into(),
            node: "main".into(),
            system: std::sync::Arc::from("You are a careful agent. ".repeat(80)),
            tools,
            provider_tools: Vec::new(),
            tool_choice: markov_core::model::ToolChoice::Auto,
            settings: markov_core::model::ModelSettings::default(),
            output_schema: None,
            history_len: history.saturating_sub(2),
            // A session under a context policy: the view's shape, a window
            // and stubs over the history and a 1 KB summary first (kept once
            // by content hash, as the prompt is).
            context_view: true,
            view: Some(markov_context::ViewShape {
                from: history / 2,
                stubbed_to: history.saturating_sub(6),
                summary: Some(std::sync::Arc::new(markov_core::Message::summary(
                    "The user asked for searches; the agent fetched pages. ".repeat(20),
                    0,
                    history / 2,
                ))),
                summary_alone: false,
            }),
            turn: markov_executor::TurnState::default(),
            replayed: false,
            model_ms: 1,
            tools_ms: 1,
            tool_calls: vec![markov_policy::CallTrace {
                call_id: markov_core::ids::ToolCallId::from("call_1"),
                tool: "search".into(),
                ms: 1,
                outcome: markov_policy::CallOutcome::Ran {
                    ok: true,
                    error: None,
                },
                approval: None,
                envelope: None,
                state: None,
            }],
        }],
        approvals: Vec::new(),
        tree: None,
        tree_before: None,
        counters_before: markov_policy::PolicyCounters::default(),
        usage_before: markov_context::UsageTotals::default(),
        sub_agents: Vec::new(),
        repeats_before: Vec::new(),
        waiting: markov_store::Waiting::default(),
    }
}

/// A session created in a store and the appends timed on it.
struct Appended {
    id: SessionId,
    /// The machine whose history the session started from.
    machine: markov_executor::Machine,
    /// Messages in the session before the appends.
    messages: usize,
    times: Vec<Duration>,
}

/// Creates a session of about `k` messages in `store` and appends
/// `appends` tool steps to it (with the trace `trace` makes for a history
/// of that many messages, if any), timing each append.
async fn timed_appends(
    store: &dyn Store,
    k: usize,
    appends: usize,
    trace: impl FnOnce(u64) -> Option<markov_store::StepTrace>,
) -> Appended {
    let scenario = Scenario::new();
    let mut machine = scenario.machine(k);
    run_turn(&mut machine, k).await;
    let snapshot = serialize_machine(&machine).expect("the machine serializes");
    let messages = snapshot.history.len();
    let id = SessionId::random();
    let holder = WorkerId::new("bench");
    store
        .create(
            &id,
            None,
            "bench",
            &snapshot,
            &holder,
            Duration::from_secs(3_600),
        )
        .await
        .expect("the session is created");
    // A tool step: the last assistant call and its results.
    let step: Vec<_> = snapshot.history[messages - 3..messages - 1].to_vec();
    let run = RunState::new(RunOptions::default());
    let trace = trace(messages as u64);
    let mut times = Vec::with_capacity(appends);
    for _ in 0..appends {
        let start = Instant::now();
        store
            .append(
                &id,
                &holder,
                StepRecord {
                    messages: &step,
                    tree: None,
                    approvals: None,
                    repeats: None,
                    counters: None,
                    answers: &[],
                    run: Some(&run),
                    usage: None,
                    trace: trace.as_ref(),
                },
            )
            .await
            .expect("the step is written");
        times.push(start.elapsed());
    }
    Appended {
        id,
        machine,
        messages,
        times,
    }
}

/// Times `appends` appends of one step to a session of about `k` messages
/// in `store`, and (for `load`) the load of that session.
async fn measure(
    store: &dyn Store,
    backend: &'static str,
    k: usize,
    appends: usize,
    load: bool,
) -> (StoreFigure, Option<LoadFigure>) {
    let Appended {
        id,
        machine,
        messages,
        times,
    } = timed_appends(store, k, appends, |history| {
        TRACED
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(|| step_trace(history))
    })
    .await;
    let figure = StoreFigure {
        backend,
        k,
        messages,
        append: Stats::of(&times),
    };
    let load = load.then(|| (id.clone(), machine.charter().clone(), k));
    let load = match load {
        None => None,
        Some((id, charter, k)) => {
            let agent = Agent::on_charter_with_executor(
                charter.clone(),
                std::sync::Arc::new(StandardExecutor::new(model(k))),
            )
            .build()
            .expect("the benchmark agent builds");
            let mut load_ms = Vec::new();
            let mut restore_ms = Vec::new();
            let mut loaded_messages = 0;
            for _ in 0..5 {
                let start = Instant::now();
                let stored = store.load(&id).await.expect("the session loads");
                load_ms.push(start.elapsed());
                loaded_messages = stored.snapshot.history.len();
                let start = Instant::now();
                let restored = agent
                    .restore(stored.snapshot)
                    .expect("the machine restores");
                restore_ms.push(start.elapsed());
                drop(restored);
            }
            Some(LoadFigure {
                backend,
                messages: loaded_messages,
                load_ms: Stats::of(&load_ms).median_us / 1e3,
                restore_ms: Stats::of(&restore_ms).median_us / 1e3,
            })
        }
    };
    let _ = store.delete(&id).await;
    (figure, load)
}

/// Figure 6 for one backend: `store_for(k)` gives the store to measure at
/// each K (the same one, or a fresh database), `label` names it in the
/// table and `key` in the machine-readable lines.
fn figures<S: Store>(
    runtime: &tokio::runtime::Runtime,
    ks: &[usize],
    appends: usize,
    label: &'static str,
    key: &str,
    mut store_for: impl FnMut(usize) -> S,
) -> (Vec<StoreFigure>, Vec<LoadFigure>) {
    let mut figures = Vec::new();
    let mut loads = Vec::new();
    for &k in ks {
        let store = store_for(k);
        let (figure, load) = runtime.block_on(measure(&store, label, k, appends, k == 1_000));
        println!(
            "bench=store backend={key} k={k} messages={} append_median_us={:.1} append_p99_us={:.1}",
            figure.messages, figure.append.median_us, figure.append.p99_us
        );
        figures.push(figure);
        if let Some(load) = load {
            println!(
                "bench=store_load backend={key} messages={} load_ms={:.2} restore_ms={:.3}",
                load.messages, load.load_ms, load.restore_ms
            );
            loads.push(load);
        }
    }
    (figures, loads)
}

/// Figure 6 for PostgreSQL (a server of its own on loopback, started from
/// the machine's binaries; `fsync=off`, so the figure is the store's work
/// and the round trips, not the disk), when PostgreSQL is installed; a
/// fresh database per K.
pub(crate) fn postgres_figures(
    ks: &[usize],
    appends: usize,
) -> (Vec<StoreFigure>, Vec<LoadFigure>) {
    let server = match TempPostgres::start() {
        Ok(server) => server,
        Err(error) => {
            println!("bench=store backend=postgres skipped=\"{error}\"");
            return (Vec::new(), Vec::new());
        }
    };
    // The connection needs the IO driver.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime with IO");
    figures(
        &runtime,
        ks,
        appends,
        "postgres (loopback)",
        "postgres",
        |_| {
            let url = server.new_database().expect("a database");
            runtime
                .block_on(PostgresStore::connect(&url))
                .expect("the store connects")
        },
    )
}

/// Figure 6 for SQLite (a file in WAL mode, the default durability) at each
/// K, and the load of a session of K = 1 000.
pub(crate) fn sqlite_figures(ks: &[usize], appends: usize) -> (Vec<StoreFigure>, Vec<LoadFigure>) {
    let scratch = Scratch::new();
    let store = SqliteStore::open(scratch.0.join("bench.db")).expect("the database opens");
    // With timers: the store's reads are bounded waits.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread tokio runtime starts");
    figures(
        &runtime,
        ks,
        appends,
        "sqlite (file, WAL)",
        "sqlite",
        |_| store.clone(),
    )
}

/// `markov-bench trace-tools <TOOLS>`: what recording a step costs when
/// its node offers `TOOLS` tools of about 450 bytes of schema each: 2 000
/// steps appended with their traces to one session in SQLite in memory
/// (no disk in the figure), each step's call sharing the node's tool list
/// and the session's system prompt, as a running machine's calls do. The
/// median and mean append, and the bytes of the tool list's JSON.
pub(crate) fn trace_tools_figure(tools: usize) {
    const APPENDS: usize = 2_000;
    let store = SqliteStore::in_memory().expect("the database opens");
    let list: Vec<_> = (0..tools).map(|i| tool(&format!("tool_{i}"), 4)).collect();
    let list_bytes = serde_json::to_string(&list).map_or(0, |t| t.len());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread tokio runtime starts");
    let list: std::sync::Arc<[_]> = std::sync::Arc::from(list);
    let times = runtime
        .block_on(timed_appends(&store, 10, APPENDS, |history| {
            Some(step_trace_offering(history, list))
        }))
        .times;
    let stats = Stats::of(&times);
    println!(
        "bench=trace_tools tools={tools} tool_list_bytes={list_bytes} appends={APPENDS} append_median_us={:.1} append_mean_us={:.1}",
        stats.median_us, stats.mean_us,
    );
}

/// `markov-bench store-messages <N>`: `n` messages to one session kept in
/// a SQLite file with the default durability, each driven as the server
/// drives one (the session leased and its kept machine taken, the user's
/// text queued, the run giving up the lease with its last write, the
/// machine kept again), the model a scripted one that answers at once:
/// what a message costs in the store's round trips and syncs of the disk.
/// Run it under `strace -c -e trace=fsync` to count the syncs.
pub(crate) fn message_figure(n: usize) {
    use markov_store::{CreateOptions, DurableMachine, OpenOptions, SessionCache};

    let scratch = Scratch::new();
    let store = std::sync::Arc::new(
        SqliteStore::open(scratch.0.join("messages.db")).expect("the database opens"),
    );
    let mut model = markov_testkit::ScriptedModel::builder();
    for _ in 0..n {
        model = model.text("ok");
    }
    let agent = Agent::builder("messages")
        .instructions("Answer.")
        .model(model.build())
        .build()
        .expect("the agent builds");
    let cache = SessionCache::new(std::num::NonZeroUsize::MIN, u64::MAX);
    let (id, worker) = (SessionId::new("messages"), WorkerId::new("bench"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread tokio runtime starts");
    let times = runtime.block_on(async {
        DurableMachine::create_with(
            store.clone(),
            id.clone(),
            worker.clone(),
            agent.machine(),
            CreateOptions::default().cache(cache.clone(), &agent),
        )
        .await
        .expect("the session is created")
        .release()
        .await
        .expect("released");
        let mut times = Vec::with_capacity(n);
        for i in 0..n {
            let started = Instant::now();
            let mut session = DurableMachine::open_with(
                store.clone(),
                id.clone(),
                worker.clone(),
                &agent,
                OpenOptions::default().cache(cache.clone()),
            )
            .await
            .expect("opens");
            session.machine().enqueue_user(format!("message {i}"));
            session.release_with_run();
            session.run().await.expect("runs");
            session.release().await.expect("released");
            times.push(started.elapsed());
        }
        times
    });
    let stats = Stats::of(&times);
    println!(
        "bench=store_messages backend=sqlite_file messages={n} median_us={:.1} p99_us={:.1}",
        stats.median_us, stats.p99_us
    );
}
