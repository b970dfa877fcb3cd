//! Serialized nodes (spec §14): the `{"ref": name}` / inline form written into
//! history, and inline nodes read back from JSON (general transitions).
//!
//! Inline nodes read from JSON carry their JSON Schema for display and accept
//! any object as state: markov validates typed state through Rust types, and a
//! schema written by a model is not a type. (Upstream rebuilds a validator.)

use std::sync::Arc;

use serde_json::{Map, Value, json};

use crate::charter::Charter;
use crate::error::ConfigError;
use crate::node::Node;
use crate::state::StateSchema;
use crate::transition::{NodeTarget, Transition};

/// A node's serialized form: a ref when the charter registers it, else inline.
pub fn serialize_node(charter: &Charter, node: &Node) -> Value {
    if let Some(name) = charter.node_name(node) {
        return json!({ "ref": name });
    }
    let mut map = Map::new();
    if let Some(name) = node.name() {
        map.insert("name".into(), Value::String(name.to_owned()));
    }
    map.insert(
        "instructions".into(),
        Value::String(node.instructions().to_owned()),
    );
    map.insert(
        "validator".into(),
        escape_schema(node.schema().json_schema()),
    );
    let mut transitions = Map::new();
    for (name, t) in node.transitions() {
        transitions.insert(name.clone(), serialize_transition(charter, name, t));
    }
    map.insert("transitions".into(), Value::Object(transitions));
    if let Some(state) = node.initial_state() {
        map.insert("initialState".into(), state.clone());
    }
    Value::Object(map)
}

fn serialize_transition(charter: &Charter, name: &str, t: &Transition) -> Value {
    match t {
        Transition::Ref(r) => json!({ "ref": r }),
        Transition::Serial {
            description,
            target,
            ..
        } => {
            let node = match target {
                NodeTarget::Ref(r) => json!({ "ref": r }),
                NodeTarget::Inline(n) => serialize_node(charter, n),
            };
            json!({ "type": "serial", "description": description, "node": node })
        }
        // Code and general transitions serialize as refs to the charter entry of
        // the same name; an unregistered one keeps its name as a ref and fails
        // to resolve on load rather than aborting a run while writing history.
        Transition::Code(_) | Transition::General { .. } => json!({ "ref": name }),
    }
}

/// Renames `$`-prefixed schema keywords to `__` (recursively), as stored schemas do.
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
                        Some(rest) => format!("{to}{rest}"),
                        None => k,
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

impl StateSchema for DeclaredSchema {
    fn parse(&self, value: &Value) -> Result<Value, String> {
        crate::state::AnyObject.parse(value)
    }

    fn json_schema(&self) -> Value {
        self.0.clone()
    }
}

/// Reads an inline node (a SerialNode) from JSON, resolving tool and
/// transition refs against the charter.
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
    if let Some(Value::Object(ts)) = obj.get("transitions") {
        for (name, t) in ts {
            builder = builder.transition(name.clone(), transition_from_json(charter, t)?);
        }
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
