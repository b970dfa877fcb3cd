//! Taking a transition: what a queued transition of one response does to the
//! instance tree, decided (code transitions run here) but not applied.

use serde_json::Value;

use markov_charter::ConfigError;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_charter::serial::node_from_json;
use markov_charter::transition::{
    NodeTarget, Transition, TransitionError, TransitionInput, TransitionOutcome, TransitionResult,
};

/// Takes the transition `name` of `node`, given the running state after this turn's updates.
pub(crate) async fn take_transition(
    charter: &Charter,
    node: &Node,
    state: &Value,
    name: &str,
    reason: &str,
    args: &Value,
) -> Result<TransitionOutcome, TransitionError> {
    let declared = node
        .transition(name)
        .ok_or_else(|| TransitionError::Unknown(name.to_owned()))?;
    let result = match charter.resolve_transition(declared)? {
        Transition::Code(code) => code
            .execute(TransitionInput {
                state: state.clone(),
                args: args.clone(),
                reason: reason.to_owned(),
            })
            .await
            .map_err(TransitionError::Code)?,
        Transition::General { .. } => {
            let inline = args.get("node").ok_or(TransitionError::GeneralNeedsNode)?;
            let target = node_from_json(charter, inline)?;
            TransitionResult::To {
                node: NodeTarget::Inline(target),
                state: None,
            }
        }
        Transition::Serial { target, .. } => TransitionResult::To {
            node: target.clone(),
            state: None,
        },
        Transition::Ref(r) => {
            return Err(ConfigError::UnknownTransitionRef(r.clone()).into());
        }
    };
    Ok(match result {
        TransitionResult::To {
            node: target,
            state,
        } => {
            let target = charter.resolve_node(&target)?;
            let state = state
                .or_else(|| target.initial_state().cloned())
                .ok_or(TransitionError::NoState)?;
            if target.id() == node.id() {
                TransitionOutcome::Stay
            } else {
                TransitionOutcome::To {
                    node: target,
                    state,
                }
            }
        }
        TransitionResult::Spawn(children) => TransitionOutcome::Spawn(
            children
                .into_iter()
                .map(|c| {
                    let node = charter.resolve_node(&c.node)?;
                    let state = c
                        .state
                        .or_else(|| node.initial_state().cloned())
                        .unwrap_or_else(|| Value::Object(serde_json::Map::new()));
                    Ok((node, state))
                })
                .collect::<Result<_, ConfigError>>()?,
        ),
        TransitionResult::Cede(content) => TransitionOutcome::Cede(content),
        TransitionResult::Suspend {
            suspend_id,
            reason,
            metadata,
        } => TransitionOutcome::Suspend {
            suspend_id,
            reason,
            metadata,
        },
    })
}
