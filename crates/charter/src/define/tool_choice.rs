//! How the loop treats a node's turns: which tool choice each model call
//! sends, and whether an answer without a tool call is accepted.
//!
//! Both are data on the node ([`TurnPolicy`]); the executor applies them,
//! and `ToolChoiceEnforcer` (in the response-running half of this crate)
//! applies a [`ToolChoiceRule`] around any model client, without the loop.

use markov_core::ToolName;
use markov_core::model::{Thinking, ThinkingAllowance, ToolChoice};

/// The default reminder injected when output is restricted.
pub const DEFAULT_RESTRICTION_MESSAGE: &str = "Do not produce a final answer directly. Before finishing, call a tool. If no tool is needed, call the 'finish' tool.";

/// Which tool choice each model call of a turn sends.
///
/// Forcing a tool on every call loops until something ends the run; forcing
/// none lets the model skip its tools. [`ToolChoiceRule::RequiredFirst`] is
/// the middle way: the first call of a turn must use a tool, later calls may
/// answer in text.
///
/// A turn starts with new user input, or when the node is entered by a
/// transition or a spawn. [`ToolChoiceRule::choice`] is the one place the
/// decision is made; the standard loop and executor's `ToolChoiceEnforcer` both ask it.
///
/// The policies that force tool use (`RequiredFirst`, `Required`, `Named`)
/// cannot be combined with extended thinking under a fixed budget: see
/// [`TurnPolicy`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoiceRule {
    /// The model decides every call.
    #[default]
    Auto,
    /// `Any` on the first call of each turn, `Auto` once a tool has run.
    RequiredFirst,
    /// `Any` on every call. Needs a way out: a terminal tool, a tool that
    /// ends the run, or a transition (checked when the node is built, against
    /// the node's own tools and transitions: an exit that only an ancestor,
    /// the charter or a pack provides is not seen there).
    Required,
    /// This tool on the first call of a turn, then `Auto`. The name must be
    /// one of the node's own tools (checked when the node is built).
    Named(ToolName),
    /// The model may not call tools.
    None,
}

impl ToolChoiceRule {
    /// The tool choice for a call, given whether a tool already ran in this turn.
    ///
    /// ```
    /// use markov_core::model::ToolChoice;
    /// use markov_charter::tool_choice::ToolChoiceRule;
    ///
    /// let policy = ToolChoiceRule::RequiredFirst;
    /// assert_eq!(policy.choice(false), ToolChoice::Any);
    /// assert_eq!(policy.choice(true), ToolChoice::Auto);
    /// ```
    pub fn choice(&self, tool_ran_this_turn: bool) -> ToolChoice {
        match (self, tool_ran_this_turn) {
            (ToolChoiceRule::Auto, _) => ToolChoice::Auto,
            (ToolChoiceRule::None, _) => ToolChoice::None,
            (ToolChoiceRule::Required, _) => ToolChoice::Any,
            (ToolChoiceRule::RequiredFirst, false) => ToolChoice::Any,
            (ToolChoiceRule::Named(name), false) => ToolChoice::Tool(name.clone()),
            (ToolChoiceRule::RequiredFirst | ToolChoiceRule::Named(_), true) => ToolChoice::Auto,
        }
    }

    /// Whether some call under this policy forces tool use.
    pub fn ever_forces(&self) -> bool {
        matches!(
            self,
            ToolChoiceRule::RequiredFirst | ToolChoiceRule::Required | ToolChoiceRule::Named(_)
        )
    }

    fn label(&self) -> &'static str {
        match self {
            ToolChoiceRule::Auto => "Auto",
            ToolChoiceRule::RequiredFirst => "RequiredFirst",
            ToolChoiceRule::Required => "Required",
            ToolChoiceRule::Named(_) => "Named",
            ToolChoiceRule::None => "None",
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
/// The rule is data: [`Thinking::allows`] gives each mode's documented
/// [`ThinkingAllowance`], and a client's [`Model::thinking_allowance`](markov_core::Model::thinking_allowance) (its
/// capability table) may relax it per model; adaptive thinking accepts forced
/// tool use by default. [`check_thinking`] applies an allowance.
///
/// It is checked twice, both times before any request is made:
///
/// - building a node whose own policy combines thinking with a forcing tool
///   choice policy, or with a temperature in its
///   [`ExecutorConfig`](crate::node::ExecutorConfig), is a
///   [`ConfigError::ThinkingConflict`](crate::ConfigError::ThinkingConflict) naming the node and the constraint
///   (under the documented allowance, since no client is known yet);
/// - the standard executor checks the final settings of each call (node over
///   executor defaults) against its client's allowance, and ends the run with
///   the same error.
///
/// `Named` must name one of the node's own tools, and `Required` needs a way
/// out (a terminal tool, a tool that ends the run, or a transition); both are
/// checked when the node is built.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TurnPolicy {
    /// Tool choice per call.
    pub tool_choice: ToolChoiceRule,
    /// Output restriction.
    pub restriction: OutputRestriction,
    /// Extended thinking for this node's calls.
    pub thinking: Option<Thinking>,
}

/// Checks a thinking mode against a tool-choice rule and a temperature,
/// under a given allowance. Returns the violated constraint.
///
/// ```
/// use markov_core::model::Thinking;
/// use markov_charter::tool_choice::{ToolChoiceRule, check_thinking};
///
/// let thinking = Thinking::Enabled { budget_tokens: 2048 };
/// let err = check_thinking(thinking, thinking.allows(), &ToolChoiceRule::RequiredFirst, None)
///     .unwrap_err();
/// assert!(err.contains("RequiredFirst"), "{err}");
/// assert!(check_thinking(thinking, thinking.allows(), &ToolChoiceRule::Auto, None).is_ok());
/// ```
pub fn check_thinking(
    thinking: Thinking,
    allowance: ThinkingAllowance,
    policy: &ToolChoiceRule,
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
            "{mode} cannot be combined with tool choice rule {} (the provider refuses forced tool use while thinking)",
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
