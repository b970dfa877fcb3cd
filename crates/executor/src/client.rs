//! Client and display formats: what a front end is sent about a
//! machine, and the machine contract a front end relies on.
//!
//! - **Dry client** ([`DryClientInstance`], [`DryClientNode`],
//!   [`DryClientPack`]): an instance's id, state and pack states with its
//!   node's instructions, state schema and command metadata. Upstream
//!   *hydrates* it into functions returning `command` items; here
//!   [`DryClientNode::command`], [`DryClientPack::command`] and
//!   [`DryClientInstance::command`] build that [`Item::Command`] directly.
//!   [`is_command_item`] is upstream's `isCommand` guard for JSON.
//! - **Display** ([`DisplayInstance`]): the whole tree with every node
//!   expanded (tools as names, transitions as target labels), the packs in
//!   force with their state and rendered instructions, and suspensions.
//!   [`find_command`] asks whether a command is offered right now.
//! - **Machine contract** ([`MachineContract`], [`assert_contract`]): the
//!   commands a front end expects the charter to declare.
//!
//! ```
//! use markov_executor::client::{DryClientInstance, is_command_item};
//! use markov_executor::Instance;
//! use markov_charter::node::Node;
//! use serde_json::json;
//!
//! let node = Node::builder("Keep a list.").build().unwrap();
//! let dry = DryClientInstance::from_instance(&Instance::new(node, json!({"items": []})));
//! let wire = serde_json::to_value(&dry).unwrap();
//! assert_eq!(wire["node"]["instructions"], "Keep a list.");
//! assert_eq!(wire["node"]["commands"], json!({}));
//! assert!(wire.get("packStates").is_none());
//! assert!(is_command_item(&json!({"type": "command", "name": "clear", "input": {}})));
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use markov_charter::charter::Charter;
use markov_charter::command::{CommandInfo, SharedCommand};
use markov_charter::node::Node;
use markov_charter::pack::{Pack, PackInstructions};
use markov_charter::serial::{Entries, escape_schema, executor_config_to_json};
use markov_charter::state::json_type;
use markov_charter::transition::{NodeTarget, Transition};
use markov_core::InstanceId;
use markov_core::message::Item;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::instance::{Instance, MAX_TREE_DEPTH, SuspendInfo};
use crate::machine::Machine;
use crate::serialize::{SerializeError, SerializedSuspendInfo};

// ------------------------------------------------------------------ errors

/// Why a `command` item could not be built from a dry client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Neither the node nor (for an instance) its packs declare the command.
    #[error("Command not found: {0}")]
    CommandNotFound(String),
    /// The input is not an object, or lacks a property the input schema requires.
    #[error("Invalid input: {0}")]
    InvalidInput(String),
}

// --------------------------------------------------------------- dry client

/// A node as a client sees it (upstream's `DryClientNode`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DryClientNode {
    /// The node's instructions.
    pub instructions: String,
    /// Its state's JSON Schema, unescaped (`$schema`, `$defs`, … as they are).
    pub validator: Value,
    /// Its commands by name: `{name, description, inputSchema}`.
    pub commands: Entries<CommandInfo>,
    /// The packs the node declares (omitted when it declares none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packs: Option<Vec<DryClientPack>>,
}

/// A pack as a client sees it (upstream's `DryClientPack`); its state is in
/// [`DryClientInstance::pack_states`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DryClientPack {
    /// The pack's name.
    pub name: String,
    /// Its description.
    pub description: String,
    /// Its state's JSON Schema, unescaped.
    pub validator: Value,
    /// Its commands by name.
    pub commands: Entries<CommandInfo>,
}

/// An instance as a client sees it (upstream's `DryClientInstance`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DryClientInstance {
    /// The instance id.
    pub id: InstanceId,
    /// Its state.
    pub state: Value,
    /// Pack states by pack name; present only when the instance holds some
    /// (the root, in a machine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack_states: Option<BTreeMap<String, Value>>,
    /// Its node.
    pub node: DryClientNode,
}

fn command_entries(commands: &[SharedCommand]) -> Entries<CommandInfo> {
    Entries(
        commands
            .iter()
            .map(|c| (c.name().to_owned(), c.info().clone()))
            .collect(),
    )
}

/// Builds the `command` item for the command `name` of `commands` after
/// checking `input` against its schema as far as markov can without a JSON
/// Schema validator: an object, with every top-level `required` property
/// present.
fn command_item(
    commands: &Entries<CommandInfo>,
    name: &str,
    input: Value,
) -> Result<Item, ClientError> {
    let info = commands
        .get(name)
        .ok_or_else(|| ClientError::CommandNotFound(name.to_owned()))?;
    let Value::Object(fields) = &input else {
        return Err(ClientError::InvalidInput(format!(
            "expected an object, got {}",
            json_type(&input)
        )));
    };
    let required = info
        .input_schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str);
    for key in required {
        if !fields.contains_key(key) {
            return Err(ClientError::InvalidInput(format!(
                "missing required property \"{key}\""
            )));
        }
    }
    Ok(Item::Command {
        name: info.name.clone(),
        input,
        instance_id: None,
        client_id: None,
    })
}

impl DryClientNode {
    /// The dry form of `node` (upstream's `createDryClientNode`).
    pub fn from_node(node: &Node) -> Self {
        let packs = node.packs();
        DryClientNode {
            instructions: node.instructions().to_owned(),
            validator: node.schema().json_schema(),
            commands: command_entries(node.commands()),
            packs: (!packs.is_empty())
                .then(|| packs.iter().map(DryClientPack::from_pack).collect()),
        }
    }

    /// The pack called `name`, if the node declares it.
    pub fn pack(&self, name: &str) -> Option<&DryClientPack> {
        self.packs.iter().flatten().find(|p| p.name == name)
    }

    /// The `command` item `{type: "command", name, input}` invoking the node
    /// command `name` (upstream's hydrated command function). `input` must be
    /// an object holding every property the command's schema requires.
    pub fn command(&self, name: &str, input: Value) -> Result<Item, ClientError> {
        command_item(&self.commands, name, input)
    }
}

impl DryClientPack {
    /// The dry form of `pack` (upstream's `createDryClientPack`).
    pub fn from_pack(pack: &Pack) -> Self {
        DryClientPack {
            name: pack.name().to_owned(),
            description: pack.description().to_owned(),
            validator: pack.schema().json_schema(),
            commands: command_entries(pack.commands()),
        }
    }

    /// The `command` item invoking this pack's command `name` (see
    /// [`DryClientNode::command`]).
    pub fn command(&self, name: &str, input: Value) -> Result<Item, ClientError> {
        command_item(&self.commands, name, input)
    }
}

impl DryClientInstance {
    /// The dry form of one instance (upstream's `createDryClientInstance`):
    /// `packStates` only when the instance holds pack states.
    pub fn from_instance(instance: &Instance) -> Self {
        let pack_states = instance.pack_states();
        DryClientInstance {
            id: instance.id().clone(),
            state: instance.state().clone(),
            pack_states: (!pack_states.is_empty()).then(|| pack_states.clone()),
            node: DryClientNode::from_node(instance.node()),
        }
    }

    /// The `command` item invoking `name`: a node command first, then a
    /// command of the node's packs, as `run_command` looks them up. The item
    /// names no instance, as upstream's.
    pub fn command(&self, name: &str, input: Value) -> Result<Item, ClientError> {
        if self.node.commands.get(name).is_some() {
            return self.node.command(name, input);
        }
        match self
            .node
            .packs
            .iter()
            .flatten()
            .find(|p| p.commands.get(name).is_some())
        {
            Some(pack) => pack.command(name, input),
            None => Err(ClientError::CommandNotFound(name.to_owned())),
        }
    }
}

/// The dry form of the machine's active instance (last child at every level).
pub fn dry_client_instance(machine: &Machine) -> DryClientInstance {
    DryClientInstance::from_instance(&machine.instance().active())
}

/// The dry form of the instance `id`, if it is in the machine's tree.
pub fn dry_client_instance_by_id(machine: &Machine, id: &InstanceId) -> Option<DryClientInstance> {
    machine
        .instance()
        .find(id)
        .map(|i| DryClientInstance::from_instance(&i))
}

/// Upstream's `isCommand` guard: whether `value` is a `command` item — an
/// object whose `type` is `"command"` and whose `name` is a string. As
/// upstream, `input` is not required; `instanceId` and `clientId` may be present.
pub fn is_command_item(value: &Value) -> bool {
    value.get("type").and_then(Value::as_str) == Some("command")
        && value.get("name").is_some_and(Value::is_string)
}

// ------------------------------------------------------------------ display

/// A command as displayed: `{name, description, inputSchema}`, the schema escaped.
pub type DisplayCommand = CommandInfo;

/// A node as displayed (upstream's `DisplayNode`): always expanded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DisplayNode {
    /// The charter key of a registered node, else `[inline] <name>` for a
    /// named node, else `[inline]`.
    pub name: String,
    /// The instructions.
    pub instructions: String,
    /// The state's JSON Schema, `$` keywords escaped to `__`.
    pub validator: Value,
    /// The node's tool names, in declaration order.
    pub tools: Vec<String>,
    /// Transition name → target label: the ref spelling of a ref transition,
    /// the target of a serial transition (its ref, the charter key of a
    /// registered node, or `inline`), the charter name of a registered code
    /// or general transition, else `code`.
    pub transitions: Entries<String>,
    /// Commands by name, input schemas escaped.
    pub commands: Entries<DisplayCommand>,
    /// The initial state, if declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_state: Option<Value>,
    /// The names of the packs the node declares (omitted when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pack_names: Vec<String>,
    /// `true` for a worker node (omitted otherwise).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub worker: bool,
    /// Model settings the node overrides (`model`, `maxTokens`, `temperature`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_config: Option<Value>,
}

/// A pack in force, as displayed with its state (upstream's `DisplayPack`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DisplayPack {
    /// The pack's name.
    pub name: String,
    /// Its description.
    pub description: String,
    /// Its instructions, rendered for `state` when dynamic (omitted when it has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// `true` when the instructions are computed from the state (omitted otherwise).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub instructions_dynamic: bool,
    /// Its state: the stored one, else its initial state, else `{}`.
    pub state: Value,
    /// Its state's JSON Schema, escaped.
    pub validator: Value,
    /// Its commands by name, input schemas escaped.
    pub commands: Entries<DisplayCommand>,
}

/// An instance as displayed (upstream's `DisplayInstance`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DisplayInstance {
    /// The instance id.
    pub id: InstanceId,
    /// Its node, expanded.
    pub node: DisplayNode,
    /// Its state.
    pub state: Value,
    /// Its children, in order (omitted when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<DisplayInstance>,
    /// The packs in force with their states: only on an instance holding pack
    /// states (the root), from its packs, else its node's (omitted when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packs: Vec<DisplayPack>,
    /// Pack states by pack name, as stored (omitted when none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack_states: Option<BTreeMap<String, Value>>,
    /// Its suspension, if suspended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended: Option<SerializedSuspendInfo>,
}

/// The machine's instance tree for display (upstream's `serializeInstanceForDisplay`).
pub fn display_instance(machine: &Machine) -> Result<DisplayInstance, SerializeError> {
    display_instance_of(machine.charter(), machine.instance())
}

/// `instance` and its subtree for display, names and labels from `charter`.
/// Fails only on a tree deeper than [`MAX_TREE_DEPTH`].
pub fn display_instance_of(
    charter: &Charter,
    instance: &Instance,
) -> Result<DisplayInstance, SerializeError> {
    display(charter, instance, 0)
}

fn display(
    charter: &Charter,
    instance: &Instance,
    depth: usize,
) -> Result<DisplayInstance, SerializeError> {
    if depth > MAX_TREE_DEPTH {
        return Err(SerializeError::TreeTooDeep);
    }
    let children = instance
        .children()
        .iter()
        .map(|c| display(charter, c, depth + 1))
        .collect::<Result<_, _>>()?;
    let stored = instance.pack_states();
    let packs = if stored.is_empty() {
        Vec::new()
    } else {
        let packs = if instance.packs().is_empty() {
            instance.node().packs()
        } else {
            instance.packs()
        };
        packs
            .iter()
            .map(|pack| {
                let state = stored
                    .get(pack.name())
                    .filter(|s| !s.is_null())
                    .or(pack.initial_state())
                    .cloned()
                    .unwrap_or_else(|| Value::Object(Map::new()));
                display_pack(pack, state)
            })
            .collect()
    };
    Ok(DisplayInstance {
        id: instance.id().clone(),
        node: display_node(charter, instance.node()),
        state: instance.state().clone(),
        children,
        packs,
        pack_states: (!stored.is_empty()).then(|| stored.clone()),
        suspended: instance.suspended().map(display_suspension),
    })
}

/// A node for display (upstream's `serializeNodeForDisplay`), names and labels from `charter`.
pub fn display_node(charter: &Charter, node: &Node) -> DisplayNode {
    let name = match (charter.node_name(node), node.name()) {
        (Some(key), _) => key.to_owned(),
        (None, Some(name)) => format!("[inline] {name}"),
        (None, None) => "[inline]".to_owned(),
    };
    DisplayNode {
        name,
        instructions: node.instructions().to_owned(),
        validator: escape_schema(node.schema().json_schema()),
        tools: node
            .tools()
            .definitions()
            .iter()
            .map(|d| d.name.as_str().to_owned())
            .collect(),
        transitions: Entries(
            node.transitions()
                .iter()
                .map(|(name, t)| (name.clone(), transition_label(charter, t)))
                .collect(),
        ),
        commands: display_commands(node.commands()),
        initial_state: node.initial_state().cloned(),
        pack_names: node.packs().iter().map(|p| p.name().to_owned()).collect(),
        worker: node.is_worker(),
        executor_config: executor_config_to_json(node.executor_config()),
    }
}

fn transition_label(charter: &Charter, transition: &Transition) -> String {
    match transition {
        Transition::Ref(r) => r.clone(),
        Transition::Serial { target, .. } => match target {
            NodeTarget::Ref(r) => r.clone(),
            NodeTarget::Inline(node) => charter
                .node_name(node)
                .map_or_else(|| "inline".to_owned(), str::to_owned),
        },
        // Code, general and later kinds: the charter-level name it is
        // registered under (by identity), else `code`. A transition held
        // only by a charter node is not looked up (upstream).
        other => charter
            .transition_ref_of(other)
            .filter(|name| {
                charter
                    .transition(name)
                    .is_some_and(|t| same_transition(t, other))
            })
            .unwrap_or_else(|| "code".to_owned()),
    }
}

fn same_transition(a: &Transition, b: &Transition) -> bool {
    match (a, b) {
        (Transition::Code(a), Transition::Code(b)) => Arc::ptr_eq(a, b),
        (Transition::General { description: a }, Transition::General { description: b }) => a == b,
        _ => false,
    }
}

fn display_commands(commands: &[SharedCommand]) -> Entries<DisplayCommand> {
    Entries(
        commands
            .iter()
            .map(|c| {
                let info = c.info();
                let shown = CommandInfo {
                    name: info.name.clone(),
                    description: info.description.clone(),
                    input_schema: escape_schema(info.input_schema.clone()),
                };
                (c.name().to_owned(), shown)
            })
            .collect(),
    )
}

fn display_pack(pack: &Pack, state: Value) -> DisplayPack {
    let (instructions, instructions_dynamic) = match pack.instructions() {
        PackInstructions::None => (None, false),
        PackInstructions::Static(text) => (Some(text.clone()), false),
        dynamic @ PackInstructions::Dynamic(_) => (Some(dynamic.render(&state)), true),
    };
    DisplayPack {
        name: pack.name().to_owned(),
        description: pack.description().to_owned(),
        instructions,
        instructions_dynamic,
        validator: escape_schema(pack.schema().json_schema()),
        commands: display_commands(pack.commands()),
        state,
    }
}

/// The last instant RFC 3339 can write with four year digits.
const MAX_RFC3339: Duration = Duration::from_millis(253_402_300_799_999);

fn display_suspension(info: &SuspendInfo) -> SerializedSuspendInfo {
    // Clamped into 1970..=9999, which `humantime` formats (it panics outside).
    let at = info
        .suspended_at
        .clamp(UNIX_EPOCH, UNIX_EPOCH + MAX_RFC3339);
    SerializedSuspendInfo {
        suspend_id: info.suspend_id.clone(),
        reason: info.reason.clone(),
        suspended_at: humantime::format_rfc3339_millis(at).to_string(),
        metadata: info.metadata.clone().filter(|m| !m.is_null()),
    }
}

fn active_display(instance: &DisplayInstance) -> &DisplayInstance {
    let mut current = instance;
    while let Some(last) = current.children.last() {
        current = last;
    }
    current
}

/// Whether the command `handle` names is offered now (upstream's
/// `findCommand`): the active display instance's (last child at every level)
/// node commands, then the root's pack commands. As upstream, only the
/// handle's name is compared, not its scope.
pub fn find_command<'a>(
    display: &'a DisplayInstance,
    handle: &CommandHandle,
) -> Option<&'a DisplayCommand> {
    active_display(display)
        .node
        .commands
        .get(&handle.name)
        .or_else(|| {
            display
                .packs
                .iter()
                .find_map(|p| p.commands.get(&handle.name))
        })
}

// ----------------------------------------------------------------- contract

/// One command a front end relies on: `[command]` or `[scope, command]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CommandHandle {
    /// The command's name.
    pub name: String,
    /// A charter node key, a node's `name` or a pack name (`None`: anywhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<String>,
}

impl CommandHandle {
    /// A command that must exist in some node or pack.
    pub fn new(name: impl Into<String>) -> Self {
        CommandHandle {
            name: name.into(),
            scope: None,
        }
    }

    /// A command that must exist in the node or pack `scope`.
    pub fn scoped(scope: impl Into<String>, name: impl Into<String>) -> Self {
        CommandHandle {
            name: name.into(),
            scope: Some(scope.into()),
        }
    }
}

/// The commands a front end expects a charter to declare (upstream's
/// `createMachineContract`), checked by [`assert_contract`].
///
/// ```
/// use markov_executor::client::{MachineContract, assert_contract};
/// use markov_charter::{charter::Charter, node::Node};
///
/// let charter = Charter::builder("c")
///     .node("main", Node::builder("Main.").build().unwrap())
///     .build()
///     .unwrap();
/// let contract = MachineContract::new().scoped("main", "reset").command("ping");
/// let err = assert_contract(&charter, &contract).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "Machine contract violation:\n  \
///      - Command \"reset\" not found in pack or node \"main\"\n  \
///      - Command \"ping\" not found in any node or pack"
/// );
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MachineContract {
    commands: Vec<CommandHandle>,
}

impl MachineContract {
    /// An empty contract.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `[command]`: a command some node or pack must declare.
    #[must_use]
    pub fn command(mut self, name: impl Into<String>) -> Self {
        self.commands.push(CommandHandle::new(name));
        self
    }

    /// Adds `[scope, command]`: a command the node (charter key or `name`)
    /// or pack `scope` must declare.
    #[must_use]
    pub fn scoped(mut self, scope: impl Into<String>, name: impl Into<String>) -> Self {
        self.commands.push(CommandHandle::scoped(scope, name));
        self
    }

    /// The entries, in order.
    pub fn commands(&self) -> &[CommandHandle] {
        &self.commands
    }

    /// The handle for `name` in `scope` (`None`: an unscoped entry), if declared.
    pub fn handle(&self, scope: Option<&str>, name: &str) -> Option<&CommandHandle> {
        self.commands
            .iter()
            .find(|h| h.name == name && h.scope.as_deref() == scope)
    }
}

impl FromIterator<CommandHandle> for MachineContract {
    fn from_iter<I: IntoIterator<Item = CommandHandle>>(iter: I) -> Self {
        MachineContract {
            commands: iter.into_iter().collect(),
        }
    }
}

/// The entries of a contract a charter does not satisfy (upstream's thrown
/// error). Displayed as `Machine contract violation:` then one
/// `  - Command "<c>" not found in pack or node "<s>"` or
/// `  - Command "<c>" not found in any node or pack` line per entry.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ContractViolation {
    /// The unsatisfied entries, in contract order.
    pub missing: Vec<CommandHandle>,
}

impl fmt::Display for ContractViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Machine contract violation:")?;
        for h in &self.missing {
            match &h.scope {
                Some(scope) => write!(
                    f,
                    "\n  - Command \"{}\" not found in pack or node \"{scope}\"",
                    h.name
                )?,
                None => write!(
                    f,
                    "\n  - Command \"{}\" not found in any node or pack",
                    h.name
                )?,
            }
        }
        Ok(())
    }
}

impl std::error::Error for ContractViolation {}

impl<'a> From<&'a Machine> for &'a Charter {
    fn from(machine: &'a Machine) -> Self {
        machine.charter()
    }
}

/// Checks `contract` against a charter (or a machine's charter; upstream's
/// `assertMachineContract`).
///
/// A scoped entry is satisfied by a charter node whose key or `name` is the
/// scope and which declares the command, or by a pack of that name — a
/// charter pack or one declared by a charter node — that declares it. An
/// unscoped entry is satisfied by any charter node, charter pack or pack of
/// a charter node declaring the command. Every unsatisfied entry is reported.
pub fn assert_contract<'a>(
    charter: impl Into<&'a Charter>,
    contract: &MachineContract,
) -> Result<(), ContractViolation> {
    let charter = charter.into();
    let missing: Vec<_> = contract
        .commands
        .iter()
        .filter(|h| !satisfied(charter, h))
        .cloned()
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(ContractViolation { missing })
    }
}

fn satisfied(charter: &Charter, handle: &CommandHandle) -> bool {
    let name = handle.name.as_str();
    let node_packs = charter.nodes().flat_map(|(_, n)| n.packs().iter());
    let mut packs = charter.packs().iter().chain(node_packs);
    match handle.scope.as_deref() {
        Some(scope) => {
            charter.nodes().any(|(key, node)| {
                (key == scope || node.name() == Some(scope)) && node.command(name).is_some()
            }) || packs.any(|p| p.name() == scope && p.command(name).is_some())
        }
        None => {
            charter
                .nodes()
                .any(|(_, node)| node.command(name).is_some())
                || packs.any(|p| p.command(name).is_some())
        }
    }
}
