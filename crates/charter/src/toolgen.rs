//! Tool generation: the tool list a model sees.
//!
//! [`generate_tools`] lists, in this order:
//!
//! 1. [`UPDATE_STATE`], whose `patch` is the node's partial state schema
//!    (for a node that has state, or every node in the
//!    [`PromptStyle::Upstream`] style);
//! 2. one [`TRANSITION`] tool choosing among the transitions without arguments
//!    (omitted when there are none), then one `transition_<name>` tool per
//!    transition with arguments (code with an argument schema, every general
//!    transition, serial with `arguments`), in declaration order;
//! 3. the node's own tools (a name equal to a built-in tool generated above is
//!    a [`ConfigError::ReservedToolName`]);
//! 4. ancestor tools, nearest ancestor first;
//! 5. charter tools;
//! 6. for non-workers, the tools of the packs the node declares, in order.
//!
//! From step 4 on, a name already listed is skipped silently (shadowing).
//! Built-in tools are never terminal.
//!
//! Provider built-in tools ([`ProviderTool`], upstream's `{ type:
//! <builtinType>, name }`) are listed apart, by [`generate_provider_tools`],
//! because a model request carries them apart
//! ([`ModelRequest::provider_tools`](markov_core::model::ModelRequest::provider_tools)):
//! they have no input schema and the loop never runs them. They take part in
//! the same shadowing: the node's own come first, then each ancestor's,
//! nearest first, and a name declared at a nearer level (as a tool or a
//! provider tool) hides the farther one in either list. The charter and packs
//! have no slot for them (upstream's charter tools are executable tools
//! only), so only nodes declare them.
//!
//! Decisions where upstream leaves room:
//!
//! - Key order inside generated schemas is `serde_json::Map` order, which is
//!   sorted (the workspace does not enable `preserve_order`); upstream keeps
//!   insertion order. `required` arrays keep the order given below.
//! - A code transition's argument schema contributes its `properties` when
//!   that is a JSON object; otherwise the whole schema becomes one `args`
//!   property.
//! - An argument property called `reason` replaces the built-in `reason`
//!   property (as upstream's object spread does), but `required` names
//!   `reason` only once.
//! - `required` is `["reason", <argument property names in the order of the
//!   argument properties map>]`.

use markov_core::tool::{ProviderTool, ToolDefinition};
use serde_json::{Map, Value, json};

use crate::charter::PromptStyle;
use crate::charter::{AncestorView, Charter};
use crate::define::error::ConfigError;
use crate::node::Node;
use crate::transition::Transition;

/// The built-in state update tool.
pub const UPDATE_STATE: &str = "updateState";
/// The built-in tool for transitions without arguments.
pub const TRANSITION: &str = "transition";
/// The prefix of the built-in tools for transitions with arguments.
pub const TRANSITION_PREFIX: &str = "transition_";

/// The description of [`UPDATE_STATE`].
pub const UPDATE_STATE_DESCRIPTION: &str = "Update the current state with a partial patch. The patch will be shallow-merged with the current state.";
/// The description of [`TRANSITION`].
pub const TRANSITION_DESCRIPTION: &str = "Transition to a different node. Use this when the current task is complete or you need different capabilities.";
/// The description of a `transition_<name>` tool whose transition has none.
pub const DEFAULT_TRANSITION_DESCRIPTION: &str = "Transition to another node";

/// [`generate_tools`], remembered by the charter: the list depends only on the
/// charter, the node, the ancestors' nodes and `is_worker`, all immutable, so
/// later steps share it instead of rebuilding every schema.
pub fn generate_tools_cached(
    charter: &Charter,
    node: &Node,
    ancestors: &[AncestorView<'_>],
    is_worker: bool,
) -> Result<std::sync::Arc<[ToolDefinition]>, ConfigError> {
    charter.cached_tools(node, ancestors, is_worker, || {
        generate_tools(charter, node, ancestors, is_worker)
    })
}

/// The tools offered to a model for `node`, in upstream's order.
///
/// `ancestors` are root first, as everywhere else; their tools are added
/// nearest first. `is_worker` leaves out pack tools. Transition refs are
/// resolved through `charter`, so an unknown ref is an error here.
pub fn generate_tools(
    charter: &Charter,
    node: &Node,
    ancestors: &[AncestorView<'_>],
    is_worker: bool,
) -> Result<Vec<ToolDefinition>, ConfigError> {
    let mut tools = Vec::new();
    if charter.prompt_style() == PromptStyle::Upstream || node.has_state() {
        tools.push(update_state_tool(node)?);
    }

    let mut without_args = Vec::new();
    let mut with_args = Vec::new();
    for (name, transition) in node.transitions() {
        let resolved = charter.resolve_transition(transition)?;
        match argument_properties(resolved) {
            Some(props) => with_args.push((name, resolved, props)),
            None => without_args.push(name.as_str()),
        }
    }
    if !without_args.is_empty() {
        tools.push(ToolDefinition::new(
            TRANSITION,
            TRANSITION_DESCRIPTION,
            json!({
                "type": "object",
                "properties": {
                    "to": {
                        "type": "string",
                        "enum": without_args,
                        "description": "The name of the transition to take",
                    },
                    "reason": reason_property(),
                },
                "required": ["to", "reason"],
            }),
        )?);
    }
    for (name, resolved, props) in with_args {
        let mut required = vec![Value::from("reason")];
        required.extend(
            props
                .keys()
                .filter(|k| k.as_str() != "reason")
                .map(|k| Value::from(k.as_str())),
        );
        let mut properties = Map::new();
        properties.insert("reason".into(), reason_property());
        properties.extend(props);
        tools.push(ToolDefinition::new(
            format!("{TRANSITION_PREFIX}{name}"),
            resolved
                .description()
                .unwrap_or(DEFAULT_TRANSITION_DESCRIPTION),
            json!({
                "type": "object",
                "properties": properties,
                "required": required,
            }),
        )?);
    }

    let builtin_count = tools.len();
    for def in node.tools().definitions() {
        if tools[..builtin_count].iter().any(|t| t.name == def.name) {
            return Err(ConfigError::ReservedToolName {
                node: node.name().unwrap_or("<unnamed>").to_owned(),
                tool: def.name.to_string(),
            });
        }
        tools.push(def.clone());
    }

    // Provider tool names declared so far (nearer levels) hide farther tools.
    let mut provider_names: Vec<&str> = provider_names_of(node).collect();
    for ancestor in ancestors.iter().rev() {
        add_missing(
            &mut tools,
            ancestor.node.tools().definitions(),
            &provider_names,
        );
        provider_names.extend(provider_names_of(ancestor.node));
    }
    add_missing(&mut tools, charter.tools().definitions(), &provider_names);
    if !is_worker {
        for pack in node.packs() {
            add_missing(&mut tools, pack.tools().definitions(), &provider_names);
        }
    }
    Ok(tools)
}

/// The provider built-in tools offered to a model for `node`: the node's own,
/// then each ancestor's (`ancestors` root first, added nearest first), in
/// declaration order. An ancestor's provider tool is skipped when a nearer
/// level (the node or a nearer ancestor) declares a tool or provider tool of
/// that name, mirroring the shadowing of [`generate_tools`].
///
/// ```
/// use markov_core::tool::ProviderTool;
/// use markov_charter::node::Node;
/// use markov_charter::toolgen::generate_provider_tools;
///
/// let search = ProviderTool::new("web_search_20250305", "web_search")?;
/// let node = Node::builder("Search.").provider_tool(search.clone()).build()?;
/// assert_eq!(generate_provider_tools(&node, &[]), vec![search]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn generate_provider_tools(node: &Node, ancestors: &[AncestorView<'_>]) -> Vec<ProviderTool> {
    let mut offered: Vec<ProviderTool> = node.provider_tools().to_vec();
    if ancestors.iter().all(|a| a.node.provider_tools().is_empty()) {
        return offered;
    }
    let mut taken: Vec<&str> = level_names(node).collect();
    for ancestor in ancestors.iter().rev() {
        for tool in ancestor.node.provider_tools() {
            if !taken.contains(&tool.name.as_str()) {
                offered.push(tool.clone());
            }
        }
        taken.extend(level_names(ancestor.node));
    }
    offered
}

/// The provider tool names a node declares.
fn provider_names_of(node: &Node) -> impl Iterator<Item = &str> {
    node.provider_tools().iter().map(|t| t.name.as_str())
}

/// Every tool name a node declares: its tools, then its provider tools.
fn level_names(node: &Node) -> impl Iterator<Item = &str> {
    node.tools()
        .definitions()
        .iter()
        .map(|d| d.name.as_str())
        .chain(provider_names_of(node))
}

fn update_state_tool(node: &Node) -> Result<ToolDefinition, ConfigError> {
    Ok(ToolDefinition::new(
        UPDATE_STATE,
        UPDATE_STATE_DESCRIPTION,
        json!({
            "type": "object",
            "properties": { "patch": node.schema().partial_json_schema() },
            "required": ["patch"],
        }),
    )?)
}

fn reason_property() -> Value {
    json!({"type": "string", "description": "Why you are making this transition"})
}

/// The argument properties of a resolved transition, `None` when it takes no arguments.
fn argument_properties(transition: &Transition) -> Option<Map<String, Value>> {
    let mut props = Map::new();
    match transition {
        Transition::Code(code) => match code.arguments()? {
            Value::Object(schema) => match schema.get("properties") {
                Some(Value::Object(p)) => props.clone_from(p),
                _ => {
                    props.insert("args".into(), Value::Object(schema.clone()));
                }
            },
            other => {
                props.insert("args".into(), other.clone());
            }
        },
        Transition::General { .. } => {
            props.insert("node".into(), general_node_property());
        }
        Transition::Serial { arguments, .. } => {
            props.insert("args".into(), arguments.clone()?);
        }
        // `Charter::resolve_transition` never returns a ref.
        Transition::Ref(_) => return None,
    }
    Some(props)
}

fn general_node_property() -> Value {
    json!({
        "type": "object",
        "description": "Inline node definition",
        "properties": {
            "instructions": {
                "type": "string",
                "description": "Instructions for the agent in this node",
            },
            "tools": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": { "ref": { "type": "string" } },
                    "required": ["ref"],
                },
                "description": "Tool references available in this node",
            },
            "validator": {
                "type": "object",
                "description": "Zodex-serialized state schema",
            },
            "transitions": {
                "type": "object",
                "description": "Available transitions from this node",
            },
        },
        "required": ["instructions", "tools", "validator", "transitions"],
    })
}

fn add_missing(tools: &mut Vec<ToolDefinition>, defs: &[ToolDefinition], hidden: &[&str]) {
    for def in defs {
        if !tools.iter().any(|t| t.name == def.name) && !hidden.contains(&def.name.as_str()) {
            tools.push(def.clone());
        }
    }
}
