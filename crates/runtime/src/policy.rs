//! How the loop treats a node's turns: which tool choice each model call
//! sends, and whether an answer without a tool call is accepted.
//!
//! Both are data on the node ([`TurnPolicy`]); the executor applies them.
//! [`ToolChoiceEnforcer`] applies a [`ToolChoicePolicy`] around any model
//! client, without the loop.

use async_trait::async_trait;
use futures::stream::BoxStream;
use markov_core::ToolName;
use markov_core::message::{Item, Items, Message, Role};
use markov_core::model::{
    Model, ModelError, ModelRequest, ModelResponse, ModelSettings, StreamEvent, Thinking,
    ThinkingAllowance, ToolChoice,
};

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
///
/// A turn starts with new user input, or when the node is entered by a
/// transition or a spawn. [`ToolChoicePolicy::choice`] is the one place the
/// decision is made; the standard loop and [`ToolChoiceEnforcer`] both ask it.
///
/// The policies that force tool use (`RequiredFirst`, `Required`, `Named`)
/// cannot be combined with extended thinking under a fixed budget: see
/// [`TurnPolicy`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoicePolicy {
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

impl ToolChoicePolicy {
    /// The tool choice for a call, given whether a tool already ran in this turn.
    ///
    /// ```
    /// use markov_core::model::ToolChoice;
    /// use markov_runtime::policy::ToolChoicePolicy;
    ///
    /// let policy = ToolChoicePolicy::RequiredFirst;
    /// assert_eq!(policy.choice(false), ToolChoice::Any);
    /// assert_eq!(policy.choice(true), ToolChoice::Auto);
    /// ```
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
/// The rule is data: [`Thinking::allows`] gives each mode's documented
/// [`ThinkingAllowance`], and a client's [`Model::thinking_allowance`] (its
/// capability table) may relax it per model; adaptive thinking accepts forced
/// tool use by default. [`check_thinking`] applies an allowance.
///
/// It is checked twice, both times before any request is made:
///
/// - building a node whose own policy combines thinking with a forcing tool
///   choice policy, or with a temperature in its
///   [`ExecutorConfig`](crate::node::ExecutorConfig), is a
///   [`ConfigError::ThinkingConflict`] naming the node and the constraint
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
///
/// ```
/// use markov_core::model::Thinking;
/// use markov_runtime::policy::{ToolChoicePolicy, check_thinking};
///
/// let thinking = Thinking::Enabled { budget_tokens: 2048 };
/// let err = check_thinking(thinking, thinking.allows(), &ToolChoicePolicy::RequiredFirst, None)
///     .unwrap_err();
/// assert!(err.contains("RequiredFirst"), "{err}");
/// assert!(check_thinking(thinking, thinking.allows(), &ToolChoicePolicy::Auto, None).is_ok());
/// ```
pub fn check_thinking(
    thinking: Thinking,
    allowance: ThinkingAllowance,
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

/// A model wrapper that applies a [`ToolChoicePolicy`] to every request,
/// around any client and without the machine loop (the "first call tool
/// enforcer").
///
/// Each request's tool choice is replaced by
/// [`ToolChoicePolicy::choice`], where "a tool ran in this turn" is read from
/// the request's messages alone: the last user message that has any content
/// holds tool results only (the model called a tool and got its result back),
/// rather than new input. The scan walks back from the end and stops at that
/// message, so its cost is the length of the current turn, not of the history.
///
/// Messages alone cannot show a transition or a spawn into a new node; the
/// standard loop, which knows them, does not use this wrapper but asks the
/// same [`ToolChoicePolicy::choice`] with its own per-instance turn state.
///
/// A request whose settings enable thinking is checked with
/// [`check_thinking`] against the inner client's
/// [`Model::thinking_allowance`] and refused with
/// [`ModelError::InvalidRequest`] before the inner client sees it.
///
/// ```
/// use markov_core::message::{Item, Message};
/// use markov_core::model::{Model, ModelRequest, ModelSettings, ToolChoice};
/// use markov_runtime::policy::{ToolChoiceEnforcer, ToolChoicePolicy};
/// use markov_testkit::ScriptedModel;
/// use serde_json::json;
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let scripted = ScriptedModel::builder()
///     .tool_call("lookup", json!({"key": "customer"}))
///     .text("Customer has 3 endpoints.")
///     .build();
/// let model = ToolChoiceEnforcer::new(scripted, ToolChoicePolicy::RequiredFirst);
/// let settings = ModelSettings::default();
/// fn request<'a>(messages: &'a [Message], settings: &'a ModelSettings) -> ModelRequest<'a> {
///     // The caller's own tool choice is replaced by the policy's.
///     ModelRequest {
///         system: "",
///         messages,
///         tools: &[],
///         provider_tools: &[],
///         tool_choice: &ToolChoice::Auto,
///         settings,
///         output_schema: None,
///     }
/// }
///
/// let mut history = vec![Message::user("What endpoints does Customer have?")];
/// let first = model.complete(request(&history, &settings)).await.unwrap();
/// history.push(Message::assistant_items(first.content));
/// history.push(Message::user_items(vec![Item::tool_result("call_1", "3 endpoints", None)]));
/// model.complete(request(&history, &settings)).await.unwrap();
///
/// let sent = model.get_ref().requests();
/// assert_eq!(sent[0].tool_choice, ToolChoice::Any);
/// assert_eq!(sent[1].tool_choice, ToolChoice::Auto);
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct ToolChoiceEnforcer<M> {
    inner: M,
    policy: ToolChoicePolicy,
    /// `policy.choice(false)`, kept so a request can borrow it.
    before_tool: ToolChoice,
    /// `policy.choice(true)`, kept so a request can borrow it.
    after_tool: ToolChoice,
}

impl<M> ToolChoiceEnforcer<M> {
    /// Wraps `inner`, applying `policy` to every request.
    pub fn new(inner: M, policy: ToolChoicePolicy) -> Self {
        ToolChoiceEnforcer {
            inner,
            before_tool: policy.choice(false),
            after_tool: policy.choice(true),
            policy,
        }
    }

    /// The wrapped model.
    pub fn get_ref(&self) -> &M {
        &self.inner
    }

    /// The wrapped model, mutably.
    pub fn get_mut(&mut self) -> &mut M {
        &mut self.inner
    }

    /// Unwraps the model.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// The policy applied.
    pub fn policy(&self) -> &ToolChoicePolicy {
        &self.policy
    }

    /// The tool choice this wrapper sends with `messages`.
    pub fn choice_for(&self, messages: &[Message]) -> &ToolChoice {
        if tool_ran_this_turn(messages) {
            &self.after_tool
        } else {
            &self.before_tool
        }
    }
}

impl<M: Model> ToolChoiceEnforcer<M> {
    fn enforce<'a>(&'a self, request: ModelRequest<'a>) -> Result<ModelRequest<'a>, ModelError> {
        if let Some(thinking) = request.settings.thinking {
            check_thinking(
                thinking,
                self.inner.thinking_allowance(request.settings, thinking),
                &self.policy,
                request.settings.temperature,
            )
            .map_err(ModelError::InvalidRequest)?;
        }
        Ok(ModelRequest {
            tool_choice: self.choice_for(request.messages),
            ..request
        })
    }
}

/// Whether the current turn of `messages` has run a tool: the last user
/// message with any content holds tool results only.
fn tool_ran_this_turn(messages: &[Message]) -> bool {
    for message in messages.iter().rev() {
        if message.role != Role::User {
            continue;
        }
        match &message.items {
            Items::Text(text) if text.is_empty() => {}
            Items::Text(_) => return false,
            Items::List(items) if items.is_empty() => {}
            Items::List(items) => {
                return items
                    .iter()
                    .all(|item| matches!(item, Item::ToolResult { .. }));
            }
            Items::Instance(_) => {}
        }
    }
    false
}

#[async_trait]
impl<M: Model> Model for ToolChoiceEnforcer<M> {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let request = self.enforce(request)?;
        self.inner.complete(request).await
    }

    fn thinking_allowance(
        &self,
        settings: &ModelSettings,
        thinking: Thinking,
    ) -> ThinkingAllowance {
        self.inner.thinking_allowance(settings, thinking)
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        match self.enforce(request) {
            Ok(request) => self.inner.stream(request),
            Err(e) => Box::pin(futures::stream::once(async move { Err(e) })),
        }
    }
}
