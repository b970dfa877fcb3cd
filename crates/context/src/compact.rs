//! A leaf's model call under a context policy: the view it is shown, the
//! summary or native compaction a view past its threshold needs first, the
//! model's own count where the policy asks for one, and the forced
//! compaction and second call after a refusal as too long.
//!
//! This module decides and keeps the books; it calls no model. Every call
//! — the leaf's, the summarizer's, a compaction, a count — is made by the
//! caller through [`LeafCalls`], so the executor keeps its requests,
//! streams and errors, and this crate keeps the views, the estimates and
//! the usage limits.

use std::future::Future;

use markov_charter::context::{ContextPolicy, TokenCount};
use markov_core::message::{Item, Message};
use markov_core::model::{
    Compaction, HistoryId, InputTokenCount, Model, ModelError, ModelRequest, ModelResponse,
    ModelSettings, Usage,
};
use tracing::Instrument;

use crate::count::{Known, Unavailable};
use crate::usage::{
    LimitExceeded, ModelCall, NoPrice, Prices, UsageMeter, admit_call, estimate_input_tokens,
    metered, metered_usage,
};
use crate::views::{ContextViews, Forced, Prepared, SummaryJob, ViewRef, native_reads};

/// The model calls a leaf's step under a context policy makes, made by the
/// caller: [`call_in_view`] decides which and when.
pub trait LeafCalls: Sync {
    /// What the leaf's own call answers.
    type Answer: Send;
    /// The caller's error; a missing price for a usage limit on money
    /// becomes one.
    type Error: From<NoPrice> + Send;

    /// The usage limits' verdict on the leaf's call over `messages`, whose
    /// estimated tokens are `tokens`: `Ok(None)` when it may be made (its
    /// estimate is then reserved), else the limit it could pass.
    ///
    /// # Errors
    /// The caller's, such as a limit on money without a price.
    fn admit(
        &self,
        messages: &[Message],
        tokens: u64,
    ) -> Result<Option<LimitExceeded>, Self::Error>;

    /// The leaf's call over `messages`, the view `id`.
    fn call(
        &self,
        messages: &[Message],
        id: HistoryId,
    ) -> impl Future<Output = Result<Self::Answer, Self::Error>> + Send;

    /// The provider's message when `error` refuses a request as too long
    /// for the model's context window.
    fn too_long(error: &Self::Error) -> Option<String>;

    /// The leaf's model's count of the leaf's request over `messages`.
    fn count(
        &self,
        messages: &[Message],
        id: HistoryId,
    ) -> impl Future<Output = Result<InputTokenCount, ModelError>> + Send;

    /// The summarizer's call: `request` answered by `model`.
    fn summarize(
        &self,
        model: &dyn Model,
        request: ModelRequest<'_>,
    ) -> impl Future<Output = Result<ModelResponse, ModelError>> + Send;

    /// A native compaction: `request` compacted by `model`.
    fn compact(
        &self,
        model: &dyn Model,
        request: ModelRequest<'_>,
    ) -> impl Future<Output = Result<Compaction, ModelError>> + Send;

    /// Records a summary message in the history (the step's queue).
    fn record(&self, summary: Message);
}

/// The leaf a call under a context policy is made for.
#[derive(Debug, Clone, Copy)]
pub struct Leaf<'a> {
    /// The policy in force (the node's, else the executor's).
    pub policy: &'a ContextPolicy,
    /// The machine's views.
    pub views: &'a ContextViews,
    /// The leaf's history.
    pub history: &'a [Message],
    /// The conversation's usage and limits.
    pub meter: &'a UsageMeter,
    /// The prices the calls are metered at.
    pub prices: &'a Prices,
    /// The leaf's model's
    /// [`provider_name`](markov_core::Model::provider_name).
    pub provider: &'a str,
    /// The leaf's model's
    /// [`native_summaries`](markov_core::Model::native_summaries).
    pub native: Option<&'a str>,
    /// The leaf's system prompt, which a native compaction is sent with.
    pub system: &'a str,
    /// The model the leaf's settings ask for, which a native compaction
    /// asks for too unless the policy names one.
    pub model: Option<&'a str>,
}

/// What [`call_in_view`] got.
#[derive(Debug)]
pub enum Called<A> {
    /// The leaf's answer.
    Answer(A),
    /// The model refused the request as too long for its context window,
    /// and no compaction could make it fit: the provider's message.
    Exhausted(String),
    /// A usage limit refused the next call (the summarizer's or the
    /// leaf's), which was not made.
    Limited(LimitExceeded),
}

/// What a summary or compaction did.
enum Summarized {
    /// The summary is in the view, and recorded.
    Done,
    /// The summarizer failed or wrote nothing: the view is as it was.
    Failed,
    /// Another leaf compacted the view meanwhile: the summary is not used.
    Stale,
    /// A usage limit refused the call, which was not made.
    Limited(LimitExceeded),
}

/// The leaf's call over what `leaf.policy` shows of its history. A view
/// past its summary threshold is summarized first (by the policy's
/// summarizer, or the vendor's own compaction); under a policy that counts
/// with the provider, a view whose estimate passes the threshold but whose
/// count does not is sent as it is. A request the model refuses as too
/// long is compacted at once — everything before the current turn
/// summarized or left out — and sent once more; when the current turn alone
/// is too long the answer is [`Called::Exhausted`].
///
/// Every call is admitted by the usage limits right before it is made,
/// with the estimate of what it sends. A refused request's reservation
/// stays for the rest of the step: providers do not bill a request refused
/// as too long, so this errs on the side of spending less. What the
/// summarizer's and compactions' answered calls used is added to `spent`;
/// a failed one is logged, and the view stays as it was.
///
/// # Errors
/// The caller's errors, but for a refusal as too long.
pub async fn call_in_view<C: LeafCalls>(
    leaf: &Leaf<'_>,
    calls: &C,
    spent: &mut Usage,
) -> Result<Called<C::Answer>, C::Error> {
    let (policy, views, history) = (leaf.policy, leaf.views, leaf.history);
    // The native summaries the model may be shown: its own vendor's, under
    // a policy that compacts natively.
    let reads = native_reads(policy, leaf.native);
    // A view the model counts within its threshold is sent as it is.
    let counted = within_by_count(leaf, calls, reads).await;
    let view = match counted.map_or_else(|| views.prepare(policy, history, reads), Prepared::Ready)
    {
        Prepared::Ready(view) => view,
        Prepared::Summarize(job) => {
            match summarize(leaf, calls, job, spent).await? {
                Summarized::Limited(limit) => return Ok(Called::Limited(limit)),
                Summarized::Failed => views.summary_failed(policy),
                Summarized::Done | Summarized::Stale => {}
            }
            views.current(policy, history, reads)
        }
    };
    if let Some(limit) = calls.admit(&view.messages, view.tokens)? {
        return Ok(Called::Limited(limit));
    }
    let result = calls.call(&view.messages, view.id).await;
    let message = match result {
        Err(error) => match C::too_long(&error) {
            Some(message) => message,
            None => return Err(error),
        },
        Ok(answer) => return Ok(Called::Answer(answer)),
    };
    drop(view);
    tracing::warn!(%message, "the model refused the context as too long: it is compacted and the call made again");
    match views.force(policy, history, reads) {
        Forced::Nothing => return Ok(Called::Exhausted(message)),
        Forced::Done => {}
        Forced::Summarize(job) => match summarize(leaf, calls, job, spent).await? {
            Summarized::Limited(limit) => return Ok(Called::Limited(limit)),
            Summarized::Failed | Summarized::Stale => views.drop_before_current(policy),
            Summarized::Done => {}
        },
    }
    let view = views.current(policy, history, reads);
    // A second request, admitted on its own estimate.
    if let Some(limit) = calls.admit(&view.messages, view.tokens)? {
        return Ok(Called::Limited(limit));
    }
    match calls.call(&view.messages, view.id).await {
        Ok(answer) => Ok(Called::Answer(answer)),
        Err(error) => match C::too_long(&error) {
            Some(message) => Ok(Called::Exhausted(message)),
            None => Err(error),
        },
    }
}

/// The span of a summarizer's or compaction's call, with the fields both
/// record.
macro_rules! compaction_span {
    ($name:literal, $call:expr) => {
        tracing::info_span!(
            $name,
            gen_ai.provider.name = $call.provider,
            gen_ai.request.model = $call.settings.model.as_deref().unwrap_or(""),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        )
    };
}

/// Admits a summarizer's or compaction's call (`what`) over `request`:
/// its input estimated, its `max_tokens` counted in full, priced at its own
/// model. A refusal is logged.
fn admit_compaction(
    leaf: &Leaf<'_>,
    call: &ModelCall<'_>,
    request: &ModelRequest<'_>,
    what: &str,
) -> Result<Option<LimitExceeded>, NoPrice> {
    let verdict = admit_call(leaf.meter, leaf.prices, call, || {
        estimate_input_tokens(request)
    })?;
    Ok(verdict.err().inspect(|limit| {
        tracing::info!(%limit, "a usage limit refuses the {what} call: the leaf stops before it");
    }))
}

/// Records what a call used on its span, and adds it to `spent`.
fn account(span: &tracing::Span, used: Usage, spent: &mut Usage) {
    span.record("gen_ai.usage.input_tokens", used.input_tokens);
    span.record("gen_ai.usage.output_tokens", used.output_tokens);
    *spent += used;
}

/// Summarizes `job` with the policy's summarizer (or compacts it, under a
/// native compaction) and puts the summary in the view and the history.
async fn summarize<C: LeafCalls>(
    leaf: &Leaf<'_>,
    calls: &C,
    mut job: SummaryJob,
    spent: &mut Usage,
) -> Result<Summarized, C::Error> {
    let Some(summarize) = leaf.policy.summarize() else {
        return Ok(Summarized::Failed);
    };
    if summarize.is_native() {
        return Ok(compact(leaf, calls, job, spent).await?);
    }
    let model = summarize.model();
    let call = ModelCall {
        provider: model.provider_name(),
        settings: summarize.model_settings(),
        configured: model.model_name(),
    };
    let messages = [Message::user(std::mem::take(&mut job.transcript))];
    let request = ModelRequest::new(
        summarize.instructions(),
        &messages,
        summarize.model_settings(),
    );
    if let Some(limit) = admit_compaction(leaf, &call, &request, "summarizer's")? {
        return Ok(Summarized::Limited(limit));
    }
    let span = compaction_span!("summarize", call);
    let answer = calls
        .summarize(&**model, request)
        .instrument(span.clone())
        .await;
    let text = match answer {
        Ok(response) => {
            account(&span, metered(leaf.prices, &call, &response), spent);
            response
                .content
                .iter()
                .filter_map(|item| match item {
                    Item::Text { text } => Some(text.as_str()),
                    _ => None,
                })
                .collect::<String>()
        }
        Err(error) => {
            span.record("error.type", "model_error");
            tracing::warn!(parent: &span, %error, "the summarizer failed: the context is not summarized");
            return Ok(Summarized::Failed);
        }
    };
    if text.trim().is_empty() {
        tracing::warn!(parent: &span, "the summarizer wrote nothing: the context is not summarized");
        return Ok(Summarized::Failed);
    }
    Ok(applied(
        calls,
        leaf.views.apply_summary(leaf.policy, job, text),
    ))
}

/// The summary message, recorded; `Stale` when the view took none.
fn applied<C: LeafCalls>(calls: &C, summary: Option<Message>) -> Summarized {
    match summary {
        Some(message) => {
            calls.record(message);
            Summarized::Done
        }
        None => Summarized::Stale,
    }
}

/// Compacts `job` with the vendor's own compaction
/// ([`Model::compact`](markov_core::Model::compact) of the policy's
/// model): the view's messages before the kept turns, as they are shown,
/// with the leaf's system prompt. The vendor's items go into the view in
/// their place and, as a summary message, to the history.
///
/// A model that offers no compaction, items of a vendor the leaf's model
/// does not read (an executor configured by hand; an agent's builder
/// refuses both) and a failed call are warned about and end as a failed
/// summarizer does: the view stays as it was, and the policy backs off.
async fn compact<C: LeafCalls>(
    leaf: &Leaf<'_>,
    calls: &C,
    mut job: SummaryJob,
    spent: &mut Usage,
) -> Result<Summarized, NoPrice> {
    let policy = leaf.policy;
    let Some(summarize) = policy.summarize() else {
        return Ok(Summarized::Failed);
    };
    let model = summarize.model();
    // The leaf's own model name unless the policy names one: the items
    // are read by the leaf's model.
    let settings = ModelSettings {
        model: summarize
            .model_settings()
            .model
            .clone()
            .or_else(|| leaf.model.map(str::to_owned)),
        ..summarize.model_settings().clone()
    };
    let call = ModelCall {
        provider: model.provider_name(),
        settings: &settings,
        configured: model.model_name(),
    };
    let messages = std::mem::take(&mut job.messages);
    let request = ModelRequest::new(leaf.system, &messages, &settings);
    if let Some(limit) = admit_compaction(leaf, &call, &request, "compaction")? {
        return Ok(Summarized::Limited(limit));
    }
    let span = compaction_span!("compact", call);
    let compacted = match calls
        .compact(&**model, request)
        .instrument(span.clone())
        .await
    {
        Ok(Compaction::Compacted(compacted)) => compacted,
        Ok(_) => {
            span.record("error.type", "not_offered");
            if leaf.views.native_unavailable(policy.id()) {
                tracing::warn!(parent: &span, "the context policy's model offers no compaction of its own: the context is not compacted (warned once)");
            }
            return Ok(Summarized::Failed);
        }
        Err(error) => {
            span.record("error.type", "model_error");
            tracing::warn!(parent: &span, %error, "the compaction failed: the context is not compacted");
            return Ok(Summarized::Failed);
        }
    };
    let used = metered_usage(leaf.prices, &call, compacted.usage, None);
    account(&span, used, spent);
    let vendor = compacted.native.vendor.clone();
    if leaf.native != Some(vendor.as_str()) {
        span.record("error.type", "unreadable");
        if leaf.views.native_unavailable(policy.id()) {
            tracing::warn!(parent: &span, vendor, "the compaction's items cannot be read by the leaf's model: the context is not compacted (warned once)");
        }
        return Ok(Summarized::Failed);
    }
    if compacted.native.items.is_empty() {
        tracing::warn!(parent: &span, "the compaction answered no items: the context is not compacted");
        return Ok(Summarized::Failed);
    }
    Ok(applied(
        calls,
        leaf.views.apply_native(policy, job, compacted.native),
    ))
}

/// Under a policy that counts with the provider ([`TokenCount::Provider`]):
/// the leaf's view, to send as it is, when its estimate passes the summary
/// threshold but the model's count of the request (remembered, plus the
/// estimates since) does not. `None` when the estimate decides: it is
/// within the threshold, the count passes it too, or no count could be had
/// (a model that offers none, a failed count: warned about once per
/// machine and policy).
///
/// The count is not a billed call (see [`TokenCount::Provider`]): it is not
/// checked against the usage limits nor accounted.
async fn within_by_count<C: LeafCalls>(
    leaf: &Leaf<'_>,
    calls: &C,
    reads: Option<&str>,
) -> Option<ViewRef> {
    let policy = leaf.policy;
    if policy.token_count() != TokenCount::Provider {
        return None;
    }
    let threshold = policy.summarize()?.threshold_tokens();
    let view = leaf.views.summary_due(policy, leaf.history, reads)?;
    let counts = &leaf.views.counts;
    match counts.known(policy.id(), view.id, &view.messages, threshold) {
        Known::Within => return Some(view),
        Known::Estimate => return None,
        Known::Ask => {}
    }
    let span = tracing::info_span!(
        "count_view",
        gen_ai.provider.name = leaf.provider,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        threshold,
    );
    let counted = calls
        .count(&view.messages, view.id)
        .instrument(span.clone())
        .await;
    let (why, error) = match counted {
        Ok(InputTokenCount::Counted(tokens)) => {
            span.record("gen_ai.usage.input_tokens", tokens);
            counts.remember(policy.id(), view.id, view.messages.len(), tokens);
            return (tokens <= threshold).then_some(view);
        }
        Ok(_) => (Unavailable::NotOffered, None),
        Err(error) => (Unavailable::Failed, Some(error)),
    };
    let error = error.map(|e| e.to_string()).unwrap_or_default();
    if counts.unavailable(policy.id(), why) {
        tracing::warn!(parent: &span, ?why, %error, "no exact token count: the context policy's estimate decides when to summarize (warned once)");
    } else {
        tracing::debug!(parent: &span, ?why, %error, "no exact token count: the estimate decides");
    }
    None
}
