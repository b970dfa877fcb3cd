//! markov's machine: the instance tree, the run loop and the standard executor.
//!
//! - [`Agent`]: the entry point. Built once from instructions or nodes,
//!   tools, a model and limits, validated and frozen; every
//!   [`Machine`] (a conversation: the instance tree, the history and the
//!   queue) is made by it, new ([`Agent::machine`]) or restored from a
//!   snapshot ([`Agent::restore`]).
//! - [`run_machine`] yields one [`MachineStep`] per step; [`run_to_completion`]
//!   returns the last one.
//! - [`StandardExecutor`]: one model call per leaf per step, the tool pipeline,
//!   transitions, terminal tools, termination, output restriction and tool choice;
//!   optionally streamed into the queue as a vessel message ([`stream`]).
//! - [`serialize_machine`] and [`Agent::restore`]: snapshots.
//! - [`run_command`] and [`available_commands`]: commands, which bypass inference.
//! - [`client`]: the dry client and display formats and the machine contract.
//! - Externalized state ([`markov_charter::externalize`]): the machine
//!   registers the scopes whose node or pack declares a handler, hands their
//!   state messages over and notifies them of every step
//!   ([`Machine::sync_externalized`]).
//!
//! ```
//! use markov_executor::Agent;
//! use markov_testkit::ScriptedModel;
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let agent = Agent::builder("greeter")
//!     .instructions("Greet the user.")
//!     .model(ScriptedModel::builder().text("Hello!").build())
//!     .build()
//!     .unwrap();
//! let mut machine = agent.machine();
//! machine.enqueue_user("hi");
//! let last = machine.run().await.unwrap();
//! assert!(last.done);
//! assert_eq!(machine.history().len(), 2);
//! # });
//! ```
#![deny(missing_docs)]

pub mod agent;
pub mod client;
mod command;
mod effect;
mod error;
mod executor;
mod externalize;
mod instance;
mod machine;
mod queue;
mod respond;
mod run;
pub mod serialize;
mod standard;
mod step;
pub mod stream;
pub mod team;
mod typed;

pub use agent::{Agent, AgentBuilder, AgentTool, BuildError, SubAgentStep};
pub use client::{
    DisplayInstance, DryClientInstance, MachineContract, assert_contract, display_instance,
    dry_client_instance, find_command, is_command_item,
};
pub use command::{
    CommandExecution, CommandOptions, CommandOutcome, available_commands, run_command,
};
pub use effect::{Effect, Entry};
pub use error::RunError;
pub use executor::{Executor, InputGuard, Intent, LeafContext, LeafOutcome};
pub use instance::{ActiveLeaf, Instance, MAX_TREE_DEPTH, SuspendInfo};
pub use machine::Machine;
pub use queue::{HeldBack, OnEnqueue, Queue};
pub use respond::enforcer::ToolChoiceEnforcer;
pub use run::{
    Action, DEFAULT_MAX_STEPS, InputCheck, InputChecked, LeafTask, LeafTasks, RECOVERY_TEXT,
    RunOptions, RunState, run_leaves, run_machine, run_to_completion,
};
pub use serialize::{
    DeserializeError, FORMAT_VERSION, SerializeError, SerializedInstance, SerializedMachine,
    serialize_instance_tree, serialize_machine,
};
pub use standard::{CANCELLED_TOOL_CALL, CUT_OFF_TOOL_CALL, DUPLICATE_TOOL_CALL, StandardExecutor};
pub use step::{
    BLOCKED_NOTE, MachineStep, ModelCall, SentRequest, SuspendedInstance, THINKING_WITHHELD,
    TurnState, YieldReason,
};
pub use stream::{MessageStreamEvent, OnMessageStream, StreamOptions, VesselState};
pub use team::{
    Handoff, HandoffRecord, HistoryFilter, Team, TeamBuilder, TeamError, TeamSession, TeamState,
    TeamTurn,
};
pub use typed::{DEFAULT_TYPED_RETRIES, Typed, TypedRunError, retry_prompt};
