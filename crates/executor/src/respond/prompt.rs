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

use std::io::Write as _;

use markov_core::tool::ToolDefinition;
use serde_json::Value;

use markov_charter::charter::{AncestorView, PromptInput, PromptStyle};
use markov_charter::transition::Transition;

/// The line that always ends the "Available Transitions" section.
pub(crate) const TRANSITION_IMPORTANT: &str = "**Important**: After calling a transition tool, you MUST respond to the user in your next message. Greet them or acknowledge the transition context - do not end your turn silently.";

/// The step warning when no step remains after this one.
pub(crate) const STEP_WARNING_CRITICAL: &str = "⚠️ CRITICAL: This is your FINAL step. You MUST respond to the user now with whatever progress you have made. Do not use any tools.";

/// The step warning when one step remains after this one.
pub(crate) const STEP_WARNING_ONE: &str = "⚠️ WARNING: You have only 1 step remaining after this one. Wrap up your work and prepare to respond to the user.";

/// The step warning when two steps remain after this one.
pub(crate) const STEP_WARNING_TWO: &str =
    "⚠️ NOTICE: You have 2 steps remaining. Start wrapping up your work soon.";

/// How many characters of an ancestor's instructions the prompt shows.
const ANCESTOR_INSTRUCTIONS_CHARS: usize = 100;

/// The system prompt for one leaf.
///
/// `offered_tools` is the tool list the model is offered in this call (as
/// produced by [`generate_tools`](markov_charter::toolgen::generate_tools)); its terminal
/// tools are listed in a "Terminal Tools" section. The charter's custom
/// builder, when set, is called with `input` unchanged and its output returned
/// verbatim.
pub(crate) fn system_prompt(input: &PromptInput<'_>, offered_tools: &[ToolDefinition]) -> String {
    if let Some(builder) = input.charter.prompt_builder() {
        return builder(input);
    }
    default_prompt(input, offered_tools)
}

/// The default prompt (charter instructions included).
fn default_prompt(input: &PromptInput<'_>, offered_tools: &[ToolDefinition]) -> String {
    let mut out = Prompt::for_input(input);
    out.body(input, offered_tools);
    if let Some(warning) = step_warning(input.current_step, input.max_steps) {
        out.section(warning);
    }
    out.finish()
}

/// A prompt being written: one buffer for every section, where formatting
/// each section and joining them cost a dozen allocations per prompt, and a
/// machine builds one whenever the state it shows changes.
struct Prompt(Vec<u8>);

impl Prompt {
    /// An empty prompt with room for the usual one.
    fn for_input(input: &PromptInput<'_>) -> Self {
        let instructions = input.charter.instructions().map_or(0, str::len);
        Prompt(Vec::with_capacity(
            1024 + instructions + input.node.instructions().len(),
        ))
    }

    /// The charter instructions (when not empty) and the default prompt
    /// without its step warning.
    fn body(&mut self, input: &PromptInput<'_>, offered_tools: &[ToolDefinition]) {
        if let Some(instructions) = input.charter.instructions().filter(|i| !i.is_empty()) {
            self.text(instructions);
            self.text("\n\n");
        }
        self.text(input.node.instructions());
        let upstream = input.charter.prompt_style() == PromptStyle::Upstream;
        let empty_state = input
            .state
            .as_object()
            .is_some_and(serde_json::Map::is_empty);
        if upstream || input.node.has_state() || !empty_state {
            self.section("## Current Node State\n```json\n");
            self.pretty(input.state);
            self.text("\n```");
        }
        if upstream || !input.node.transitions().is_empty() {
            self.transitions(input.node.transitions());
        }
        self.terminal_tools(offered_tools);
        self.ancestors(input.ancestors);
        self.packs(input);
    }

    fn text(&mut self, text: &str) {
        self.0.extend_from_slice(text.as_bytes());
    }

    /// Starts a section: sections are separated by one blank line.
    fn section(&mut self, start: &str) {
        self.text("\n\n");
        self.text(start);
    }

    /// Pretty JSON with a 2-space indent.
    fn pretty(&mut self, value: &Value) {
        let mark = self.0.len();
        // Writing a `Value` to a `Vec` cannot fail; compact JSON regardless.
        if serde_json::to_writer_pretty(&mut self.0, value).is_err() {
            self.0.truncate(mark);
            self.text(&value.to_string());
        }
    }

    fn transitions(&mut self, transitions: &[(String, Transition)]) {
        self.section("## Available Transitions\n");
        if transitions.is_empty() {
            self.text("None");
        }
        for (i, (name, transition)) in transitions.iter().enumerate() {
            if i > 0 {
                self.text("\n");
            }
            self.text("- **");
            self.text(name);
            self.text("**: ");
            self.text(transition.description().unwrap_or("Transition"));
        }
        self.text("\n\n");
        self.text(TRANSITION_IMPORTANT);
    }

    fn terminal_tools(&mut self, tools: &[ToolDefinition]) {
        let mut terminal = tools.iter().filter(|t| t.terminal).peekable();
        if terminal.peek().is_none() {
            return;
        }
        self.section("## Terminal Tools\nThese tools generate your final response:");
        for tool in terminal {
            self.text("\n- ");
            self.text(tool.name.as_str());
            self.text(": ");
            self.text(&tool.description);
        }
        self.text(
            "\n\nWhen you call a terminal tool, its output IS your response. Do not add text after calling one.",
        );
    }

    fn ancestors(&mut self, ancestors: &[AncestorView<'_>]) {
        if ancestors.is_empty() {
            return;
        }
        self.section("## Ancestor Context");
        for (i, ancestor) in ancestors.iter().enumerate() {
            let depth = ancestors.len() - i;
            let instructions = ancestor.node.instructions();
            let head = instructions
                .char_indices()
                .nth(ANCESTOR_INSTRUCTIONS_CHARS)
                .map_or(instructions, |(end, _)| &instructions[..end]);
            self.text(if i == 0 { "\n" } else { "\n\n" });
            // Writing to a `Vec` cannot fail.
            let _ = write!(self.0, "### Ancestor {depth}: {head}...\nState: ");
            self.pretty(ancestor.state);
        }
    }

    fn packs(&mut self, input: &PromptInput<'_>) {
        if input.node.is_worker() || input.packs.is_empty() {
            return;
        }
        let empty = Value::Object(serde_json::Map::new());
        self.section("## Active Packs");
        for (i, pack) in input.packs.iter().enumerate() {
            let state = input
                .pack_states
                .get(pack.name())
                .filter(|v| !v.is_null())
                .or_else(|| pack.initial_state().filter(|v| !v.is_null()))
                .unwrap_or(&empty);
            let rendered = pack.instructions().render(state);
            let instructions = rendered.trim();
            self.text(if i == 0 { "\n### " } else { "\n\n### " });
            self.text(pack.name());
            self.text("\n");
            self.text(pack.description());
            self.text("\n");
            if !instructions.is_empty() {
                self.text("\nInstructions:\n");
                self.text(instructions);
                self.text("\n");
            }
            self.text("\nState: ```json\n");
            self.pretty(state);
            self.text("\n```");
        }
    }

    fn finish(self) -> String {
        // Every piece written is a `str` or serde_json's output.
        String::from_utf8(self.0)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }
}

/// The step warning for `current_step` of `max_steps`, if any.
pub(crate) fn step_warning(current_step: usize, max_steps: usize) -> Option<&'static str> {
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
