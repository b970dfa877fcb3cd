//! Serialized nodes and packs: the `{"ref": name}` / inline forms,
//! as typed serde values ([`NodeSpec`], [`TransitionSpec`], [`PackSpec`]) and
//! as the JSON written into history.
//!
//! Two ways to write a node:
//!
//! - [`node_spec`] is **strict** (machine snapshots): a code or general
//!   transition of an inlined node must be registered in the charter (found by
//!   identity, see [`Charter::transition_ref_of`]), else
//!   [`SerialError::UnregisteredTransition`].
//! - [`serialize_node`] is **lenient** (the node inside `transition`/`spawn`
//!   instance messages of history): an unregistered code or general transition
//!   is written as a ref to its own name, which fails to resolve when read back,
//!   rather than aborting a run while it records history.
//!
//! Both write a serial transition whole (`description`, `node`, `arguments`):
//! upstream rewraps an inline target as `{type: "serial", description:
//! "Transition", node}` and stores a ref target as a bare ref (which later
//! loads as a *transition* ref), losing data; markov keeps it.
//!
//! Inline nodes read back carry their JSON Schema for display and accept any
//! object as state ([`DeclaredSchema`]): markov validates typed state through
//! Rust types, and a schema written by a model or read from storage is not a
//! type. (Upstream rebuilds a validator; see `docs/PORTING.md`.)

use std::sync::Arc;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::charter::Charter;
use crate::command::SharedCommand;
use crate::define::error::ConfigError;
use crate::node::{ExecutorConfig, Node};
use crate::pack::{Pack, PackInstructions};
use crate::state::StateSchema;
use crate::transition::{NodeTarget, Transition};

/// Why a node or pack could not be written or read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SerialError {
    /// An inlined node has a code or general transition the charter does not hold.
    #[error(
        "CodeTransition and GeneralTransition must be registered in the charter for serialization (transition \"{0}\")"
    )]
    UnregisteredTransition(String),
    /// A command ref without a dot.
    #[error("Command ref must be dotted (node.command): {0}")]
    CommandRefNotDotted(String),
    /// A command ref naming no charter node.
    #[error("Unknown node in command ref: {0}")]
    UnknownNodeInCommandRef(String),
    /// A command ref naming no command of its node.
    #[error("Unknown command on node {node}: {command}")]
    UnknownCommandOnNode {
        /// The node.
        node: String,
        /// The command.
        command: String,
    },
    /// A pack ref naming no charter pack.
    #[error("Pack not found in charter: {0}")]
    PackNotFound(String),
    /// An inline pack without a charter pack of the same name to merge with.
    #[error("Pack not found in charter for inline merge: {0}")]
    PackNotFoundForMerge(String),
    /// A ref or an inline node that does not resolve or build
    /// (`Unknown node ref`, tool and transition ref errors, an invalid initial state).
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// `{"ref": name}`: a node, transition, tool, command or pack held by the charter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Ref {
    /// The ref spelling: a node key, `"t"` or `"node.t"`, …
    #[serde(rename = "ref")]
    pub name: String,
}

impl Ref {
    /// A ref to `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Ref { name: name.into() }
    }
}

/// Named entries that keep their order: written as a JSON object, read from
/// one in document order (reading from a [`serde_json::Value`] sees its keys
/// sorted). A duplicate key is an error.
#[derive(Debug, Clone, PartialEq)]
pub struct Entries<T>(pub Vec<(String, T)>);

impl<T> Default for Entries<T> {
    fn default() -> Self {
        Entries(Vec::new())
    }
}

impl<T> Entries<T> {
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The entry called `name`.
    pub fn get(&self, name: &str) -> Option<&T> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}

impl<T: Serialize> Serialize for Entries<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Entries<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for EntriesVisitor<T> {
            type Value = Entries<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(String, T)> = Vec::new();
                while let Some((k, v)) = access.next_entry::<String, T>()? {
                    if out.iter().any(|(n, _)| *n == k) {
                        return Err(de::Error::custom(format!("duplicate key {k:?}")));
                    }
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        deserializer.deserialize_map(EntriesVisitor(std::marker::PhantomData))
    }
}

/// A node as stored: a charter ref, or inline.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawNode")]
pub enum NodeSpec {
    /// `{"ref": "<charter node key>"}`.
    Ref(Ref),
    /// A SerialNode.
    Inline(Box<SerialNode>),
}

impl Serialize for NodeSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            NodeSpec::Ref(r) => r.serialize(serializer),
            NodeSpec::Inline(n) => n.serialize(serializer),
        }
    }
}

/// An inline node (upstream's `SerialNode`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SerialNode {
    /// The node's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The instructions.
    pub instructions: String,
    /// The state's JSON Schema, `$` keywords escaped ([`escape_schema`]).
    pub validator: Value,
    /// Transitions by name, in declaration order.
    #[serde(default)]
    pub transitions: Entries<TransitionSpec>,
    /// Tools by name, as charter refs.
    #[serde(default, skip_serializing_if = "Entries::is_empty")]
    pub tools: Entries<Ref>,
    /// Commands by name, as `"<node>.<command>"` refs.
    #[serde(default, skip_serializing_if = "Entries::is_empty")]
    pub commands: Entries<Ref>,
    /// The initial state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_state: Option<Value>,
    /// Model settings (`model`, `maxTokens`, `temperature`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor_config: Option<Value>,
}

/// The fields a stored node may have: `ref` alone, or a SerialNode's.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawNode {
    #[serde(rename = "ref")]
    reference: Option<String>,
    name: Option<String>,
    instructions: Option<String>,
    validator: Option<Value>,
    transitions: Option<Entries<TransitionSpec>>,
    tools: Option<Entries<Ref>>,
    commands: Option<Entries<Ref>>,
    initial_state: Option<Value>,
    executor_config: Option<Value>,
}

impl TryFrom<RawNode> for NodeSpec {
    type Error = String;

    fn try_from(raw: RawNode) -> Result<Self, String> {
        if let Some(name) = raw.reference {
            let others = raw.name.is_some()
                || raw.instructions.is_some()
                || raw.validator.is_some()
                || raw.transitions.is_some()
                || raw.tools.is_some()
                || raw.commands.is_some()
                || raw.initial_state.is_some()
                || raw.executor_config.is_some();
            if others {
                return Err(format!("node ref {name:?} has other fields"));
            }
            return Ok(NodeSpec::Ref(Ref { name }));
        }
        Ok(NodeSpec::Inline(Box::new(SerialNode {
            name: raw.name,
            instructions: raw
                .instructions
                .ok_or("an inline node needs `instructions`")?,
            validator: raw.validator.ok_or("an inline node needs `validator`")?,
            transitions: raw.transitions.unwrap_or_default(),
            tools: raw.tools.unwrap_or_default(),
            commands: raw.commands.unwrap_or_default(),
            initial_state: raw.initial_state,
            executor_config: raw.executor_config,
        })))
    }
}

/// A transition as stored: a ref (`"t"` or `"node.t"`), or a serial transition.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawTransition")]
pub enum TransitionSpec {
    /// `{"ref": "t"}` or `{"ref": "node.t"}`.
    Ref(Ref),
    /// `{"type": "serial", "description", "node", "arguments"?}`.
    Serial(SerialTransition),
}

/// A transition to a fixed node (upstream's `SerialTransition`; written with `"type": "serial"`).
#[derive(Debug, Clone, PartialEq)]
pub struct SerialTransition {
    /// The description shown to the model.
    pub description: String,
    /// The target.
    pub node: NodeSpec,
    /// A JSON Schema of arguments the model must supply, if any.
    pub arguments: Option<Value>,
}

impl Serialize for TransitionSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Out<'a> {
            #[serde(rename = "type")]
            kind: &'static str,
            description: &'a str,
            node: &'a NodeSpec,
            #[serde(skip_serializing_if = "Option::is_none")]
            arguments: Option<&'a Value>,
        }
        match self {
            TransitionSpec::Ref(r) => r.serialize(serializer),
            TransitionSpec::Serial(s) => Out {
                kind: "serial",
                description: &s.description,
                node: &s.node,
                arguments: s.arguments.as_ref(),
            }
            .serialize(serializer),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTransition {
    #[serde(rename = "ref")]
    reference: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    description: Option<String>,
    node: Option<NodeSpec>,
    arguments: Option<Value>,
}

impl TryFrom<RawTransition> for TransitionSpec {
    type Error = String;

    fn try_from(raw: RawTransition) -> Result<Self, String> {
        if let Some(name) = raw.reference {
            if raw.kind.is_some()
                || raw.description.is_some()
                || raw.node.is_some()
                || raw.arguments.is_some()
            {
                return Err(format!("transition ref {name:?} has other fields"));
            }
            return Ok(TransitionSpec::Ref(Ref { name }));
        }
        match raw.kind.as_deref() {
            Some("serial") => Ok(TransitionSpec::Serial(SerialTransition {
                description: raw.description.unwrap_or_else(|| "Transition".into()),
                node: raw.node.ok_or("a serial transition needs a `node`")?,
                arguments: raw.arguments,
            })),
            Some(other) => Err(format!("Unknown transition type: {other}")),
            None => Err("a transition needs `ref` or `type`".into()),
        }
    }
}

/// A pack as stored: a charter ref, or inline.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawPack")]
pub enum PackSpec {
    /// `{"ref": "<pack name>"}`.
    Ref(Ref),
    /// A SerialPack.
    Inline(SerialPack),
}

impl Serialize for PackSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            PackSpec::Ref(r) => r.serialize(serializer),
            PackSpec::Inline(p) => p.serialize(serializer),
        }
    }
}

/// An inline pack (upstream's `SerialPack`). When read back it is merged with
/// the charter pack of the same name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SerialPack {
    /// The pack's name.
    pub name: String,
    /// Its description.
    pub description: String,
    /// Its instructions as rendered for the stored state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Its state's JSON Schema, escaped (informative: the charter's is used).
    pub validator: Value,
    /// Its tools, as `"<pack>.<tool>"` refs (informative).
    #[serde(default, skip_serializing_if = "Entries::is_empty")]
    pub tools: Entries<Ref>,
    /// Its commands, as `"<pack>.<command>"` refs (informative).
    #[serde(default, skip_serializing_if = "Entries::is_empty")]
    pub commands: Entries<Ref>,
    /// Its initial state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_state: Option<Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawPack {
    #[serde(rename = "ref")]
    reference: Option<String>,
    name: Option<String>,
    description: Option<String>,
    instructions: Option<String>,
    validator: Option<Value>,
    tools: Option<Entries<Ref>>,
    commands: Option<Entries<Ref>>,
    initial_state: Option<Value>,
}

impl TryFrom<RawPack> for PackSpec {
    type Error = String;

    fn try_from(raw: RawPack) -> Result<Self, String> {
        if let Some(name) = raw.reference {
            if raw.name.is_some()
                || raw.description.is_some()
                || raw.instructions.is_some()
                || raw.validator.is_some()
                || raw.tools.is_some()
                || raw.commands.is_some()
                || raw.initial_state.is_some()
            {
                return Err(format!("pack ref {name:?} has other fields"));
            }
            return Ok(PackSpec::Ref(Ref { name }));
        }
        Ok(PackSpec::Inline(SerialPack {
            name: raw.name.ok_or("an inline pack needs `name`")?,
            description: raw
                .description
                .ok_or("an inline pack needs `description`")?,
            instructions: raw.instructions,
            validator: raw.validator.ok_or("an inline pack needs `validator`")?,
            tools: raw.tools.unwrap_or_default(),
            commands: raw.commands.unwrap_or_default(),
            initial_state: raw.initial_state,
        }))
    }
}

/// A node's serialized form for history (lenient, see the module docs): a
/// ref when the charter registers it, else inline.
pub fn serialize_node(charter: &Charter, node: &Node) -> Value {
    match spec_of(charter, node, false) {
        // Serializing these types cannot fail: every map key is a string.
        Ok(spec) => serde_json::to_value(spec).unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

/// A node's serialized form for machine snapshots (strict, see the module
/// docs): a ref when the charter registers it, else a [`SerialNode`].
///
/// Tools are kept as refs when the charter holds the very same tool (a charter
/// tool → `"tool"`, a charter node's → `"node.tool"`), commands when a charter
/// node holds the very same command (`"node.command"`); others are dropped
///. The worker flag, packs, output config and turn policy are
/// never written: register a node whose identity must survive.
pub fn node_spec(charter: &Charter, node: &Node) -> Result<NodeSpec, SerialError> {
    spec_of(charter, node, true)
}

fn spec_of(charter: &Charter, node: &Node, strict: bool) -> Result<NodeSpec, SerialError> {
    if let Some(name) = charter.node_name(node) {
        return Ok(NodeSpec::Ref(Ref::new(name)));
    }
    let mut transitions = Vec::with_capacity(node.transitions().len());
    for (name, t) in node.transitions() {
        transitions.push((name.clone(), transition_spec(charter, name, t, strict)?));
    }
    let tools = node
        .tools()
        .iter()
        .filter_map(|tool| {
            let found = charter.tool_ref_of(tool);
            if found.is_none() && strict {
                tracing::warn!(
                    tool = tool.definition().name.as_str(),
                    "unregistered tool of an inlined node dropped from the snapshot"
                );
            }
            found.map(|r| (tool.definition().name.as_str().to_owned(), Ref::new(r)))
        })
        .collect();
    let commands = node
        .commands()
        .iter()
        .filter_map(|c| {
            charter
                .command_ref_of(c)
                .map(|r| (c.name().to_owned(), Ref::new(r)))
        })
        .collect();
    Ok(NodeSpec::Inline(Box::new(SerialNode {
        name: node.name().map(str::to_owned),
        instructions: node.instructions().to_owned(),
        validator: escape_schema(node.schema().json_schema()),
        transitions: Entries(transitions),
        tools: Entries(tools),
        commands: Entries(commands),
        initial_state: node.initial_state().cloned(),
        executor_config: executor_config_json(node.executor_config()),
    })))
}

fn transition_spec(
    charter: &Charter,
    name: &str,
    t: &Transition,
    strict: bool,
) -> Result<TransitionSpec, SerialError> {
    Ok(match t {
        Transition::Ref(r) => TransitionSpec::Ref(Ref::new(r.clone())),
        Transition::Serial {
            description,
            target,
            arguments,
        } => TransitionSpec::Serial(SerialTransition {
            description: description.clone(),
            node: match target {
                NodeTarget::Ref(r) => NodeSpec::Ref(Ref::new(r.clone())),
                NodeTarget::Inline(n) => spec_of(charter, n, strict)?,
            },
            arguments: arguments.clone(),
        }),
        // Code and general transitions, and any kind added later: by identity.
        other => match charter.transition_ref_of(other) {
            Some(r) => TransitionSpec::Ref(Ref::new(r)),
            None if strict => return Err(SerialError::UnregisteredTransition(name.to_owned())),
            None => TransitionSpec::Ref(Ref::new(name)),
        },
    })
}

/// A node's model settings as upstream's `executorConfig` JSON (`model`,
/// `maxTokens`, `temperature`), `None` when nothing is overridden.
pub fn executor_config_to_json(config: &ExecutorConfig) -> Option<Value> {
    executor_config_json(config)
}

fn executor_config_json(config: &ExecutorConfig) -> Option<Value> {
    if *config == ExecutorConfig::default() {
        return None;
    }
    let mut map = Map::new();
    if let Some(model) = &config.model {
        map.insert("model".into(), Value::String(model.clone()));
    }
    if let Some(n) = config.max_tokens {
        map.insert("maxTokens".into(), Value::from(n));
    }
    if let Some(t) = config.temperature {
        // Through the shortest decimal form, so 0.7f32 is written 0.7.
        let t = t.to_string().parse::<f64>().unwrap_or(f64::from(t));
        map.insert("temperature".into(), Value::from(t));
    }
    Some(Value::Object(map))
}

/// Builds the node a [`NodeSpec`] describes: a ref resolves to the charter
/// node (`Unknown node ref: <r>`); a SerialNode becomes a **new** node (fresh
/// id) whose tool, command and transition refs are resolved against the charter.
pub fn node_from_spec(charter: &Charter, spec: &NodeSpec) -> Result<Node, SerialError> {
    let node = match spec {
        NodeSpec::Ref(r) => charter
            .node(&r.name)
            .cloned()
            .ok_or_else(|| ConfigError::UnknownNodeRef(r.name.clone()))?,
        NodeSpec::Inline(n) => {
            let node = inline_node(charter, n)?;
            charter.check(&node)?;
            node
        }
    };
    Ok(node)
}

fn inline_node(charter: &Charter, n: &SerialNode) -> Result<Node, SerialError> {
    let schema = DeclaredSchema(unescape_schema(n.validator.clone()));
    let mut builder =
        Node::builder(n.instructions.clone()).schema(Arc::new(schema), n.initial_state.clone());
    if let Some(name) = &n.name {
        builder = builder.name(name.clone());
    }
    for (_, r) in &n.tools.0 {
        builder = builder.shared_tool(resolve_tool_ref(charter, &r.name)?);
    }
    for (key, r) in &n.commands.0 {
        builder = builder.shared_command(key.clone(), resolve_command_ref(charter, &r.name)?);
    }
    for (name, t) in &n.transitions.0 {
        let t = match t {
            TransitionSpec::Ref(r) => Transition::Ref(r.name.clone()),
            TransitionSpec::Serial(s) => Transition::Serial {
                description: s.description.clone(),
                target: match &s.node {
                    NodeSpec::Ref(r) => NodeTarget::Ref(r.name.clone()),
                    NodeSpec::Inline(inner) => NodeTarget::Inline(inline_node(charter, inner)?),
                },
                arguments: s.arguments.clone(),
            },
        };
        builder = builder.transition(name.clone(), t);
    }
    if let Some(config) = &n.executor_config {
        builder = builder.executor_config(ExecutorConfig::from_json(config)?);
    }
    Ok(builder.build()?)
}

/// A pack's serialized form with `state`: a ref when the charter
/// has a pack of that name whose instructions render the same for `state`,
/// else a [`SerialPack`].
pub fn pack_spec(charter: &Charter, pack: &Pack, state: &Value) -> PackSpec {
    let rendered = pack.instructions().render(state);
    if let Some(registered) = charter.pack(pack.name())
        && registered.instructions().render(state) == rendered
    {
        return PackSpec::Ref(Ref::new(pack.name()));
    }
    let refs = |names: Vec<String>| {
        Entries(
            names
                .into_iter()
                .map(|n| {
                    let r = Ref::new(format!("{}.{n}", pack.name()));
                    (n, r)
                })
                .collect(),
        )
    };
    PackSpec::Inline(SerialPack {
        name: pack.name().to_owned(),
        description: pack.description().to_owned(),
        instructions: match pack.instructions() {
            PackInstructions::None => None,
            _ => Some(rendered),
        },
        validator: escape_schema(pack.schema().json_schema()),
        tools: refs(
            pack.tools()
                .iter()
                .map(|t| t.definition().name.as_str().to_owned())
                .collect(),
        ),
        commands: refs(
            pack.commands()
                .iter()
                .map(|c| c.name().to_owned())
                .collect(),
        ),
        initial_state: pack.initial_state().cloned(),
    })
}

/// The pack a [`PackSpec`] describes: a ref is the charter pack
/// (`Pack not found in charter`); an inline pack is the charter pack of the
/// same name (`Pack not found in charter for inline merge`) with the stored
/// description, instructions and initial state (each falling back to the
/// charter's); schema, tools and commands are the charter's.
pub fn pack_from_spec(charter: &Charter, spec: &PackSpec) -> Result<Pack, SerialError> {
    match spec {
        PackSpec::Ref(r) => charter
            .pack(&r.name)
            .cloned()
            .ok_or_else(|| SerialError::PackNotFound(r.name.clone())),
        PackSpec::Inline(p) => {
            let base = charter
                .pack(&p.name)
                .ok_or_else(|| SerialError::PackNotFoundForMerge(p.name.clone()))?;
            Ok(base.merged(
                p.description.clone(),
                p.instructions.clone(),
                p.initial_state.clone(),
            ))
        }
    }
}

/// The JSON Schema keywords that start with `$` (draft 2020-12), renamed to a
/// `__` prefix in stored schemas.
const DOLLAR_KEYWORDS: [&str; 9] = [
    "schema",
    "id",
    "ref",
    "defs",
    "anchor",
    "vocabulary",
    "comment",
    "dynamicRef",
    "dynamicAnchor",
];

/// Renames the `$`-prefixed JSON Schema keywords (`$schema`, `$id`, `$ref`,
/// `$defs`, `$anchor`, `$vocabulary`, `$comment`, `$dynamicRef`,
/// `$dynamicAnchor`) to a `__` prefix, recursively, as stored schemas do.
/// Other keys (property names included) are left alone.
pub fn escape_schema(schema: Value) -> Value {
    rename_keys(schema, "$", "__")
}

/// Reverses [`escape_schema`].
pub fn unescape_schema(schema: Value) -> Value {
    rename_keys(schema, "__", "$")
}

fn rename_keys(value: Value, from: &str, to: &str) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| {
                    let k = match k.strip_prefix(from) {
                        Some(rest) if DOLLAR_KEYWORDS.contains(&rest) => format!("{to}{rest}"),
                        _ => k,
                    };
                    (k, rename_keys(v, from, to))
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(
            items
                .into_iter()
                .map(|v| rename_keys(v, from, to))
                .collect(),
        ),
        other => other,
    }
}

/// A schema read from JSON: shown to the model, not enforced beyond "an object".
#[derive(Debug, Clone)]
pub struct DeclaredSchema(Value);

impl DeclaredSchema {
    /// A declared (unescaped) JSON Schema.
    pub fn new(schema: Value) -> Self {
        DeclaredSchema(schema)
    }
}

impl StateSchema for DeclaredSchema {
    fn parse(&self, value: &Value) -> Result<Value, String> {
        crate::state::AnyObject.parse(value)
    }

    fn json_schema(&self) -> Value {
        self.0.clone()
    }
}

/// Reads an inline node from JSON leniently (a node a model wrote for a
/// general transition, or one read from an instance message): `validator`
/// defaults to `{"type": "object"}`, `initialState` to `{}`, `tools` may be a
/// list or a map of refs, unknown fields are ignored. Tool, command and
/// transition refs are resolved against the charter.
pub fn node_from_json(charter: &Charter, value: &Value) -> Result<Node, ConfigError> {
    let invalid = |why: &str| ConfigError::InvalidSerialNode(why.to_owned());
    let obj = value
        .as_object()
        .ok_or_else(|| invalid("a node must be an object"))?;
    let instructions = obj
        .get("instructions")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("missing string field `instructions`"))?;
    let schema = obj
        .get("validator")
        .cloned()
        .map(unescape_schema)
        .unwrap_or_else(|| json!({"type": "object"}));
    let initial = obj
        .get("initialState")
        .cloned()
        .unwrap_or_else(|| Value::Object(Map::new()));
    let mut builder =
        Node::builder(instructions).schema(Arc::new(DeclaredSchema(schema)), Some(initial));
    if let Some(name) = obj.get("name").and_then(Value::as_str) {
        builder = builder.name(name);
    }
    for r in tool_refs(obj.get("tools"))? {
        builder = builder.shared_tool(resolve_tool_ref(charter, &r)?);
    }
    if let Some(Value::Object(commands)) = obj.get("commands") {
        for (key, r) in commands {
            let r = r.get("ref").and_then(Value::as_str).ok_or_else(|| {
                ConfigError::InvalidSerialNode("a command must be a {\"ref\": name}".into())
            })?;
            let command = resolve_command_ref(charter, r)
                .map_err(|e| ConfigError::InvalidSerialNode(e.to_string()))?;
            builder = builder.shared_command(key.clone(), command);
        }
    }
    if let Some(Value::Object(ts)) = obj.get("transitions") {
        for (name, t) in ts {
            builder = builder.transition(name.clone(), transition_from_json(charter, t)?);
        }
    }
    if let Some(config) = obj.get("executorConfig") {
        builder = builder.executor_config(ExecutorConfig::from_json(config)?);
    }
    let node = builder.build()?;
    charter.check(&node)?;
    Ok(node)
}

fn tool_refs(tools: Option<&Value>) -> Result<Vec<String>, ConfigError> {
    let as_ref = |v: &Value| {
        v.get("ref")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| {
                ConfigError::InvalidSerialNode("a tool must be a {\"ref\": name}".into())
            })
    };
    match tools {
        None | Some(Value::Null) => Ok(Vec::new()),
        // The general-transition schema describes an array; stored nodes use a map.
        Some(Value::Array(items)) => items.iter().map(as_ref).collect(),
        Some(Value::Object(map)) => map.values().map(as_ref).collect(),
        Some(_) => Err(ConfigError::InvalidSerialNode(
            "`tools` must be a list or a map of refs".into(),
        )),
    }
}

fn resolve_tool_ref(
    charter: &Charter,
    r: &str,
) -> Result<markov_core::tool::SharedTool, ConfigError> {
    match r.split_once('.') {
        None => charter
            .tools()
            .get(r)
            .cloned()
            .ok_or_else(|| ConfigError::UnknownToolRef(r.to_owned())),
        Some((node, tool)) => {
            let n = charter
                .node(node)
                .ok_or_else(|| ConfigError::UnknownNodeInToolRef(r.to_owned()))?;
            n.tools()
                .get(tool)
                .cloned()
                .ok_or_else(|| ConfigError::UnknownToolOnNode {
                    node: node.to_owned(),
                    tool: tool.to_owned(),
                })
        }
    }
}

fn resolve_command_ref(charter: &Charter, r: &str) -> Result<SharedCommand, SerialError> {
    let (node, command) = r
        .split_once('.')
        .ok_or_else(|| SerialError::CommandRefNotDotted(r.to_owned()))?;
    let n = charter
        .node(node)
        .ok_or_else(|| SerialError::UnknownNodeInCommandRef(r.to_owned()))?;
    n.command(command)
        .cloned()
        .ok_or_else(|| SerialError::UnknownCommandOnNode {
            node: node.to_owned(),
            command: command.to_owned(),
        })
}

fn transition_from_json(charter: &Charter, t: &Value) -> Result<Transition, ConfigError> {
    if let Some(r) = t.get("ref").and_then(Value::as_str) {
        return Ok(Transition::Ref(r.to_owned()));
    }
    if t.get("type").and_then(Value::as_str) == Some("serial") {
        let description = t
            .get("description")
            .and_then(Value::as_str)
            .unwrap_or("Transition")
            .to_owned();
        let target = match t.get("node") {
            Some(n) => match n.get("ref").and_then(Value::as_str) {
                Some(r) => NodeTarget::Ref(r.to_owned()),
                None => NodeTarget::Inline(node_from_json(charter, n)?),
            },
            None => {
                return Err(ConfigError::InvalidSerialNode(
                    "a serial transition needs a `node`".into(),
                ));
            }
        };
        return Ok(Transition::Serial {
            description,
            target,
            arguments: t.get("arguments").cloned(),
        });
    }
    Err(ConfigError::InvalidSerialNode(format!(
        "Unknown transition type: {}",
        t.get("type").map(Value::to_string).unwrap_or_default()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_only_dollar_keywords() {
        let schema = json!({
            "$schema": "x", "$defs": {"A": {"$ref": "#/$defs/A"}},
            "properties": {"$price": {"type": "number"}, "__x": {}}
        });
        let escaped = escape_schema(schema.clone());
        assert_eq!(escaped["__schema"], "x");
        assert_eq!(escaped["__defs"]["A"]["__ref"], "#/$defs/A");
        assert!(escaped["properties"].get("$price").is_some());
        assert_eq!(unescape_schema(escaped), schema);
    }

    #[test]
    fn specs_read_refs_and_inline_forms() {
        let r: NodeSpec = serde_json::from_value(json!({"ref": "a"})).unwrap();
        assert_eq!(r, NodeSpec::Ref(Ref::new("a")));
        let err = serde_json::from_value::<NodeSpec>(json!({"ref": "a", "instructions": "x"}))
            .unwrap_err();
        assert!(err.to_string().contains("other fields"), "{err}");
        let t: TransitionSpec =
            serde_json::from_str(r#"{"type":"serial","description":"d","node":{"ref":"b"}}"#)
                .unwrap();
        assert_eq!(
            serde_json::to_value(&t).unwrap(),
            json!({"type": "serial", "description": "d", "node": {"ref": "b"}})
        );
        let err = serde_json::from_value::<TransitionSpec>(json!({"type": "code"})).unwrap_err();
        assert!(err.to_string().contains("Unknown transition type: code"));
        let e: Entries<Ref> = serde_json::from_str(r#"{"b":{"ref":"x"},"a":{"ref":"y"}}"#).unwrap();
        assert_eq!(e.0[0].0, "b", "document order kept");
        assert!(
            serde_json::from_str::<Entries<Ref>>(r#"{"a":{"ref":"x"},"a":{"ref":"y"}}"#).is_err()
        );
    }
}
