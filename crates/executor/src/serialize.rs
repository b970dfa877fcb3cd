//! Machine snapshots: [`serialize_machine`] writes a [`Machine`]'s
//! instance tree and history as serde values, [`deserialize_machine`] reads
//! them back against a charter.
//!
//! The JSON follows upstream's SerializedMachine, plus two fields of
//! markov's: `formatVersion` ([`FORMAT_VERSION`]; a snapshot without it,
//! upstream's, is read as version 1) and `policy`, the conversation's pending
//! and approved confirmation requests and its idempotency ledger (left out
//! when empty), so that an approval or an answered call survives a restart.
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
//! [`markov_runtime::serial::DeclaredSchema`]). A per-instance tool-choice
//! override ([`Instance::with_tool_choice`]) is not written.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use markov_core::message::read_history_json_prefix;
use markov_core::{InstanceId, Message};
use markov_runtime::charter::Charter;
use markov_runtime::registry::{IdempotencyLimits, PolicySnapshot, PolicyState};
use markov_runtime::serial::{
    NodeSpec, PackSpec, SerialError, node_from_spec, node_spec, pack_from_spec, pack_spec,
};
use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::executor::Executor;
use crate::instance::{Instance, MAX_TREE_DEPTH, SuspendInfo};
use crate::machine::{Machine, MachineOptions};
use crate::queue::Queue;

/// The snapshot format this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;

fn format_version_1() -> u32 {
    1
}

/// A machine as stored (upstream's `SerializedMachine`).
///
/// Read by a `Deserialize` of its own ([`SnapshotSeed`] without a size
/// hint): the same fields, defaults and refusals as a derived impl with
/// `deny_unknown_fields`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SerializedMachine {
    /// markov's format version ([`FORMAT_VERSION`]); 1 when absent.
    #[serde(default = "format_version_1")]
    pub format_version: u32,
    /// The root instance.
    pub instance: SerializedInstance,
    /// The history, as recorded.
    pub history: Vec<Message>,
    /// markov's: the conversation's pending and approved confirmation
    /// requests and its idempotency ledger (omitted when empty).
    #[serde(default, skip_serializing_if = "PolicySnapshot::is_empty")]
    pub policy: PolicySnapshot,
}

impl SerializedMachine {
    /// Reads a snapshot from JSON text (shape errors are [`DeserializeError::Format`]).
    ///
    /// What it accepts and refuses is what the `Deserialize` impl does, but
    /// faster: the snapshot's object is walked here and its history, most
    /// of its bytes, read by [`read_history_json_prefix`] (the written
    /// shapes straight from the text); the other fields go through serde.
    pub fn from_json_str(json: &str) -> Result<Self, DeserializeError> {
        read_snapshot(json).map_err(|e| DeserializeError::Format(e.to_string()))
    }

    /// Reads a snapshot from JSON bytes. The bytes are checked to be UTF-8
    /// once, as a whole, rather than string by string as the parser would.
    pub fn from_json_slice(json: &[u8]) -> Result<Self, DeserializeError> {
        let text = std::str::from_utf8(json)
            .map_err(|e| DeserializeError::Format(format!("the snapshot is not UTF-8: {e}")))?;
        Self::from_json_str(text)
    }

    /// Reads a snapshot from a JSON value (object keys are then read sorted,
    /// so an inline node's transitions lose their declaration order).
    pub fn from_json_value(json: Value) -> Result<Self, DeserializeError> {
        serde_json::from_value(json).map_err(|e| DeserializeError::Format(e.to_string()))
    }
}

/// The snapshot object of `json`, its history read by the history reader.
fn read_snapshot(json: &str) -> serde_json::Result<SerializedMachine> {
    let bytes = json.as_bytes();
    let skip_ws = |mut at: usize| {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = bytes.get(at) {
            at += 1;
        }
        at
    };
    let syntax = |what: &str, at: usize| {
        serde::de::Error::custom(format_args!("expected {what} at byte {at}"))
    };
    let mut at = skip_ws(0);
    if bytes.get(at) != Some(&b'{') {
        return Err(syntax("a serialized machine (an object)", at));
    }
    at = skip_ws(at + 1);
    let mut format_version = None;
    let mut instance = None;
    let mut history = None;
    let mut policy = None;
    if bytes.get(at) == Some(&b'}') {
        at += 1;
    } else {
        loop {
            let field: SnapshotField;
            (field, at) = serde_at(json, at)?;
            at = skip_ws(at);
            if bytes.get(at) != Some(&b':') {
                return Err(syntax("`:`", at));
            }
            at += 1;
            let duplicate = match field {
                SnapshotField::FormatVersion => {
                    let version;
                    (version, at) = serde_at(json, at)?;
                    format_version.replace(version).map(|_| "formatVersion")
                }
                SnapshotField::Instance => {
                    let root;
                    (root, at) = serde_at(json, at)?;
                    instance.replace(root).map(|_| "instance")
                }
                SnapshotField::History => {
                    let (messages, used) = read_history_json_prefix(&json[at..])?;
                    at += used;
                    history.replace(messages).map(|_| "history")
                }
                SnapshotField::Policy => {
                    let snapshot;
                    (snapshot, at) = serde_at(json, at)?;
                    policy.replace(snapshot).map(|_| "policy")
                }
            };
            if let Some(name) = duplicate {
                return Err(serde::de::Error::duplicate_field(name));
            }
            at = skip_ws(at);
            match bytes.get(at) {
                Some(b',') => at = skip_ws(at + 1),
                Some(b'}') => {
                    at += 1;
                    break;
                }
                _ => return Err(syntax("`,` or `}`", at)),
            }
        }
    }
    if skip_ws(at) < bytes.len() {
        return Err(syntax("the end of the snapshot", skip_ws(at)));
    }
    Ok(SerializedMachine {
        format_version: format_version.unwrap_or_else(format_version_1),
        instance: instance.ok_or_else(|| serde::de::Error::missing_field("instance"))?,
        history: history.ok_or_else(|| serde::de::Error::missing_field("history"))?,
        policy: policy.unwrap_or_default(),
    })
}

/// The value that starts at byte `at` of `json` (after white space), read
/// by serde, and where it ends.
fn serde_at<T: serde::de::DeserializeOwned>(
    json: &str,
    at: usize,
) -> serde_json::Result<(T, usize)> {
    let mut stream = serde_json::Deserializer::from_str(&json[at..]).into_iter();
    match stream.next() {
        Some(Ok(value)) => Ok((value, at + stream.byte_offset())),
        Some(Err(e)) => Err(serde::de::Error::custom(format_args!(
            "{e} (in the value at byte {at})"
        ))),
        None => Err(serde::de::Error::custom(format_args!(
            "expected a value at byte {at}"
        ))),
    }
}

/// Reads a [`SerializedMachine`] whose history is read into a list of
/// `history_capacity` messages to start with.
#[derive(Debug, Clone, Copy, Default)]
pub struct SnapshotSeed {
    /// The history's first capacity (a guess; the list grows past it).
    pub history_capacity: usize,
}

impl<'de> Deserialize<'de> for SerializedMachine {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        SnapshotSeed::default().deserialize(deserializer)
    }
}

impl<'de> DeserializeSeed<'de> for SnapshotSeed {
    type Value = SerializedMachine;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<SerializedMachine, D::Error> {
        deserializer.deserialize_struct("SerializedMachine", SNAPSHOT_FIELDS, self)
    }
}

const SNAPSHOT_FIELDS: &[&str] = &["formatVersion", "instance", "history", "policy"];

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "camelCase")]
enum SnapshotField {
    FormatVersion,
    Instance,
    History,
    Policy,
}

/// The history's messages, read into a list of a given first capacity.
struct HistorySeed(usize);

impl<'de> DeserializeSeed<'de> for HistorySeed {
    type Value = Vec<Message>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Vec<Message>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for HistorySeed {
    type Value = Vec<Message>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a list of messages")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Message>, A::Error> {
        let mut history = Vec::with_capacity(self.0);
        while let Some(message) = seq.next_element()? {
            history.push(message);
        }
        // A guess far too large gives its room back.
        if history.capacity() > history.len() * 2 + 16 {
            history.shrink_to_fit();
        }
        Ok(history)
    }
}

impl<'de> Visitor<'de> for SnapshotSeed {
    type Value = SerializedMachine;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a serialized machine")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SerializedMachine, A::Error> {
        let mut format_version = None;
        let mut instance = None;
        let mut history = None;
        let mut policy = None;
        while let Some(field) = map.next_key::<SnapshotField>()? {
            let duplicate = match field {
                SnapshotField::FormatVersion => format_version
                    .replace(map.next_value()?)
                    .map(|_| "formatVersion"),
                SnapshotField::Instance => instance.replace(map.next_value()?).map(|_| "instance"),
                SnapshotField::History => history
                    .replace(map.next_value_seed(HistorySeed(self.history_capacity))?)
                    .map(|_| "history"),
                SnapshotField::Policy => policy.replace(map.next_value()?).map(|_| "policy"),
            };
            if let Some(name) = duplicate {
                return Err(serde::de::Error::duplicate_field(name));
            }
        }
        Ok(SerializedMachine {
            format_version: format_version.unwrap_or_else(format_version_1),
            instance: instance.ok_or_else(|| serde::de::Error::missing_field("instance"))?,
            history: history.ok_or_else(|| serde::de::Error::missing_field("history"))?,
            policy: policy.unwrap_or_default(),
        })
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
/// use markov_executor::serialize::{SerializedMachine, deserialize_machine, serialize_machine};
/// use markov_executor::{Instance, Machine, MachineOptions, StandardExecutor};
/// use markov_runtime::{charter::Charter, node::Node};
/// use markov_testkit::ScriptedModel;
/// use serde_json::json;
///
/// let node = Node::builder("Greet the user.").build().unwrap();
/// let charter = Charter::builder("greeter").node("greet", node.clone()).build().unwrap();
/// let executor: std::sync::Arc<dyn markov_executor::Executor> =
///     std::sync::Arc::new(StandardExecutor::new(ScriptedModel::builder().build()));
/// let machine = Machine::with_options(
///     charter.clone(),
///     executor.clone(),
///     Instance::new(node, json!({"visits": 1})),
///     MachineOptions::default(),
/// )
/// .unwrap();
///
/// let text = serde_json::to_string(&serialize_machine(&machine).unwrap()).unwrap();
/// assert!(text.starts_with(r#"{"formatVersion":1,"instance":{"id":"#));
///
/// let snapshot = SerializedMachine::from_json_str(&text).unwrap();
/// let restored = deserialize_machine(charter, executor, snapshot, MachineOptions::default()).unwrap();
/// assert_eq!(restored.instance().id(), machine.instance().id());
/// assert_eq!(restored.instance().state(), &json!({"visits": 1}));
/// ```
pub fn serialize_machine(machine: &Machine) -> Result<SerializedMachine, SerializeError> {
    Ok(SerializedMachine {
        format_version: FORMAT_VERSION,
        instance: serialize_instance(&machine.charter, &machine.root, 0)?,
        history: machine.history.clone(),
        policy: machine.policy.snapshot(),
    })
}

/// The snapshot of [`serialize_machine`] as JSON, written straight from the
/// machine: the same bytes as `serde_json::to_vec` of that snapshot,
/// without copying the history into it first.
///
/// ```
/// use markov_executor::serialize::{serialize_machine, serialize_machine_json};
/// use markov_executor::{Instance, Machine, MachineOptions, StandardExecutor};
/// use markov_runtime::{charter::Charter, node::Node};
/// use markov_testkit::ScriptedModel;
/// use serde_json::json;
///
/// let node = Node::builder("Greet the user.").build().unwrap();
/// let charter = Charter::builder("greeter").node("greet", node.clone()).build().unwrap();
/// let executor: std::sync::Arc<dyn markov_executor::Executor> =
///     std::sync::Arc::new(StandardExecutor::new(ScriptedModel::builder().build()));
/// let machine =
///     Machine::with_options(charter, executor, Instance::new(node, json!({})), MachineOptions::default())
///         .unwrap();
/// let bytes = serialize_machine_json(&machine).unwrap();
/// assert_eq!(bytes, serde_json::to_vec(&serialize_machine(&machine).unwrap()).unwrap());
/// ```
pub fn serialize_machine_json(machine: &Machine) -> Result<Vec<u8>, SerializeError> {
    /// The fields of [`SerializedMachine`] before its history.
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Head {
        format_version: u32,
        instance: SerializedInstance,
    }
    let json = |e: serde_json::Error| SerializeError::Json(e.to_string());
    let head = Head {
        format_version: FORMAT_VERSION,
        instance: serialize_instance(&machine.charter, &machine.root, 0)?,
    };
    // About 200 bytes a message: one allocation for most snapshots.
    let mut out = Vec::with_capacity(1024 + machine.history.len() * 256);
    serde_json::to_writer(&mut out, &head).map_err(json)?;
    // `{...}` without its closing brace, then the history and the rest.
    out.pop();
    out.extend_from_slice(b",\"history\":");
    markov_core::message::write_history_json(&machine.history, &mut out).map_err(json)?;
    let policy = machine.policy.snapshot();
    if !policy.is_empty() {
        out.extend_from_slice(b",\"policy\":");
        serde_json::to_writer(&mut out, &policy).map_err(json)?;
    }
    out.push(b'}');
    Ok(out)
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
/// The history is the snapshot's, followed by `options.history` (normally
/// empty); the queue is new and empty, with `options.on_enqueue`. Unlike
/// [`Machine::with_options`], packs are not hoisted and there is no separate
/// validation pass. Externalized scopes are registered (their handlers run).
pub fn deserialize_machine(
    charter: Charter,
    executor: Arc<dyn Executor>,
    data: SerializedMachine,
    options: MachineOptions,
) -> Result<Machine, DeserializeError> {
    if data.format_version == 0 || data.format_version > FORMAT_VERSION {
        return Err(DeserializeError::UnsupportedVersion(data.format_version));
    }
    let mut seen = HashSet::new();
    let root = deserialize_instance(&charter, &data.instance, 0, &mut seen)?;
    let mut history = data.history;
    history.extend(options.history);
    let mut machine = Machine {
        charter,
        executor,
        root: Arc::new(root),
        history,
        history_id: markov_core::model::HistoryId::fresh(),
        queue: Queue::new(options.on_enqueue),
        externals: Default::default(),
        policy: Arc::new(PolicyState::restored(
            data.policy,
            &IdempotencyLimits::default(),
        )),
        deps: None,
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
