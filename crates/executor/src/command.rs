//! Running commands against a machine: user-invoked operations
//! that bypass inference.
//!
//! [`run_command`] executes at once, changes the instance tree directly and
//! enqueues messages — the `command` record first, then `state` /
//! `packState` instance messages and the command's own messages — that the
//! next [`run_machine`](crate::run_machine) drains into history. A queued
//! `command` message is only recorded by the run loop, never executed, and
//! alone does not trigger inference.
//!
//! Every failure is a value: [`CommandExecution`] with `success: false` and
//! upstream's message (`Command not found: <name>`, `Invalid input: <msg>`, …).
//!
//! ```
//! use markov_core::async_trait;
//! use markov_executor::{Agent, CommandOptions, run_command};
//! use markov_charter::command::{Command, CommandContext, CommandError, CommandResult};
//! use markov_charter::node::Node;
//! use markov_testkit::ScriptedModel;
//! use schemars::JsonSchema;
//! use serde::Deserialize;
//! use serde_json::json;
//!
//! #[derive(Deserialize, JsonSchema)]
//! struct Reset {}
//!
//! /// Sets the count back to zero and returns the old one.
//! struct ResetCount;
//!
//! #[async_trait]
//! impl Command for ResetCount {
//!     const NAME: &'static str = "reset";
//!     type Input = Reset;
//!     type Error = CommandError;
//!     fn description(&self) -> String { "Reset the counter".into() }
//!     async fn execute(&self, _: Reset, cx: &CommandContext<'_>) -> Result<CommandResult, CommandError> {
//!         let old = cx.state_json()["count"].clone();
//!         cx.update_state(json!({ "count": 0 }))?;
//!         Ok(CommandResult::with_payload(old))
//!     }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let node = Node::builder("Count.").command(ResetCount).build().unwrap();
//! let agent = Agent::builder("counter")
//!     .node("main", node)
//!     .state(json!({ "count": 3 }))
//!     .model(ScriptedModel::builder().build())
//!     .build()
//!     .unwrap();
//! let mut machine = agent.machine();
//!
//! let outcome = run_command(&mut machine, "reset", json!({}), CommandOptions::default()).await;
//! assert!(outcome.result.success);
//! assert_eq!(outcome.result.value, Some(json!(3)));
//! assert_eq!(machine.instance().state(), &json!({ "count": 0 }));
//! // Queued: the `command` record, then one `state` message.
//! assert_eq!(machine.queue().len(), 2);
//! # });
//! ```

use std::sync::Arc;
use std::time::SystemTime;

use markov_charter::charter::Charter;
use markov_charter::command::{
    CommandContext, CommandError, CommandInfo, CommandResult, SharedCommand,
};
use markov_charter::externalize::Scope;
use markov_charter::pack::Pack;
use markov_charter::transition::{SpawnChild, TransitionResult};
use markov_core::message::{Item, Items, Message};
use markov_core::{InstanceId, Role};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::effect::{Effect, Entry, cede_json};
use crate::instance::{Instance, SuspendInfo};
use crate::machine::Machine;

/// Who a command targets and who invoked it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandOptions {
    /// The instance to run on (it may be suspended); the active instance when `None`.
    pub instance_id: Option<InstanceId>,
    /// The invoking client, recorded in the `command` message.
    pub client_id: Option<String>,
}

impl CommandOptions {
    /// Targets the instance `id`.
    #[must_use]
    pub fn instance(mut self, id: InstanceId) -> Self {
        self.instance_id = Some(id);
        self
    }

    /// Records the invoking client.
    #[must_use]
    pub fn client(mut self, id: impl Into<String>) -> Self {
        self.client_id = Some(id.into());
        self
    }
}

/// Upstream's `{ success, value?, error? }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandExecution {
    /// Whether the command succeeded.
    pub success: bool,
    /// The payload (a `command_result`'s, or a cede's content).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<Value>,
    /// The failure message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl CommandExecution {
    fn ok(value: Option<Value>) -> Self {
        CommandExecution {
            success: true,
            value,
            error: None,
        }
    }

    fn failed(error: &CommandError) -> Self {
        CommandExecution {
            success: false,
            value: None,
            error: Some(error.to_string()),
        }
    }
}

/// What [`run_command`] reports.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandOutcome {
    /// Success, value, error.
    pub result: CommandExecution,
    /// The messages a `command_result` enqueued (empty otherwise).
    pub messages: Vec<Message>,
}

impl CommandOutcome {
    fn failed(error: &CommandError) -> Self {
        CommandOutcome {
            result: CommandExecution::failed(error),
            messages: Vec::new(),
        }
    }
}

/// The `command` message recording an invocation.
fn command_message(name: &str, input: &Value, options: &CommandOptions) -> Message {
    Message::from(markov_core::message::MessageData {
        role: Role::Command,
        items: Items::List(vec![Item::Command {
            name: name.to_owned(),
            input: input.clone(),
            instance_id: options.instance_id.clone(),
            client_id: options.client_id.clone(),
        }]),
        metadata: None,
    })
}

/// The packs whose commands a target offers: the root's packs in force when
/// it has any, else the target node's own packs.
fn packs_of(target: &Instance) -> &[Pack] {
    if target.packs.is_empty() {
        target.node().packs()
    } else {
        &target.packs
    }
}

/// The commands of the active instance: its node's, then its packs'
/// (`getAvailableCommands`).
pub fn available_commands(machine: &Machine) -> Vec<CommandInfo> {
    let active = machine.root.active();
    let node = active.node().commands().iter();
    let packs = packs_of(&active).iter().flat_map(|p| p.commands().iter());
    node.chain(packs).map(|c| c.info().clone()).collect()
}

/// Runs the command `name` with `input` (upstream's default input is `{}`)
/// on the instance `options.instance_id`, else on the active instance.
///
/// The `command` message is always enqueued first, even when the command
/// then fails. Node commands win over pack commands of the same name. Tree
/// changes (spawn, transition, cede, suspend, resume, and a `command_result`'s
/// running state) are applied directly and not recorded as instance messages;
/// each accepted node `update_state` enqueues its own `state` message, and a
/// pack command enqueues one merged `packState` message, applied by the next run.
///
/// Externalized state is synchronised before and after the command; on an
/// externalized node, a result other than a transition leaves the tree's
/// state as it was — the queued `state` messages carry the change to the
/// scope's handler in the next run.
pub async fn run_command(
    machine: &mut Machine,
    name: &str,
    input: Value,
    options: CommandOptions,
) -> CommandOutcome {
    machine
        .queue
        .enqueue([command_message(name, &input, &options)]);
    machine.sync_externalized();
    let outcome = dispatch(machine, name, input, options).await;
    machine.sync_externalized();
    outcome
}

async fn dispatch(
    machine: &mut Machine,
    name: &str,
    input: Value,
    options: CommandOptions,
) -> CommandOutcome {
    let target = match &options.instance_id {
        Some(id) => match machine.root.find(id) {
            Some(t) => t,
            None => return CommandOutcome::failed(&CommandError::InstanceNotFound(id.clone())),
        },
        None => machine.root.active(),
    };
    if let Some(command) = target.node().command(name) {
        let command = Arc::clone(command);
        return run_node_command(machine, &target, &command, input).await;
    }
    let found = packs_of(&target)
        .iter()
        .find_map(|p| p.command(name).map(|c| (p.clone(), Arc::clone(c))));
    if let Some((pack, command)) = found {
        return run_pack_command(machine, &target, &pack, &command, input).await;
    }
    CommandOutcome::failed(&CommandError::NotFound(name.to_owned()))
}

async fn run_node_command(
    machine: &mut Machine,
    target: &Arc<Instance>,
    command: &SharedCommand,
    input: Value,
) -> CommandOutcome {
    let id = target.id().clone();
    let charter = &machine.charter;
    let queue = &machine.queue;
    let enqueue_state = |patch: &Value| {
        queue.enqueue_entries([Entry::effect(
            charter,
            Effect::State {
                instance: id.clone(),
                patch: patch.clone(),
            },
            None,
        )]);
    };
    let cx = CommandContext::for_node(
        target.id(),
        target.state().clone(),
        target.node().schema(),
        &machine.history,
    )
    .on_state_update(&enqueue_state);
    let result = command.execute_json(input, &cx).await;
    let updates = cx.into_updates();
    let result = match result {
        Ok(r) => r,
        Err(e) => return CommandOutcome::failed(&e),
    };
    // An externalized node keeps its old state in the tree unless it
    // transitions: the change arrives through the queued `state` message,
    // which the next run hands to the scope's handler.
    let externalized = machine.externals.is_registered(&Scope::node_id_of(&id));
    let state = if externalized {
        target.state().clone()
    } else {
        updates.state
    };
    let root = &mut machine.root;
    match result {
        CommandResult::Result { payload, messages } => {
            if !updates.patches.is_empty() {
                Instance::update(root, &id, &mut |i| i.state = state.clone());
            }
            machine.queue.enqueue(messages.iter().cloned());
            return CommandOutcome {
                result: CommandExecution::ok(payload),
                messages,
            };
        }
        CommandResult::Resume => {
            Instance::update(root, &id, &mut |i| {
                i.state = state.clone();
                i.suspended = None;
            });
        }
        CommandResult::Transition(TransitionResult::To { node, state: given }) => {
            let node = match machine.charter.resolve_node(&node) {
                Ok(n) => n,
                Err(e) => return CommandOutcome::failed(&CommandError::failed(e)),
            };
            let state = given.unwrap_or_else(|| initial_state(&node));
            // Quirk kept (see docs/PORTING.md): a new instance with a new id, keeping the
            // pack states but neither the packs in force nor a suspension.
            let mut replacement = Instance::new(node, state);
            replacement.pack_states = target.pack_states.clone();
            Instance::update(root, &id, &mut |i| *i = replacement.clone());
        }
        CommandResult::Transition(TransitionResult::Spawn(children)) => {
            let children = match resolve_children(&machine.charter, children) {
                Ok(c) => c,
                Err(e) => return CommandOutcome::failed(&e),
            };
            // Unlike spawn in the run loop, the children replace any there were.
            Instance::update(root, &id, &mut |i| {
                i.state = state.clone();
                i.children = children.clone();
            });
        }
        CommandResult::Transition(TransitionResult::Cede(content)) => {
            if root.id() == &id {
                return CommandOutcome::failed(&CommandError::CedeFromRoot);
            }
            Instance::remove(root, &id);
            return CommandOutcome {
                result: CommandExecution::ok(cede_json(&content)),
                messages: Vec::new(),
            };
        }
        CommandResult::Transition(TransitionResult::Suspend {
            suspend_id,
            reason,
            metadata,
        }) => {
            let info = SuspendInfo {
                suspend_id,
                reason,
                suspended_at: SystemTime::now(),
                metadata,
            };
            Instance::update(root, &id, &mut |i| {
                i.state = state.clone();
                i.suspended = Some(info.clone());
            });
        }
        // Both enums are non-exhaustive: a result this version does not know.
        _ => {
            return CommandOutcome::failed(&CommandError::failed("Unknown command result type"));
        }
    }
    CommandOutcome {
        result: CommandExecution::ok(None),
        messages: Vec::new(),
    }
}

fn initial_state(node: &markov_charter::node::Node) -> Value {
    node.initial_state()
        .cloned()
        .unwrap_or_else(|| Value::Object(serde_json::Map::new()))
}

fn resolve_children(
    charter: &Charter,
    children: Vec<SpawnChild>,
) -> Result<Vec<Arc<Instance>>, CommandError> {
    children
        .into_iter()
        .map(|c| {
            let node = charter
                .resolve_node(&c.node)
                .map_err(CommandError::failed)?;
            let state = c.state.unwrap_or_else(|| initial_state(&node));
            Ok(Arc::new(Instance::new(node, state)))
        })
        .collect()
}

async fn run_pack_command(
    machine: &mut Machine,
    target: &Arc<Instance>,
    pack: &Pack,
    command: &SharedCommand,
    input: Value,
) -> CommandOutcome {
    let state = machine
        .root
        .pack_states
        .get(pack.name())
        .filter(|s| !s.is_null())
        .or(pack.initial_state())
        .cloned()
        .unwrap_or_else(|| Value::Object(serde_json::Map::new()));
    let cx = CommandContext::for_pack(pack, state, target.id());
    let result = command.execute_json(input, &cx).await;
    let updates = cx.into_updates();
    // Enqueued even when the command then failed; the tree's pack state
    // changes only when the next run applies it.
    if let Some(patch) = updates.merged_patch() {
        machine.queue.enqueue_entries([Entry::effect(
            &machine.charter,
            Effect::PackState {
                pack: pack.name().to_owned(),
                patch,
            },
            None,
        )]);
    }
    match result {
        Err(e) => CommandOutcome::failed(&e),
        Ok(CommandResult::Result { payload, messages }) => {
            machine.queue.enqueue(messages.iter().cloned());
            CommandOutcome {
                result: CommandExecution::ok(payload),
                messages,
            }
        }
        // Upstream: any other return of a pack command is a plain success.
        Ok(_) => CommandOutcome {
            result: CommandExecution::ok(None),
            messages: Vec::new(),
        },
    }
}
