//! Call or replay: the leaf's answer, replayed when an unfinished step
//! recorded one (a replay never calls the model), else asked of the model
//! over what the context policy shows of the history, each call admitted
//! by the usage limits first.

use futures::StreamExt;
use markov_context::{
    Leaf, LeafCalls, LimitExceeded, ModelCall, admit_call, call_in_view, estimate_framing_tokens,
    estimate_input_tokens,
};
use markov_core::message::{Item, Message};
use markov_core::model::{
    Compaction, HistoryId, InputTokenCount, Model, ModelError, ModelRequest, ModelResponse,
    StreamEvent, Usage,
};
use tracing::Instrument;

use super::StandardExecutor;
use super::prepare::Prepared;
use crate::error::RunError;
use crate::executor::{LeafContext, LeafOutcome};
use crate::step::YieldReason;
use crate::stream::{StreamOptions, VesselState};

/// The leaf's answer, called or replayed.
pub(super) struct Answer {
    /// The model's answer (or the recorded one).
    pub(super) response: ModelResponse,
    /// The vessel it was streamed into, when streaming is configured.
    pub(super) vessel: Option<VesselState>,
    /// The answer is the recorded one of an unfinished step: its calls
    /// are already durable.
    pub(super) replayed: bool,
    /// The answer is a paused one being resumed: the step that asked for
    /// it counted its usage.
    pub(super) resumed: bool,
    /// What the leaf's summarizer calls used, beside its model call.
    pub(super) spent: Usage,
}

/// What [`StandardExecutor::call_or_replay`] got.
// Made once per leaf per step and matched at once: boxing would add an
// allocation per step.
#[allow(clippy::large_enum_variant)]
pub(super) enum Reply {
    /// An answer to interpret.
    Answer(Answer),
    /// The step ends without an answer (a usage limit, a context that
    /// does not fit), with what it used.
    Stopped(LeafOutcome),
}

impl StandardExecutor {
    /// The leaf's answer: the recorded answer of an unfinished step (a
    /// crash, a failed write), replayed with the same calls and ids and
    /// never asked of the model again, with the application's edits when
    /// it was paused; else the model's, over what the context policy shows
    /// (see [`Self::call_in_context`]).
    pub(super) async fn call_or_replay(
        &self,
        cx: &LeafContext<'_>,
        prepared: &Prepared,
        span: &tracing::Span,
    ) -> Result<Reply, RunError> {
        let recorded = cx
            .policy
            .answers()
            .find(cx.instance().id(), cx.history.len());
        let replayed = recorded.is_some();
        // A paused answer was counted by the step that asked for it.
        let resumed = replayed && cx.policy.answers().is_paused(cx.instance().id());
        let mut spent = Usage::default();
        if let Some(mut response) = recorded {
            if resumed {
                apply_edits(cx, &mut response);
            }
            tracing::info!(parent: span, "the recorded answer of an unfinished step is replayed");
            return Ok(Reply::Answer(Answer {
                response,
                vessel: None,
                replayed,
                resumed,
                spent,
            }));
        }
        // Pinned where it is made, so instrumenting it moves a reference,
        // not the call's future.
        let called = {
            let called = std::pin::pin!(self.call_in_context(cx, prepared, &mut spent));
            called.instrument(span.clone()).await
        };
        match called {
            Ok(Called::Answer((response, vessel))) => Ok(Reply::Answer(Answer {
                response,
                vessel,
                replayed,
                resumed,
                spent,
            })),
            Ok(Called::Limited(limit)) => {
                // The summary a summarizer made before is queued: the step
                // records it; nothing else happened.
                let mut stopped = LeafOutcome::new(Vec::new(), YieldReason::UsageLimit, cx.turn);
                stopped.usage_limit = Some(limit);
                stopped.usage = spent;
                Ok(Reply::Stopped(stopped))
            }
            Ok(Called::Exhausted(message)) => {
                span.record("error.type", "context_length");
                tracing::warn!(
                    parent: span,
                    %message,
                    "the conversation does not fit the model's context window: the run ends"
                );
                let mut exhausted =
                    LeafOutcome::new(Vec::new(), YieldReason::ContextExhausted, cx.turn);
                exhausted.usage = spent;
                Ok(Reply::Stopped(exhausted))
            }
            Err(error) => {
                span.record("error.type", "model_error");
                Err(error)
            }
        }
    }
}

/// Rewrites the calls of a resumed answer whose arguments the application
/// edited: the history records each call with the arguments it ran with.
/// The answer was never recorded in the history, so nothing recorded is
/// rewritten.
pub(super) fn apply_edits(cx: &LeafContext<'_>, response: &mut ModelResponse) {
    for item in &mut response.content {
        if let Item::ToolUse { id, name, input } = item
            && let Some(args) = cx.policy.edited_args(cx.instance().id(), id, name)
        {
            *input = args;
        }
    }
}

impl StandardExecutor {
    /// The usage limits' verdict on the leaf's model call over `messages`,
    /// whose estimated tokens `message_tokens` gives (kept incrementally:
    /// never a walk of the history): `Ok(None)` when it may be made (its
    /// estimate is then reserved for the step), else the limit it could
    /// pass.
    pub(super) fn admit(
        &self,
        cx: &LeafContext<'_>,
        prepared: &Prepared,
        messages: &[Message],
        message_tokens: impl FnOnce() -> u64,
    ) -> Result<Option<LimitExceeded>, RunError> {
        let call = self.call(prepared);
        let verdict = admit_call(cx.usage, &self.prices, &call, || {
            // The framing (system prompt, tools) does not grow with the
            // conversation; the messages' sum is kept as they are appended.
            let framing = estimate_framing_tokens(&prepared.request(&[]));
            let input = framing.saturating_add(message_tokens());
            // Debug and test builds check the sum kept against the one
            // estimate, walked afresh.
            debug_assert_eq!(
                input,
                estimate_input_tokens(&prepared.request(messages)),
                "the incremental estimate of the request"
            );
            input
        })?;
        Ok(verdict.err())
    }

    /// The leaf's model call, as the usage limits and prices see it.
    pub(super) fn call<'a>(&'a self, prepared: &'a Prepared) -> ModelCall<'a> {
        ModelCall {
            provider: self.model.provider_name(),
            settings: &prepared.settings,
            configured: self.model.model_name(),
        }
    }

    /// Reads the model's stream into `vessel`, reporting each delta, until
    /// the final answer.
    pub(super) async fn read_stream(
        &self,
        request: ModelRequest<'_>,
        vessel: &mut VesselState,
        options: &StreamOptions,
    ) -> Result<ModelResponse, ModelError> {
        if let Some(hold) = &self.hold {
            return super::guard::read_held(self, request, vessel, options, hold).await;
        }
        let mut events = self.model.stream(request);
        while let Some(event) = events.next().await {
            match event? {
                StreamEvent::Done(response) => return Ok(response),
                event => {
                    if let Some(update) = vessel.on_event(&event) {
                        (options.on_message_stream)(&update);
                    }
                }
            }
        }
        Err(ModelError::InvalidResponse(
            "the stream ended without a final message".into(),
        ))
    }

    /// The model call over `messages` (the history `id`, or a context
    /// view of it), streamed into a vessel when streaming is configured.
    pub(super) async fn call_model(
        &self,
        cx: &LeafContext<'_>,
        prepared: &Prepared,
        messages: &[Message],
        id: HistoryId,
    ) -> Result<(ModelResponse, Option<VesselState>), RunError> {
        let request = prepared.request(messages).with_history_id(id);
        let model_error = |source| RunError::Model {
            step: cx.current_step,
            source,
        };
        let Some(options) = &self.streaming else {
            let response = self.model.complete(request).await.map_err(model_error)?;
            return Ok((response, None));
        };
        let mut vessel = VesselState::new(cx.source());
        let (message, event) = vessel.start();
        cx.queue.enqueue([message]);
        (options.on_message_stream)(&event);
        // Structured output is never streamed.
        let result = if prepared.output_schema.is_none() {
            // Boxed, so that the stream's reader does not enlarge the step
            // future of every call that is not streamed.
            Box::pin(self.read_stream(request, &mut vessel, options)).await
        } else {
            self.model.complete(request).await
        };
        match result {
            Ok(response) => Ok((response, Some(vessel))),
            Err(error) => {
                let (message, event) = vessel.fail(error.to_string());
                cx.queue.enqueue([message]);
                (options.on_message_stream)(&event);
                Err(model_error(error))
            }
        }
    }
}

/// What [`StandardExecutor::call_in_context`] got: the model's answer
/// and the vessel it was streamed into.
pub(super) type Called = markov_context::Called<(ModelResponse, Option<VesselState>)>;

/// Whether `result` failed because the request does not fit the model's
/// context window; its message if so.
fn context_length(error: &RunError) -> Option<String> {
    match error {
        RunError::Model {
            source: ModelError::ContextLength(message),
            ..
        } => Some(message.clone()),
        _ => None,
    }
}

impl StandardExecutor {
    /// The model call over what the leaf's context policy shows of the
    /// history (the node's policy, else the executor's; see
    /// [`markov_context::call_in_view`], which makes its calls through
    /// [`PolicyCalls`]), or over the whole history without one. Without a
    /// policy, a request the model refuses as too long is
    /// [`Called::Exhausted`]. Every call is admitted by the usage limits
    /// right before it is made; what a summarizer's or compaction's
    /// answered calls used is added to `spent`.
    pub(super) async fn call_in_context(
        &self,
        cx: &LeafContext<'_>,
        prepared: &Prepared,
        spent: &mut Usage,
    ) -> Result<Called, RunError> {
        let policy = cx
            .instance()
            .node()
            .context_policy()
            .or(self.context_policy.as_ref());
        let Some(policy) = policy else {
            let tokens = || cx.views.history_tokens(cx.history, cx.history_id);
            if let Some(limit) = self.admit(cx, prepared, cx.history, tokens)? {
                return Ok(Called::Limited(limit));
            }
            return match self
                .call_model(cx, prepared, cx.history, cx.history_id)
                .await
            {
                Ok(answer) => Ok(Called::Answer(answer)),
                Err(error) => match context_length(&error) {
                    Some(message) => Ok(Called::Exhausted(message)),
                    None => Err(error),
                },
            };
        };
        let leaf = Leaf {
            policy,
            views: cx.views,
            history: cx.history,
            meter: cx.usage,
            prices: &self.prices,
            provider: self.model.provider_name(),
            native: self.model.native_summaries(),
            system: &prepared.system,
            model: prepared.settings.model.as_deref(),
        };
        let calls = PolicyCalls {
            executor: self,
            cx,
            prepared,
        };
        // Boxed: the policy's summaries and counts would make every leaf's
        // step future larger, copied whole on every step without a policy.
        Box::pin(call_in_view(&leaf, &calls, spent)).await
    }
}

/// The calls a leaf's step under a context policy makes, for
/// [`call_in_view`]: the leaf's own as without a policy, the others
/// straight to the model they name.
struct PolicyCalls<'a, 'c> {
    executor: &'a StandardExecutor,
    cx: &'a LeafContext<'c>,
    prepared: &'a Prepared,
}

impl LeafCalls for PolicyCalls<'_, '_> {
    type Answer = (ModelResponse, Option<VesselState>);
    type Error = RunError;

    fn admit(&self, messages: &[Message], tokens: u64) -> Result<Option<LimitExceeded>, RunError> {
        self.executor
            .admit(self.cx, self.prepared, messages, || tokens)
    }

    async fn call(&self, messages: &[Message], id: HistoryId) -> Result<Self::Answer, RunError> {
        self.executor
            .call_model(self.cx, self.prepared, messages, id)
            .await
    }

    fn too_long(error: &RunError) -> Option<String> {
        context_length(error)
    }

    async fn count(
        &self,
        messages: &[Message],
        id: HistoryId,
    ) -> Result<InputTokenCount, ModelError> {
        let request = self.prepared.request(messages).with_history_id(id);
        self.executor.model.count_tokens(request).await
    }

    async fn summarize(
        &self,
        model: &dyn Model,
        request: ModelRequest<'_>,
    ) -> Result<ModelResponse, ModelError> {
        model.complete(request).await
    }

    async fn compact(
        &self,
        model: &dyn Model,
        request: ModelRequest<'_>,
    ) -> Result<Compaction, ModelError> {
        model.compact(request).await
    }

    fn record(&self, summary: Message) {
        self.cx.queue.enqueue([summary]);
    }
}
