//! Where a call's tool is found, and the state it sees.
//!
//! A call is resolved as the pipeline dispatches it: the node, its
//! ancestors (nearest first), the charter, the node's packs (not for a
//! worker), then the registry. The tool sees a snapshot of the state of
//! the level it was found on and writes through that level's schema; an
//! ancestor's state is read-only.

use std::collections::BTreeMap;
use std::sync::Mutex;

use markov_charter::charter::{AncestorView, Charter};
use markov_charter::node::Node;
use markov_charter::pack::Pack;
use markov_charter::state::{StateSchema, accumulate_patch, merge_patch};
use markov_core::tool::{Delivery, SharedTool, StateAccess, StateUpdateError};
use serde_json::{Map, Value};

use super::pipeline::LeafView;

/// Whose state a tool call writes to.
pub(super) enum Scope<'a> {
    Current,
    Ancestor(&'a Value),
}

/// A state a tool sees as a snapshot and writes through validation.
pub(super) struct ScopedState<'s> {
    snapshot: Value,
    running: Mutex<Value>,
    patch: Mutex<Option<Value>>,
    refused: Mutex<Option<String>>,
    schema: Option<&'s dyn StateSchema>,
}

impl<'s> ScopedState<'s> {
    pub(super) fn writable(snapshot: Value, schema: &'s dyn StateSchema) -> Self {
        ScopedState {
            running: Mutex::new(snapshot.clone()),
            snapshot,
            patch: Mutex::new(None),
            refused: Mutex::new(None),
            schema: Some(schema),
        }
    }

    pub(super) fn read_only(snapshot: Value) -> Self {
        ScopedState {
            running: Mutex::new(snapshot.clone()),
            snapshot,
            patch: Mutex::new(None),
            refused: Mutex::new(None),
            schema: None,
        }
    }

    pub(super) fn take(self) -> (Value, Option<Value>, Option<String>) {
        (
            self.running.into_inner().unwrap_or_else(|p| p.into_inner()),
            self.patch.into_inner().unwrap_or_else(|p| p.into_inner()),
            self.refused.into_inner().unwrap_or_else(|p| p.into_inner()),
        )
    }
}

impl StateAccess for ScopedState<'_> {
    fn state(&self) -> &Value {
        &self.snapshot
    }

    fn update_state(&self, patch: Value) -> Result<(), StateUpdateError> {
        let Some(schema) = self.schema else {
            return Err(StateUpdateError::Ancestor);
        };
        let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let merged = merge_patch(&running, &patch)?;
        match schema.parse(&merged) {
            Ok(parsed) => {
                *running = parsed;
                accumulate_patch(
                    &mut self.patch.lock().unwrap_or_else(|p| p.into_inner()),
                    &patch,
                );
                *self.refused.lock().unwrap_or_else(|p| p.into_inner()) = None;
                Ok(())
            }
            Err(message) => {
                *self.refused.lock().unwrap_or_else(|p| p.into_inner()) = Some(message.clone());
                Err(StateUpdateError::Invalid(message))
            }
        }
    }
}

/// Where a tool was found.
pub(super) enum Found<'a> {
    Node(&'a SharedTool, Scope<'a>),
    Pack(&'a SharedTool, &'a Pack),
}

/// Whether `name` resolves to a provider built-in tool: the node, then each ancestor (nearest first), is searched as
/// [`resolve`] does, and the first level that declares the name decides. The
/// charter and packs declare no provider tools.
pub(super) fn is_provider_tool(leaf: &LeafView<'_>, name: &str) -> bool {
    let levels = std::iter::once(leaf.node).chain(leaf.ancestors.iter().rev().map(|a| a.node));
    for node in levels {
        if node.tools().get(name).is_some() {
            return false;
        }
        if node.provider_tool(name).is_some() {
            return true;
        }
    }
    false
}

pub(super) fn resolve<'a>(leaf: &LeafView<'a>, name: &str) -> Option<Found<'a>> {
    find(
        leaf.charter,
        leaf.node,
        leaf.ancestors,
        leaf.is_worker,
        name,
    )
    // A tool registered only in the registry runs like a charter tool.
    .or_else(|| {
        let t = leaf.policies.and_then(|p| p.registry.tool(name))?;
        Some(Found::Node(t, Scope::Current))
    })
}

/// [`resolve`] without a registry: the node, its ancestors (nearest
/// first), the charter, then the node's packs (not for a worker).
fn find<'a>(
    charter: &'a Charter,
    node: &'a Node,
    ancestors: &'a [AncestorView<'a>],
    is_worker: bool,
    name: &str,
) -> Option<Found<'a>> {
    if let Some(t) = node.tools().get(name) {
        return Some(Found::Node(t, Scope::Current));
    }
    for ancestor in ancestors.iter().rev() {
        if let Some(t) = ancestor.node.tools().get(name) {
            // An ancestor sharing the leaf's node definition counts as current.
            let scope = if ancestor.node.id() == node.id() {
                Scope::Current
            } else {
                Scope::Ancestor(ancestor.state)
            };
            return Some(Found::Node(t, scope));
        }
    }
    if let Some(t) = charter.tools().get(name) {
        return Some(Found::Node(t, Scope::Current));
    }
    if !is_worker {
        for pack in node.packs() {
            if let Some(t) = pack.tools().get(name) {
                return Some(Found::Pack(t, pack));
            }
        }
    }
    None
}

/// Whether a call of `names` by a leaf without a registry (its `node`
/// under `ancestors`) may pause the step or must run at most once: its
/// tool needs the application's approval, or must never run twice. Such
/// an answer is recorded before its calls run, and they keep the ledger,
/// so that a resumed step answers what ran.
pub(crate) fn may_pause<'n>(
    charter: &Charter,
    node: &Node,
    ancestors: &[AncestorView<'_>],
    is_worker: bool,
    mut names: impl Iterator<Item = &'n str>,
) -> bool {
    names.any(
        |name| match find(charter, node, ancestors, is_worker, name) {
            Some(Found::Node(tool, _) | Found::Pack(tool, _)) => {
                let definition = tool.definition();
                definition.needs_approval
                    || definition.delivery == Some(Delivery::AtMostOnce)
                    || tool.may_pause()
            }
            None => false,
        },
    )
}

pub(super) fn pack_state(
    running: &BTreeMap<String, Value>,
    stored: &BTreeMap<String, Value>,
    pack: &Pack,
) -> Value {
    running
        .get(pack.name())
        .or_else(|| stored.get(pack.name()))
        .or_else(|| pack.initial_state())
        .cloned()
        .unwrap_or_else(|| Value::Object(Map::new()))
}
