//! Tree mutations ([`Effect`]s) and their record in history (`instance` messages).
//!
//! Executors never touch the tree: they report effects, which the loop applies
//! after every leaf of a step has finished. Each effect is also written to
//! history as an `instance` message, with nodes in their serialized form.

use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_charter::serial::{node_from_json, serialize_node};
use markov_charter::transition::CedeContent;
use markov_core::message::{InstancePayload, Items, Message, Metadata, Source, SpawnedChild};
use markov_core::{InstanceId, Role};
use serde_json::Value;

use crate::error::RunError;
use crate::instance::SuspendInfo;

/// A change to the instance tree.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Effect {
    /// Shallow-merge a patch into an instance's state.
    State {
        /// The instance.
        instance: InstanceId,
        /// The patch.
        patch: Value,
    },
    /// Shallow-merge a patch into a pack's state.
    PackState {
        /// The pack.
        pack: String,
        /// The patch.
        patch: Value,
    },
    /// Replace an instance's node and state, dropping its children.
    Transition {
        /// The instance.
        instance: InstanceId,
        /// The new node.
        node: Node,
        /// The new state.
        state: Value,
    },
    /// Append children.
    Spawn {
        /// The parent.
        parent: InstanceId,
        /// The children's nodes and states.
        children: Vec<(Node, Value)>,
    },
    /// Remove an instance; its content goes to the parent.
    Cede {
        /// The instance.
        instance: InstanceId,
        /// What it hands back.
        content: Option<CedeContent>,
    },
    /// Suspend an instance.
    Suspend {
        /// The instance.
        instance: InstanceId,
        /// Why and since when.
        info: SuspendInfo,
    },
}

/// Something enqueued: a message, and the typed effect behind it when it records one.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The message, as history stores it.
    pub message: Message,
    /// The typed effect; `None` for conversation messages and for instance
    /// messages enqueued by applications (parsed when drained).
    pub effect: Option<Effect>,
    /// Whether this is markov's own instruction (see [`Entry::instruction`]).
    instruction: bool,
}

impl Entry {
    /// A conversation message.
    pub fn message(message: Message) -> Self {
        Entry {
            message,
            effect: None,
            instruction: false,
        }
    }

    /// markov's own instruction to the model (a follow-up asking again for
    /// an answer, say): recorded as a system message
    /// ([`Role::System`](markov_core::Role::System)), never as the user's
    /// words, yet it starts a run as user input does. It continues the
    /// user's turn: per-turn budgets do not start over.
    pub fn instruction(text: impl Into<String>) -> Self {
        Entry {
            message: Message::system(text),
            effect: None,
            instruction: true,
        }
    }

    /// An entry of a run's pending input read back from its stored
    /// message: an effect's record is parsed again when drained.
    pub(crate) fn pending(message: Message, instruction: bool) -> Self {
        Entry {
            message,
            effect: None,
            instruction,
        }
    }

    /// Whether this is markov's own instruction, made by
    /// [`Entry::instruction`]: it starts a run.
    pub fn is_instruction(&self) -> bool {
        self.instruction
    }

    /// An effect with its history record.
    pub fn effect(charter: &Charter, effect: Effect, source: Option<Source>) -> Self {
        let mut message = Message::instance(to_payload(charter, &effect));
        if let Some(source) = source {
            message = message.with_metadata(Metadata::with_source(source));
        }
        Entry {
            message,
            effect: Some(effect),
            instruction: false,
        }
    }

    /// The effect of an instance entry, parsing the payload when needed.
    pub(crate) fn resolve_effect(&self, charter: &Charter) -> Result<Option<Effect>, RunError> {
        if let Some(e) = &self.effect {
            return Ok(Some(e.clone()));
        }
        match &self.message.items {
            Items::Instance(payload) if self.message.role == Role::Instance => {
                from_payload(charter, payload).map(Some)
            }
            _ => Ok(None),
        }
    }
}

fn cede_to_json(content: &CedeContent) -> Value {
    match content {
        CedeContent::Text(s) => Value::String(s.clone()),
        CedeContent::Messages(m) => serde_json::to_value(m).unwrap_or(Value::Null),
    }
}

/// The content a cede hands back, as JSON (a string or a list of messages).
pub(crate) fn cede_json(content: &Option<CedeContent>) -> Option<Value> {
    content.as_ref().map(cede_to_json)
}

fn to_payload(charter: &Charter, effect: &Effect) -> InstancePayload {
    match effect {
        Effect::State { instance, patch } => InstancePayload::State {
            instance_id: instance.clone(),
            patch: patch.clone(),
        },
        Effect::PackState { pack, patch } => InstancePayload::PackState {
            pack_name: pack.clone(),
            patch: patch.clone(),
        },
        Effect::Transition {
            instance,
            node,
            state,
        } => InstancePayload::Transition {
            instance_id: instance.clone(),
            node: serialize_node(charter, node),
            state: Some(state.clone()),
        },
        Effect::Spawn { parent, children } => InstancePayload::Spawn {
            parent_instance_id: parent.clone(),
            children: children
                .iter()
                .map(|(node, state)| SpawnedChild {
                    node: serialize_node(charter, node),
                    state: Some(state.clone()),
                })
                .collect(),
        },
        Effect::Cede { instance, content } => InstancePayload::Cede {
            instance_id: instance.clone(),
            content: cede_json(content),
        },
        Effect::Suspend { instance, info } => InstancePayload::Suspend {
            instance_id: instance.clone(),
            suspend_info: info.to_json(),
        },
    }
}

fn node_from_payload(charter: &Charter, node: &Value) -> Result<Node, RunError> {
    match node.get("ref").and_then(Value::as_str) {
        Some(r) => charter
            .node(r)
            .cloned()
            .ok_or_else(|| markov_charter::ConfigError::UnknownNodeRef(r.to_owned()).into()),
        None => Ok(node_from_json(charter, node)?),
    }
}

fn from_payload(charter: &Charter, payload: &InstancePayload) -> Result<Effect, RunError> {
    let initial = |node: &Node| {
        node.initial_state()
            .cloned()
            .unwrap_or_else(|| Value::Object(serde_json::Map::new()))
    };
    Ok(match payload {
        InstancePayload::State { instance_id, patch } => Effect::State {
            instance: instance_id.clone(),
            patch: patch.clone(),
        },
        InstancePayload::PackState { pack_name, patch } => Effect::PackState {
            pack: pack_name.clone(),
            patch: patch.clone(),
        },
        InstancePayload::Transition {
            instance_id,
            node,
            state,
        } => {
            let node = node_from_payload(charter, node)?;
            let state = state.clone().unwrap_or_else(|| initial(&node));
            Effect::Transition {
                instance: instance_id.clone(),
                node,
                state,
            }
        }
        InstancePayload::Spawn {
            parent_instance_id,
            children,
        } => Effect::Spawn {
            parent: parent_instance_id.clone(),
            children: children
                .iter()
                .map(|c| {
                    let node = node_from_payload(charter, &c.node)?;
                    let state = c.state.clone().unwrap_or_else(|| initial(&node));
                    Ok((node, state))
                })
                .collect::<Result<_, RunError>>()?,
        },
        InstancePayload::Cede {
            instance_id,
            content,
        } => Effect::Cede {
            instance: instance_id.clone(),
            content: match content {
                None => None,
                Some(Value::String(s)) => Some(CedeContent::Text(s.clone())),
                Some(v) => Some(CedeContent::Messages(
                    serde_json::from_value(v.clone())
                        .map_err(|e| RunError::InvalidInstanceMessage(e.to_string()))?,
                )),
            },
        },
        InstancePayload::Suspend {
            instance_id,
            suspend_info,
        } => {
            let field = |k: &str| {
                suspend_info
                    .get(k)
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        RunError::InvalidInstanceMessage(format!("suspendInfo needs a string {k}"))
                    })
            };
            let suspended_at = match suspend_info.get("suspendedAt").and_then(Value::as_str) {
                Some(s) => humantime::parse_rfc3339_weak(s)
                    .map_err(|e| RunError::InvalidInstanceMessage(e.to_string()))?,
                None => std::time::SystemTime::now(),
            };
            Effect::Suspend {
                instance: instance_id.clone(),
                info: SuspendInfo {
                    suspend_id: field("suspendId")?,
                    reason: field("reason")?,
                    suspended_at,
                    metadata: suspend_info.get("metadata").cloned(),
                },
            }
        }
        other => {
            return Err(RunError::InvalidInstanceMessage(format!(
                "unsupported instance payload {other:?}"
            )));
        }
    })
}
