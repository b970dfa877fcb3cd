//! Machine snapshots: [`serialize_machine`] writes a [`Machine`]'s
//! instance tree and history as serde values,
//! [`Agent::restore`](crate::Agent::restore) reads them back against the
//! agent's charter.
//!
//! The JSON follows upstream's SerializedMachine, plus three fields of
//! markov's: `formatVersion` ([`FORMAT_VERSION`]; a snapshot without it,
//! upstream's, is read as version 1), `policy`, the conversation's pending
//! and approved confirmation requests and its idempotency ledger (left out
//! when empty), so that an approval or an answered call survives a restart,
//! and `usage`, what the session and its current turn have used
//! ([`UsageTotals`]; left out while nothing was).
//!
//! ```json
//! {
//!   "formatVersion": 1,
//!   "instance": {
//!     "id": "root",
//!     "node": {"ref": "main"},
//!     "state": {"count": 3},
//!     "children": [{
//!       "id": "child",
//!       "node": {"name": "helper", "instructions": "Help.", "validator": {"type": "object"},
//!                "transitions": {"back": {"ref": "main.done"}}, "initialState": {}},
//!       "state": {},
//!       "suspended": {"suspendId": "s1", "reason": "approval",
//!                     "suspendedAt": "2024-01-15T10:30:00.000Z"}
//!     }],
//!     "packInstances": [{"state": {"items": []}, "pack": {"ref": "todo"}}]
//!   },
//!   "history": [{"role": "user", "items": "hi"}]
//! }
//! ```
//!
//! What survives a round trip: with registered nodes, instance ids,
//! tree shape, states, suspension (to the millisecond), pack states and pack
//! instructions. An unregistered node is inlined: it gets a new id on load and
//! loses its worker flag, packs, output config, turn policy, unregistered
//! tools and commands; its state is then accepted as any object (see
//! [`markov_charter::serial::DeclaredSchema`]). A per-instance tool-choice
//! override ([`Instance::with_tool_choice`]) is not written.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use markov_charter::charter::Charter;
use markov_charter::serial::{
    NodeSpec, PackSpec, SerialError, node_from_spec, node_spec, pack_from_spec, pack_spec,
};
use markov_core::{InstanceId, Message};
use markov_policy::{IdempotencyLimits, PolicySnapshot, PolicyState};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::executor::Executor;
use crate::instance::{Instance, MAX_TREE_DEPTH, SuspendInfo};
use crate::machine::Machine;
use crate::queue::Queue;
use markov_context::UsageTotals;

/// The snapshot format this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

fn format_version_1() -> u32 {
    1
}

/// A machine as stored (upstream's `SerializedMachine`).
///
/// `H` is how the history is held: a `Vec<Message>` when read, a borrowed
/// slice of the machine's own history when written by
/// [`serialize_machine`] (no copy of a history that may hold thousands of
/// messages). Both write the same JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SerializedMachine<H = Vec<Message>> {
    /// markov's format version ([`FORMAT_VERSION`]); 1 when absent.
    #[serde(default = "format_version_1")]
    pub format_version: u32,
    /// The root instance.
    pub instance: SerializedInstance,
    /// The history, as recorded.
    pub history: H,
    /// markov's: the conversation's pending and approved confirmation
    /// requests and its idempotency ledger (omitted when empty).
    #[serde(default, skip_serializing_if = "PolicySnapshot::is_empty")]
    pub policy: PolicySnapshot,
    /// markov's: what the session and its current user turn have used
    /// (omitted while nothing was; a snapshot without it used nothing).
    #[serde(default, skip_serializing_if = "UsageTotals::is_empty")]
    pub usage: UsageTotals,
}

impl SerializedMachine<&[Message]> {
    /// The snapshot with a history of its own (to restore a machine from).
    pub fn into_owned(self) -> SerializedMachine {
        SerializedMachine {
            format_version: self.format_version,
            instance: self.instance,
            history: self.history.to_vec(),
            policy: self.policy,
            usage: self.usage,
        }
    }
}

impl SerializedMachine {
    /// Reads a snapshot from a JSON value (object keys are then read sorted,
    /// so an inline node's transitions lose their declaration order).
    pub fn from_json_value(json: Value) -> Result<Self, DeserializeError> {
        serde_json::from_value(json).map_err(|e| DeserializeError::Format(e.to_string()))
    }
}

/// An instance as stored (upstream's `SerializedInstance`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SerializedInstance {
    /// The instance id.
    pub id: InstanceId,
    /// Its node: a charter ref, or inline.
    pub node: NodeSpec,
    /// Its state.
    pub state: Value,
    /// Its children, in order (omitted when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<SerializedInstance>,
    /// Its packs with their states (omitted when empty; the root's in practice).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pack_instances: Vec<SerializedPackInstance>,
    /// Its suspension, if suspended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended: Option<SerializedSuspendInfo>,
}

/// A pack with its state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SerializedPackInstance {
    /// The pack's state.
    pub state: Value,
    /// The pack: a charter ref, or inline.
    pub pack: PackSpec,
}

/// A suspension as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SerializedSuspendInfo {
    /// The id a resume must name.
    pub suspend_id: String,
    /// Why.
    pub reason: String,
    /// When: ISO-8601 in UTC with milliseconds, `2024-01-15T10:30:00.000Z`.
    pub suspended_at: String,
    /// Application data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
}

/// Why a machine could not be serialized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SerializeError {
    /// A node could not be written (an unregistered code or general transition).
    #[error(transparent)]
    Node(#[from] SerialError),
    /// A suspension time outside what ISO-8601 can write (before 1970 or after 9999).
    #[error("suspendedAt of instance {0} cannot be written as an ISO-8601 timestamp")]
    InvalidTimestamp(InstanceId),
    /// The snapshot could not be written as JSON (a state that is not JSON
    /// after all, such as a map with non-string keys).
    #[error("the snapshot cannot be written as JSON: {0}")]
    Json(String),
    /// The tree is deeper than [`MAX_TREE_DEPTH`].
    #[error("Max depth (100) exceeded in instance tree traversal. Possible cycle detected.")]
    TreeTooDeep,
}

/// Why a snapshot could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeserializeError {
    /// The JSON does not have the snapshot's shape.
    #[error("Invalid serialized machine: {0}")]
    Format(String),
    /// A `formatVersion` this build does not read.
    #[error("Unsupported formatVersion {0} (this build reads 1)")]
    UnsupportedVersion(u32),
    /// A state refused by its node's schema.
    #[error("Invalid state: {0}")]
    InvalidState(String),
    /// A `suspendedAt` that is not ISO-8601 UTC (`YYYY-MM-DDTHH:MM:SS[.sss]Z`).
    #[error("Invalid suspendedAt {value:?}: {message}")]
    InvalidTimestamp {
        /// The stored text.
        value: String,
        /// The parser's message.
        message: String,
    },
    /// Two instances with one id.
    #[error("Duplicate instance id: {0}")]
    DuplicateInstanceId(InstanceId),
    /// The tree is deeper than [`MAX_TREE_DEPTH`].
    #[error("Max depth (100) exceeded in instance tree traversal. Possible cycle detected.")]
    TreeTooDeep,
    /// A node or pack that does not resolve: `Unknown node ref: <r>`, tool,
    /// command and transition ref errors, `Pack not found in charter: <n>`,
    /// `Pack not found in charter for inline merge: <n>`.
    #[error(transparent)]
    Node(#[from] SerialError),
}

/// Writes a machine's instance tree and history.
///
/// Registered nodes are written as refs; other nodes inline, and then each of
/// their code and general transitions must be registered in the charter
/// ([`SerialError::UnregisteredTransition`] otherwise).
///
/// ```
/// use markov_executor::Agent;
/// use markov_executor::serialize::{SerializedMachine, serialize_machine};
/// use markov_testkit::ScriptedModel;
/// use serde_json::json;
///
/// let agent = Agent::builder("greeter")
///     .instructions("Greet the user.")
///     .state(json!({"visits": 1}))
///     .model(ScriptedModel::builder().build())
///     .build()
///     .unwrap();
/// let machine = agent.machine();
///
/// let text = serde_json::to_string(&serialize_machine(&machine).unwrap()).unwrap();
/// assert!(text.starts_with(r#"{"formatVersion":1,"instance":{"id":"#));
///
/// let snapshot: SerializedMachine = serde_json::from_str(&text).unwrap();
/// let restored = agent.restore(snapshot).unwrap();
/// assert_eq!(restored.instance().id(), machine.instance().id());
/// assert_eq!(restored.instance().state(), &json!({"visits": 1}));
/// ```
pub fn serialize_machine(
    machine: &Machine,
) -> Result<SerializedMachine<&[Message]>, SerializeError> {
    Ok(SerializedMachine {
        format_version: FORMAT_VERSION,
        instance: serialize_instance(&machine.charter, &machine.root, 0)?,
        history: &machine.history,
        policy: machine.policy.snapshot(),
        usage: machine.usage,
    })
}

/// The machine's instance tree as stored, without the history: what a store
/// writes when the tree changed.
pub fn serialize_instance_tree(machine: &Machine) -> Result<SerializedInstance, SerializeError> {
    serialize_instance(&machine.charter, &machine.root, 0)
}

fn serialize_instance(
    charter: &Charter,
    instance: &Instance,
    depth: usize,
) -> Result<SerializedInstance, SerializeError> {
    if depth > MAX_TREE_DEPTH {
        return Err(SerializeError::TreeTooDeep);
    }
    let children = instance
        .children
        .iter()
        .map(|c| serialize_instance(charter, c, depth + 1))
        .collect::<Result<_, _>>()?;
    let pack_instances = if instance.pack_states.is_empty() {
        Vec::new()
    } else {
        let packs = if instance.packs.is_empty() {
            instance.node.packs()
        } else {
            &instance.packs
        };
        // Pack states without a pack definition are dropped.
        packs
            .iter()
            .map(|pack| {
                let state = instance
                    .pack_states
                    .get(pack.name())
                    .or_else(|| pack.initial_state())
                    .cloned()
                    .unwrap_or_else(|| Value::Object(serde_json::Map::new()));
                SerializedPackInstance {
                    pack: pack_spec(charter, pack, &state),
                    state,
                }
            })
            .collect()
    };
    let suspended = match &instance.suspended {
        None => None,
        Some(info) => Some(SerializedSuspendInfo {
            suspend_id: info.suspend_id.clone(),
            reason: info.reason.clone(),
            suspended_at: iso_millis(info.suspended_at)
                .ok_or_else(|| SerializeError::InvalidTimestamp(instance.id.clone()))?,
            metadata: info.metadata.clone().filter(|m| !m.is_null()),
        }),
    };
    Ok(SerializedInstance {
        id: instance.id.clone(),
        node: node_spec(charter, &instance.node)?,
        state: instance.state.clone(),
        children,
        pack_instances,
        suspended,
    })
}

/// The first instant ISO-8601 cannot write with four year digits (10000-01-01).
const YEAR_10000: Duration = Duration::from_secs(253_402_300_800);

fn iso_millis(t: SystemTime) -> Option<String> {
    let since = t.duration_since(UNIX_EPOCH).ok()?;
    (since < YEAR_10000).then(|| humantime::format_rfc3339_millis(t).to_string())
}

/// Reads a snapshot back into a machine.
///
/// Node refs resolve to charter nodes; an inline node becomes a new node. Each
/// state is parsed by its node's schema and the parsed value is stored.
/// `packInstances` become the instance's packs (a ref is the charter pack, an
/// inline pack is merged with the charter pack of its name) and pack states.
/// The history is the snapshot's; the queue is new and empty. Unlike a new
/// machine, packs are not hoisted and there is no separate validation pass.
/// Externalized scopes are registered (their handlers run).
/// [`Agent::restore`](crate::Agent::restore) calls it with the agent's
/// charter and executor.
pub(crate) fn deserialize_machine(
    charter: Charter,
    executor: Arc<dyn Executor>,
    data: SerializedMachine,
) -> Result<Machine, DeserializeError> {
    if data.format_version == 0 || data.format_version > FORMAT_VERSION {
        return Err(DeserializeError::UnsupportedVersion(data.format_version));
    }
    let mut seen = HashSet::new();
    let root = deserialize_instance(&charter, &data.instance, 0, &mut seen)?;
    let history = data.history;
    let mut machine = Machine {
        charter,
        executor,
        root: Arc::new(root),
        history,
        history_id: markov_core::model::HistoryId::fresh(),
        queue: Queue::new(),
        externals: Default::default(),
        policy: Arc::new(PolicyState::restored(
            data.policy,
            &IdempotencyLimits::default(),
        )),
        run_options: crate::run::RunOptions::default(),
        usage: data.usage,
        views: Default::default(),
        record_calls: false,
        replayable_ids: false,
    };
    machine.sync_externalized();
    Ok(machine)
}

fn deserialize_instance(
    charter: &Charter,
    data: &SerializedInstance,
    depth: usize,
    seen: &mut HashSet<InstanceId>,
) -> Result<Instance, DeserializeError> {
    if depth > MAX_TREE_DEPTH {
        return Err(DeserializeError::TreeTooDeep);
    }
    if !seen.insert(data.id.clone()) {
        return Err(DeserializeError::DuplicateInstanceId(data.id.clone()));
    }
    let node = node_from_spec(charter, &data.node)?;
    let state = node
        .schema()
        .parse(&data.state)
        .map_err(DeserializeError::InvalidState)?;
    let mut instance = Instance::with_id(data.id.clone(), node, state);
    for child in &data.children {
        let child = deserialize_instance(charter, child, depth + 1, seen)?;
        instance.children.push(Arc::new(child));
    }
    let mut pack_states = BTreeMap::new();
    for p in &data.pack_instances {
        let pack = pack_from_spec(charter, &p.pack)?;
        pack_states.insert(pack.name().to_owned(), p.state.clone());
        if !instance.packs.iter().any(|q| q.name() == pack.name()) {
            instance.packs.push(pack);
        }
    }
    instance.pack_states = pack_states;
    if let Some(s) = &data.suspended {
        let suspended_at = humantime::parse_rfc3339(&s.suspended_at).map_err(|e| {
            DeserializeError::InvalidTimestamp {
                value: s.suspended_at.clone(),
                message: e.to_string(),
            }
        })?;
        instance.suspended = Some(SuspendInfo {
            suspend_id: s.suspend_id.clone(),
            reason: s.reason.clone(),
            suspended_at,
            metadata: s.metadata.clone(),
        });
    }
    Ok(instance)
}
