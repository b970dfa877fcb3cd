//! The benchmark scenario of the peer comparison (docs/PERFORMANCE.md), shared by the `markov-bench` binary and
//! the divan bench (`benches/step.rs`).
//!
//! One node with three tools, `add(a, b)`, `echo(text)` and `lookup(key)`; a
//! zero-latency [`ScriptedModel`] that answers one user message with `k`
//! responses of exactly one tool call each (cycling add, echo, lookup with
//! fixed arguments), then the final text `"done"`. A turn therefore has
//! `k + 1` model steps. Other frameworks are measured on the same scenario, so
//! keep it exactly so.
//!
//! [`Scenario::with_policies`] is the same scenario with the tool registry on
//! (figure 5): the three tools registered, every policy of the standard stack
//! active and generous enough that nothing is rejected, each tool with a
//! timeout (so the timer is armed on every call).
//!
//! ```
//! let scenario = markov_bench::Scenario::new();
//! let mut machine = scenario.machine(3);
//! let runtime = markov_bench::current_thread_runtime();
//! let steps = runtime.block_on(markov_bench::run_turn(&mut machine, 3));
//! assert_eq!(steps, 4);
//! // user, then (assistant call, user result) × 3, then the final text.
//! assert_eq!(machine.history().len(), 8);
//! ```

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use markov_charter::charter::Charter;
use markov_charter::context::ContextPolicy;
use markov_charter::node::Node;
use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{
    Agent, Limit, Machine, MachineStep, RunOptions, StandardExecutor, UsageLimits, run_machine,
};
use markov_policy::{Budget, Category, Mode, PolicyConfig, ToolMetadata, ToolRegistry};
use markov_testkit::{Recording, ScriptedModel};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

/// The user message that starts the turn.
pub const USER_MESSAGE: &str = "Run the tools.";

/// What `lookup` always returns.
pub const LOOKUP_VALUE: &str = "the value of every key";

/// `add(a: i64, b: i64) -> i64`.
#[derive(Debug, Clone, Copy)]
pub struct Add;

/// The arguments of [`Add`].
#[derive(Debug, Deserialize, JsonSchema)]
pub struct AddArgs {
    /// The first term.
    pub a: i64,
    /// The second term.
    pub b: i64,
}

#[async_trait]
impl Tool for Add {
    const NAME: &'static str = "add";
    type Args = AddArgs;
    type Output = i64;
    type Error = Infallible;
    fn description(&self) -> String {
        "Add two integers".into()
    }
    async fn call(&self, args: AddArgs, _cx: &ToolContext<'_>) -> Result<i64, Infallible> {
        Ok(args.a.wrapping_add(args.b))
    }
}

/// `echo(text: String) -> String`.
#[derive(Debug, Clone, Copy)]
pub struct Echo;

/// The arguments of [`Echo`].
#[derive(Debug, Deserialize, JsonSchema)]
pub struct EchoArgs {
    /// The text to return.
    pub text: String,
}

#[async_trait]
impl Tool for Echo {
    const NAME: &'static str = "echo";
    type Args = EchoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Return the text unchanged".into()
    }
    async fn call(&self, args: EchoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok(args.text)
    }
}

/// `lookup(key: String) -> String`, always [`LOOKUP_VALUE`].
#[derive(Debug, Clone, Copy)]
pub struct Lookup;

/// The arguments of [`Lookup`].
#[derive(Debug, Deserialize, JsonSchema)]
pub struct LookupArgs {
    /// The key to look up (ignored).
    pub key: String,
}

#[async_trait]
impl Tool for Lookup {
    const NAME: &'static str = "lookup";
    type Args = LookupArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Look a key up".into()
    }
    async fn call(&self, _args: LookupArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok(LOOKUP_VALUE.to_owned())
    }
}

/// The `i`-th scripted tool call (0-based): add, echo, lookup, add, ...
pub fn tool_call(i: usize) -> (&'static str, Value) {
    match i % 3 {
        0 => (Add::NAME, json!({"a": 2, "b": 3})),
        1 => (Echo::NAME, json!({"text": "hello"})),
        _ => (Lookup::NAME, json!({"key": "answer"})),
    }
}

/// The zero-latency model of a turn of `k` tool steps: `k` single tool calls,
/// then `"done"`. It records nothing, so it costs next to nothing per call.
pub fn model(k: usize) -> ScriptedModel {
    let mut script = ScriptedModel::builder();
    for i in 0..k {
        let (name, args) = tool_call(i);
        script = script.tool_call(name, args);
    }
    script.text("done").build().recording(Recording::Off)
}

/// The charter (its one node and three tools), built once and shared by
/// every machine, as a server running many sessions of one agent would.
#[derive(Debug, Clone)]
pub struct Scenario {
    charter: Charter,
    registry: Option<Arc<ToolRegistry>>,
    context: Option<ContextPolicy>,
    limits: UsageLimits,
}

/// The registry of figure 5: the three tools, a budget no turn reaches, the
/// envelope on, a 10 s timeout and a 2 s latency budget on each tool.
pub fn policy_registry() -> Arc<ToolRegistry> {
    let metadata = |category| {
        ToolMetadata::new(category)
            .with_modes([Mode::TEXT])
            .with_timeout(Duration::from_secs(10))
            .with_latency_budget(Duration::from_secs(2))
    };
    let budget = Budget::UNLIMITED
        .max_calls(u32::MAX)
        .max_for(Category::Retrieval, u32::MAX);
    Arc::new(
        ToolRegistry::builder(PolicyConfig::new(budget))
            .register(Add, metadata(Category::Other))
            .register(Echo, metadata(Category::Other))
            .register(Lookup, metadata(Category::Retrieval))
            .lock()
            .expect("the benchmark registry locks"),
    )
}

impl Scenario {
    /// Builds the node with the three tools and its charter.
    pub fn new() -> Self {
        let node = Node::builder("Call the tools you are asked to call.")
            .name("worker")
            .tool(Add)
            .tool(Echo)
            .tool(Lookup)
            .build()
            .expect("the benchmark node builds");
        // The scenario repeats identical calls on purpose (the peers' script):
        // the loop guard would end it, so it is off here.
        let charter = Charter::builder("bench")
            .node("worker", node)
            .loop_guard(markov_policy::LoopGuard::OFF)
            .build()
            .expect("the benchmark charter builds");
        Scenario {
            charter,
            registry: None,
            context: None,
            limits: UsageLimits::none(),
        }
    }

    /// The same scenario with a context policy (keep the last 4 turns,
    /// trim the tool results of all but the last 2): each model call is
    /// sent the policy's view of the history, kept up to date step by
    /// step, instead of the history itself.
    pub fn with_context_policy() -> Self {
        let policy = ContextPolicy::builder()
            .keep_last_turns(4)
            .trim_tool_results(2)
            .build()
            .expect("the benchmark context policy builds");
        Scenario {
            context: Some(policy),
            ..Self::new()
        }
    }

    /// The same scenario with usage limits on tokens and requests that no
    /// turn reaches: every model call is admitted first, its input
    /// estimated (figure 11's limits variant).
    #[must_use]
    pub fn with_usage_limits(self) -> Self {
        let limits = UsageLimits::builder()
            .per_session(Limit::new().tokens(u64::MAX / 2).requests(u64::MAX / 2))
            .build()
            .expect("the benchmark limits build");
        Scenario { limits, ..self }
    }

    /// The run options of a turn of `k` tool steps (see [`options`]), with
    /// the scenario's usage limits.
    pub fn options(&self, k: usize) -> RunOptions {
        options(k).usage_limits(self.limits)
    }

    /// The charter: its one node and three tools.
    pub fn charter(&self) -> &Charter {
        &self.charter
    }

    /// The same scenario with every call going through [`policy_registry`].
    pub fn with_policies() -> Self {
        Scenario {
            registry: Some(policy_registry()),
            ..Self::new()
        }
    }

    /// A fresh machine whose model answers a turn of `k` tool steps, with
    /// the user message already enqueued.
    pub fn machine(&self, k: usize) -> Machine {
        let mut executor = match &self.registry {
            None => StandardExecutor::new(model(k)),
            Some(registry) => {
                StandardExecutor::new(model(k)).with_registry(Arc::clone(registry), Mode::TEXT)
            }
        };
        if let Some(policy) = &self.context {
            executor = executor.with_context_policy(policy.clone());
        }
        let machine = Agent::on_charter(self.charter.clone())
            .executor(executor)
            .build()
            .expect("the benchmark agent builds")
            .machine();
        machine.enqueue_user(USER_MESSAGE);
        machine
    }
}

impl Default for Scenario {
    fn default() -> Self {
        Self::new()
    }
}

/// The run options of a turn of `k` tool steps: the step limit is `k + 1`.
pub fn options(k: usize) -> RunOptions {
    RunOptions::default().max_steps(k + 1)
}

/// Checks one step of a turn of `k` tool steps; panics on a wrong scenario.
fn check_step(step: &Result<MachineStep, markov_executor::RunError>, index: usize, k: usize) {
    let step = match step {
        Ok(step) => step,
        Err(e) => panic!("step {} of a turn of {k} failed: {e}", index + 1),
    };
    assert_eq!(
        step.done,
        index == k,
        "step {} of a turn of {k}: done = {}",
        index + 1,
        step.done
    );
}

/// Runs the machine's turn of `k` tool steps and returns how many steps it
/// yielded (always `k + 1`; anything else panics).
pub async fn run_turn(machine: &mut Machine, k: usize) -> usize {
    run_turn_with(machine, k, options(k)).await
}

/// [`run_turn`] with `options` (a scenario's, say).
pub async fn run_turn_with(machine: &mut Machine, k: usize, options: RunOptions) -> usize {
    let mut stream = std::pin::pin!(run_machine(machine, options));
    let mut steps = 0;
    while let Some(step) = stream.next().await {
        check_step(&step, steps, k);
        steps += 1;
    }
    assert_eq!(steps, k + 1, "a turn of {k} tool steps has {} steps", k + 1);
    steps
}

/// Runs the machine's turn of `k` tool steps, timing each step around the
/// stream's `next()`, and appends the `k + 1` durations to `times`.
pub async fn run_turn_timed(
    machine: &mut Machine,
    k: usize,
    options: RunOptions,
    times: &mut Vec<Duration>,
) {
    let mut stream = std::pin::pin!(run_machine(machine, options));
    let mut steps = 0;
    loop {
        let start = Instant::now();
        let step = stream.next().await;
        let elapsed = start.elapsed();
        let Some(step) = step else { break };
        times.push(elapsed);
        check_step(&step, steps, k);
        // The step (its messages and instance handle) is dropped here, outside the timing.
        drop(step);
        steps += 1;
    }
    assert_eq!(steps, k + 1, "a turn of {k} tool steps has {} steps", k + 1);
}

/// A single-threaded tokio runtime with its timer, for figure 5 (tool
/// timeouts need it).
pub fn timed_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread tokio runtime starts")
}

/// A tokio runtime of two worker threads (one per core of the machine the
/// figures were measured on) with I/O and timers, for each process of the
/// service figures: workers, clients, the fake provider.
pub fn two_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a two-thread tokio runtime starts")
}

/// A single-threaded tokio runtime, for the per-step figures.
pub fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread tokio runtime starts")
}
