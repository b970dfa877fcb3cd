//! [`ContextPolicy`]: what a model is shown of a long conversation.
//!
//! The history stays whole, in memory, in snapshots and in the store; a
//! policy decides the *view* of it each model call is sent: keep the last
//! turns, trim old tool results to a stub that names what was left out,
//! summarize older turns with a model call once the view passes a token
//! threshold. Several combine in one policy. An agent sets one for all its
//! nodes (`AgentBuilder::context_policy` in `markov-executor`), a node may
//! set its own ([`NodeBuilder::context_policy`](crate::node::NodeBuilder::context_policy)).
//!
//! A *turn* starts with a user message that is not tool results (the
//! user's input, a cede's content); the view is only ever cut where one
//! starts, so a tool call and its result are both in or both out, the view
//! starts with a user message, and the current turn is always whole.
//!
//! ```
//! use std::sync::Arc;
//! use markov_core::{Message, Model, ModelError, ModelRequest, ModelResponse, StopReason, Item};
//! use markov_charter::context::{ContextPolicy, Summarize};
//!
//! # #[derive(Debug)]
//! # struct Cheap;
//! # #[markov_core::async_trait]
//! # impl Model for Cheap {
//! #     async fn complete(&self, _r: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
//! #         Ok(ModelResponse::new(vec![Item::text("a summary")], StopReason::EndTurn))
//! #     }
//! # }
//! let policy = ContextPolicy::builder()
//!     .trim_tool_results(2)
//!     .summarize(Summarize::new(Arc::new(Cheap), 50_000).keep_last_turns(4))
//!     .build()
//!     .unwrap();
//! assert_eq!(policy.trim_tool_results(), Some(2));
//!
//! // Nonsense is refused when the policy is built.
//! assert!(ContextPolicy::builder().keep_last_turns(0).build().is_err());
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use markov_core::model::{Model, ModelSettings};

/// The instructions a summarizer gets unless [`Summarize::prompt`] says
/// otherwise.
pub const DEFAULT_SUMMARY_PROMPT: &str = "You summarize the earlier part of a conversation between a user and an assistant that uses tools, so that the assistant can carry on without it. Keep every fact, decision, name, number, open question and promise that may matter later, and what the tools returned that is still relevant; leave out pleasantries and repetition. Write plain prose, in the conversation's language, addressed to the assistant.";

/// The answer tokens a summarizer is allowed unless
/// [`Summarize::settings`] says otherwise.
pub const DEFAULT_SUMMARY_MAX_TOKENS: u32 = 1_024;

/// How a context view is made from a long history: frozen, cheap to
/// clone, built with [`ContextPolicy::builder`].
#[derive(Clone)]
pub struct ContextPolicy(Arc<PolicyInner>);

struct PolicyInner {
    id: u64,
    keep_last_turns: Option<usize>,
    trim_tool_results: Option<usize>,
    summarize: Option<Summarize>,
    token_count: TokenCount,
}

impl fmt::Debug for ContextPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextPolicy")
            .field("keep_last_turns", &self.0.keep_last_turns)
            .field("trim_tool_results", &self.0.trim_tool_results)
            .field("summarize", &self.0.summarize)
            .field("token_count", &self.0.token_count)
            .finish()
    }
}

impl PartialEq for ContextPolicy {
    fn eq(&self, other: &Self) -> bool {
        self.0.id == other.0.id
    }
}

impl ContextPolicy {
    /// A builder with nothing set; at least one rule must be.
    pub fn builder() -> ContextPolicyBuilder {
        ContextPolicyBuilder::default()
    }

    /// An identity unique within the process (a machine keeps one view
    /// per policy).
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// How many turns the view keeps, the current one included; older
    /// turns are left out (and not summarized).
    pub fn keep_last_turns(&self) -> Option<usize> {
        self.0.keep_last_turns
    }

    /// How many of the last turns, the current one included, keep their
    /// tool results whole; the results of older turns are shown as a stub
    /// naming the tool, the call and the size of what was left out.
    pub fn trim_tool_results(&self) -> Option<usize> {
        self.0.trim_tool_results
    }

    /// The summarizer, if older turns are summarized.
    pub fn summarize(&self) -> Option<&Summarize> {
        self.0.summarize.as_ref()
    }

    /// How the view's tokens are counted against the summary threshold.
    pub fn token_count(&self) -> TokenCount {
        self.0.token_count
    }
}

/// How a policy counts the view's tokens against its summary threshold
/// (set with [`ContextPolicyBuilder::token_count`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TokenCount {
    /// [`markov_core::tokens`]' estimate of the view's messages: no call,
    /// no tokenizer, and on the high side (a token per three bytes).
    #[default]
    Estimate,
    /// The estimate first; where it says the threshold is passed, the main
    /// model's own count of the request
    /// ([`Model::count_tokens`](markov_core::Model::count_tokens): the
    /// system prompt, the tools and the view, as the provider counts
    /// them) decides, and the view is summarized only if that count passes
    /// the threshold too.
    ///
    /// A count is remembered with the view it was of; while the view is
    /// only appended to, the estimates of the messages added since are
    /// added to it, and the provider is asked again only when that sum
    /// passes the threshold: near a crossing, never on every step. A
    /// count is a model call that the vendors do not bill (Anthropic's
    /// and Gemini's counts are free), so it is not accounted as usage nor
    /// checked against usage limits.
    ///
    /// A model that offers no count (OpenAI's Chat Completions, a server
    /// without the endpoint), or a count that fails, leaves the decision
    /// to the estimate, with one warning in the trace per machine and
    /// policy; a model that offers none is not asked again.
    Provider,
}

/// Summarizes older turns with a model call once the view's messages
/// pass a token threshold (counted with [`markov_core::tokens`]' estimate;
/// the system prompt and the tools are not counted, so leave room for
/// them below the model's context window).
///
/// The summary is appended to the history as a
/// [`Role::Summary`](markov_core::Role::Summary) message that names the
/// messages it stands for, and the view shows it in their place (as the
/// first text of the first user message kept): one summary per crossing
/// of the threshold, not one per step. A summarizer that fails or writes
/// nothing is asked again only at a new turn or once the view has grown
/// by a quarter of the threshold; a request the model refuses as too long
/// asks it at once.
///
/// The summarizer's calls are model calls like any other: the executor's
/// usage limits admit each one before it is made (its transcript and
/// prompt estimated, its `max_tokens` counted in full, priced at the
/// model its [`settings`](Self::settings) name), and what it used counts
/// in the step's usage.
///
/// [`Summarize::native`] uses the vendor's own compaction instead of a
/// summarizer's prompt, under the same rules.
#[derive(Clone)]
pub struct Summarize {
    model: Arc<dyn Model>,
    settings: ModelSettings,
    prompt: String,
    threshold_tokens: u64,
    keep_last_turns: usize,
    native: bool,
    /// Whether `prompt` was set (refused on a native one).
    prompt_set: bool,
}

impl fmt::Debug for Summarize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Summarize")
            .field("model", &self.model)
            .field("settings", &self.settings)
            .field("threshold_tokens", &self.threshold_tokens)
            .field("keep_last_turns", &self.keep_last_turns)
            .field("native", &self.native)
            .finish_non_exhaustive()
    }
}

impl Summarize {
    /// Summarizes with `model` once the view's messages are estimated at
    /// more than `threshold_tokens`; keeps the last 2 turns (the current one
    /// included) as they are, with [`DEFAULT_SUMMARY_PROMPT`] and
    /// [`DEFAULT_SUMMARY_MAX_TOKENS`].
    pub fn new(model: Arc<dyn Model>, threshold_tokens: u64) -> Self {
        Summarize {
            model,
            settings: ModelSettings {
                max_tokens: DEFAULT_SUMMARY_MAX_TOKENS,
                ..ModelSettings::default()
            },
            prompt: DEFAULT_SUMMARY_PROMPT.to_owned(),
            threshold_tokens,
            keep_last_turns: 2,
            native: false,
            prompt_set: false,
        }
    }

    /// Compacts with `model`'s own compaction
    /// ([`Model::compact`](markov_core::Model::compact): OpenAI's
    /// `/responses/compact`) once the view's messages are estimated at
    /// more than `threshold_tokens`, keeping the last 2 turns as they are:
    /// the turns before them go to the vendor as they are shown (the
    /// leaf's instructions with them), and the opaque items it answers are
    /// appended to the history as a summary message with no text, shown
    /// in their place, verbatim, to a model that reads that vendor's items
    /// ([`Model::native_summaries`](markov_core::Model::native_summaries)).
    /// The threshold, [`Self::keep_last_turns`], the back-off after a
    /// failure, the one compaction per crossing and the usage limits work
    /// as for a summarizer.
    ///
    /// An agent whose model cannot read what `model` makes (another
    /// vendor, a model with no compaction) fails when it is built. The
    /// compaction is asked of the model named by [`Self::settings`], else
    /// of the leaf's own; its `max_tokens` (default
    /// [`DEFAULT_SUMMARY_MAX_TOKENS`]) is what the usage limits count for
    /// its answer. A native summarizer has no prompt: setting one is an
    /// error ([`ContextPolicyError::PromptWithNative`]).
    pub fn native(model: Arc<dyn Model>, threshold_tokens: u64) -> Self {
        Summarize {
            native: true,
            settings: ModelSettings {
                max_tokens: DEFAULT_SUMMARY_MAX_TOKENS,
                ..ModelSettings::default()
            },
            ..Summarize::new(model, threshold_tokens)
        }
    }

    /// Whether this is the vendor's own compaction ([`Self::native`]).
    pub fn is_native(&self) -> bool {
        self.native
    }

    /// The summarizer's instructions (its system prompt).
    #[must_use]
    pub fn prompt(mut self, prompt: impl Into<String>) -> Self {
        self.prompt = prompt.into();
        self.prompt_set = true;
        self
    }

    /// The summarizer's settings (model name, answer tokens).
    #[must_use]
    pub fn settings(mut self, settings: ModelSettings) -> Self {
        self.settings = settings;
        self
    }

    /// How many of the last turns, the current one included, are kept as
    /// they are when the rest is summarized.
    #[must_use]
    pub fn keep_last_turns(mut self, turns: usize) -> Self {
        self.keep_last_turns = turns;
        self
    }

    /// The summarizer's model.
    pub fn model(&self) -> &Arc<dyn Model> {
        &self.model
    }

    /// The summarizer's settings.
    pub fn model_settings(&self) -> &ModelSettings {
        &self.settings
    }

    /// The summarizer's instructions.
    pub fn instructions(&self) -> &str {
        &self.prompt
    }

    /// The estimated tokens past which older turns are summarized.
    pub fn threshold_tokens(&self) -> u64 {
        self.threshold_tokens
    }

    /// How many of the last turns are kept as they are.
    pub fn kept_turns(&self) -> usize {
        self.keep_last_turns
    }
}

/// Builds a [`ContextPolicy`]; [`ContextPolicyBuilder::build`] validates.
#[derive(Debug, Default)]
pub struct ContextPolicyBuilder {
    keep_last_turns: Option<usize>,
    trim_tool_results: Option<usize>,
    summarize: Option<Summarize>,
    token_count: TokenCount,
}

impl ContextPolicyBuilder {
    /// Keeps the last `turns` turns, the current one included; older ones
    /// are left out of the view.
    #[must_use]
    pub fn keep_last_turns(mut self, turns: usize) -> Self {
        self.keep_last_turns = Some(turns);
        self
    }

    /// Keeps the tool results of the last `turns` turns, the current one
    /// included, whole; older results become a stub that names the tool,
    /// the call and the size left out.
    #[must_use]
    pub fn trim_tool_results(mut self, turns: usize) -> Self {
        self.trim_tool_results = Some(turns);
        self
    }

    /// Summarizes older turns (see [`Summarize`]).
    #[must_use]
    pub fn summarize(mut self, summarize: Summarize) -> Self {
        self.summarize = Some(summarize);
        self
    }

    /// How the view's tokens are counted against the summary threshold
    /// (default [`TokenCount::Estimate`]); [`TokenCount::Provider`] asks
    /// the main model for an exact count near a crossing, and needs a
    /// summarizer.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use markov_charter::context::{ContextPolicy, ContextPolicyError, Summarize, TokenCount};
    /// # use markov_core::{Item, Model, ModelError, ModelRequest, ModelResponse, StopReason};
    /// # #[derive(Debug)]
    /// # struct Cheap;
    /// # #[markov_core::async_trait]
    /// # impl Model for Cheap {
    /// #     async fn complete(&self, _r: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
    /// #         Ok(ModelResponse::new(vec![Item::text("a summary")], StopReason::EndTurn))
    /// #     }
    /// # }
    ///
    /// let policy = ContextPolicy::builder()
    ///     .summarize(Summarize::new(Arc::new(Cheap), 100_000))
    ///     .token_count(TokenCount::Provider)
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policy.token_count(), TokenCount::Provider);
    ///
    /// // Exact counts decide only whether to summarize.
    /// let alone = ContextPolicy::builder()
    ///     .keep_last_turns(4)
    ///     .token_count(TokenCount::Provider)
    ///     .build();
    /// assert_eq!(alone.unwrap_err(), ContextPolicyError::CountWithoutSummary);
    /// ```
    #[must_use]
    pub fn token_count(mut self, count: TokenCount) -> Self {
        self.token_count = count;
        self
    }

    /// Validates and freezes the policy.
    ///
    /// # Errors
    /// A count of zero turns (the current turn is always kept), a zero
    /// threshold, an empty summary prompt or a summarizer allowed no
    /// tokens, a policy with no rule at all, and exact token counts
    /// without a summarizer (they decide nothing else).
    pub fn build(self) -> Result<ContextPolicy, ContextPolicyError> {
        if self.token_count == TokenCount::Provider && self.summarize.is_none() {
            return Err(ContextPolicyError::CountWithoutSummary);
        }
        if self.keep_last_turns.is_none()
            && self.trim_tool_results.is_none()
            && self.summarize.is_none()
        {
            return Err(ContextPolicyError::Empty);
        }
        if self.keep_last_turns == Some(0) {
            return Err(ContextPolicyError::ZeroTurns {
                option: "keep_last_turns",
            });
        }
        if self.trim_tool_results == Some(0) {
            return Err(ContextPolicyError::ZeroTurns {
                option: "trim_tool_results",
            });
        }
        if let Some(summarize) = &self.summarize {
            if summarize.keep_last_turns == 0 {
                return Err(ContextPolicyError::ZeroTurns {
                    option: "Summarize::keep_last_turns",
                });
            }
            if summarize.threshold_tokens == 0 {
                return Err(ContextPolicyError::ZeroThreshold);
            }
            if summarize.native && summarize.prompt_set {
                return Err(ContextPolicyError::PromptWithNative);
            }
            if summarize.prompt.trim().is_empty() {
                return Err(ContextPolicyError::EmptyPrompt);
            }
            if summarize.settings.max_tokens == 0 {
                return Err(ContextPolicyError::NoSummaryTokens);
            }
        }
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Ok(ContextPolicy(Arc::new(PolicyInner {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            keep_last_turns: self.keep_last_turns,
            trim_tool_results: self.trim_tool_results,
            summarize: self.summarize,
            token_count: self.token_count,
        })))
    }
}

/// A context policy that makes no sense, refused by
/// [`ContextPolicyBuilder::build`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContextPolicyError {
    /// No rule is set: leave the policy out instead.
    #[error(
        "a context policy needs at least one rule (keep_last_turns, trim_tool_results or summarize)"
    )]
    Empty,
    /// A count of turns is zero; the current turn is always kept, so the
    /// least is 1.
    #[error("{option} must be at least 1: the current turn is always kept")]
    ZeroTurns {
        /// The option at fault.
        option: &'static str,
    },
    /// The summary threshold is zero tokens.
    #[error("the summary threshold must be more than 0 tokens")]
    ZeroThreshold,
    /// The summary prompt is empty.
    #[error("the summary prompt is empty")]
    EmptyPrompt,
    /// The summarizer's settings allow no answer tokens.
    #[error("the summarizer's max_tokens is 0: it could not write a summary")]
    NoSummaryTokens,
    /// [`TokenCount::Provider`] without a summarizer: the count decides
    /// only whether to summarize.
    #[error(
        "token_count(TokenCount::Provider) needs summarize: exact counts only decide when to summarize"
    )]
    CountWithoutSummary,
    /// A prompt on [`Summarize::native`]: the vendor's compaction takes
    /// none.
    #[error("Summarize::native takes no prompt: the vendor's compaction has none")]
    PromptWithNative,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct NoModel;

    #[markov_core::async_trait]
    impl Model for NoModel {
        async fn complete(
            &self,
            _r: markov_core::ModelRequest<'_>,
        ) -> Result<markov_core::ModelResponse, markov_core::ModelError> {
            Err(markov_core::ModelError::InvalidRequest("not called".into()))
        }
    }

    #[test]
    fn nonsense_is_refused_by_name() {
        assert_eq!(
            ContextPolicy::builder().build().unwrap_err(),
            ContextPolicyError::Empty
        );
        assert_eq!(
            ContextPolicy::builder()
                .trim_tool_results(0)
                .build()
                .unwrap_err(),
            ContextPolicyError::ZeroTurns {
                option: "trim_tool_results"
            }
        );
        let policy = ContextPolicy::builder().keep_last_turns(3).build().unwrap();
        assert_eq!(policy.keep_last_turns(), Some(3));
        assert_eq!(policy.trim_tool_results(), None);
        assert!(policy.summarize().is_none());
        let native = Summarize::native(Arc::new(NoModel), 1_000);
        assert!(native.is_native());
        assert!(!Summarize::new(Arc::new(NoModel), 1_000).is_native());
        assert!(
            ContextPolicy::builder()
                .summarize(native.clone())
                .build()
                .is_ok()
        );
        assert_eq!(
            ContextPolicy::builder()
                .summarize(native.prompt("Be brief."))
                .build()
                .unwrap_err(),
            ContextPolicyError::PromptWithNative
        );
        // Each policy is its own.
        let other = ContextPolicy::builder().keep_last_turns(3).build().unwrap();
        assert_ne!(policy, other);
        assert_eq!(policy, policy.clone());
    }
}
