//! Compaction glue: the summarizer's or the vendor's compaction called
//! for a view past its threshold, and the model's own count of a view,
//! each admitted and metered like any model call.

use markov_charter::context::{ContextPolicy, TokenCount};
use markov_context::{
    LimitExceeded, ModelCall, admit_call, estimate_input_tokens, metered, metered_usage,
};
use markov_core::message::{Item, Message};
use markov_core::model::{Compaction, InputTokenCount, Model, ModelRequest, ModelSettings};
use tracing::Instrument;

use super::StandardExecutor;
use super::prepare::Prepared;
use crate::error::RunError;
use crate::executor::LeafContext;
use markov_context::SummaryJob;

/// What [`StandardExecutor::summarize`] did.
pub(super) enum Summarized {
    /// The summary is in the view, and queued for the history.
    Done,
    /// The summarizer failed or wrote nothing: the view is as it was.
    Failed,
    /// Another leaf compacted the view while the summarizer ran: its
    /// summary is not used.
    Stale,
    /// A usage limit refused the summarizer's call, which was not made.
    Limited(LimitExceeded),
}

impl StandardExecutor {
    /// Summarizes `job` with the policy's summarizer and puts the summary
    /// in the view; the summary message goes to the queue, so the step
    /// records it in the history. The summarizer's call passes the usage
    /// limits first, like any model call (its transcript and instructions
    /// estimated, its `max_tokens` counted in full, priced at its own
    /// model and provider), and what it used is added to `spent`. A failed
    /// summarizer is logged, and the view stays as it was.
    pub(super) async fn summarize(
        &self,
        cx: &LeafContext<'_>,
        policy: &ContextPolicy,
        prepared: &Prepared,
        mut job: SummaryJob,
        spent: &mut markov_core::model::Usage,
    ) -> Result<Summarized, RunError> {
        let Some(summarize) = policy.summarize() else {
            return Ok(Summarized::Failed);
        };
        if summarize.is_native() {
            return self.compact(cx, policy, prepared, job, spent).await;
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
        if let Err(limit) = admit_call(cx.usage, &self.prices, &call, || {
            estimate_input_tokens(&request)
        })? {
            tracing::info!(%limit, "a usage limit refuses the summarizer's call: the leaf stops before it");
            return Ok(Summarized::Limited(limit));
        }
        let span = tracing::info_span!(
            "summarize",
            gen_ai.provider.name = call.provider,
            gen_ai.request.model = call.settings.model.as_deref().unwrap_or(""),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let answer = model.complete(request).instrument(span.clone()).await;
        let text = match answer {
            Ok(response) => {
                let used = metered(&self.prices, &call, &response);
                span.record("gen_ai.usage.input_tokens", used.input_tokens);
                span.record("gen_ai.usage.output_tokens", used.output_tokens);
                *spent += used;
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
        match cx.views.apply_summary(policy, job, text) {
            Some(message) => {
                cx.queue.enqueue([message]);
                Ok(Summarized::Done)
            }
            None => Ok(Summarized::Stale),
        }
    }
}

impl StandardExecutor {
    /// Compacts `job` with the vendor's own compaction
    /// ([`Model::compact`](markov_core::Model::compact) of the policy's
    /// model): the view's messages before the kept turns, as they are
    /// shown, with the leaf's instructions. The vendor's items go into the
    /// view in their place and, as a summary message, to the queue, so the
    /// step records them. The call passes the usage limits first, its
    /// input estimated and the settings' `max_tokens` counted for its
    /// answer, and what it used is added to `spent`.
    ///
    /// A model that offers no compaction, items of a vendor the leaf's
    /// model does not read (an executor configured by hand; an agent's
    /// builder refuses both) and a failed call are warned about and end
    /// as a failed summarizer does: the view stays as it was, and the
    /// policy backs off.
    pub(super) async fn compact(
        &self,
        cx: &LeafContext<'_>,
        policy: &ContextPolicy,
        prepared: &Prepared,
        mut job: SummaryJob,
        spent: &mut markov_core::model::Usage,
    ) -> Result<Summarized, RunError> {
        let Some(summarize) = policy.summarize() else {
            return Ok(Summarized::Failed);
        };
        let model = summarize.model();
        // The leaf's own model name unless the policy names one: the
        // items are read by the leaf's model.
        let settings = ModelSettings {
            model: summarize
                .model_settings()
                .model
                .clone()
                .or_else(|| prepared.settings.model.clone()),
            ..summarize.model_settings().clone()
        };
        let call = ModelCall {
            provider: model.provider_name(),
            settings: &settings,
            configured: model.model_name(),
        };
        let messages = std::mem::take(&mut job.messages);
        let request = ModelRequest::new(&prepared.system, &messages, &settings);
        if let Err(limit) = admit_call(cx.usage, &self.prices, &call, || {
            estimate_input_tokens(&request)
        })? {
            tracing::info!(%limit, "a usage limit refuses the compaction call: the leaf stops before it");
            return Ok(Summarized::Limited(limit));
        }
        let span = tracing::info_span!(
            "compact",
            gen_ai.provider.name = call.provider,
            gen_ai.request.model = call.settings.model.as_deref().unwrap_or(""),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let compacted = match model.compact(request).instrument(span.clone()).await {
            Ok(Compaction::Compacted(compacted)) => compacted,
            Ok(_) => {
                span.record("error.type", "not_offered");
                if cx.views.native_unavailable(policy.id()) {
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
        let used = metered_usage(&self.prices, &call, compacted.usage, None);
        span.record("gen_ai.usage.input_tokens", used.input_tokens);
        span.record("gen_ai.usage.output_tokens", used.output_tokens);
        *spent += used;
        let vendor = compacted.native.vendor.clone();
        if self.model.native_summaries() != Some(vendor.as_str()) {
            span.record("error.type", "unreadable");
            if cx.views.native_unavailable(policy.id()) {
                tracing::warn!(parent: &span, vendor, "the compaction's items cannot be read by the leaf's model: the context is not compacted (warned once)");
            }
            return Ok(Summarized::Failed);
        }
        if compacted.native.items.is_empty() {
            tracing::warn!(parent: &span, "the compaction answered no items: the context is not compacted");
            return Ok(Summarized::Failed);
        }
        match cx.views.apply_native(policy, job, compacted.native) {
            Some(message) => {
                cx.queue.enqueue([message]);
                Ok(Summarized::Done)
            }
            None => Ok(Summarized::Stale),
        }
    }
}

impl StandardExecutor {
    /// Under a policy that counts with the provider
    /// ([`TokenCount::Provider`]): the leaf's view, to send as it is, when
    /// its estimate passes the summary threshold but the model's count of
    /// the request (remembered, plus the estimates since) does not. `None`
    /// when the estimate decides: it is within the threshold, the count
    /// passes it too, or no count could be had (a model that offers none,
    /// a failed count: warned about once per machine and policy).
    ///
    /// The count is not a billed call (see [`TokenCount::Provider`]): it
    /// is not checked against the usage limits nor accounted.
    pub(super) async fn within_by_count(
        &self,
        cx: &LeafContext<'_>,
        policy: &ContextPolicy,
        prepared: &Prepared,
        reads: Option<&str>,
    ) -> Option<markov_context::ViewRef> {
        use markov_context::{Known, Unavailable};
        if policy.token_count() != TokenCount::Provider {
            return None;
        }
        let threshold = policy.summarize()?.threshold_tokens();
        let view = cx.views.summary_due(policy, cx.history, reads)?;
        let counts = &cx.views.counts;
        match counts.known(policy.id(), view.id, &view.messages, threshold) {
            Known::Within => return Some(view),
            Known::Estimate => return None,
            Known::Ask => {}
        }
        let span = tracing::info_span!(
            "count_view",
            gen_ai.provider.name = self.model.provider_name(),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            threshold,
        );
        let request = prepared.request(&view.messages).with_history_id(view.id);
        let counted = self
            .model
            .count_tokens(request)
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
}
