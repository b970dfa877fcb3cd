//! The instance tree: nodes with their state, shared copy-on-write.
//!
//! Children are `Arc<Instance>`: changing one instance copies only the path
//! from the root to it, so a [`MachineStep`](crate::MachineStep)'s snapshot of
//! the tree stays valid and cheap.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use markov_charter::node::Node;
use markov_charter::pack::Pack;
use markov_charter::tool_choice::ToolChoiceRule;
use markov_core::InstanceId;
use serde_json::{Value, json};

use crate::error::RunError;

/// How deep a tree may be before traversal gives up (a cycle is suspected).
pub const MAX_TREE_DEPTH: usize = 100;

/// Why and since when an instance is suspended.
#[derive(Debug, Clone, PartialEq)]
pub struct SuspendInfo {
    /// The id a resume must name.
    pub suspend_id: String,
    /// Why.
    pub reason: String,
    /// When.
    pub suspended_at: SystemTime,
    /// Application data.
    pub metadata: Option<Value>,
}

impl SuspendInfo {
    /// The wire form (`suspendedAt` as ISO-8601 with milliseconds). A time
    /// outside 1970..=9999, which RFC 3339 cannot write, is clamped to that range.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "suspendId": self.suspend_id,
            "reason": self.reason,
            "suspendedAt": humantime::format_rfc3339_millis(clamp_rfc3339(self.suspended_at)).to_string(),
        });
        if let (Some(meta), Value::Object(map)) = (&self.metadata, &mut v) {
            map.insert("metadata".into(), meta.clone());
        }
        v
    }
}

/// The last instant RFC 3339 can write: 9999-12-31T23:59:59.999Z.
const MAX_RFC3339_SECS: u64 = 253_402_300_799;

/// Clamps `t` into the range `humantime` formats (it panics outside it).
fn clamp_rfc3339(t: SystemTime) -> SystemTime {
    let max =
        SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(MAX_RFC3339_SECS * 1000 + 999);
    t.clamp(SystemTime::UNIX_EPOCH, max)
}

/// A node with its state, in the tree.
#[derive(Debug, Clone)]
pub struct Instance {
    pub(crate) id: InstanceId,
    pub(crate) node: Node,
    pub(crate) state: Value,
    pub(crate) children: Vec<Arc<Instance>>,
    pub(crate) suspended: Option<SuspendInfo>,
    pub(crate) pack_states: BTreeMap<String, Value>,
    pub(crate) packs: Vec<Pack>,
    pub(crate) tool_choice: Option<ToolChoiceRule>,
}

/// One active leaf: the path from the root to it. Only the tree builds one
/// ([`Instance::active_leaves`]), so the path is never empty.
#[derive(Debug, Clone)]
pub struct ActiveLeaf {
    path: LeafPath,
    leaf_index: Vec<usize>,
    is_worker: bool,
}

/// Root … leaf. A one-instance tree, the common case, needs no list.
#[derive(Debug, Clone)]
enum LeafPath {
    Root(Arc<Instance>),
    Nested(Vec<Arc<Instance>>),
}

impl ActiveLeaf {
    /// Root … leaf (never empty).
    pub fn path(&self) -> &[Arc<Instance>] {
        match &self.path {
            LeafPath::Root(root) => std::slice::from_ref(root),
            LeafPath::Nested(path) => path,
        }
    }

    /// Child indices from the root (`[]` for the root).
    pub fn leaf_index(&self) -> &[usize] {
        &self.leaf_index
    }

    /// Whether the leaf's node is a worker.
    pub fn is_worker(&self) -> bool {
        self.is_worker
    }

    /// The root.
    pub fn root(&self) -> &Arc<Instance> {
        &self.path()[0]
    }

    /// The leaf.
    pub fn leaf(&self) -> &Arc<Instance> {
        let path = self.path();
        &path[path.len() - 1]
    }

    /// Everything above the leaf, root first.
    pub fn ancestors(&self) -> &[Arc<Instance>] {
        let path = self.path();
        &path[..path.len() - 1]
    }
}

impl Instance {
    /// A new instance with a fresh uuid.
    pub fn new(node: Node, state: Value) -> Self {
        Self::with_id(
            InstanceId::new(uuid::Uuid::new_v4().to_string()),
            node,
            state,
        )
    }

    /// A new instance with a given id.
    pub fn with_id(id: InstanceId, node: Node, state: Value) -> Self {
        Instance {
            id,
            node,
            state,
            children: Vec::new(),
            suspended: None,
            pack_states: BTreeMap::new(),
            packs: Vec::new(),
            tool_choice: None,
        }
    }

    /// Overrides the node's tool-choice rule for this instance only
    /// (instance > node). Kept across transitions of this instance.
    #[must_use]
    pub fn with_tool_choice(mut self, policy: ToolChoiceRule) -> Self {
        self.tool_choice = Some(policy);
        self
    }

    /// The tool-choice rule in force: the instance's override, else the node's.
    pub fn tool_choice(&self) -> &ToolChoiceRule {
        self.tool_choice
            .as_ref()
            .unwrap_or(&self.node.policy().tool_choice)
    }

    /// Adds a child (builder style).
    #[must_use]
    pub fn with_child(mut self, child: Instance) -> Self {
        self.children.push(Arc::new(child));
        self
    }

    /// Marks the instance suspended (builder style).
    #[must_use]
    pub fn with_suspended(mut self, info: SuspendInfo) -> Self {
        self.suspended = Some(info);
        self
    }

    /// The instance id.
    pub fn id(&self) -> &InstanceId {
        &self.id
    }

    /// The node.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The state.
    pub fn state(&self) -> &Value {
        &self.state
    }

    /// The state deserialized into `S`.
    pub fn state_as<S: serde::de::DeserializeOwned>(&self) -> Result<S, serde_json::Error> {
        S::deserialize(&self.state)
    }

    /// The children, in order.
    pub fn children(&self) -> &[Arc<Instance>] {
        &self.children
    }

    /// Suspension, if suspended.
    pub fn suspended(&self) -> Option<&SuspendInfo> {
        self.suspended.as_ref()
    }

    /// Pack states (on the root).
    pub fn pack_states(&self) -> &BTreeMap<String, Value> {
        &self.pack_states
    }

    /// Packs in force (on the root).
    pub fn packs(&self) -> &[Pack] {
        &self.packs
    }

    /// Whether the node is a worker.
    pub fn is_worker(&self) -> bool {
        self.node.is_worker()
    }

    /// The path root … active instance, following the last child at every level.
    pub fn active_path(self: &Arc<Self>) -> Vec<Arc<Instance>> {
        let mut path = vec![Arc::clone(self)];
        while let Some(last) = path[path.len() - 1].children.last() {
            let last = Arc::clone(last);
            path.push(last);
        }
        path
    }

    /// The active instance (last child at every level).
    pub fn active(self: &Arc<Self>) -> Arc<Instance> {
        let mut current = Arc::clone(self);
        while let Some(last) = current.children.last().cloned() {
            current = last;
        }
        current
    }

    /// Every instance, pre-order.
    pub fn all(self: &Arc<Self>) -> Result<Vec<Arc<Instance>>, RunError> {
        fn walk(
            i: &Arc<Instance>,
            depth: usize,
            out: &mut Vec<Arc<Instance>>,
        ) -> Result<(), RunError> {
            if depth > MAX_TREE_DEPTH {
                return Err(RunError::TreeTooDeep);
            }
            if out.iter().any(|seen| seen.id == i.id) {
                return Err(RunError::Cycle(i.id.clone()));
            }
            out.push(Arc::clone(i));
            for c in &i.children {
                walk(c, depth + 1, out)?;
            }
            Ok(())
        }
        let mut out = Vec::new();
        walk(self, 0, &mut out)?;
        Ok(out)
    }

    /// The active leaves, left to right; a suspended instance prunes its subtree.
    pub fn active_leaves(self: &Arc<Self>) -> Vec<ActiveLeaf> {
        let mut out = Vec::new();
        self.for_each_active_leaf(&mut |leaf| out.push(leaf));
        out
    }

    /// [`Self::active_leaves`], handed over one at a time (a step builds its
    /// tasks from them without a list in between).
    pub(crate) fn for_each_active_leaf(self: &Arc<Self>, f: &mut dyn FnMut(ActiveLeaf)) {
        fn walk(
            path: &mut Vec<Arc<Instance>>,
            index: &mut Vec<usize>,
            f: &mut dyn FnMut(ActiveLeaf),
        ) {
            let current = Arc::clone(&path[path.len() - 1]);
            if current.suspended.is_some() || path.len() > MAX_TREE_DEPTH {
                return;
            }
            if current.children.is_empty() {
                f(ActiveLeaf {
                    path: LeafPath::Nested(path.clone()),
                    leaf_index: index.clone(),
                    is_worker: current.is_worker(),
                });
                return;
            }
            for (i, child) in current.children.iter().enumerate() {
                path.push(Arc::clone(child));
                index.push(i);
                walk(path, index, f);
                path.pop();
                index.pop();
            }
        }
        if self.children.is_empty() {
            // The common one-instance tree, without the walk's scratch path.
            if self.suspended.is_none() {
                f(ActiveLeaf {
                    path: LeafPath::Root(Arc::clone(self)),
                    leaf_index: Vec::new(),
                    is_worker: self.is_worker(),
                });
            }
            return;
        }
        walk(&mut vec![Arc::clone(self)], &mut Vec::new(), f);
    }

    /// Suspended instances, pre-order.
    pub fn suspended_instances(self: &Arc<Self>) -> Vec<Arc<Instance>> {
        let mut out = Vec::new();
        let mut stack = vec![Arc::clone(self)];
        while let Some(i) = stack.pop() {
            if i.suspended.is_some() {
                out.push(Arc::clone(&i));
            }
            stack.extend(i.children.iter().rev().cloned());
        }
        out
    }

    /// The instance with `id`.
    pub fn find(self: &Arc<Self>, id: &InstanceId) -> Option<Arc<Instance>> {
        if self.id == *id {
            return Some(Arc::clone(self));
        }
        self.children.iter().find_map(|c| c.find(id))
    }

    /// Changes the instance `id` copy-on-write. Returns false when not found.
    pub(crate) fn update(
        root: &mut Arc<Instance>,
        id: &InstanceId,
        f: &mut dyn FnMut(&mut Instance),
    ) -> bool {
        if root.id == *id {
            f(Arc::make_mut(root));
            return true;
        }
        let Some(pos) = root.children.iter().position(|c| c.find(id).is_some()) else {
            return false;
        };
        let node = Arc::make_mut(root);
        Instance::update(&mut node.children[pos], id, f)
    }

    /// Removes the instance `id` (not the root). Returns false when not found.
    pub(crate) fn remove(root: &mut Arc<Instance>, id: &InstanceId) -> bool {
        if let Some(pos) = root.children.iter().position(|c| c.id == *id) {
            Arc::make_mut(root).children.remove(pos);
            return true;
        }
        let Some(pos) = root.children.iter().position(|c| c.find(id).is_some()) else {
            return false;
        };
        Instance::remove(&mut Arc::make_mut(root).children[pos], id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn suspension_times_outside_rfc3339_do_not_panic() {
        let info = |t| SuspendInfo {
            suspend_id: "s".into(),
            reason: "r".into(),
            suspended_at: t,
            metadata: None,
        };
        let before = SystemTime::UNIX_EPOCH - Duration::from_secs(10);
        assert_eq!(
            info(before).to_json()["suspendedAt"],
            "1970-01-01T00:00:00.000Z"
        );
        let after = SystemTime::UNIX_EPOCH + Duration::from_secs(MAX_RFC3339_SECS * 2);
        assert_eq!(
            info(after).to_json()["suspendedAt"],
            "9999-12-31T23:59:59.999Z"
        );
    }
}
