//! [`Charter`]: the static registry many machines share — nodes, tools,
//! transitions, packs and an optional system-prompt builder.
//!
//! Building a charter resolves every transition ref reachable from its nodes,
//! so an unknown ref is an error before any machine runs.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;

use markov_core::tool::{SharedTool, Tool};
use serde_json::Value;

use crate::define::error::ConfigError;
use crate::define::toolset::ToolSet;
use crate::loop_guard::LoopGuard;
use crate::node::Node;
use crate::pack::Pack;
use crate::transition::{NodeTarget, Transition};

/// An ancestor of the leaf a prompt or tool call is for.
#[derive(Debug, Clone, Copy)]
pub struct AncestorView<'a> {
    /// The ancestor's node.
    pub node: &'a Node,
    /// The ancestor's stored state.
    pub state: &'a Value,
}

/// What a system prompt is built from.
#[derive(Debug, Clone, Copy)]
pub struct PromptInput<'a> {
    /// The charter.
    pub charter: &'a Charter,
    /// The leaf's node.
    pub node: &'a Node,
    /// The leaf's state.
    pub state: &'a Value,
    /// Ancestors, root first.
    pub ancestors: &'a [AncestorView<'a>],
    /// Pack states by pack name.
    pub pack_states: &'a BTreeMap<String, Value>,
    /// The packs in force (the root's hoisted packs, else the node's own).
    pub packs: &'a [Pack],
    /// The 1-based step number of this run.
    pub current_step: usize,
    /// The run's step limit.
    pub max_steps: usize,
}

type PromptBuilderFn = dyn Fn(&PromptInput<'_>) -> String + Send + Sync;

/// Generated tool lists by (node, ancestors' nodes, worker): the list is a pure
/// function of the charter and those nodes, all immutable, so a step reuses it
/// instead of rebuilding schemas.
type ToolCacheKey = (markov_core::NodeId, Vec<markov_core::NodeId>, bool);

/// Entries kept before the cache starts over (inline nodes from general
/// transitions get fresh ids, so the key space is open).
const TOOL_CACHE_LIMIT: usize = 256;

struct CharterInner {
    name: String,
    tool_cache: std::sync::RwLock<
        std::collections::HashMap<
            ToolCacheKey,
            Arc<[markov_core::ToolDefinition]>,
            foldhash::fast::RandomState,
        >,
    >,
    instructions: Option<String>,
    tools: ToolSet,
    transitions: Vec<(String, Transition)>,
    nodes: Vec<(String, Node)>,
    packs: Vec<Pack>,
    prompt_builder: Option<Arc<PromptBuilderFn>>,
    prompt_style: PromptStyle,
    loop_guard: LoopGuard,
}

/// What the default system prompt and the built-in tools show a node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PromptStyle {
    /// Only what applies: the state section and `updateState` for a node
    /// that has state ([`Node::has_state`]) or a non-empty state, the
    /// transitions section for a node that has transitions. Empty sections
    /// cost tokens and confuse small models.
    #[default]
    Concise,
    /// Every section and `updateState` for every node, exactly as
    /// markov-machines writes them ("Current Node State {}", "Available
    /// Transitions None").
    Upstream,
}

/// The static, shareable registry. Cheap to clone.
#[derive(Clone)]
pub struct Charter(Arc<CharterInner>);

impl fmt::Debug for Charter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Charter")
            .field("name", &self.0.name)
            .field(
                "nodes",
                &self.0.nodes.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("tools", &self.0.tools.len())
            .finish_non_exhaustive()
    }
}

/// How deep refs may chain before we call it a cycle.
const MAX_REF_DEPTH: usize = 16;

impl Charter {
    /// A builder for a charter called `name`.
    pub fn builder(name: impl Into<String>) -> CharterBuilder {
        CharterBuilder {
            name: name.into(),
            instructions: None,
            tools: Vec::new(),
            transitions: Vec::new(),
            nodes: Vec::new(),
            packs: Vec::new(),
            prompt_builder: None,
            prompt_style: PromptStyle::default(),
            loop_guard: LoopGuard::default(),
            errors: Vec::new(),
        }
    }

    /// The loop guard of nodes that set none (three identical calls per
    /// user turn by default).
    pub fn loop_guard(&self) -> LoopGuard {
        self.0.loop_guard
    }

    /// The charter's name.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// What the default prompt and built-in tools show a node.
    pub fn prompt_style(&self) -> PromptStyle {
        self.0.prompt_style
    }

    /// Instructions prepended to every default system prompt.
    pub fn instructions(&self) -> Option<&str> {
        self.0.instructions.as_deref()
    }

    /// Charter-level tools, available to every node.
    pub fn tools(&self) -> &ToolSet {
        &self.0.tools
    }

    /// The transition registered as `name`.
    pub fn transition(&self, name: &str) -> Option<&Transition> {
        self.0
            .transitions
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
    }

    /// The node registered as `name`.
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.0
            .nodes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, node)| node)
    }

    /// The registered nodes with their keys, in registration order.
    pub fn nodes(&self) -> impl ExactSizeIterator<Item = (&str, &Node)> {
        self.0
            .nodes
            .iter()
            .map(|(name, node)| (name.as_str(), node))
    }

    /// The registered name of `node`, if it is registered.
    pub fn node_name(&self, node: &Node) -> Option<&str> {
        self.0
            .nodes
            .iter()
            .find(|(_, n)| n.id() == node.id())
            .map(|(name, _)| name.as_str())
    }

    /// Registered packs.
    pub fn packs(&self) -> &[Pack] {
        &self.0.packs
    }

    /// The pack called `name`.
    pub fn pack(&self, name: &str) -> Option<&Pack> {
        self.0.packs.iter().find(|p| p.name() == name)
    }

    /// The custom system-prompt builder, if any.
    pub fn prompt_builder(&self) -> Option<&PromptBuilderFn> {
        self.0.prompt_builder.as_deref()
    }

    /// The cached tool list for `node` under `ancestors`, or the one `make` builds.
    pub(crate) fn cached_tools(
        &self,
        node: &Node,
        ancestors: &[AncestorView<'_>],
        is_worker: bool,
        make: impl FnOnce() -> Result<Vec<markov_core::ToolDefinition>, ConfigError>,
    ) -> Result<Arc<[markov_core::ToolDefinition]>, ConfigError> {
        let key = (
            node.id().clone(),
            ancestors
                .iter()
                .map(|a| a.node.id().clone())
                .collect::<Vec<_>>(),
            is_worker,
        );
        if let Some(hit) = self
            .0
            .tool_cache
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(Arc::clone(hit));
        }
        let tools: Arc<[markov_core::ToolDefinition]> = make()?.into();
        let mut cache = self.0.tool_cache.write().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= TOOL_CACHE_LIMIT {
            cache.clear();
        }
        cache.insert(key, Arc::clone(&tools));
        Ok(tools)
    }

    /// Follows refs until a concrete transition.
    pub fn resolve_transition<'a>(
        &'a self,
        transition: &'a Transition,
    ) -> Result<&'a Transition, ConfigError> {
        let mut current = transition;
        for _ in 0..MAX_REF_DEPTH {
            let Transition::Ref(r) = current else {
                return Ok(current);
            };
            current = match r.split_once('.') {
                Some((node_name, t)) => {
                    let node = self
                        .node(node_name)
                        .ok_or_else(|| ConfigError::UnknownNodeInTransitionRef(r.clone()))?;
                    node.transition(t)
                        .ok_or_else(|| ConfigError::UnknownTransitionOnNode {
                            node: node_name.to_owned(),
                            transition: t.to_owned(),
                        })?
                }
                None => self
                    .transition(r)
                    .ok_or_else(|| ConfigError::UnknownTransitionRef(r.clone()))?,
            };
        }
        match current {
            Transition::Ref(r) => Err(ConfigError::UnknownTransitionRef(r.clone())),
            other => Ok(other),
        }
    }

    /// The node a target names.
    pub fn resolve_node(&self, target: &NodeTarget) -> Result<Node, ConfigError> {
        match target {
            NodeTarget::Inline(node) => Ok(node.clone()),
            NodeTarget::Ref(r) => self
                .node(r)
                .cloned()
                .ok_or_else(|| ConfigError::UnknownNodeRef(r.clone())),
        }
    }

    fn check_node(
        &self,
        node: &Node,
        seen: &mut HashSet<markov_core::NodeId>,
    ) -> Result<(), ConfigError> {
        if !seen.insert(node.id().clone()) {
            return Ok(());
        }
        for (_, t) in node.transitions() {
            self.check_transition(t, seen)?;
        }
        Ok(())
    }

    fn check_transition(
        &self,
        t: &Transition,
        seen: &mut HashSet<markov_core::NodeId>,
    ) -> Result<(), ConfigError> {
        if let Transition::Serial { target, .. } = self.resolve_transition(t)? {
            let node = self.resolve_node(target)?;
            self.check_node(&node, seen)?;
        }
        Ok(())
    }

    /// Checks every ref reachable from `node` (for nodes used outside the charter's registry).
    pub fn check(&self, node: &Node) -> Result<(), ConfigError> {
        self.check_node(node, &mut HashSet::new())
    }

    /// The ref under which the charter holds this very tool (same `Arc`):
    /// `"<tool>"` for a charter tool, `"<node>.<tool>"` for a charter node's.
    /// Used by serialization.
    pub fn tool_ref_of(&self, tool: &SharedTool) -> Option<String> {
        let name = tool.definition().name.as_str();
        if let Some(t) = self.0.tools.get(name)
            && Arc::ptr_eq(t, tool)
        {
            return Some(name.to_owned());
        }
        self.0.nodes.iter().find_map(|(node_name, node)| {
            node.tools()
                .get(name)
                .filter(|t| Arc::ptr_eq(t, tool))
                .map(|_| format!("{node_name}.{name}"))
        })
    }

    /// The ref under which the charter holds this code or general transition:
    /// `"<name>"` for a charter transition, `"<node>.<transition>"` for a
    /// charter node's. A code transition is matched by identity (same
    /// `Arc<CodeTransition>`); a general transition, which has no identity,
    /// by its description. `None` for serial transitions and refs.
    pub fn transition_ref_of(&self, transition: &Transition) -> Option<String> {
        let same = |t: &Transition| match (t, transition) {
            (Transition::Code(a), Transition::Code(b)) => Arc::ptr_eq(a, b),
            (Transition::General { description: a }, Transition::General { description: b }) => {
                a == b
            }
            _ => false,
        };
        if let Some((name, _)) = self.0.transitions.iter().find(|(_, t)| same(t)) {
            return Some(name.clone());
        }
        self.0.nodes.iter().find_map(|(node_name, node)| {
            node.transitions()
                .iter()
                .find(|(_, t)| same(t))
                .map(|(name, _)| format!("{node_name}.{name}"))
        })
    }

    /// The ref `"<node>.<command>"` under which a charter node holds this
    /// very command (same `Arc`, same name).
    pub fn command_ref_of(&self, command: &crate::command::SharedCommand) -> Option<String> {
        let name = command.name();
        self.0.nodes.iter().find_map(|(node_name, node)| {
            node.command(name)
                .filter(|c| Arc::ptr_eq(c, command))
                .map(|_| format!("{node_name}.{name}"))
        })
    }
}

/// Builds a [`Charter`].
pub struct CharterBuilder {
    name: String,
    instructions: Option<String>,
    tools: Vec<(String, SharedTool)>,
    transitions: Vec<(String, Transition)>,
    nodes: Vec<(String, Node)>,
    packs: Vec<Pack>,
    prompt_builder: Option<Arc<PromptBuilderFn>>,
    prompt_style: PromptStyle,
    loop_guard: LoopGuard,
    errors: Vec<ConfigError>,
}

impl fmt::Debug for CharterBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CharterBuilder")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl CharterBuilder {
    /// The loop guard of nodes that set none: how many identical tool
    /// calls a leaf may make per user turn ([`LoopGuard::OFF`] for no
    /// limit).
    #[must_use]
    pub fn loop_guard(mut self, guard: LoopGuard) -> Self {
        self.loop_guard = guard;
        self
    }

    /// Instructions prepended to every default system prompt.
    #[must_use]
    pub fn instructions(mut self, text: impl Into<String>) -> Self {
        self.instructions = Some(text.into());
        self
    }

    /// Registers a typed tool under its own name.
    #[must_use]
    pub fn tool<T: Tool>(mut self, tool: T) -> Self {
        match markov_core::tool::Erased::shared(tool) {
            Ok(t) => self.tools.push((T::NAME.to_owned(), t)),
            Err(e) => self.errors.push(e.into()),
        }
        self
    }

    /// Registers an erased tool under `key`, which must equal its name.
    #[must_use]
    pub fn shared_tool(mut self, key: impl Into<String>, tool: SharedTool) -> Self {
        self.tools.push((key.into(), tool));
        self
    }

    /// Registers a transition others can refer to by `name`.
    #[must_use]
    pub fn transition(mut self, name: impl Into<String>, transition: Transition) -> Self {
        self.transitions.push((name.into(), transition));
        self
    }

    /// Registers a node under `name`.
    #[must_use]
    pub fn node(mut self, name: impl Into<String>, node: Node) -> Self {
        self.nodes.push((name.into(), node));
        self
    }

    /// Registers a pack.
    #[must_use]
    pub fn pack(mut self, pack: Pack) -> Self {
        self.packs.push(pack);
        self
    }

    /// Replaces the default system prompt; the builder's output is used verbatim.
    #[must_use]
    pub fn system_prompt(
        mut self,
        builder: impl Fn(&PromptInput<'_>) -> String + Send + Sync + 'static,
    ) -> Self {
        self.prompt_builder = Some(Arc::new(builder));
        self
    }

    /// What the default prompt and the built-in tools show a node
    /// ([`PromptStyle::Concise`] unless set).
    #[must_use]
    pub fn prompt_style(mut self, style: PromptStyle) -> Self {
        self.prompt_style = style;
        self
    }

    /// Validates and freezes the charter.
    pub fn build(mut self) -> Result<Charter, ConfigError> {
        if let Some(e) = self.errors.drain(..).next() {
            return Err(e);
        }
        let mut tools = ToolSet::new();
        for (key, tool) in self.tools {
            let name = tool.definition().name.as_str();
            if key != name {
                return Err(ConfigError::CharterToolNameMismatch {
                    key,
                    name: name.to_owned(),
                });
            }
            tools.add_shared(tool)?;
        }
        let names = [
            self.nodes
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>(),
            self.transitions.iter().map(|(n, _)| n.as_str()).collect(),
            self.packs.iter().map(|p| p.name()).collect(),
        ];
        for list in names {
            if let Some(dup) = first_duplicate(&list) {
                return Err(ConfigError::DuplicateCharterEntry(dup.to_owned()));
            }
        }
        let charter = Charter(Arc::new(CharterInner {
            name: self.name,
            tool_cache: Default::default(),
            instructions: self.instructions,
            tools,
            transitions: self.transitions,
            nodes: self.nodes,
            packs: self.packs,
            prompt_builder: self.prompt_builder,
            prompt_style: self.prompt_style,
            loop_guard: self.loop_guard,
        }));
        let mut seen = HashSet::new();
        for (_, t) in &charter.0.transitions {
            charter.check_transition(t, &mut seen)?;
        }
        for (_, node) in &charter.0.nodes {
            charter.check_node(node, &mut seen)?;
        }
        Ok(charter)
    }
}

fn first_duplicate<'a>(names: &[&'a str]) -> Option<&'a str> {
    names
        .iter()
        .enumerate()
        .find(|(i, n)| names[..*i].contains(n))
        .map(|(_, n)| *n)
}
