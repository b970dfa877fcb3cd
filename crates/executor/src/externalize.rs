//! The machine's externalized-state runtime: which scopes are
//! registered, the hand-over of their `state` / `packState` messages, the
//! step notifications, and copying the handlers' writes into the tree.
//!
//! Registrations live on the [`Machine`](crate::Machine), never in the
//! serializable [`RunState`](crate::RunState). Handlers and callbacks are
//! plain synchronous calls; what they write with
//! [`ExternalContext::set_state`](markov_charter::externalize::ExternalContext::set_state)
//! is recorded in the context and copied into the tree, copy-on-write, as
//! soon as they return.

use std::sync::Arc;

use markov_charter::charter::Charter;
use markov_charter::externalize::{MutationEvent, Registration, Scope, StateHandler, StepInfo};
use markov_charter::state::StateSchema;
use markov_core::message::Message;
use serde_json::Value;

use crate::instance::Instance;

/// The registered scopes of one machine, in registration order.
#[derive(Debug, Default)]
pub(crate) struct Externals {
    registrations: Vec<Registration>,
    /// The last event's sequence number (per machine; the first event is 1).
    sequence: u64,
    /// Events collected since the last yielded step.
    unreported: Vec<MutationEvent>,
}

/// A scope the tree calls for: its handler, schema and current state.
struct Wanted {
    scope: Scope,
    handler: StateHandler,
    schema: Arc<dyn StateSchema>,
    state: Value,
}

fn empty() -> Value {
    Value::Object(serde_json::Map::new())
}

/// A pack's state: `packStates[name]`, else its initial state, else `{}`.
fn pack_state(root: &Instance, name: &str, initial: Option<&Value>) -> Value {
    root.pack_states
        .get(name)
        .filter(|s| !s.is_null())
        .or(initial.filter(|s| !s.is_null()))
        .cloned()
        .unwrap_or_else(empty)
}

/// The scopes the tree calls for: charter packs first, then the root's
/// packs (first handler per name wins), then every instance whose node has
/// a handler, pre-order.
fn wanted(charter: &Charter, root: &Arc<Instance>) -> Vec<Wanted> {
    let mut out: Vec<Wanted> = Vec::new();
    let root_id = root.id().clone();
    for pack in charter.packs().iter().chain(root.packs.iter()) {
        let Some(handler) = pack.externalize_handler() else {
            continue;
        };
        let id = Scope::pack_id(pack.name());
        if out.iter().any(|w| w.scope.id() == id) {
            continue;
        }
        out.push(Wanted {
            scope: Scope::pack(pack.name(), root_id.clone()),
            handler: handler.clone(),
            schema: pack.shared_schema(),
            state: pack_state(root, pack.name(), pack.initial_state()),
        });
    }
    // Walked in place (this runs every step, and most trees have no
    // handler at all). A tree too deep was refused when the machine was
    // made; a later one registers what the walk reached.
    fn walk(
        instance: &Instance,
        depth: usize,
        root_id: &markov_core::InstanceId,
        out: &mut Vec<Wanted>,
    ) {
        if depth > crate::MAX_TREE_DEPTH {
            return;
        }
        let node = instance.node();
        if let Some(handler) = node.externalize_handler() {
            let scope = Scope::node(instance.id().clone(), node.id().clone(), root_id.clone());
            if !out.iter().any(|w| w.scope.id() == scope.id()) {
                out.push(Wanted {
                    scope,
                    handler: handler.clone(),
                    schema: node.shared_schema(),
                    state: instance.state().clone(),
                });
            }
        }
        for child in &instance.children {
            walk(child, depth + 1, root_id, out);
        }
    }
    walk(root, 0, &root_id, &mut out);
    out
}

impl Externals {
    /// How many scopes are registered.
    pub(crate) fn len(&self) -> usize {
        self.registrations.len()
    }

    fn find(&self, scope_id: &str) -> Option<&Registration> {
        self.registrations
            .iter()
            .find(|r| r.scope().id() == scope_id)
    }

    /// Whether the scope `scope_id` is registered.
    pub(crate) fn is_registered(&self, scope_id: &str) -> bool {
        self.find(scope_id).is_some()
    }

    /// Synchronises the registrations with the tree: writes are copied in,
    /// scopes that vanished or whose handler changed are dropped (their
    /// cleanup runs), new scopes are registered (handler, then hydrate).
    pub(crate) fn sync(&mut self, charter: &Charter, root: &mut Arc<Instance>) {
        self.apply_writes(root);
        let wanted = wanted(charter, root);
        self.registrations.retain(|r| {
            wanted
                .iter()
                .any(|w| w.scope.id() == r.scope().id() && w.handler.same(r.handler()))
        });
        for w in wanted {
            if let Some(existing) = self.find(w.scope.id()) {
                existing.refresh(&w.state);
                continue;
            }
            let id = w.scope.id().to_owned();
            match w.handler.register(w.scope, w.schema, w.state) {
                Ok(registration) => {
                    self.registrations.push(registration);
                    self.apply_writes(root);
                }
                Err(e) => tracing::warn!(
                    scope = %id,
                    error = %e,
                    "externalized state handler failed; the scope is not registered"
                ),
            }
        }
    }

    /// Copies every recorded `set_state` write into the tree.
    pub(crate) fn apply_writes(&self, root: &mut Arc<Instance>) {
        for r in &self.registrations {
            let Some(state) = r.take_write() else {
                continue;
            };
            match r.scope() {
                Scope::Pack { pack_name, .. } => {
                    Arc::make_mut(root)
                        .pack_states
                        .insert(pack_name.clone(), state);
                }
                Scope::Node { instance_id, .. } => {
                    let found =
                        Instance::update(root, instance_id, &mut |i| i.state = state.clone());
                    if !found {
                        tracing::warn!(
                            instance = %instance_id,
                            "externalized state written for an instance no longer in the tree"
                        );
                    }
                }
                _ => {}
            }
        }
    }

    /// Hands a `state` / `packState` message to its scope's registration:
    /// builds the event, calls the mutation callbacks, copies their writes
    /// into the tree and keeps the event for the next step. Returns false
    /// when the scope is not registered (the message is then applied).
    pub(crate) fn hand_over(
        &mut self,
        root: &mut Arc<Instance>,
        scope_id: &str,
        patch: &Value,
        message: &Message,
        step_number: usize,
    ) -> bool {
        let Some(pos) = self
            .registrations
            .iter()
            .position(|r| r.scope().id() == scope_id)
        else {
            return false;
        };
        self.sequence += 1;
        let registration = &self.registrations[pos];
        let current = match registration.scope() {
            Scope::Pack { pack_name, .. } => root
                .pack_states
                .get(pack_name)
                .filter(|s| !s.is_null())
                .cloned(),
            Scope::Node { instance_id, .. } => root.find(instance_id).map(|i| i.state().clone()),
            _ => None,
        };
        if let Some(current) = &current {
            registration.refresh(current);
        }
        let state = current.unwrap_or_else(|| registration.context().state());
        let event = MutationEvent::new(
            registration.scope().clone(),
            state,
            patch.clone(),
            message.clone(),
            step_number,
            self.sequence,
        );
        registration.dispatch_mutation(&event);
        self.apply_writes(root);
        self.unreported.push(event);
        true
    }

    /// Before a step is yielded: every registration's step callbacks receive
    /// the step and the events of its scope since the last yielded step.
    pub(crate) fn notify_step(&mut self, root: &mut Arc<Instance>, step: &StepInfo<'_>) {
        let events = std::mem::take(&mut self.unreported);
        for r in &self.registrations {
            let mine: Vec<MutationEvent> = events
                .iter()
                .filter(|e| e.scope.id() == r.scope().id())
                .cloned()
                .collect();
            r.notify_step(step, &mine);
        }
        self.apply_writes(root);
    }
}
