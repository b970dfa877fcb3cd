//! Record: an answer with calls made durable before any tool runs, its
//! usage metered, and the answer interpreted into the step's first entries.

use std::collections::{HashMap, HashSet};

use markov_context::metered;
use markov_core::MessageId;
use markov_core::ids::ToolCallId;
use markov_core::message::{Item, MAX_ARGUMENT_DEPTH, Message, nesting_exceeds};
use markov_core::model::{ModelResponse, StopReason, Usage};
use markov_core::tool::{InvalidArguments, ToolCallError, ToolExecutionResult, ToolName};
use markov_policy::{ErrorFormat, RecordedAnswer, Rejection, ToolErrorKind};
use serde_json::Value;

use super::call::Answer;
use super::prepare::{Prepared, ancestor_views, provider_tool_names};
use super::tools::tool_calls;
use super::{CUT_OFF_TOOL_CALL, DUPLICATE_TOOL_CALL, StandardExecutor, with_source};
use crate::effect::Entry;
use crate::error::RunError;
use crate::executor::{LeafContext, LeafOutcome};
use crate::respond::lookup::may_pause;
use crate::step::YieldReason;
use crate::stream::{MessageStreamEvent, VesselState};

/// What the step used and the model that answered, set on its outcome
/// however it ends.
pub(super) struct Metered {
    usage: Usage,
    model: Option<String>,
}

impl Metered {
    /// Adds what the step's tool calls spent themselves.
    pub(super) fn add(&mut self, usage: Usage) {
        self.usage += usage;
    }

    /// `outcome` with the step's usage and model.
    pub(super) fn onto(self, mut outcome: LeafOutcome) -> LeafOutcome {
        outcome.usage = self.usage;
        outcome.model = self.model;
        outcome
    }
}

/// An answer whose calls are to run.
pub(super) struct ToolStep {
    /// Entries so far (the assistant message first).
    pub(super) entries: Vec<Entry>,
    /// The results of calls answered without running.
    pub(super) refused: Vec<ToolExecutionResult>,
    /// What the step used so far.
    pub(super) metered: Metered,
    /// The streamed vessel's message, removed from the queue if the step
    /// pauses.
    pub(super) vessel_id: Option<MessageId>,
    /// The answer is a paused one being resumed.
    pub(super) resumed: bool,
    /// Set when the answer was not recorded, nothing being able to replay
    /// it: the length of the history it was asked over (see
    /// [`LeafView::unrecorded`](crate::respond::pipeline::LeafView)).
    pub(super) unrecorded: Option<u64>,
}

/// What [`StandardExecutor::record`] decided.
// Made once per leaf per step and matched at once: boxing would add an
// allocation per step.
#[allow(clippy::large_enum_variant)]
pub(super) enum Recorded {
    /// The leaf is done for this step.
    Finished(LeafOutcome),
    /// The answer's calls run next.
    Calls(ToolStep),
}

impl StandardExecutor {
    /// Records the answer: one with calls, unless replayed, is made
    /// durable before the first tool runs (a resumed step must answer
    /// these calls, not ask the model for new ones); its usage is metered
    /// (nothing for a resumed answer, which its first step counted) with
    /// what the summarizer used; and it is interpreted, a streamed vessel
    /// completed with it.
    pub(super) async fn record(
        &self,
        cx: &LeafContext<'_>,
        prepared: &Prepared,
        answer: Answer,
        span: &tracing::Span,
    ) -> Result<Recorded, RunError> {
        let Answer {
            response,
            vessel,
            replayed,
            resumed,
            spent,
        } = answer;
        let history_len = u64::try_from(cx.history.len()).unwrap_or(u64::MAX);
        // Nothing can replay an answer that no journal keeps, whose calls
        // cannot pause the step and that is not a replay itself: without a
        // registry (policies off), it is not recorded and its calls keep no
        // ledger entries.
        let unrecorded = (!replayed
            && self.registry.is_none()
            && cx.policy.journal().is_none()
            && !may_pause(
                cx.charter,
                cx.instance().node(),
                &ancestor_views(cx),
                cx.is_worker(),
                response.tool_calls().map(|(_, name, _)| name),
            ))
        .then_some(history_len);
        if !replayed && unrecorded.is_none() && response.tool_calls().next().is_some() {
            let answer = RecordedAnswer {
                instance: cx.instance().id().clone(),
                history_len,
                response: response.clone(),
                paused: false,
            };
            if let Err(reason) = cx.policy.record_answer(answer).await {
                span.record("error.type", "journal_error");
                return Err(RunError::AnswerNotRecorded {
                    step: cx.current_step,
                    reason,
                });
            }
        }
        let mut usage = if resumed {
            Usage::default()
        } else {
            metered(&self.prices, &self.call(prepared), &response)
        };
        usage += spent;
        span.record("gen_ai.usage.input_tokens", usage.input_tokens);
        span.record("gen_ai.usage.output_tokens", usage.output_tokens);
        let model = response.model.clone();
        if let Some(model) = &model {
            span.record("gen_ai.response.model", model.as_str());
        }
        span.record(
            "gen_ai.response.finish_reasons",
            tracing::field::debug([&response.stop_reason]),
        );
        if self.capture_content
            && !span.is_disabled()
            && let Ok(json) = serde_json::to_string(&response.content)
        {
            span.record("gen_ai.output.messages", json.as_str());
        }
        let errors = match self.registry {
            Some(_) => ErrorFormat::Envelope,
            None => ErrorFormat::PlainText,
        };
        let mut after = interpret(cx, response, errors);
        let vessel_id = vessel.as_ref().map(|v| v.message_id().clone());
        if let Some(mut vessel) = vessel
            && let Some(event) = finalize_vessel(&mut vessel, &mut after)
            && let Some(options) = &self.streaming
        {
            (options.on_message_stream)(&event);
        }
        let metered = Metered { usage, model };
        Ok(match after {
            AfterModel::Finish(outcome) => Recorded::Finished(metered.onto(outcome)),
            AfterModel::RunTools { entries, refused } => Recorded::Calls(ToolStep {
                entries,
                refused,
                metered,
                vessel_id,
                resumed,
                unrecorded,
            }),
        })
    }
}

/// What to do after the model answered.
#[derive(Debug)]
pub(super) enum AfterModel {
    /// The leaf is done for this step.
    Finish(LeafOutcome),
    /// Run the calls of the assistant message (see [`tool_calls`]), then
    /// call [`after_tools`] with `entries` so far.
    RunTools {
        /// Entries so far (the assistant message).
        entries: Vec<Entry>,
        /// The results of calls answered without running (a repeated id),
        /// to record after the pipeline's.
        refused: Vec<ToolExecutionResult>,
    },
}

/// Interprets the model's answer. The assistant message is always the first
/// of the returned entries.
///
/// Calls of provider built-in tools are not run and get no result: the
/// provider answered them in the same response
/// ([`Item::ProviderToolUse`]/[`Item::ProviderToolResult`], kept as they
/// are). A plain `tool_use` naming a provider tool offered to this leaf (a
/// client that reports server calls as ordinary calls) is recorded as an
/// [`Item::ProviderToolUse`], so the history keeps one result per client
/// call. An answer whose only calls are provider calls ends the turn like a
/// text answer.
///
/// Arguments nested deeper than [`MAX_ARGUMENT_DEPTH`] could be recorded but
/// never read back: they are recorded as `{}`, and such a regular call is
/// answered as invalid input, worded as `errors` says (the error envelope
/// under a registry, the plain text without), without running.
pub(super) fn interpret(
    cx: &LeafContext<'_>,
    response: ModelResponse,
    errors: ErrorFormat,
) -> AfterModel {
    let source = cx.source();
    let output = cx.instance().node().output();
    let provider_tools = provider_tool_names(cx);
    let mut items: Vec<Item> = response
        .content
        .into_iter()
        .map(|item| match item {
            Item::Text { text } if output.is_some() => Item::Output {
                data: output
                    .map(|o| o.map_text_block(&text))
                    .unwrap_or(Value::Null),
            },
            other => other,
        })
        .collect();
    let refused = screen_calls(&mut items, &provider_tools, errors);
    let has_calls = items.iter().any(|i| matches!(i, Item::ToolUse { .. }));
    // Room for the results or the reminder that usually follow.
    let mut entries = Vec::with_capacity(2);
    entries.push(Entry::message(with_source(
        Message::assistant_items(items),
        &source,
    )));
    let mut turn = cx.turn;

    if response.stop_reason == StopReason::MaxTokens {
        // The calls may be cut mid-argument: answer each without running it, so
        // the history keeps one result per call.
        if has_calls {
            let results = tool_calls(&entries, &refused)
                .iter()
                .map(|c| ToolExecutionResult::error(c.id.clone(), CUT_OFF_TOOL_CALL).to_item(true))
                .chain(refused.iter().map(|r| r.to_item(true)))
                .collect();
            entries.push(Entry::message(with_source(
                Message::user_items(results),
                &source,
            )));
        }
        return AfterModel::Finish(LeafOutcome::new(entries, YieldReason::MaxTokens, turn));
    }
    if has_calls {
        return AfterModel::RunTools { entries, refused };
    }
    let restriction = &cx.instance().node().policy().restriction;
    if restriction.may_inject(turn.injections) {
        turn.injections += 1;
        entries.push(Entry::message(with_source(
            Message::system(restriction.restriction_message.clone()),
            &source,
        )));
        return AfterModel::Finish(LeafOutcome::new(entries, YieldReason::Restricted, turn));
    }
    AfterModel::Finish(LeafOutcome::new(entries, YieldReason::EndTurn, turn))
}

/// Screens the calls of a response before anything runs, returning the
/// results of those answered without running:
///
/// - arguments nested deeper than [`MAX_ARGUMENT_DEPTH`] are replaced by
///   `{}` (vendors want an object), and such a regular call gets an
///   invalid-input error result;
/// - a call that repeats an earlier call's id gets a unique id (`id_2`,
///   `id_3`, ...) and an error result;
/// - a plain `tool_use` naming one of `provider_tools` becomes an
///   [`Item::ProviderToolUse`].
///
/// In place, in order: the calls are read from the message itself later
/// (borrowed, never copied).
pub(super) fn screen_calls(
    items: &mut [Item],
    provider_tools: &[ToolName],
    errors: ErrorFormat,
) -> Vec<ToolExecutionResult> {
    let mut refused = Vec::new();
    let mut taken = CallIds::default();
    for item in items.iter_mut() {
        if let Item::ProviderToolUse { id, input, .. } = item
            && nesting_exceeds(input, MAX_ARGUMENT_DEPTH)
        {
            // Answered by the provider already: only the record must be
            // readable.
            tracing::warn!(call_id = %id, "provider tool call arguments nested too deep; recorded as {{}}");
            *input = Value::Object(serde_json::Map::new());
        }
        let Item::ToolUse { id, name, input } = item else {
            continue;
        };
        // What is recorded must read back: serde_json reads a bounded depth.
        let too_deep = nesting_exceeds(input, MAX_ARGUMENT_DEPTH);
        if too_deep {
            *input = Value::Object(serde_json::Map::new());
        }
        if taken.contains(id) {
            // Providers reject a history with two calls of one id (Anthropic
            // does), and running both could repeat a side effect: the repeat
            // gets a unique id and an error result, and does not run.
            let unique = taken.unique(id);
            refused.push(ToolExecutionResult::error(
                unique.clone(),
                DUPLICATE_TOOL_CALL,
            ));
            *id = unique.clone();
            taken.insert(unique);
        } else if provider_tools.iter().any(|p| *p == **name) {
            *item = Item::ProviderToolUse {
                id: id.clone(),
                name: std::mem::take(name),
                input: std::mem::take(input),
            };
        } else {
            if too_deep {
                refused.push(too_deep_result(id.clone(), errors));
            }
            taken.insert(id.clone());
        }
    }
    refused
}

/// The error result of a call whose arguments were nested too deep to keep.
pub(super) fn too_deep_result(id: ToolCallId, errors: ErrorFormat) -> ToolExecutionResult {
    let detail = format!(
        "{}; the call was not run, and its arguments are recorded as {{}}",
        InvalidArguments::TooDeep {
            limit: MAX_ARGUMENT_DEPTH
        }
    );
    tracing::debug!(call_id = %id, "tool call refused: {detail}");
    let content = match errors {
        ErrorFormat::PlainText => ToolCallError::InvalidInput(detail).to_string(),
        _ => Rejection::new(ToolErrorKind::InvalidInput)
            .with_detail(detail)
            .to_envelope(),
    };
    ToolExecutionResult::error(id, content)
}

/// Completes a streamed message: the answer's assistant message (always the
/// first entry, see [`interpret`]) is replaced by its completed version under
/// the vessel's id, which takes the vessel's place when the outcome is
/// enqueued. Returns the `message_end` event; `None` if there is no entry.
pub(super) fn finalize_vessel(
    vessel: &mut VesselState,
    after: &mut AfterModel,
) -> Option<MessageStreamEvent> {
    let entries = match after {
        AfterModel::Finish(outcome) => &mut outcome.entries,
        AfterModel::RunTools { entries, .. } => entries,
    };
    let first = entries.first_mut()?;
    let assistant = std::mem::replace(&mut first.message, Message::assistant_items(Vec::new()));
    let (completed, event) = vessel.complete(assistant);
    first.message = completed;
    Some(event)
}

/// The ids of the calls of one response so far, to make a repeated one
/// unique. A model can repeat one id thousands of times in one response:
/// a set, and a counter per repeated id that resumes where the last
/// search stopped, keep the renaming linear in the number of calls.
/// The first id is held apart, so that a response of one call (the most
/// common) makes no set.
#[derive(Default)]
pub(super) struct CallIds {
    first: Option<ToolCallId>,
    /// The ids after the first.
    taken: HashSet<ToolCallId>,
    /// Per repeated id, the first suffix not yet tried.
    next: HashMap<ToolCallId, u64>,
}

impl CallIds {
    fn contains(&self, id: &ToolCallId) -> bool {
        self.first.as_ref() == Some(id) || self.taken.contains(id)
    }

    fn insert(&mut self, id: ToolCallId) {
        match self.first {
            None => self.first = Some(id),
            Some(_) => {
                self.taken.insert(id);
            }
        }
    }

    /// `id` with the first numeric suffix from 2 (`id_2`, `id_3`, ...) that
    /// no earlier call has. A suffix tried stays taken (ids are only ever
    /// added), so the next search for `id` starts after it.
    fn unique(&mut self, id: &ToolCallId) -> ToolCallId {
        let n = self.next.entry(id.clone()).or_insert(2);
        loop {
            let candidate = ToolCallId::new(format!("{id}_{n}"));
            *n = n.saturating_add(1);
            if self.first.as_ref() != Some(&candidate) && !self.taken.contains(&candidate) {
                return candidate;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The renaming as it was first written (a scan of the earlier calls per
    /// candidate): the names the linear one must reproduce.
    fn reference(ids: &[(&str, bool)]) -> Vec<String> {
        let mut out: Vec<(String, bool)> = Vec::new();
        for (id, provider) in ids {
            let taken = |c: &str| out.iter().any(|(o, call)| *call && o == c);
            if taken(id) {
                let unique = (2..)
                    .map(|n| format!("{id}_{n}"))
                    .find(|c| !taken(c))
                    .unwrap_or_default();
                out.push((unique, true));
            } else {
                out.push(((*id).to_owned(), !provider));
            }
        }
        out.into_iter().map(|(id, _)| id).collect()
    }

    fn renamed(ids: &[(&str, bool)]) -> (Vec<Item>, Vec<ToolExecutionResult>) {
        let mut items: Vec<Item> = ids
            .iter()
            .map(|(id, provider)| {
                let name = if *provider { "web_search" } else { "pay" };
                Item::tool_use(*id, name, serde_json::json!({}))
            })
            .collect();
        let refused = screen_calls(
            &mut items,
            &[ToolName::new("web_search").expect("a tool name")],
            ErrorFormat::PlainText,
        );
        (items, refused)
    }

    fn id_of(item: &Item) -> String {
        match item {
            Item::ToolUse { id, .. } | Item::ProviderToolUse { id, .. } => id.to_string(),
            other => panic!("not a call: {other:?}"),
        }
    }

    proptest! {
        #[test]
        fn repeated_ids_get_the_same_unique_names_as_before(
            picks in proptest::collection::vec((0usize..6, proptest::bool::weighted(0.1)), 0..40)
        ) {
            const IDS: [&str; 6] = ["a", "a_2", "a_3", "a_2_2", "b", "b_2"];
            let ids: Vec<(&str, bool)> = picks.iter().map(|(i, p)| (IDS[*i], *p)).collect();
            let (items, refused) = renamed(&ids);
            let names: Vec<String> = items.iter().map(id_of).collect();
            prop_assert_eq!(&names, &reference(&ids));
            let calls: Vec<&String> = items
                .iter()
                .zip(&names)
                .filter(|(i, _)| matches!(i, Item::ToolUse { .. }))
                .map(|(_, n)| n)
                .collect();
            let unique: HashSet<&String> = calls.iter().copied().collect();
            prop_assert_eq!(unique.len(), calls.len(), "call ids are unique");
            // Each refused result answers one renamed call; the others run.
            let refused_ids: HashSet<String> =
                refused.iter().map(|r| r.call_id.to_string()).collect();
            prop_assert_eq!(refused_ids.len(), refused.len());
            prop_assert!(refused_ids.iter().all(|r| unique.contains(r)));
        }
    }

    #[test]
    fn arguments_too_deep_are_recorded_as_an_empty_object_and_refused() {
        let mut deep = Value::Object(serde_json::Map::new());
        for _ in 0..MAX_ARGUMENT_DEPTH {
            let mut outer = serde_json::Map::new();
            outer.insert("a".to_owned(), deep);
            deep = Value::Object(outer);
        }
        let mut items = vec![
            Item::tool_use("c1", "pay", deep.clone()),
            Item::tool_use("c1", "pay", deep.clone()),
            Item::tool_use("c2", "web_search", deep.clone()),
            Item::tool_use("c3", "pay", serde_json::json!({"a": 1})),
        ];
        let refused = screen_calls(
            &mut items,
            &[ToolName::new("web_search").expect("a tool name")],
            ErrorFormat::Envelope,
        );
        let empty = serde_json::json!({});
        for item in &items[..3] {
            match item {
                Item::ToolUse { input, .. } | Item::ProviderToolUse { input, .. } => {
                    assert_eq!(*input, empty);
                }
                other => panic!("not a call: {other:?}"),
            }
        }
        assert!(matches!(&items[2], Item::ProviderToolUse { .. }));
        let ids: Vec<&str> = refused.iter().map(|r| r.call_id.as_str()).collect();
        assert_eq!(ids, ["c1", "c1_2"], "c3 runs; the provider answered c2");
        assert!(
            refused[0].content.contains("INVALID_INPUT"),
            "{}",
            refused[0].content
        );
        assert_eq!(refused[1].content, DUPLICATE_TOOL_CALL);
    }

    #[test]
    fn twenty_thousand_repeats_of_one_id_are_numbered_in_order() {
        let ids = vec![("dup", false); 20_000];
        let (items, refused) = renamed(&ids);
        assert_eq!(id_of(&items[0]), "dup");
        assert_eq!(id_of(&items[1]), "dup_2");
        assert_eq!(id_of(&items[19_999]), "dup_20000");
        assert_eq!(refused.len(), 19_999);
    }
}
