//! Shared fixtures for the executor's scenario tests: tools, a machine over
//! a scripted model, a scripted executor ([`Script`]) that returns leaf
//! outcomes without any model, and history helpers.
#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_charter::transition::CedeContent;
use markov_core::InstanceId;
use markov_core::message::{InstancePayload, Item, Items, Message, Metadata, Role};
use markov_core::tool::{Delivery, Tool, ToolContext, ToolReply};
use markov_executor::{
    Agent, Effect, Entry, Executor, Instance, LeafContext, LeafOutcome, Machine, MachineStep,
    RunError, RunOptions, SerializedMachine, StandardExecutor, TurnState, YieldReason, run_machine,
};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use markov_testkit::fixtures::Add;

/// Sends an email (it honours no idempotency key), at most once: counts
/// its executions, and hangs the first time, right after its effect (the
/// process dies there); `hung` set from the start, it never hangs.
#[derive(Clone)]
pub struct SendEmail {
    pub sent: Arc<AtomicUsize>,
    pub hung: Arc<AtomicBool>,
}

#[async_trait]
impl Tool for SendEmail {
    const NAME: &'static str = "send_email";
    const DELIVERY: Option<Delivery> = Some(Delivery::AtMostOnce);
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Send the email".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.sent.fetch_add(1, Ordering::SeqCst);
        if !self.hung.swap(true, Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok("sent".into())
    }
}

/// Counter state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Counter {
    pub count: i64,
    #[serde(default)]
    pub label: String,
}

/// Increments `count` through `update_state`.
pub struct Increment;

#[derive(Deserialize, JsonSchema)]
pub struct NoArgs {}

#[async_trait]
impl Tool for Increment {
    const NAME: &'static str = "increment";
    type Args = NoArgs;
    type Output = String;
    type Error = markov_core::tool::StateUpdateError;
    fn description(&self) -> String {
        "Increment the counter".into()
    }
    async fn call(&self, _: NoArgs, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let c: Counter = cx
            .state()
            .map_err(|e| markov_core::tool::StateUpdateError::Invalid(e.to_string()))?;
        cx.update_state(serde_json::json!({"count": c.count + 1}))?;
        Ok(format!("count is now {}", c.count + 1))
    }
}

/// Writes an invalid state and reports success anyway.
pub struct BadUpdate;

#[async_trait]
impl Tool for BadUpdate {
    const NAME: &'static str = "bad_update";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Writes a string into count".into()
    }
    async fn call(&self, _: NoArgs, cx: &ToolContext<'_>) -> Result<String, Infallible> {
        let _ = cx.update_state(serde_json::json!({"count": "not a number"}));
        Ok("done".into())
    }
}

/// Formats items as a numbered list (terminal), the seed's `formatResult`.
pub struct FormatResult;

#[derive(Deserialize, JsonSchema)]
pub struct FormatArgs {
    pub items: Vec<String>,
}

#[async_trait]
impl Tool for FormatResult {
    const NAME: &'static str = "formatResult";
    const TERMINAL: bool = true;
    type Args = FormatArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Format items into the final response".into()
    }
    async fn call(&self, args: FormatArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok(args
            .items
            .iter()
            .enumerate()
            .map(|(n, i)| format!("{}. {i}", n + 1))
            .collect::<Vec<_>>()
            .join("\n"))
    }
}

/// A terminal tool that fails when asked to.
pub struct MaybeFail;

#[derive(Deserialize, JsonSchema)]
pub struct MaybeFailArgs {
    pub fail: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("asked to fail")]
pub struct Failed;

#[async_trait]
impl Tool for MaybeFail {
    const NAME: &'static str = "maybe_fail";
    const TERMINAL: bool = true;
    type Args = MaybeFailArgs;
    type Output = String;
    type Error = Failed;
    fn description(&self) -> String {
        "Terminal unless it fails".into()
    }
    async fn call(&self, args: MaybeFailArgs, _cx: &ToolContext<'_>) -> Result<String, Failed> {
        if args.fail {
            Err(Failed)
        } else {
            Ok("fine".into())
        }
    }
}

/// Counts its calls (to prove a call did or did not run).
#[derive(Clone, Default)]
pub struct Probe {
    pub calls: Arc<AtomicUsize>,
}

impl Probe {
    pub fn count(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

/// A terminal tool that counts its calls.
pub struct TerminalProbe(pub Probe);

#[async_trait]
impl Tool for TerminalProbe {
    const NAME: &'static str = "terminal_probe";
    const TERMINAL: bool = true;
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "A second terminal tool".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.calls.fetch_add(1, Ordering::SeqCst);
        Ok("probe".into())
    }
}

/// A reply with separate texts.
pub struct Reply;

#[async_trait]
impl Tool for Reply {
    const NAME: &'static str = "reply";
    type Args = NoArgs;
    type Output = ToolReply;
    type Error = Infallible;
    fn description(&self) -> String {
        "Replies".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<ToolReply, Infallible> {
        Ok(ToolReply::new("shown to the user", "read by the model"))
    }
}

/// A machine over `node` registered as `main` in a charter built by `charter`.
pub fn machine(
    charter: impl FnOnce(
        markov_charter::charter::CharterBuilder,
    ) -> markov_charter::charter::CharterBuilder,
    node: Node,
    state: Value,
    model: Arc<ScriptedModel>,
) -> Machine {
    let charter = charter(Charter::builder("test").node("main", node.clone()))
        .build()
        .expect("charter builds");
    machine_on(
        charter,
        StandardExecutor::shared(model),
        Instance::new(node, state),
    )
    .expect("machine builds")
}

/// Runs the machine and collects every step (stops at the first error).
pub async fn run_all(
    machine: &mut Machine,
    options: RunOptions,
) -> (Vec<MachineStep>, Option<RunError>) {
    use futures::StreamExt;
    let mut steps = Vec::new();
    let mut stream = std::pin::pin!(run_machine(machine, options));
    while let Some(item) = stream.next().await {
        match item {
            Ok(step) => steps.push(step),
            Err(e) => return (steps, Some(e)),
        }
    }
    (steps, None)
}

/// The tool results of a message: (call id, content, is_error).
pub fn results(message: &Message) -> Vec<(String, String, Option<bool>)> {
    message
        .item_list()
        .iter()
        .filter_map(|i| match i {
            Item::ToolResult {
                tool_use_id,
                content,
                is_error,
                ..
            } => Some((tool_use_id.to_string(), content.clone(), *is_error)),
            _ => None,
        })
        .collect()
}

/// A history as a person reads it, one line per item: who, then what
/// (text, a tool call with its arguments, a result with its call id and
/// whether it failed). Transcript tests compare it with `expect!` snapshots.
pub fn transcript(history: &[Message]) -> String {
    let mut out = String::new();
    for m in history {
        let who = format!("{:?}", m.role).to_lowercase();
        match &m.items {
            Items::Text(text) => out.push_str(&format!("{who}: {text}\n")),
            Items::List(items) => {
                for item in items {
                    let line = match item {
                        Item::Text { text } => text.clone(),
                        Item::ToolUse { id, name, input } => format!("call {name} {input} [{id}]"),
                        Item::ToolResult {
                            tool_use_id,
                            content,
                            is_error,
                            ..
                        } => {
                            let failed = if *is_error == Some(true) {
                                " (error)"
                            } else {
                                ""
                            };
                            format!("result [{tool_use_id}]{failed}: {content}")
                        }
                        other => format!("{other:?}"),
                    };
                    out.push_str(&format!("{who}: {line}\n"));
                }
            }
            Items::Instance(payload) => {
                // Without the instance's id: a uuid, new on every run.
                let mut json = serde_json::to_value(payload).unwrap_or_default();
                if let Some(fields) = json.as_object_mut() {
                    fields.retain(|key, _| !key.to_lowercase().contains("instanceid"));
                }
                out.push_str(&format!("{who}: {json}\n"));
            }
        }
    }
    out
}

/// All tool results in a history, in order.
pub fn all_results(history: &[Message]) -> Vec<(String, String, Option<bool>)> {
    history.iter().flat_map(results).collect()
}

/// Checks that every tool_use has exactly one tool_result after it, and no
/// result lacks its call. Provider built-in tool calls are answered by the
/// provider, not the loop: they need no tool_result (and must get none),
/// and a provider result must answer an earlier provider call.
pub fn assert_paired(history: &[Message]) {
    let mut open: Vec<String> = Vec::new();
    let mut seen_results: Vec<String> = Vec::new();
    let mut provider_calls: Vec<String> = Vec::new();
    for m in history {
        for item in m.item_list() {
            match item {
                Item::ProviderToolUse { id, .. } => {
                    assert_eq!(m.role, Role::Assistant);
                    provider_calls.push(id.to_string());
                }
                Item::ProviderToolResult { tool_use_id, .. } => {
                    assert_eq!(m.role, Role::Assistant);
                    let id = tool_use_id.to_string();
                    assert!(
                        provider_calls.contains(&id),
                        "provider result for unknown provider call {id}"
                    );
                }
                Item::ToolResult { tool_use_id, .. }
                    if provider_calls.contains(&tool_use_id.to_string()) =>
                {
                    panic!("a client tool_result for provider call {tool_use_id}");
                }
                Item::ToolUse { id, .. } => {
                    assert_eq!(m.role, Role::Assistant);
                    open.push(id.to_string());
                }
                Item::ToolResult { tool_use_id, .. } => {
                    let id = tool_use_id.to_string();
                    assert!(!seen_results.contains(&id), "two results for {id}");
                    let pos = open.iter().position(|o| *o == id);
                    assert!(pos.is_some(), "result for unknown call {id}");
                    if let Some(p) = pos {
                        open.remove(p);
                    }
                    seen_results.push(id);
                }
                _ => {}
            }
        }
    }
    assert!(open.is_empty(), "calls without results: {open:?}");
}

/// The instance payloads recorded in a history, in order.
pub fn instance_payloads(history: &[Message]) -> impl Iterator<Item = &InstancePayload> {
    history.iter().filter_map(|msg| match &msg.items {
        Items::Instance(p) => Some(p.as_ref()),
        _ => None,
    })
}

// ---------------------------------------------------------------------------
// A scripted executor: per node name, a queue of leaf outcomes; no model.
// ---------------------------------------------------------------------------

/// A scripted answer of one leaf call, built from the leaf's context.
pub type LeafReply = Box<dyn Fn(&LeafContext<'_>) -> LeafOutcome + Send + Sync>;

/// One executor call: the node's name, the instance, the step and the
/// worker flag.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub node: String,
    pub instance: InstanceId,
    pub step: usize,
    pub worker: bool,
}

impl Call {
    /// The call the executor receives with `cx`.
    pub fn of(cx: &LeafContext<'_>) -> Self {
        Call {
            node: cx.instance().node().name().unwrap_or("?").to_owned(),
            instance: cx.instance().id().clone(),
            step: cx.current_step,
            worker: cx.is_worker(),
        }
    }
}

/// An executor that answers each leaf with the next reply scripted for its
/// node's name, and records every call. A call with nothing scripted fails
/// with [`RunError::Executor`].
#[derive(Default)]
pub struct Script {
    replies: Mutex<HashMap<String, VecDeque<LeafReply>>>,
    calls: Mutex<Vec<Call>>,
}

impl Script {
    pub fn new() -> Arc<Self> {
        Arc::new(Script::default())
    }

    /// Queues the next reply of the node called `node`.
    pub fn on(
        self: &Arc<Self>,
        node: &str,
        reply: impl Fn(&LeafContext<'_>) -> LeafOutcome + Send + Sync + 'static,
    ) -> Arc<Self> {
        self.replies
            .lock()
            .expect("lock")
            .entry(node.to_owned())
            .or_default()
            .push_back(Box::new(reply));
        Arc::clone(self)
    }

    /// Every call so far, in order.
    pub fn records(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }

    /// The node names of the calls so far.
    pub fn calls(&self) -> Vec<String> {
        self.records().into_iter().map(|c| c.node).collect()
    }

    /// The instances of the calls so far.
    pub fn instances(&self) -> Vec<InstanceId> {
        self.records().into_iter().map(|c| c.instance).collect()
    }
}

#[async_trait]
impl Executor for Script {
    async fn run_leaf(&self, cx: LeafContext<'_>) -> Result<LeafOutcome, RunError> {
        let call = Call::of(&cx);
        let node = call.node.clone();
        self.calls.lock().expect("lock").push(call);
        let reply = self
            .replies
            .lock()
            .expect("lock")
            .get_mut(&node)
            .and_then(VecDeque::pop_front)
            .ok_or_else(|| RunError::Executor(format!("no scripted reply for {node}")))?;
        Ok(reply(&cx))
    }
}

/// A machine over `root`, run by `executor`: the agent of a charter called
/// `name` whose only node is the root's.
pub fn script_machine(name: &str, executor: Arc<dyn Executor>, root: Instance) -> Machine {
    Agent::with_executor(name, executor)
        .node("root", root.node().clone())
        .state(root.state().clone())
        .build()
        .expect("the agent builds")
        .machine_at(root)
        .expect("machine builds")
}

/// The agent of `charter` run by `executor`, starting where `root` does
/// when the charter registers `root`'s node. A charter without nodes (a
/// tree of inline nodes) gets `root`'s node registered as `root`.
pub fn agent_on(charter: Charter, executor: Arc<dyn Executor>, root: &Instance) -> Agent {
    if charter.nodes().len() == 0 {
        return Agent::with_executor(charter.name(), executor)
            .node("root", root.node().clone())
            .state(root.state().clone())
            .build()
            .expect("the agent builds");
    }
    let start = charter.node_name(root.node()).map(str::to_owned);
    let mut agent = Agent::on_charter_with_executor(charter, executor);
    if let Some(start) = start {
        agent = agent.state(root.state().clone()).start(start);
    }
    agent.build().expect("the agent builds")
}

/// A machine of `charter`'s agent on `executor` whose tree is `root`.
pub fn machine_on(
    charter: Charter,
    executor: impl Executor + 'static,
    root: Instance,
) -> Result<Machine, RunError> {
    machine_on_shared(charter, Arc::new(executor), root)
}

/// [`machine_on`] with a shared executor.
pub fn machine_on_shared(
    charter: Charter,
    executor: Arc<dyn Executor>,
    root: Instance,
) -> Result<Machine, RunError> {
    agent_on(charter, executor, &root).machine_at(root)
}

/// A machine of `charter`'s agent whose tree is `root` and whose history
/// already holds `history` (restored from a snapshot that has it).
pub fn machine_with_history(
    charter: Charter,
    executor: Arc<dyn Executor>,
    root: Instance,
    history: Vec<Message>,
) -> Machine {
    let fresh =
        machine_on_shared(charter.clone(), Arc::clone(&executor), root).expect("machine builds");
    let mut snapshot = markov_executor::serialize_machine(&fresh)
        .expect("serializes")
        .into_owned();
    snapshot.history = history;
    restore_on(charter, executor, snapshot).expect("restores")
}

/// `snapshot` restored by the agent of `charter` on `executor`. The agent
/// starts at the charter's first node with the snapshot's root state when
/// that node accepts it, else with the node's own start state: either way
/// the snapshot itself is read by `restore`, whatever it holds.
pub fn restore_on(
    charter: Charter,
    executor: Arc<dyn Executor>,
    snapshot: SerializedMachine,
) -> Result<Machine, markov_executor::DeserializeError> {
    let with_state = serde_json::to_value(&snapshot.instance)
        .ok()
        .and_then(|v| v.get("state").cloned())
        .and_then(|state| {
            Agent::on_charter_with_executor(charter.clone(), Arc::clone(&executor))
                .state(state)
                .build()
                .ok()
        });
    let agent = match with_state {
        Some(agent) => agent,
        None => Agent::on_charter_with_executor(charter, executor)
            .build()
            .expect("the agent builds"),
    };
    agent.restore(snapshot)
}

/// A node called `name` with one line of instructions.
pub fn node(name: &str) -> Node {
    Node::builder(format!("{name} instructions."))
        .name(name)
        .build()
        .expect("node builds")
}

/// A leaf outcome with the default turn state.
pub fn outcome(entries: Vec<Entry>, reason: YieldReason) -> LeafOutcome {
    LeafOutcome::new(entries, reason, TurnState::default())
}

/// An assistant message attributed to the leaf.
pub fn say(cx: &LeafContext<'_>, text: &str) -> Entry {
    Entry::message(Message::assistant(text).with_metadata(Metadata::with_source(cx.source())))
}

/// An effect attributed to the leaf.
pub fn fx(cx: &LeafContext<'_>, effect: Effect) -> Entry {
    Entry::effect(cx.charter, effect, Some(cx.source()))
}

/// The leaf cedes with `content`.
pub fn cede_fx(cx: &LeafContext<'_>, content: Option<CedeContent>) -> Entry {
    fx(
        cx,
        Effect::Cede {
            instance: cx.instance().id().clone(),
            content,
        },
    )
}
