//! The system prompt, plus the "Terminal Tools" section of the new rules.
//!
//! [`system_prompt`] returns the charter's custom builder output verbatim when
//! the charter has one, and otherwise the default prompt below, prefixed with
//! `<charter instructions>\n\n` when the charter has non-empty instructions.
//! Sections are separated by exactly one blank line and the prompt has no
//! trailing newline:
//!
//! ````text
//! <node instructions>
//!
//! ## Current Node State
//! ```json
//! <state, pretty JSON>
//! ```
//!
//! ## Available Transitions
//! - **<name>**: <description>
//!
//! **Important**: After calling a transition tool, ...
//!
//! ## Terminal Tools                        (only if a terminal tool is offered)
//! These tools generate your final response:
//! - <name>: <description>
//!
//! When you call a terminal tool, its output IS your response. Do not add text after calling one.
//!
//! ## Ancestor Context                      (only if there are ancestors)
//! ### Ancestor 2: <first 100 chars of the root's instructions>...
//! State: <pretty JSON>
//!
//! ### Ancestor 1: <first 100 chars of the parent's instructions>...
//! State: <pretty JSON>
//!
//! ## Active Packs                          (non-worker nodes with packs in force)
//! ### <pack name>
//! <pack description>
//!
//! Instructions:                            (only if the trimmed instructions are non-empty)
//! <trimmed instructions>
//!
//! State: ```json
//! <pack state, pretty JSON>
//! ```
//!
//! <step warning>                           (only near the step limit)
//! ````
//!
//! Decisions where upstream (TypeScript) leaves room:
//!
//! - JSON is `serde_json::to_string_pretty` (2-space indent). Object keys come
//!   out in `serde_json::Map` order, which is sorted (the workspace does not
//!   enable `preserve_order`), where upstream keeps insertion order; numbers
//!   follow serde's formatting (`1.0` stays `1.0`, upstream prints `1`).
//! - "First 100 chars" counts Unicode scalar values (never splits a UTF-8
//!   character; upstream counts UTF-16 code units). `...` is always appended.
//! - Pack instructions are trimmed with [`str::trim`] (Unicode whitespace).
//! - A pack state stored as JSON `null` counts as missing (upstream's `??`), so
//!   the pack's initial state, else `{}`, is shown.
//! - Charter instructions that are empty are not prepended (upstream's truthiness test).
//! - The step warning is computed from `max_steps - current_step` as a signed
//!   number; like upstream, there is no warning when either value is 0
//!   (upstream treats 0 as "not given").
//! - The custom builder receives the [`PromptInput`] exactly as given (including
//!   `packs`) and no tool list, so it gets no "Terminal Tools" section.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use markov_core::tool::ToolDefinition;
use serde_json::Value;

use crate::charter::{AncestorView, Charter, PromptInput};
use crate::node::Node;
use crate::pack::Pack;
use crate::transition::Transition;

/// The line that always ends the "Available Transitions" section.
pub const TRANSITION_IMPORTANT: &str = "**Important**: After calling a transition tool, you MUST respond to the user in your next message. Greet them or acknowledge the transition context - do not end your turn silently.";

/// The step warning when no step remains after this one.
pub const STEP_WARNING_CRITICAL: &str = "⚠️ CRITICAL: This is your FINAL step. You MUST respond to the user now with whatever progress you have made. Do not use any tools.";

/// The step warning when one step remains after this one.
pub const STEP_WARNING_ONE: &str = "⚠️ WARNING: You have only 1 step remaining after this one. Wrap up your work and prepare to respond to the user.";

/// The step warning when two steps remain after this one.
pub const STEP_WARNING_TWO: &str =
    "⚠️ NOTICE: You have 2 steps remaining. Start wrapping up your work soon.";

/// How many characters of an ancestor's instructions the prompt shows.
const ANCESTOR_INSTRUCTIONS_CHARS: usize = 100;

/// The system prompt for one leaf.
///
/// `offered_tools` is the tool list the model is offered in this call (as
/// produced by [`generate_tools`](crate::toolgen::generate_tools)); its terminal
/// tools are listed in a "Terminal Tools" section. The charter's custom
/// builder, when set, is called with `input` unchanged and its output returned
/// verbatim.
pub fn system_prompt(input: &PromptInput<'_>, offered_tools: &[ToolDefinition]) -> String {
    if let Some(builder) = input.charter.prompt_builder() {
        return builder(input);
    }
    let default = default_prompt(input, offered_tools);
    match input.charter.instructions() {
        Some(instructions) if !instructions.is_empty() => format!("{instructions}\n\n{default}"),
        _ => default,
    }
}

/// The default prompt, without charter instructions.
fn default_prompt(input: &PromptInput<'_>, offered_tools: &[ToolDefinition]) -> String {
    let mut sections = vec![
        input.node.instructions().to_owned(),
        state_section(input.state),
        transitions_section(input.node.transitions()),
    ];
    if let Some(s) = terminal_tools_section(offered_tools) {
        sections.push(s);
    }
    if let Some(s) = ancestor_section(input.ancestors) {
        sections.push(s);
    }
    if let Some(s) = packs_section(input) {
        sections.push(s);
    }
    if let Some(s) = step_warning(input.current_step, input.max_steps) {
        sections.push(s.to_owned());
    }
    sections.join("\n\n")
}

/// Pretty JSON with a 2-space indent.
fn pretty(value: &Value) -> String {
    // Serializing a `Value` cannot fail; fall back to compact JSON regardless.
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

fn state_section(state: &Value) -> String {
    format!("## Current Node State\n```json\n{}\n```", pretty(state))
}

fn transitions_section(transitions: &[(String, Transition)]) -> String {
    let list = if transitions.is_empty() {
        "None".to_owned()
    } else {
        transitions
            .iter()
            .map(|(name, t)| format!("- **{name}**: {}", t.description().unwrap_or("Transition")))
            .collect::<Vec<_>>()
            .join("\n")
    };
    format!("## Available Transitions\n{list}\n\n{TRANSITION_IMPORTANT}")
}

fn terminal_tools_section(tools: &[ToolDefinition]) -> Option<String> {
    let mut lines = tools
        .iter()
        .filter(|t| t.terminal)
        .map(|t| format!("- {}: {}", t.name, t.description))
        .peekable();
    lines.peek()?;
    let list = lines.collect::<Vec<_>>().join("\n");
    Some(format!(
        "## Terminal Tools\nThese tools generate your final response:\n{list}\n\nWhen you call a terminal tool, its output IS your response. Do not add text after calling one."
    ))
}

fn ancestor_section(ancestors: &[AncestorView<'_>]) -> Option<String> {
    if ancestors.is_empty() {
        return None;
    }
    let blocks = ancestors
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let depth = ancestors.len() - i;
            let head: String = a
                .node
                .instructions()
                .chars()
                .take(ANCESTOR_INSTRUCTIONS_CHARS)
                .collect();
            format!(
                "### Ancestor {depth}: {head}...\nState: {}",
                pretty(a.state)
            )
        })
        .collect::<Vec<_>>()
        .join("\n\n");
    Some(format!("## Ancestor Context\n{blocks}"))
}

fn packs_section(input: &PromptInput<'_>) -> Option<String> {
    if input.node.is_worker() || input.packs.is_empty() {
        return None;
    }
    let empty = Value::Object(serde_json::Map::new());
    let blocks = input
        .packs
        .iter()
        .map(|pack| {
            let state = input
                .pack_states
                .get(pack.name())
                .filter(|v| !v.is_null())
                .or_else(|| pack.initial_state().filter(|v| !v.is_null()))
                .unwrap_or(&empty);
            let rendered = pack.instructions().render(state);
            let instructions = rendered.trim();
            let mut block = format!("### {}\n{}\n", pack.name(), pack.description());
            if !instructions.is_empty() {
                // Writing to a String cannot fail.
                let _ = write!(block, "\nInstructions:\n{instructions}\n");
            }
            let _ = write!(block, "\nState: ```json\n{}\n```", pretty(state));
            block
        })
        .collect::<Vec<_>>()
        .join("\n\n");
    Some(format!("## Active Packs\n{blocks}"))
}

/// The step warning for `current_step` of `max_steps`, if any.
pub fn step_warning(current_step: usize, max_steps: usize) -> Option<&'static str> {
    if current_step == 0 || max_steps == 0 {
        return None;
    }
    let remaining = i128::try_from(max_steps).unwrap_or(i128::MAX)
        - i128::try_from(current_step).unwrap_or(i128::MAX);
    match remaining {
        r if r <= 0 => Some(STEP_WARNING_CRITICAL),
        1 => Some(STEP_WARNING_ONE),
        2 => Some(STEP_WARNING_TWO),
        _ => None,
    }
}

/// The last default prompt built for one leaf, reused while nothing it shows
/// has changed.
///
/// Building the prompt formats the state and the packs as pretty JSON, which
/// costs a handful of allocations on every model call; yet within a turn the
/// state rarely changes. The cache keeps the inputs the prompt was built from
/// and compares them (node, state, ancestors, packs and their states, the
/// offered tools, the step warning): a hit costs comparisons and no
/// allocation, a miss rebuilds and remembers. A charter with a custom prompt
/// builder is never cached, since the builder may read anything.
///
/// Cloning gives an empty cache: a changed copy of an instance starts afresh.
#[derive(Default)]
pub struct PromptCache {
    last: std::sync::Mutex<Option<CachedPrompt>>,
}

impl Clone for PromptCache {
    fn clone(&self) -> Self {
        PromptCache::default()
    }
}

impl std::fmt::Debug for PromptCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cached = self.last.lock().map(|last| last.is_some()).unwrap_or(false);
        f.debug_struct("PromptCache")
            .field("cached", &cached)
            .finish()
    }
}

struct CachedPrompt {
    key: PromptKey,
    prompt: Arc<str>,
}

/// Everything [`system_prompt`] reads, owned.
struct PromptKey {
    charter: Charter,
    node: Node,
    state: Value,
    ancestors: Vec<(Node, Value)>,
    packs: Vec<Pack>,
    pack_states: BTreeMap<String, Value>,
    tools: Arc<[ToolDefinition]>,
    warning: Option<&'static str>,
}

impl PromptKey {
    fn of(input: &PromptInput<'_>, tools: &Arc<[ToolDefinition]>) -> Self {
        PromptKey {
            charter: input.charter.clone(),
            node: input.node.clone(),
            state: input.state.clone(),
            ancestors: input
                .ancestors
                .iter()
                .map(|a| (a.node.clone(), a.state.clone()))
                .collect(),
            packs: input.packs.to_vec(),
            pack_states: input.pack_states.clone(),
            tools: Arc::clone(tools),
            warning: step_warning(input.current_step, input.max_steps),
        }
    }

    fn matches(&self, input: &PromptInput<'_>, tools: &Arc<[ToolDefinition]>) -> bool {
        self.charter.is_same(input.charter)
            && self.node.is_same(input.node)
            && self.warning == step_warning(input.current_step, input.max_steps)
            && Arc::ptr_eq(&self.tools, tools)
            && self.ancestors.len() == input.ancestors.len()
            && self.packs.len() == input.packs.len()
            && self
                .packs
                .iter()
                .zip(input.packs)
                .all(|(a, b)| a.is_same(b))
            && self
                .ancestors
                .iter()
                .zip(input.ancestors)
                .all(|((node, state), view)| node.is_same(view.node) && state == view.state)
            && self.state == *input.state
            && self.pack_states == *input.pack_states
    }
}

/// [`system_prompt`], remembered in `cache` (see [`PromptCache`]).
///
/// `offered_tools` is compared by identity: the charter and the tool
/// registry hand out the same shared list for as long as it is unchanged.
pub fn system_prompt_cached(
    cache: &PromptCache,
    input: &PromptInput<'_>,
    offered_tools: &Arc<[ToolDefinition]>,
) -> Arc<str> {
    if input.charter.prompt_builder().is_some() {
        return system_prompt(input, offered_tools).into();
    }
    // A poisoned lock only means another thread panicked mid-update; the
    // entry is replaced below either way.
    let mut last = cache.last.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(hit) = last
        .as_ref()
        .filter(|c| c.key.matches(input, offered_tools))
    {
        return Arc::clone(&hit.prompt);
    }
    let prompt: Arc<str> = system_prompt(input, offered_tools).into();
    *last = Some(CachedPrompt {
        key: PromptKey::of(input, offered_tools),
        prompt: Arc::clone(&prompt),
    });
    prompt
}
