//! How the loop treats a node's turns: which tool choice each model call
//! sends, and whether an answer without a tool call is accepted.
//!
//! Both are data on the node ([`TurnPolicy`]); the executor applies them.

use markov_core::ToolName;
use markov_core::model::{Thinking, ToolChoice};

use crate::error::ConfigError;
use crate::node::Node;

/// The default reminder injected when output is restricted.
pub const DEFAULT_RESTRICTION_MESSAGE: &str = "Do not produce a final answer directly. Before finishing, call a tool. If no tool is needed, call the 'finish' tool.";

/// Which tool choice each model call of a turn sends.
///
/// Forcing a tool on every call loops until something ends the run; forcing
/// none lets the model skip its tools. [`ToolChoicePolicy::RequiredFirst`] is
/// the middle way: the first call of a turn must use a tool, later calls may
/// answer in text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoicePolicy {
    /// The model decides every call.
    #[default]
    Auto,
    /// `Any` on the first call of each turn, `Auto` once a tool has run.
    RequiredFirst,
    /// `Any` on every call. Needs a way out: a terminal tool, a tool that
    /// ends the run, or a transition (checked when the node is built).
    Required,
    /// This tool on the first call of a turn, then `Auto`.
    Named(ToolName),
    /// The model may not call tools.
    None,
}

impl ToolChoicePolicy {
    /// The tool choice for a call, given whether a tool already ran in this turn.
    pub fn choice(&self, tool_ran_this_turn: bool) -> ToolChoice {
        match (self, tool_ran_this_turn) {
            (ToolChoicePolicy::Auto, _) => ToolChoice::Auto,
            (ToolChoicePolicy::None, _) => ToolChoice::None,
            (ToolChoicePolicy::Required, _) => ToolChoice::Any,
            (ToolChoicePolicy::RequiredFirst, false) => ToolChoice::Any,
            (ToolChoicePolicy::Named(name), false) => ToolChoice::Tool(name.clone()),
            (ToolChoicePolicy::RequiredFirst | ToolChoicePolicy::Named(_), true) => {
                ToolChoice::Auto
            }
        }
    }

    /// Whether some call under this policy forces tool use.
    pub fn ever_forces(&self) -> bool {
        matches!(
            self,
            ToolChoicePolicy::RequiredFirst
                | ToolChoicePolicy::Required
                | ToolChoicePolicy::Named(_)
        )
    }

    fn label(&self) -> &'static str {
        match self {
            ToolChoicePolicy::Auto => "Auto",
            ToolChoicePolicy::RequiredFirst => "RequiredFirst",
            ToolChoicePolicy::Required => "Required",
            ToolChoicePolicy::Named(_) => "Named",
            ToolChoicePolicy::None => "None",
        }
    }
}

/// Output restriction: an answer without a tool call is met with a reminder
/// (a system message) and another model call, instead of ending the turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputRestriction {
    /// Whether tool-less answers are restricted.
    pub restrict_output: bool,
    /// The reminder injected as a system message.
    pub restriction_message: String,
    /// Reminders per turn; 0 means no limit (the run's step limit still applies).
    pub restriction_max_injections: u32,
}

impl Default for OutputRestriction {
    fn default() -> Self {
        OutputRestriction {
            restrict_output: false,
            restriction_message: DEFAULT_RESTRICTION_MESSAGE.to_owned(),
            restriction_max_injections: 0,
        }
    }
}

impl OutputRestriction {
    /// Restriction on, with the default message and no injection limit.
    pub fn enabled() -> Self {
        OutputRestriction {
            restrict_output: true,
            ..OutputRestriction::default()
        }
    }

    /// Whether another reminder may be injected after `injected` in this turn.
    pub fn may_inject(&self, injected: u32) -> bool {
        self.restrict_output
            && (self.restriction_max_injections == 0 || injected < self.restriction_max_injections)
    }
}

/// A node's turn policy.
///
/// # Extended thinking
///
/// Anthropic refuses a forced tool choice (`any` or a named tool) while a
/// fixed thinking budget is enabled ("Thinking may not be enabled when
/// tool_choice forces tool use"), and an explicit temperature with thinking.
/// Building a node whose policy would send such a request is a
/// [`ConfigError::ThinkingConflict`]; the rule comes from
/// [`Thinking::allows`], so a provider's capability table can relax it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TurnPolicy {
    /// Tool choice per call.
    pub tool_choice: ToolChoicePolicy,
    /// Output restriction.
    pub restriction: OutputRestriction,
    /// Extended thinking for this node's calls.
    pub thinking: Option<Thinking>,
}

impl TurnPolicy {
    /// Checks the policy against the node it belongs to.
    pub(crate) fn validate(&self, node: &Node) -> Result<(), ConfigError> {
        let label = || node.name().unwrap_or("<unnamed>").to_owned();
        match &self.tool_choice {
            ToolChoicePolicy::Named(tool) if node.tools().get(tool.as_str()).is_none() => {
                return Err(ConfigError::UnknownNamedTool {
                    node: label(),
                    tool: tool.to_string(),
                });
            }
            ToolChoicePolicy::Required => {
                let has_exit = !node.transitions().is_empty()
                    || node
                        .tools()
                        .iter()
                        .any(|t| t.definition().terminal || t.may_terminate());
                if !has_exit {
                    return Err(ConfigError::RequiredWithoutExit(label()));
                }
            }
            _ => {}
        }
        if let Some(thinking) = self.thinking {
            check_thinking(
                thinking,
                thinking.allows(),
                &self.tool_choice,
                node.executor_config().temperature,
            )
            .map_err(|constraint| ConfigError::ThinkingConflict {
                node: label(),
                constraint,
            })?;
        }
        Ok(())
    }
}

/// Checks a thinking mode against a tool-choice policy and a temperature,
/// under a given allowance. Returns the violated constraint.
pub fn check_thinking(
    thinking: Thinking,
    allowance: markov_core::model::ThinkingAllowance,
    policy: &ToolChoicePolicy,
    temperature: Option<f32>,
) -> Result<(), String> {
    let mode = match thinking {
        Thinking::Enabled { budget_tokens } => {
            format!("extended thinking (budget {budget_tokens})")
        }
        _ => "adaptive thinking".to_owned(),
    };
    if policy.ever_forces() && !allowance.forced_tool_choice {
        return Err(format!(
            "{mode} cannot be combined with tool choice policy {} (the provider refuses forced tool use while thinking)",
            policy.label()
        ));
    }
    if temperature.is_some() && !allowance.temperature {
        return Err(format!(
            "{mode} cannot be combined with an explicit temperature (the provider refuses it while thinking)"
        ));
    }
    Ok(())
}
