//! `markov-bench`: figures 1–9 on the scenario of `lib.rs`, as a
//! release binary run by `cargo xtask bench`.
//!
//! 1. Framework overhead per step for K = 10, 100, 1 000 and 10 000: each
//!    step is timed around the run stream's `next()`; the model answers at
//!    once, so what is measured is the framework.
//! 2. Throughput: 1 000 independent machines of K = 10 at once on tokio's
//!    multi-threaded runtime with 2 workers.
//! 3. Memory: the process's peak resident set after figure 2 (`VmHWM`), the
//!    peak live heap during one such run, and the heap held by one idle
//!    machine after a turn, counted by the global allocator in `counting.rs`.
//! 4. Serializing and deserializing after K = 100 and 1 000 with serde_json:
//!    the history alone (`Vec<Message>`), and the full machine snapshot
//!    (`serialize_machine` + `to_string`, `from_str` + `Agent::restore`).
//!
//! 5. The tool-registry policy pipeline: figure 1 at K = 10 and 1 000 with
//!    the registry on and every policy active (nothing rejects), on a
//!    runtime with its timer, beside the same figure without the registry on
//!    that runtime; then the cost of each layer, calling the stack directly
//!    with layers added one at a time from the inside out.
//!
//! 6. Durable sessions: the cost of persisting one step to a session of
//!    K = 10, 1 000 and 10 000 messages (SQLite file in WAL mode; PostgreSQL
//!    on loopback when installed), and the time to load a session of
//!    K = 1 000 back into a machine.
//!
//! 7. The HTTP service under load, its workers on SQLite and on one
//!    PostgreSQL (see `server.rs`).
//!
//! 7b. Workers on one PostgreSQL, one of them killed half-way: no step lost
//!     or repeated (see `failover.rs`).
//!
//! 8. A provider's request body at K = 10, 1 000 and 10 000 tool steps, for
//!    both vendors: built from the client's cache of encoded messages,
//!    against `serde_json::to_vec` of the whole request and a plain copy of
//!    the body's bytes (see `body.rs`).
//!
//! 9. Decoding a streamed answer, both vendors, against parsing each event
//!    once into a `serde_json::Value` (see `stream.rs`).
//!
//! 10. A tool call through MCP, over stdio and over loopback HTTP, beside
//!     the same tool called natively (see `mcp.rs`).
//!
//! 11. Context views: figure 1 at K = 10, 1 000 and 10 000 with a context
//!     policy (each call sent the policy's view, kept up to date step by
//!     step) beside the same figure without one, and both again with usage
//!     limits on tokens and requests (each call admitted first, its input
//!     estimated from sums kept as the history grows).
//!
//! 13. Guards on a streamed answer: the latency holding text back until
//!     the output guards passed it adds, per sentence and to the first
//!     byte (see `guard_stream.rs`; `markov-bench guard-stream`).
//!
//! Every figure prints one machine-readable line (`bench=<name> key=value
//! ...`) as it finishes, and a table closes the run.
//!
//! Usage: `markov-bench [--quick]` (`--quick`: fewer repetitions and K up to
//! 1 000, to check that it runs), or `markov-bench profile <K> <TURNS>` (only
//! turns of K steps, untimed, for `valgrind --tool=callgrind`), or
//! `markov-bench profile-body <anthropic|openai> <K> <REPS> [plain]` (the Anthropic bodies of
//! REPS steps after K, through the cache or, with `plain`, without).

mod body;
mod counting;
mod failover;
mod floor;
mod guard_stream;
mod mcp;
mod provider_path;
mod server;
mod soak;
mod store;
mod stream;
mod tool_search;

use std::fmt::Write as _;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use markov_bench::{
    Scenario, current_thread_runtime, model, policy_registry, run_turn, run_turn_timed,
    run_turn_with, timed_runtime,
};
use markov_core::ids::ToolCallId;
use markov_core::message::Message;
use markov_core::tool::{NoState, ToolContext};
use markov_executor::serialize::{SerializedMachine, serialize_machine};
use markov_executor::{Agent, Machine, StandardExecutor};
use markov_policy::{
    AuditLayer, CallReport, ConfirmLayer, DEFAULT_CONFIRMATION_TTL, EnvelopeMode, ExecuteService,
    GateLayer, IdempotencyLayer, IdempotencyLimits, LatencyLayer, Mode, PolicyStack, PolicyState,
    TimeoutLayer, ToolRequest, ToolService, TurnBudgetState, mode::ModeLayer,
    unknown_tool::UnknownToolLayer, validate::ValidateLayer,
};

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting;

/// The history lengths of figure 1.
const STEP_KS: [usize; 4] = [10, 100, 1_000, 10_000];
/// Steps timed per K in figure 1 (at least one turn).
const STEPS_PER_K: usize = 100_000;
/// Machines run at once in figures 2 and 3.
const MACHINES: usize = 1_000;
/// Tool steps per machine in figures 2 and 3.
const MACHINE_K: usize = 10;
/// Worker threads of figure 2's runtime.
const WORKERS: usize = 2;
/// Timed rounds of figure 2.
const ROUNDS: usize = 7;
/// The history lengths of figure 5.
const POLICY_KS: [usize; 2] = [10, 1_000];
/// The history lengths of figure 11.
const CONTEXT_KS: [usize; 3] = [10, 1_000, 10_000];
/// The history lengths of figure 4.
const SERDE_KS: [usize; 2] = [100, 1_000];

/// How much to run.
#[derive(Debug, Clone, Copy)]
struct Plan {
    step_ks: &'static [usize],
    steps_per_k: usize,
    rounds: usize,
    serde_iterations: usize,
    store_appends: usize,
    server_sessions: &'static [usize],
    /// Sessions and turns per session of the multi-worker figure.
    failover: (usize, usize),
    /// Timed bodies per vendor and K in figure 8.
    body_reps: usize,
    /// Timed decodings per vendor and N in figure 9.
    stream_reps: usize,
    /// Timed calls per path in figure 10.
    mcp_calls: usize,
    /// Turns at K = 10 in figure 12 (K = 1 000 runs a tenth as many, at
    /// least one).
    provider_turns: usize,
}

/// Sessions of the multi-worker figure: enough to keep every worker busy,
/// few enough that its three runs take about a minute on two cores.
const FAILOVER_SESSIONS: usize = 500;
/// Turns per session of the multi-worker figure, one after another.
const FAILOVER_TURNS: usize = 5;
/// Worker processes of the multi-worker figure's runs.
const FAILOVER_WORKERS: [usize; 3] = [1, 2, 4];

/// The multi-worker figure (see `failover.rs`) for each of
/// [`FAILOVER_WORKERS`].
fn failover_figures(plan: Plan) -> Vec<failover::FailoverFigure> {
    let (sessions, turns) = plan.failover;
    FAILOVER_WORKERS
        .iter()
        .filter_map(|&workers| failover::figure(sessions, turns, workers))
        .collect()
}

/// Fails the run when a multi-worker figure lost or repeated a step: a
/// figure that did is no figure.
fn exactly_once(figures: &[failover::FailoverFigure]) -> ExitCode {
    if figures.iter().all(|f| f.problems.is_empty()) {
        ExitCode::SUCCESS
    } else {
        eprintln!("the multi-worker figure lost or repeated a step (see its `problem=` lines)");
        ExitCode::FAILURE
    }
}

/// The text fragments of figure 9's streams.
const STREAM_NS: [usize; 3] = [10, 100, 1_000];

/// The history lengths (tool steps) of figure 8.
const BODY_KS: [usize; 3] = [10, 1_000, 10_000];

/// The history lengths of figure 6.
const STORE_KS: [usize; 3] = [10, 1_000, 10_000];

const FULL: Plan = Plan {
    step_ks: &STEP_KS,
    steps_per_k: STEPS_PER_K,
    rounds: ROUNDS,
    serde_iterations: 200_000,
    store_appends: 1_000,
    server_sessions: &[1_000, 10_000],
    failover: (FAILOVER_SESSIONS, FAILOVER_TURNS),
    body_reps: 50,
    stream_reps: 200,
    mcp_calls: 2_000,
    provider_turns: 400,
};

const QUICK: Plan = Plan {
    step_ks: &[10, 100, 1_000],
    steps_per_k: 2_000,
    rounds: 2,
    serde_iterations: 20_000,
    store_appends: 100,
    server_sessions: &[200],
    failover: (50, 3),
    body_reps: 10,
    stream_reps: 20,
    mcp_calls: 200,
    provider_turns: 40,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        [] => run_all(FULL),
        ["--quick"] => run_all(QUICK),
        ["server-processes", n, workers, rest @ ..] => {
            let (backend, scenario) = match rest {
                [rest @ .., "tool-call"] => (rest, server::Scenario::ToolCall),
                rest => (rest, server::Scenario::Text),
            };
            let backend = match backend {
                [] | ["sqlite"] => server::Backend::Sqlite,
                ["postgres"] => server::Backend::Postgres,
                // The floor answers text only: one step a message.
                ["floor"] if scenario == server::Scenario::Text => server::Backend::Floor,
                _ => return usage(),
            };
            match (n.parse(), workers.parse()) {
                (Ok(n), Ok(workers)) => {
                    server::multi_process(n, workers, backend, scenario);
                    ExitCode::SUCCESS
                }
                _ => usage(),
            }
        }
        ["server-beside-floor", n, workers, rounds] => {
            match (n.parse(), workers.parse(), rounds.parse()) {
                (Ok(n), Ok(workers), Ok(rounds)) if rounds > 0 => {
                    server::beside_floor(n, workers, rounds);
                    ExitCode::SUCCESS
                }
                _ => usage(),
            }
        }
        ["serve-worker", provider, options @ ..] => match server::WorkerOptions::parse(options) {
            Some(options) if options.floor => floor::worker(provider),
            Some(options) => server::worker(provider, &options),
            None => usage(),
        },
        ["failover"] => exactly_once(&failover_figures(FULL)),
        ["failover", sessions, turns, workers] => {
            match (sessions.parse(), turns.parse(), workers.parse()) {
                (Ok(sessions), Ok(turns), Ok(workers)) => exactly_once(
                    &failover::figure(sessions, turns, workers)
                        .into_iter()
                        .collect::<Vec<_>>(),
                ),
                _ => usage(),
            }
        }
        ["failover-clients", sessions, turns, bases] => match (sessions.parse(), turns.parse()) {
            (Ok(sessions), Ok(turns)) => {
                failover::clients(sessions, turns, &bases.split(',').collect::<Vec<_>>())
            }
            _ => usage(),
        },
        ["soak"] => {
            soak::figure(1_000, 100, 1_000);
            ExitCode::SUCCESS
        }
        ["soak", sessions, turns] => match (sessions.parse(), turns.parse()) {
            (Ok(sessions), Ok(turns)) => {
                soak::figure(sessions, turns, sessions);
                ExitCode::SUCCESS
            }
            _ => usage(),
        },
        ["soak", sessions, turns, in_flight] => {
            match (sessions.parse(), turns.parse(), in_flight.parse()) {
                (Ok(sessions), Ok(turns), Ok(in_flight)) if in_flight > 0 => {
                    soak::figure(sessions, turns, in_flight);
                    ExitCode::SUCCESS
                }
                _ => usage(),
            }
        }
        ["soak-clients", sessions, turns, in_flight, base] => {
            match (sessions.parse(), turns.parse(), in_flight.parse()) {
                (Ok(sessions), Ok(turns), Ok(in_flight)) => {
                    soak::clients(sessions, turns, in_flight, base)
                }
                _ => usage(),
            }
        }
        ["fake-provider", k] => match k.parse() {
            Ok(k) => provider_path::fake_provider(k),
            Err(_) => usage(),
        },
        ["provider-path"] => {
            provider_path_figures(FULL);
            ExitCode::SUCCESS
        }
        ["provider-path", call, k, turns] => {
            let call = match *call {
                "plain" => provider_path::Call::Plain,
                "streamed" => provider_path::Call::Streamed,
                _ => return usage(),
            };
            match (k.parse(), turns.parse()) {
                (Ok(k), Ok(turns)) => {
                    provider_path::figure(call, k, turns);
                    ExitCode::SUCCESS
                }
                _ => usage(),
            }
        }
        ["guard-stream"] => {
            guard_stream::figure(20, 200);
            ExitCode::SUCCESS
        }
        ["mcp-server"] => mcp::serve_stdio(),
        ["tool-search"] => match tool_search::figure(500) {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tool search: {e}");
                ExitCode::FAILURE
            }
        },
        ["mcp"] => {
            mcp::figure(QUICK.mcp_calls);
            ExitCode::SUCCESS
        }
        ["load-clients", n, bases, model_calls] => match (n.parse(), model_calls.parse()) {
            (Ok(n), Ok(model_calls)) => {
                server::clients(n, &bases.split(',').collect::<Vec<_>>(), model_calls)
            }
            _ => usage(),
        },
        ["server", ns @ ..] if !ns.is_empty() => {
            let ns: Vec<usize> = ns.iter().filter_map(|n| n.parse().ok()).collect();
            server::server_figures(&ns);
            ExitCode::SUCCESS
        }
        ["profile-snapshot", k, reps, rest @ ..] => match (k.parse(), reps.parse(), rest) {
            (Ok(k), Ok(reps), [] | ["read"]) => {
                profile_snapshot(k, reps, !rest.is_empty());
                ExitCode::SUCCESS
            }
            _ => usage(),
        },
        ["context"] => {
            context_figures(QUICK);
            ExitCode::SUCCESS
        }
        ["steps"] => {
            for &k in QUICK.step_ks {
                step_overhead(k, QUICK);
            }
            ExitCode::SUCCESS
        }
        ["serde"] => {
            for k in SERDE_KS {
                history_serde(k, QUICK.serde_iterations);
            }
            ExitCode::SUCCESS
        }
        ["profile-stream", vendor, n, reps] => match (n.parse(), reps.parse()) {
            (Ok(n), Ok(reps)) => match stream::profile(vendor, n, reps) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    usage()
                }
            },
            _ => usage(),
        },
        ["stream"] => {
            stream_figures(QUICK.stream_reps);
            ExitCode::SUCCESS
        }
        ["body"] => {
            body_figures(QUICK.body_reps);
            ExitCode::SUCCESS
        }
        ["store"] => {
            let _ = store::sqlite_figures(&STORE_KS, QUICK.store_appends);
            ExitCode::SUCCESS
        }
        ["store-messages", n] => match n.parse() {
            Ok(n) => {
                store::message_figure(n);
                ExitCode::SUCCESS
            }
            Err(_) => usage(),
        },
        ["trace-tools", tools] => match tools.parse() {
            Ok(tools) => {
                store::trace_tools_figure(tools);
                ExitCode::SUCCESS
            }
            Err(_) => usage(),
        },
        ["store-traced"] => {
            store::TRACED.store(true, std::sync::atomic::Ordering::Relaxed);
            let _ = store::sqlite_figures(&STORE_KS, QUICK.store_appends);
            ExitCode::SUCCESS
        }
        ["profile-body", vendor, k, reps, rest @ ..] => match (k.parse(), reps.parse(), rest) {
            (Ok(k), Ok(reps), [] | ["plain"]) => {
                match body::profile(vendor, k, reps, !rest.is_empty()) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        eprintln!("{e}");
                        usage()
                    }
                }
            }
            _ => usage(),
        },
        ["profile", k, turns] => match (k.parse(), turns.parse()) {
            (Ok(k), Ok(turns)) => {
                profile(k, turns);
                ExitCode::SUCCESS
            }
            _ => usage(),
        },
        _ => usage(),
    }
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: markov-bench [--quick] | markov-bench profile <K> <TURNS> | markov-bench profile-body <anthropic|openai> <K> <REPS> [plain] | markov-bench profile-snapshot <K> <REPS> [read] | markov-bench profile-stream <anthropic|openai> <N> <REPS> | markov-bench steps | markov-bench context | markov-bench serde | markov-bench body | markov-bench store | markov-bench store-messages <N> | markov-bench trace-tools <TOOLS> | markov-bench stream | markov-bench mcp | markov-bench tool-search | markov-bench guard-stream | markov-bench provider-path [plain|streamed <K> <TURNS>] | markov-bench server <N>... | markov-bench server-processes <N> <WORKERS> [sqlite|postgres [tool-call] | floor] | markov-bench server-beside-floor <N> <WORKERS> <ROUNDS> | markov-bench failover [<SESSIONS> <TURNS> <WORKERS>] | markov-bench soak [<SESSIONS> <TURNS> [<IN_FLIGHT>]]"
    );
    ExitCode::from(2)
}

/// After a turn of `k` tool steps, `reps` snapshot round trips (written as
/// JSON, read back into a machine; with `read_only`, written once and read
/// `reps` times), untimed: the workload to profile.
fn profile_snapshot(k: usize, reps: usize, read_only: bool) {
    let scenario = Scenario::new();
    let runtime = current_thread_runtime();
    let mut machine = scenario.machine(k);
    runtime.block_on(run_turn(&mut machine, k));
    let charter = machine.charter().clone();
    let agent = Agent::on_charter_with_executor(
        charter.clone(),
        std::sync::Arc::new(StandardExecutor::new(model(k))),
    )
    .build()
    .expect("the benchmark agent builds");
    let write = |machine: &Machine| {
        serde_json::to_string(&serialize_machine(machine).expect("the machine serializes"))
            .expect("the snapshot serializes")
    };
    let written = write(&machine);
    for _ in 0..reps {
        let bytes = if read_only {
            written.clone()
        } else {
            write(black_box(&machine))
        };
        let data: SerializedMachine =
            serde_json::from_str(&bytes).expect("the snapshot deserializes");
        let restored = agent.restore(data).expect("the machine deserializes");
        drop(black_box(restored));
    }
}

/// Runs `turns` turns of `k` tool steps, untimed: the workload to profile.
fn profile(k: usize, turns: usize) {
    let scenario = Scenario::new();
    let runtime = current_thread_runtime();
    let mut steps = 0;
    for _ in 0..turns {
        let mut machine = scenario.machine(k);
        steps += runtime.block_on(run_turn(&mut machine, k));
    }
    println!("profile: {turns} turns of K = {k}, {steps} steps");
}

fn run_all(plan: Plan) -> ExitCode {
    let mut table = String::new();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    // Figures 2 and 3 first, so the process's peak RSS is theirs.
    let throughput = throughput(plan);
    let idle = idle_memory();
    let steps: Vec<StepFigure> = plan
        .step_ks
        .iter()
        .map(|&k| step_overhead(k, plan))
        .collect();
    let ratio = step_ratio(&steps);
    let serde: Vec<SerdeFigure> = SERDE_KS
        .iter()
        .map(|&k| history_serde(k, plan.serde_iterations))
        .collect();
    let policy: Vec<(StepFigure, StepFigure)> = POLICY_KS
        .iter()
        .map(|&k| {
            let base = step_figure(k, plan, &Scenario::new(), &timed_runtime(), "off");
            let on = step_figure(k, plan, &Scenario::with_policies(), &timed_runtime(), "on");
            (base, on)
        })
        .collect();
    let layers = layer_costs(plan.steps_per_k.max(20_000));
    let context = context_figures(plan);
    let (mut stores, mut loads) = store::sqlite_figures(&STORE_KS, plan.store_appends);
    let (pg_stores, pg_loads) = store::postgres_figures(&STORE_KS, plan.store_appends);
    let bodies = body_figures(plan.body_reps);
    let streams = stream_figures(plan.stream_reps);
    let mcp = mcp::figure(plan.mcp_calls);
    let provider_paths = provider_path_figures(plan);
    let servers: Vec<server::ProcessesFigure> = plan
        .server_sessions
        .iter()
        .flat_map(|&n| {
            [
                server::Backend::Sqlite,
                server::Backend::Postgres,
                server::Backend::Floor,
            ]
            .into_iter()
            .filter_map(move |backend| server::multi_process(n, 2, backend, server::Scenario::Text))
        })
        .collect();
    let failovers = failover_figures(plan);
    stores.extend(pg_stores);
    loads.extend(pg_loads);

    let _ = writeln!(
        table,
        "\nmarkov benchmarks: zero-latency scripted model, {cpus} CPUs visible\n"
    );
    let _ = writeln!(
        table,
        "1. Framework overhead per step (timed around the run stream's next())"
    );
    let _ = writeln!(
        table,
        "   {:>6} {:>8} {:>9} {:>10} {:>8} {:>8} {:>13} {:>13} {:>12}",
        "K",
        "steps",
        "mean µs",
        "median µs",
        "p90 µs",
        "p99 µs",
        "first10% med",
        "last10% med",
        "allocs/step"
    );
    for s in &steps {
        let _ = writeln!(
            table,
            "   {:>6} {:>8} {:>9.2} {:>10.2} {:>8.2} {:>8.2} {:>13.2} {:>13.2} {:>12.1}",
            s.k,
            s.stats.count,
            s.stats.mean_us,
            s.stats.median_us,
            s.stats.p90_us,
            s.stats.p99_us,
            s.first_tenth_median_us,
            s.last_tenth_median_us,
            s.allocations_per_step
        );
    }
    if let Some((hi, lo, median, mean)) = ratio {
        let _ = writeln!(
            table,
            "   K = {hi} vs K = {lo}: median ×{median:.2}, mean ×{mean:.2} (target: within ×2)"
        );
    }
    let _ = writeln!(
        table,
        "\n2. Throughput: {MACHINES} machines × K = {MACHINE_K} ({} steps each) at once, tokio multi-thread, {WORKERS} workers, {} rounds",
        MACHINE_K + 1,
        throughput.rounds.len()
    );
    let _ = writeln!(
        table,
        "   median round {:.1} ms: {:.0} machines/s, {:.0} steps/s (best round: {:.0} steps/s)",
        throughput.median.as_secs_f64() * 1e3,
        throughput.machines_per_s(throughput.median),
        throughput.steps_per_s(throughput.median),
        throughput.steps_per_s(throughput.best),
    );
    let _ = writeln!(table, "\n3. Memory");
    let _ = writeln!(
        table,
        "   peak RSS after figure 2 (VmHWM): {:.1} MB (at start: {:.1} MB); peak live heap of one figure-2 round (build + run {MACHINES} machines): {:.1} MB",
        throughput.vm_hwm_kb as f64 / 1024.0,
        throughput.start_rss_kb as f64 / 1024.0,
        throughput.peak_heap as f64 / MB,
    );
    let _ = writeln!(
        table,
        "   heap per machine: {} B built, {} B idle after a turn of K = {MACHINE_K} ({} messages; a copy of that history alone: {} B); the scripted model alone, fresh: {} B",
        idle.built_per_machine,
        idle.idle_per_machine,
        idle.messages,
        idle.history_bytes,
        idle.model_per_machine
    );
    let _ = writeln!(
        table,
        "\n4. To and from JSON: the history (Vec<Message>) and the full machine snapshot, with serde_json"
    );
    let _ = writeln!(
        table,
        "   {:>6} {:>9} {:>11} {:>13} {:>13} {:>14} {:>13} {:>13} {:>13}",
        "K",
        "messages",
        "JSON bytes",
        "serialize µs",
        "deserialize µs",
        "snapshot bytes",
        "snapshot ser",
        "snapshot de",
        "round trip"
    );
    for s in &serde {
        let _ = writeln!(
            table,
            "   {:>6} {:>9} {:>11} {:>13.1} {:>13.1} {:>14} {:>13.1} {:>13.1} {:>13.1}",
            s.k,
            s.messages,
            s.bytes,
            s.serialize_us,
            s.deserialize_us,
            s.snapshot_bytes,
            s.snapshot_serialize_us,
            s.snapshot_deserialize_us,
            s.snapshot_round_trip_us
        );
    }
    let _ = writeln!(
        table,
        "\n5. Tool-registry policy pipeline (every policy on, nothing rejected; timer-enabled runtime)"
    );
    let _ = writeln!(
        table,
        "   {:>6} {:>16} {:>15} {:>10} {:>16} {:>15}",
        "K", "median µs (off)", "median µs (on)", "Δ µs", "allocs/step off", "allocs/step on"
    );
    for (off, on) in &policy {
        let _ = writeln!(
            table,
            "   {:>6} {:>16.2} {:>15.2} {:>10.2} {:>16.1} {:>15.1}",
            off.k,
            off.stats.median_us,
            on.stats.median_us,
            on.stats.median_us - off.stats.median_us,
            off.allocations_per_step,
            on.allocations_per_step
        );
    }
    let _ = writeln!(
        table,
        "   per call through the stack, layers added from the inside out:"
    );
    let mut previous = 0.0;
    for (name, ns) in &layers {
        let _ = writeln!(
            table,
            "   {name:>14}: {ns:>7.0} ns per call ({:+.0} ns)",
            ns - previous
        );
        previous = *ns;
    }
    let _ = writeln!(
        table,
        "\n11. Context views (keep the last 4 turns, trim all but the last 2 turns' tool results)"
    );
    let _ = writeln!(
        table,
        "   {:>6} {:>16} {:>15} {:>10} {:>16} {:>15} {:>18} {:>17}",
        "K",
        "median µs (off)",
        "median µs (on)",
        "Δ µs",
        "allocs/step off",
        "allocs/step on",
        "off + limits µs",
        "on + limits µs"
    );
    for f in &context {
        let _ = writeln!(
            table,
            "   {:>6} {:>16.2} {:>15.2} {:>10.2} {:>16.1} {:>15.1} {:>18.2} {:>17.2}",
            f.off.k,
            f.off.stats.median_us,
            f.on.stats.median_us,
            f.on.stats.median_us - f.off.stats.median_us,
            f.off.allocations_per_step,
            f.on.allocations_per_step,
            f.off_limited.stats.median_us,
            f.on_limited.stats.median_us
        );
    }
    let _ = writeln!(
        table,
        "\n6. Durable sessions: persisting one step (2 messages + the run's progress), one transaction each"
    );
    let _ = writeln!(
        table,
        "   {:>20} {:>6} {:>9} {:>8} {:>10} {:>8} {:>8}",
        "backend", "K", "messages", "appends", "median µs", "p90 µs", "p99 µs"
    );
    for s in &stores {
        let _ = writeln!(
            table,
            "   {:>20} {:>6} {:>9} {:>8} {:>10.1} {:>8.1} {:>8.1}",
            s.backend,
            s.k,
            s.messages,
            s.append.count,
            s.append.median_us,
            s.append.p90_us,
            s.append.p99_us
        );
    }
    for l in &loads {
        let _ = writeln!(
            table,
            "   load a session of {} messages ({}): {:.2} ms reading, {:.3} ms restoring the machine",
            l.messages, l.backend, l.load_ms, l.restore_ms
        );
    }
    let _ = writeln!(
        table,
        "   LangGraph's checkpointers (issue figure, not measured here): ≈ 15 ms per step at 1 000 steps, re-serializing the whole history"
    );
    let _ = writeln!(
        table,
        "\n7. The HTTP service: N sessions at once, one message each, the model 100 ms away on loopback (Anthropic client, fake provider); 2 server processes (each its own SQLite in memory, or one shared PostgreSQL on loopback with fsync off), the clients and the provider in processes of their own; \"floor\" is not markov but the least a durable server does with a message on the same crates (see floor.rs)"
    );
    for s in &servers {
        let _ = writeln!(
            table,
            "   {:<8} N = {:>5}: {} completed in {:.0} ms, {:.0} steps/s; added latency p50 {:.1} ms, p99 {:.1} ms; peak RSS of the {} servers {:.1} MB (clients {:.1} MB); CPU per step: servers {:.0} µs, clients {:.0} µs, provider {:.0} µs, database {:.0} µs",
            s.backend.name(),
            s.sessions,
            s.completed,
            s.wall_ms,
            s.steps_per_s(),
            s.p50_ms,
            s.p99_ms,
            s.workers,
            s.workers_mb,
            s.clients_mb,
            s.cpu_per_step_us(s.workers_cpu),
            s.cpu_per_step_us(s.client_cpu),
            s.cpu_per_step_us(s.provider_cpu),
            s.cpu_per_step_us(s.database_cpu)
        );
    }
    let _ = writeln!(
        table,
        "\n7b. Workers on one PostgreSQL: N sessions of T turns each (a tool call, then text: 2 steps), spread over W server processes; with W > 1 the first is killed (SIGKILL) half-way and the others continue its runs (lease {} s); every (session, turn) checked executed exactly once and every stored history exact",
        failover::LEASE.as_secs()
    );
    for f in &failovers {
        let _ = writeln!(
            table,
            "   W = {}: N = {} x {} turns, {} turns in {:.0} ms, {:.0} steps/s; added latency p50 {:.1} ms, p99 {:.1} ms; {} streams lost, {} runs continued, {} messages resent, longest failover {:.0} ms; {:.1} KB per session; CPU per step {:.0} µs (servers {:.0}, clients {:.0}, provider {:.0}, database {:.0}); exactly once: {} ({} problems, {} repeats absorbed by the idempotency key; at most once: {} notifications, {} calls answered INTERRUPTED, none run twice)",
            f.workers,
            f.sessions,
            f.turns,
            f.completed_turns,
            f.wall_ms,
            f.steps_per_s(),
            f.p50_ms,
            f.p99_ms,
            f.streams_lost,
            f.runs_continued,
            f.resent,
            f.failover_max_ms,
            f.memory_per_session_kb,
            f.cpu_per_step_us(f.total_cpu()),
            f.cpu_per_step_us(f.workers_cpu),
            f.cpu_per_step_us(f.client_cpu),
            f.cpu_per_step_us(f.provider_cpu),
            f.cpu_per_step_us(f.database_cpu),
            if f.problems.is_empty() { "yes" } else { "NO" },
            f.problems.len(),
            f.deduplicated,
            f.notified,
            f.interrupted,
        );
    }
    let _ = writeln!(
        table,
        "\n8. A provider's request body at K tool steps (no network): cached = the client's body for a step (two new messages since the last call), plain = serde_json::to_vec of the whole request, copy = the body's bytes copied into a new buffer; medians"
    );
    let _ = writeln!(
        table,
        "   {:>9} {:>6} {:>8} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "vendor",
        "K",
        "messages",
        "bytes",
        "cached µs",
        "plain µs",
        "copy µs",
        "cached/copy",
        "cached ns/msg"
    );
    for b in &bodies {
        let _ = writeln!(
            table,
            "   {:>9} {:>6} {:>8} {:>10} {:>10.1} {:>10.1} {:>10.1} {:>12.2} {:>12.1}",
            b.vendor,
            b.k,
            b.messages,
            b.bytes,
            b.cached.median_us,
            b.plain.median_us,
            b.copy.median_us,
            b.cached_over_copy(),
            b.cached_ns_per_message()
        );
    }
    let _ = writeln!(
        table,
        "\n9. Decoding a streamed answer (N text fragments and a tool call in 20 argument fragments) with the client's decoder, against parsing each event once into a serde_json::Value; medians"
    );
    let _ = writeln!(
        table,
        "   {:>9} {:>6} {:>7} {:>9} {:>10} {:>10} {:>10} {:>14} {:>8}",
        "vendor",
        "N",
        "events",
        "bytes",
        "decode µs",
        "Value µs",
        "ns/event",
        "decode/Value",
        "MB/s"
    );
    for s in &streams {
        let _ = writeln!(
            table,
            "   {:>9} {:>6} {:>7} {:>9} {:>10.1} {:>10.1} {:>10.0} {:>14.2} {:>8.0}",
            s.vendor,
            s.fragments,
            s.events,
            s.bytes,
            s.decode.median_us,
            s.values.median_us,
            s.decode_ns_per_event(),
            s.decode_over_values(),
            s.decode_mb_per_s()
        );
    }
    let _ = writeln!(
        table,
        "\n10. A tool call through MCP (markov-mcp on rmcp) beside the same tool called natively; {} sequential calls each",
        mcp.native.count
    );
    let _ = writeln!(
        table,
        "   {:>22} {:>10} {:>8} {:>16}",
        "path", "median µs", "p90 µs", "over native µs"
    );
    for (path, stats) in [
        ("native", Some(mcp.native)),
        ("MCP stdio (child)", mcp.stdio),
        ("MCP HTTP (loopback)", mcp.http),
    ] {
        match stats {
            Some(s) => {
                let _ = writeln!(
                    table,
                    "   {:>22} {:>10.1} {:>8.1} {:>16.1}",
                    path,
                    s.median_us,
                    s.p90_us,
                    s.median_us - mcp.native.median_us
                );
            }
            None => {
                let _ = writeln!(table, "   {path:>22} skipped (see stderr)");
            }
        }
    }
    let _ = writeln!(
        table,
        "\n12. A step through the Anthropic client against a keep-alive loopback fake provider in a process of its own, answering at once; per step: wall, and this process's CPU (the client and the loop: its own code + the kernel's work for it), beside the floor: the same bytes exchanged bare over one connection"
    );
    let _ = writeln!(
        table,
        "   {:>9} {:>6} {:>6} {:>9} {:>22} {:>7} {:>6} {:>11} {:>22}",
        "call",
        "K",
        "steps",
        "wall µs",
        "CPU µs (own + kernel)",
        "allocs",
        "conns",
        "floor wall",
        "floor CPU (own + kern)"
    );
    for p in &provider_paths {
        let _ = writeln!(
            table,
            "   {:>9} {:>6} {:>6} {:>9.1} {:>22} {:>7.0} {:>6} {:>11.1} {:>22}",
            p.call.as_str(),
            p.k,
            p.steps,
            p.wall_per_step_us,
            p.cpu,
            p.allocations_per_step,
            p.connections,
            p.floor.wall_per_step_us,
            p.floor.cpu,
        );
    }
    println!("{table}");
    exactly_once(&failovers)
}

/// Figure 12: both ways of calling, at K = 10 and 1 000.
fn provider_path_figures(plan: Plan) -> Vec<provider_path::ProviderPathFigure> {
    use provider_path::Call;
    [Call::Plain, Call::Streamed]
        .into_iter()
        .flat_map(|call| {
            [
                (10, plan.provider_turns),
                (1_000, (plan.provider_turns / 100).max(1)),
            ]
            .map(|(k, turns)| provider_path::figure(call, k, turns))
        })
        .collect()
}

/// Figure 9, printing its machine-readable lines.
fn stream_figures(reps: usize) -> Vec<stream::StreamFigure> {
    let figures = stream::stream_figures(&STREAM_NS, reps);
    for s in &figures {
        println!(
            "bench=stream_decode vendor={} fragments={} events={} bytes={} reps={} decode_median_us={:.1} values_median_us={:.1} decode_ns_per_event={:.0} decode_over_values={:.2} decode_mb_per_s={:.0}",
            s.vendor,
            s.fragments,
            s.events,
            s.bytes,
            s.decode.count,
            s.decode.median_us,
            s.values.median_us,
            s.decode_ns_per_event(),
            s.decode_over_values(),
            s.decode_mb_per_s()
        );
    }
    figures
}

/// Figure 8, printing its machine-readable lines.
fn body_figures(reps: usize) -> Vec<body::BodyFigure> {
    let bodies = body::body_figures(&BODY_KS, reps);
    for b in &bodies {
        println!(
            "bench=request_body vendor={} k={} messages={} bytes={} reps={} cached_median_us={:.1} plain_median_us={:.1} copy_median_us={:.1} cached_over_copy={:.2} cached_ns_per_message={:.1} plain_ns_per_message={:.1}",
            b.vendor,
            b.k,
            b.messages,
            b.bytes,
            b.cached.count,
            b.cached.median_us,
            b.plain.median_us,
            b.copy.median_us,
            b.cached_over_copy(),
            b.cached_ns_per_message(),
            b.plain_ns_per_message()
        );
    }
    bodies
}

const MB: f64 = 1024.0 * 1024.0;

/// Summary statistics of a sample of durations, in microseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stats {
    count: usize,
    mean_us: f64,
    median_us: f64,
    p90_us: f64,
    p99_us: f64,
}

impl Stats {
    fn of(times: &[Duration]) -> Stats {
        let mut us: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1e6).collect();
        us.sort_by(f64::total_cmp);
        let count = us.len();
        let mean_us = if count == 0 {
            0.0
        } else {
            us.iter().sum::<f64>() / count as f64
        };
        Stats {
            count,
            mean_us,
            median_us: quantile(&us, 0.5),
            p90_us: quantile(&us, 0.9),
            p99_us: quantile(&us, 0.99),
        }
    }
}

/// With `MARKOV_BENCH_STEP_TIMES=<dir>` set, appends each timed turn's
/// per-step times (step index and nanoseconds, one a line) to
/// `<dir>/steps-<K>.txt`, to see which steps of a turn make the tail.
fn dump_step_times(k: usize, times: &[Duration]) {
    let Some(dir) = std::env::var_os("MARKOV_BENCH_STEP_TIMES") else {
        return;
    };
    let path = std::path::Path::new(&dir).join(format!("steps-{k}.txt"));
    let mut text = String::new();
    for (i, t) in times.iter().enumerate() {
        let _ = writeln!(text, "{i} {}", t.as_nanos());
    }
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()));
    if let Err(e) = written {
        eprintln!("cannot write step times to {}: {e}", path.display());
    }
}

/// The `q` quantile of sorted values (nearest rank); 0 when empty.
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Figure 1 for one K.
#[derive(Debug)]
struct StepFigure {
    k: usize,
    stats: Stats,
    /// Median of the first tenth of each turn's steps.
    first_tenth_median_us: f64,
    /// Median of the last tenth of each turn's steps.
    last_tenth_median_us: f64,
    /// Heap allocations per step, counted over one more, untimed turn.
    allocations_per_step: f64,
}

/// The `registry` label of a [`step_figure`] that prints no line of its
/// own (its caller prints one).
const QUIET: &str = "-";

/// Figure 11 at one K: figure 1 without and with a context policy, each
/// without and with usage limits, on the same runtime.
#[derive(Debug)]
struct ContextFigure {
    off: StepFigure,
    on: StepFigure,
    off_limited: StepFigure,
    on_limited: StepFigure,
}

/// Figure 11: figure 1 at each of [`CONTEXT_KS`] without and with a
/// context policy, and both again with usage limits on tokens and
/// requests (every call admitted first, its input estimated), on the
/// same runtime.
fn context_figures(plan: Plan) -> Vec<ContextFigure> {
    CONTEXT_KS
        .iter()
        .map(|&k| {
            let runtime = current_thread_runtime();
            let figure = |scenario: Scenario| step_figure(k, plan, &scenario, &runtime, QUIET);
            let figures = ContextFigure {
                off: figure(Scenario::new()),
                on: figure(Scenario::with_context_policy()),
                off_limited: figure(Scenario::new().with_usage_limits()),
                on_limited: figure(Scenario::with_context_policy().with_usage_limits()),
            };
            for (policy, limits, figure) in [
                ("off", "off", &figures.off),
                ("on", "off", &figures.on),
                ("off", "on", &figures.off_limited),
                ("on", "on", &figures.on_limited),
            ] {
                println!(
                    "bench=context_view policy={policy} limits={limits} k={k} steps={} mean_us={:.3} median_us={:.3} p90_us={:.3} p99_us={:.3} allocs_per_step={:.1}",
                    figure.stats.count,
                    figure.stats.mean_us,
                    figure.stats.median_us,
                    figure.stats.p90_us,
                    figure.stats.p99_us,
                    figure.allocations_per_step
                );
            }
            figures
        })
        .collect()
}

fn step_overhead(k: usize, plan: Plan) -> StepFigure {
    step_figure(k, plan, &Scenario::new(), &current_thread_runtime(), "")
}

/// Figure 1 (or, with `registry` = "on"/"off", figure 5) for one K.
fn step_figure(
    k: usize,
    plan: Plan,
    scenario: &Scenario,
    runtime: &tokio::runtime::Runtime,
    registry: &str,
) -> StepFigure {
    let steps = k + 1;
    let turns = plan.steps_per_k.div_ceil(steps).max(1);
    // Warm up: caches, lazily registered tracing callsites, the allocator.
    for _ in 0..turns.min(3) {
        let mut machine = scenario.machine(k);
        runtime.block_on(run_turn_with(&mut machine, k, scenario.options(k)));
    }
    let mut all = Vec::with_capacity(turns * steps);
    let mut first = Vec::new();
    let mut last = Vec::new();
    let tenth = steps.div_ceil(10);
    for _ in 0..turns {
        let mut machine = scenario.machine(k);
        let mut times = Vec::with_capacity(steps);
        runtime.block_on(run_turn_timed(
            &mut machine,
            k,
            scenario.options(k),
            &mut times,
        ));
        dump_step_times(k, &times);
        first.extend_from_slice(&times[..tenth]);
        last.extend_from_slice(&times[times.len() - tenth..]);
        all.extend(times);
        drop(machine);
    }
    let stats = Stats::of(&all);
    let mut machine = scenario.machine(k);
    let window = counting::Window::open();
    runtime.block_on(run_turn_with(&mut machine, k, scenario.options(k)));
    let counted = window.close();
    drop(machine);
    let figure = StepFigure {
        k,
        stats,
        first_tenth_median_us: Stats::of(&first).median_us,
        last_tenth_median_us: Stats::of(&last).median_us,
        allocations_per_step: counted.allocations as f64 / steps as f64,
    };
    if registry == QUIET {
        return figure;
    }
    if !registry.is_empty() {
        println!(
            "bench=policy_pipeline registry={registry} k={k} steps={} mean_us={:.3} median_us={:.3} p90_us={:.3} p99_us={:.3} allocs_per_step={:.1}",
            stats.count,
            stats.mean_us,
            stats.median_us,
            stats.p90_us,
            stats.p99_us,
            figure.allocations_per_step
        );
        return figure;
    }
    println!(
        "bench=step_overhead k={k} turns={turns} steps={} mean_us={:.3} median_us={:.3} p90_us={:.3} p99_us={:.3} first10_median_us={:.3} last10_median_us={:.3} allocs_per_step={:.1}",
        stats.count,
        stats.mean_us,
        stats.median_us,
        stats.p90_us,
        stats.p99_us,
        figure.first_tenth_median_us,
        figure.last_tenth_median_us,
        figure.allocations_per_step
    );
    figure
}

/// The largest K against the smallest: (K hi, K lo, median ratio, mean ratio).
fn step_ratio(steps: &[StepFigure]) -> Option<(usize, usize, f64, f64)> {
    let lo = steps.first()?;
    let hi = steps.last()?;
    let median = hi.stats.median_us / lo.stats.median_us;
    let mean = hi.stats.mean_us / lo.stats.mean_us;
    println!(
        "bench=step_overhead_ratio k_hi={} k_lo={} median_ratio={median:.3} mean_ratio={mean:.3} target_max=2",
        hi.k, lo.k
    );
    Some((hi.k, lo.k, median, mean))
}

/// Figures 2 and the RSS part of 3.
#[derive(Debug)]
struct Throughput {
    rounds: Vec<Duration>,
    median: Duration,
    best: Duration,
    start_rss_kb: u64,
    vm_hwm_kb: u64,
    peak_heap: isize,
}

impl Throughput {
    fn machines_per_s(&self, round: Duration) -> f64 {
        MACHINES as f64 / round.as_secs_f64()
    }

    fn steps_per_s(&self, round: Duration) -> f64 {
        (MACHINES * (MACHINE_K + 1)) as f64 / round.as_secs_f64()
    }
}

/// One round: runs the machines at once and returns them (dropped by the
/// caller, outside the timing) with the time from the first spawn to the
/// last join.
fn round(runtime: &tokio::runtime::Runtime, machines: Vec<markov_executor::Machine>) -> Duration {
    runtime.block_on(async {
        let start = Instant::now();
        let handles: Vec<_> = machines
            .into_iter()
            .map(|mut machine| {
                tokio::spawn(async move {
                    run_turn(&mut machine, MACHINE_K).await;
                    machine
                })
            })
            .collect();
        let mut done = Vec::with_capacity(handles.len());
        for handle in handles {
            done.push(handle.await.expect("a benchmark machine's task completes"));
        }
        let elapsed = start.elapsed();
        drop(done);
        elapsed
    })
}

fn throughput(plan: Plan) -> Throughput {
    let start_rss_kb = proc_status_kb("VmRSS").unwrap_or(0);
    let scenario = Scenario::new();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .build()
        .expect("a multi-threaded tokio runtime starts");
    // An untimed round with the allocator counting: the peak live heap.
    let window = counting::Window::open();
    let machines: Vec<_> = (0..MACHINES).map(|_| scenario.machine(MACHINE_K)).collect();
    round(&runtime, machines);
    let peak_heap = window.close().peak;
    let mut rounds = Vec::with_capacity(plan.rounds);
    for _ in 0..plan.rounds {
        let machines: Vec<_> = (0..MACHINES).map(|_| scenario.machine(MACHINE_K)).collect();
        rounds.push(round(&runtime, machines));
    }
    let vm_hwm_kb = proc_status_kb("VmHWM").unwrap_or(0);
    let mut sorted = rounds.clone();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    let best = sorted[0];
    let figure = Throughput {
        rounds,
        median,
        best,
        start_rss_kb,
        vm_hwm_kb,
        peak_heap,
    };
    println!(
        "bench=throughput machines={MACHINES} k={MACHINE_K} workers={WORKERS} rounds={} median_ms={:.2} machines_per_s={:.0} steps_per_s={:.0} best_steps_per_s={:.0}",
        figure.rounds.len(),
        median.as_secs_f64() * 1e3,
        figure.machines_per_s(median),
        figure.steps_per_s(median),
        figure.steps_per_s(best)
    );
    println!(
        "bench=peak_memory machines={MACHINES} k={MACHINE_K} vm_hwm_mb={:.1} start_rss_mb={:.1} peak_heap_mb={:.2}",
        vm_hwm_kb as f64 / 1024.0,
        start_rss_kb as f64 / 1024.0,
        peak_heap as f64 / MB
    );
    figure
}

/// CPU a process has used, all threads together: `utime` + `stime` of
/// `/proc/<pid>/stat` (`pid` a number or `self`), in clock ticks of 1/100 s
/// (`USER_HZ`, fixed at 100 by the kernel's ABI on the platforms we run on).
pub(crate) fn process_cpu(pid: &str) -> Option<Duration> {
    process_cpu_split(pid).map(|cpu| cpu.user + cpu.kernel)
}

/// A process's CPU time, split into its own code and the kernel's work for it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpuSplit {
    /// Time in the process's own code (`utime`).
    pub(crate) user: Duration,
    /// Time in the kernel on its behalf (`stime`): system calls, and on
    /// loopback the receiving side's TCP work, which runs in the sender.
    pub(crate) kernel: Duration,
}

impl CpuSplit {
    /// What was spent between `before` and `self`.
    pub(crate) fn since(self, before: CpuSplit) -> CpuSplit {
        CpuSplit {
            user: self.user.saturating_sub(before.user),
            kernel: self.kernel.saturating_sub(before.kernel),
        }
    }
}

/// [`process_cpu`], split into user and kernel time.
pub(crate) fn process_cpu_split(pid: &str) -> Option<CpuSplit> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after it are plain.
    let after_name = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // `utime` and `stime` are fields 14 and 15 of the whole line, so 11 and
    // 12 (0-based) after the state field that follows the name.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(CpuSplit {
        user: Duration::from_millis(utime * 10),
        kernel: Duration::from_millis(stime * 10),
    })
}

/// A `kB` line of `/proc/<pid>/status` (`pid` a number or `self`), e.g.
/// `VmHWM`.
pub(crate) fn proc_status_kb_of(pid: &str, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.trim().strip_suffix("kB")?.trim().parse().ok()
    })
}

/// A `kB` line of `/proc/self/status`, e.g. `VmHWM`.
pub(crate) fn proc_status_kb(key: &str) -> Option<u64> {
    proc_status_kb_of("self", key)
}

/// The per-machine part of figure 3.
#[derive(Debug)]
struct IdleMemory {
    built_per_machine: isize,
    idle_per_machine: isize,
    model_per_machine: isize,
    messages: usize,
    history_bytes: isize,
}

fn idle_memory() -> IdleMemory {
    let scenario = Scenario::new();
    let runtime = current_thread_runtime();
    // Warm up outside the window (tracing callsites, runtime internals).
    let mut warm = scenario.machine(MACHINE_K);
    runtime.block_on(run_turn(&mut warm, MACHINE_K));
    drop(warm);

    let n = MACHINES as isize;
    let window = counting::Window::open();
    let models: Vec<_> = (0..MACHINES)
        .map(|_| markov_bench::model(MACHINE_K))
        .collect();
    let model_per_machine = window.close().net / n;
    drop(black_box(models));

    let window = counting::Window::open();
    let mut machines: Vec<_> = Vec::with_capacity(MACHINES);
    let vec_bytes = window.net();
    machines.extend((0..MACHINES).map(|_| scenario.machine(MACHINE_K)));
    let built = window.net() - vec_bytes;
    for machine in &mut machines {
        runtime.block_on(run_turn(machine, MACHINE_K));
    }
    let idle = window.close().net - vec_bytes;
    let messages = machines.first().map_or(0, |m| m.history().len());
    // The heap of one history alone: a copy with exact capacity.
    let window = counting::Window::open();
    let copy = machines.first().map(|m| m.history().to_vec());
    let history_bytes = window.close().net;
    drop(black_box(copy));
    drop(black_box(machines));
    let figure = IdleMemory {
        built_per_machine: built / n,
        idle_per_machine: idle / n,
        model_per_machine,
        messages,
        history_bytes,
    };
    println!(
        "bench=idle_machine_memory machines={MACHINES} k={MACHINE_K} messages={messages} built_bytes_per_machine={} idle_bytes_per_machine={} fresh_model_bytes={} history_copy_bytes={}",
        figure.built_per_machine,
        figure.idle_per_machine,
        figure.model_per_machine,
        figure.history_bytes
    );
    figure
}

/// Figure 4 for one K.
#[derive(Debug)]
struct SerdeFigure {
    k: usize,
    messages: usize,
    bytes: usize,
    serialize_us: f64,
    deserialize_us: f64,
    snapshot_bytes: usize,
    snapshot_serialize_us: f64,
    snapshot_deserialize_us: f64,
    /// Median of each repetition's write plus read.
    snapshot_round_trip_us: f64,
    /// Their mean after 20 untimed round trips: how the peers' harnesses
    /// report the same figure (markov-machines: 200 round trips after 20).
    snapshot_round_trip_mean_us: f64,
}

fn history_serde(k: usize, iterations: usize) -> SerdeFigure {
    let scenario = Scenario::new();
    let runtime = current_thread_runtime();
    let mut machine = scenario.machine(k);
    runtime.block_on(run_turn(&mut machine, k));
    let history = machine.history();
    let json = serde_json::to_string(history).expect("the history serializes");
    let back: Vec<Message> = serde_json::from_str(&json).expect("the history deserializes");
    assert_eq!(back, history, "the history survives a JSON round trip");

    // About the same total work for every K.
    let reps = (iterations / history.len()).clamp(20, 5_000);
    let mut ser = Vec::with_capacity(reps);
    let mut de = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        let out = serde_json::to_string(black_box(history)).expect("the history serializes");
        ser.push(start.elapsed());
        let start = Instant::now();
        let back: Vec<Message> =
            serde_json::from_str(black_box(&out)).expect("the history deserializes");
        de.push(start.elapsed());
        drop(black_box(back));
    }

    // The full snapshot: instance tree and history, written and read back.
    let charter = machine.charter().clone();
    let agent = Agent::on_charter_with_executor(
        charter.clone(),
        std::sync::Arc::new(StandardExecutor::new(model(k))),
    )
    .build()
    .expect("the benchmark agent builds");
    // Written as text and read from text, as the stores keep it.
    let snapshot = |machine: &Machine| {
        serde_json::to_string(&serialize_machine(machine).expect("the machine serializes"))
            .expect("the snapshot serializes")
    };
    let restore = |text: &str| {
        let data: SerializedMachine =
            serde_json::from_str(text).expect("the snapshot deserializes");
        agent.restore(data).expect("the machine deserializes")
    };
    let snap = snapshot(&machine);
    let restored = restore(&snap);
    assert_eq!(
        restored.history(),
        history,
        "the snapshot keeps the history"
    );
    assert_eq!(
        snapshot(&restored),
        snap,
        "a snapshot round trip is a fixed point"
    );
    let mut snap_ser = Vec::with_capacity(reps);
    let mut snap_de = Vec::with_capacity(reps);
    let mut snap_both = Vec::with_capacity(reps);
    for _ in 0..20 {
        drop(black_box(restore(&snapshot(black_box(&machine)))));
    }
    for _ in 0..reps.max(200) {
        let start = Instant::now();
        let out = snapshot(black_box(&machine));
        let written = start.elapsed();
        snap_ser.push(written);
        let start = Instant::now();
        let back = restore(black_box(&out));
        let read = start.elapsed();
        snap_de.push(read);
        snap_both.push(written + read);
        drop(black_box(back));
    }

    let figure = SerdeFigure {
        k,
        messages: history.len(),
        bytes: json.len(),
        serialize_us: Stats::of(&ser).median_us,
        deserialize_us: Stats::of(&de).median_us,
        snapshot_bytes: snap.len(),
        snapshot_serialize_us: Stats::of(&snap_ser).median_us,
        snapshot_deserialize_us: Stats::of(&snap_de).median_us,
        snapshot_round_trip_us: Stats::of(&snap_both).median_us,
        snapshot_round_trip_mean_us: Stats::of(&snap_both).mean_us,
    };
    println!(
        "bench=history_serde k={k} messages={} json_bytes={} reps={reps} serialize_median_us={:.1} deserialize_median_us={:.1} snapshot_bytes={} snapshot_serialize_median_us={:.1} snapshot_deserialize_median_us={:.1} snapshot_round_trip_median_us={:.1} snapshot_round_trip_mean_us={:.1}",
        figure.messages,
        figure.bytes,
        figure.serialize_us,
        figure.deserialize_us,
        figure.snapshot_bytes,
        figure.snapshot_serialize_us,
        figure.snapshot_deserialize_us,
        figure.snapshot_round_trip_us,
        figure.snapshot_round_trip_mean_us
    );
    figure
}

/// Figure 5's per-layer part: the mean cost of one `add` call through the
/// stack, layers added one at a time from the inside out.
fn layer_costs(calls: usize) -> Vec<(&'static str, f64)> {
    let registry = policy_registry();
    let config = registry.config();
    // Layers from the inside out; stack `n` has the first `n` of them. Absent
    // layers are `option_layer(None)`: a pass-through costing one branch.
    const NAMES: [&str; 10] = [
        "execute",
        "+timeout",
        "+latency",
        "+idempotency",
        "+confirm",
        "+validate",
        "+budget",
        "+mode",
        "+unknown_tool",
        "+audit",
    ];
    let stack = |depth: usize| -> Box<dyn ToolService> {
        let on = |layer: usize| depth >= layer;
        Box::new(
            PolicyStack::new()
                .option_layer(on(9).then(|| AuditLayer::new(registry.version(), None)))
                .option_layer(on(8).then(UnknownToolLayer::unknown_tool))
                .option_layer(on(7).then(ModeLayer::mode))
                .option_layer(on(6).then(|| GateLayer::new(config.budget_gate())))
                .option_layer(on(5).then(ValidateLayer::validate))
                .option_layer(on(4).then(|| ConfirmLayer::new(DEFAULT_CONFIRMATION_TTL)))
                .option_layer(on(3).then(|| IdempotencyLayer::new(IdempotencyLimits::default())))
                .option_layer(on(2).then(LatencyLayer::new))
                .option_layer(on(1).then(TimeoutLayer::new))
                .service(ExecuteService::new(EnvelopeMode::On)),
        )
    };
    let stacks: Vec<(&'static str, Box<dyn ToolService>)> = NAMES
        .iter()
        .enumerate()
        .map(|(depth, name)| (*name, stack(depth)))
        .collect();
    let runtime = timed_runtime();
    let tool = registry.tool("add").expect("add is registered");
    let metadata = registry.metadata("add");
    let ids: Vec<ToolCallId> = (0..calls)
        .map(|i| ToolCallId::new(format!("c{i}")))
        .collect();
    let input = serde_json::json!({"a": 2, "b": 3});
    let state = NoState::default();
    let turn = TurnBudgetState::new();
    let policy = PolicyState::new();
    let mut out = Vec::new();
    let mut previous = 0.0;
    for (name, service) in &stacks {
        let run = |ids: &[ToolCallId]| {
            runtime.block_on(async {
                for id in ids {
                    let report = CallReport::new();
                    let result = service
                        .call(ToolRequest {
                            call_id: id,
                            name: "add",
                            input: std::borrow::Cow::Borrowed(&input),
                            tool: Some(tool),
                            metadata,
                            mode: &Mode::TEXT,
                            turn: &turn,
                            policy: &policy,
                            report: &report,
                            cx: ToolContext::new(id, &[], &state),
                            terminate_message: "Finished",
                            origin: Default::default(),
                        })
                        .await;
                    assert!(!result.is_error, "{name}: {}", result.content);
                    black_box(result);
                }
            })
        };
        // Warm up on ids of their own (the idempotency store keys on them).
        let warm: Vec<ToolCallId> = (0..1_000)
            .map(|i| ToolCallId::new(format!("w{name}{i}")))
            .collect();
        run(&warm);
        let start = Instant::now();
        run(&ids);
        let mean_ns = start.elapsed().as_secs_f64() * 1e9 / calls as f64;
        println!(
            "bench=policy_layers stack={name} calls={calls} mean_ns_per_call={mean_ns:.0} layer_ns={:.0}",
            mean_ns - previous
        );
        previous = mean_ns;
        out.push((*name, mean_ns));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{proc_status_kb, quantile};

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let sorted = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(quantile(&sorted, 0.5), 3.0);
        assert_eq!(quantile(&sorted, 0.0), 1.0);
        assert_eq!(quantile(&sorted, 1.0), 5.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn reads_the_peak_resident_set() {
        let hwm = proc_status_kb("VmHWM").expect("Linux reports VmHWM");
        assert!(hwm > 0);
        assert_eq!(proc_status_kb("NoSuchKey"), None);
    }
}
