//! The apply phase: the queued effects of a step resolved, and applied to
//! the tree in order, copy-on-write, once every leaf has finished.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use markov_charter::externalize::{Scope, StepInfo};
use markov_charter::state::merge_patch;
use markov_charter::transition::CedeContent;
use markov_core::message::{Item, Message};
use markov_core::{InstanceId, Role};
use serde_json::Value;

use crate::effect::{Effect, Entry};
use crate::error::RunError;
use crate::instance::Instance;
use crate::machine::{Machine, hoist_packs};
use crate::step::MachineStep;
/// What the apply phase found.
#[derive(Debug, Default)]
pub(super) struct Applied {
    /// The instances that ceded, in order, with what they ceded.
    pub(super) cedes: Vec<(InstanceId, Option<CedeContent>)>,
}

/// An effect with the message that recorded it (kept for `state` /
/// `packState`, which an externalized scope receives as an event).
pub(super) type Resolved = (Effect, Option<Message>);

/// Applies effects in order, copy-on-write. Never validates.
/// A `state` / `packState` effect of an externalized scope is handed over
/// instead of applied; registrations are re-synchronised at the end.
pub(super) fn apply(machine: &mut Machine, effects: &[Resolved], step_number: usize) {
    let Machine {
        root,
        externals,
        charter,
        history,
        replayable_ids,
        ..
    } = machine;
    // Writes made outside callbacks since the last sync land first.
    externals.apply_writes(root);
    let mut writes: HashMap<String, usize> = HashMap::new();
    let mut note_write = |key: String| {
        let n = writes.entry(key.clone()).or_insert(0);
        *n += 1;
        if *n > 1 {
            tracing::warn!(scope = %key, writes = *n, "state updated {n} times, last write wins");
        }
    };
    for (effect, message) in effects {
        match effect {
            Effect::State { instance, patch } => {
                note_write(format!("instance:{instance}"));
                if let Some(message) = message
                    && externals.hand_over(
                        root,
                        &Scope::node_id_of(instance),
                        patch,
                        message,
                        step_number,
                    )
                {
                    continue;
                }
                Instance::update(root, instance, &mut |i| {
                    if let Ok(merged) = merge_patch(&i.state, patch) {
                        i.state = merged;
                    }
                });
            }
            Effect::PackState { pack, patch } => {
                note_write(format!("pack:{pack}"));
                if let Some(message) = message
                    && externals.hand_over(root, &Scope::pack_id(pack), patch, message, step_number)
                {
                    continue;
                }
                let r = Arc::make_mut(root);
                let current = r.pack_states.get(pack).cloned().unwrap_or(Value::Null);
                if let Ok(merged) = merge_patch(&current, patch) {
                    r.pack_states.insert(pack.clone(), merged);
                }
            }
            Effect::Transition {
                instance,
                node,
                state,
            } => {
                hoist_packs(root, std::iter::once(node));
                Instance::update(root, instance, &mut |i| {
                    i.node = node.clone();
                    i.state = state.clone();
                    i.children.clear();
                });
            }
            Effect::Spawn { parent, children } => {
                hoist_packs(root, children.iter().map(|(n, _)| n));
                let mut ids = Vec::new();
                if *replayable_ids {
                    for at in 0..children.len() {
                        ids.push(replayable_id(root, parent, history.len(), at, &ids));
                    }
                }
                Instance::update(root, parent, &mut |i| {
                    for (at, (node, state)) in children.iter().enumerate() {
                        let child = match ids.get(at) {
                            Some(id) => Instance::with_id(id.clone(), node.clone(), state.clone()),
                            None => Instance::new(node.clone(), state.clone()),
                        };
                        i.children.push(Arc::new(child));
                    }
                });
            }
            Effect::Cede { instance, .. } => {
                if root.id() == instance {
                    tracing::warn!(instance = %instance, "cannot remove the root instance");
                } else {
                    Instance::remove(root, instance);
                }
            }
            Effect::Suspend { instance, info } => {
                Instance::update(root, instance, &mut |i| i.suspended = Some(info.clone()));
            }
        }
    }
    externals.sync(charter, root);
}

/// The id of the `at`-th child spawned under `parent` over a history of
/// `len` messages, for a machine whose spawned ids must be the same when
/// it runs again: `<parent>.<len>.<at>`, followed by `.<n>`, the first
/// free, when that names an instance already in the tree (or one of
/// `taken`, the effect's earlier children), such as one spawned by another
/// call of the same step.
fn replayable_id(
    root: &Arc<Instance>,
    parent: &InstanceId,
    len: usize,
    at: usize,
    taken: &[InstanceId],
) -> InstanceId {
    let base = format!("{parent}.{len}.{at}");
    let free = |id: &InstanceId| root.find(id).is_none() && !taken.contains(id);
    let first = InstanceId::new(base.clone());
    if free(&first) {
        return first;
    }
    (1usize..)
        .map(|n| InstanceId::new(format!("{base}.{n}")))
        .find(free)
        .unwrap_or(first)
}

/// Tells the externalized scopes about a step about to be yielded.
pub(super) fn announce(machine: &mut Machine, step: &MachineStep, step_number: usize) {
    let info = StepInfo::new(
        step_number,
        step.yield_reason.as_str(),
        step.done,
        &step.history,
    );
    machine.externals.notify_step(&mut machine.root, &info);
}

pub(super) fn cedes_of(effects: &[Resolved]) -> Applied {
    Applied {
        cedes: effects
            .iter()
            .filter_map(|(e, _)| match e {
                Effect::Cede { instance, content } => Some((instance.clone(), content.clone())),
                _ => None,
            })
            .collect(),
    }
}

/// Collapses ephemerals sharing a `singleton` key to the last one, counting frames.
pub(super) fn collapse_ephemerals(entries: Vec<Entry>) -> Vec<Entry> {
    let mut counts: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        if e.message.role == Role::Ephemeral
            && let Some(key) = e
                .message
                .metadata
                .as_ref()
                .and_then(|m| m.singleton.clone())
        {
            let c = counts.entry(key).or_insert((i, 0));
            c.0 = i;
            c.1 += 1;
        }
    }
    if counts.is_empty() {
        return entries;
    }
    entries
        .into_iter()
        .enumerate()
        .filter_map(|(i, mut e)| {
            let key = e
                .message
                .metadata
                .as_ref()
                .and_then(|m| m.singleton.clone())
                .filter(|_| e.message.role == Role::Ephemeral);
            match key.and_then(|k| counts.get(&k).copied()) {
                Some((last, _)) if last != i => None,
                Some((_, n)) => {
                    if let Some(m) = e.message.make_mut().metadata.as_mut() {
                        m.singleton_frame_count = Some(n);
                    }
                    Some(e)
                }
                None => Some(e),
            }
        })
        .collect()
}

/// The effects of a drained batch. When one entry cannot be resolved, the
/// batch goes back to the front of the queue without it and the error hands
/// that entry back: nothing is lost, and the next run is not stuck on it.
/// The effect of one queued entry, with the message a state effect keeps.
pub(super) fn resolve_effect(machine: &Machine, e: &Entry) -> Result<Option<Resolved>, RunError> {
    Ok(e.resolve_effect(&machine.charter)?.map(|effect| {
        let message = matches!(effect, Effect::State { .. } | Effect::PackState { .. })
            .then(|| e.message.clone());
        (effect, message)
    }))
}

pub(super) fn resolve_effects(
    machine: &Machine,
    entries: &mut Vec<Entry>,
) -> Result<Vec<Resolved>, RunError> {
    let mut effects = Vec::new();
    for (index, e) in entries.iter().enumerate() {
        match resolve_effect(machine, e) {
            Ok(resolved) => effects.extend(resolved),
            Err(error) => {
                let mut rest = std::mem::take(entries);
                let refused = rest.remove(index);
                machine.queue.requeue_front(rest);
                return Err(RunError::RefusedInstanceMessage {
                    reason: error.to_string(),
                    message: Box::new(refused.message),
                });
            }
        }
    }
    Ok(effects)
}

/// The first resume request of a batch: its position, instance and suspend id.
pub(super) fn resume_request(entries: &[Entry]) -> Option<(usize, InstanceId, String)> {
    entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.message.role == Role::System)
        .find_map(|(at, e)| {
            e.message.item_list().iter().find_map(|i| match i {
                Item::Resume {
                    instance_id,
                    suspend_id,
                } => Some((at, instance_id.clone(), suspend_id.clone())),
                _ => None,
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use markov_charter::node::Node;
    use serde_json::json;

    #[test]
    fn a_replayable_id_names_where_it_was_spawned_and_never_an_instance_already_there() {
        let node = Node::builder("Work.").build().expect("node");
        let root_id = InstanceId::new("sub-a");
        let mut root = Arc::new(Instance::with_id(root_id.clone(), node.clone(), json!({})));
        let first = replayable_id(&root, &root_id, 4, 0, &[]);
        assert_eq!(first.as_str(), "sub-a.4.0");
        assert_eq!(
            replayable_id(&root, &root_id, 4, 0, &[]),
            first,
            "the same every time"
        );
        // The effect's earlier children and the tree's instances are taken.
        let second = replayable_id(&root, &root_id, 4, 0, std::slice::from_ref(&first));
        assert_eq!(second.as_str(), "sub-a.4.0.1");
        Instance::update(&mut root, &root_id, &mut |i| {
            i.children.push(Arc::new(Instance::with_id(
                first.clone(),
                node.clone(),
                json!({}),
            )));
        });
        assert_eq!(
            replayable_id(&root, &root_id, 4, 0, std::slice::from_ref(&second)).as_str(),
            "sub-a.4.0.2"
        );
    }
}
