//! Context policies: what a model call is sent of a long history — the
//! history itself staying whole — and a session that a too-long
//! conversation never leaves stuck.

use std::sync::Arc;

use markov_charter::context::{ContextPolicy, ContextPolicyError, Summarize};
use markov_charter::node::Node;
use markov_core::message::{Item, Message, Role};
use markov_core::model::{HistoryId, ModelError};
use markov_core::tokens;
use markov_executor::{
    Agent, Machine, MachineStep, RunError, SUMMARY_PREAMBLE, SerializedMachine, YieldReason,
    serialize_machine,
};
use markov_testkit::{FailingModel, RecordedRequest, ScriptBuilder, ScriptedModel};
use proptest::prelude::*;
use serde_json::json;

use crate::common::*;

/// A script of `turns` turns, each a call of `add` and a text answer.
fn tool_turns(mut script: ScriptBuilder, turns: usize) -> ScriptBuilder {
    for n in 0..turns {
        script = script
            .tool_call("add", json!({"a": n, "b": 1}))
            .text(format!("The sum is {}.", n + 1));
    }
    script
}

fn agent(model: Arc<ScriptedModel>, policy: Option<ContextPolicy>) -> Agent {
    let mut builder = Agent::builder("calculator")
        .instructions("Add numbers with your tool.")
        .tool(Add)
        .shared_model(model);
    if let Some(policy) = policy {
        builder = builder.context_policy(policy);
    }
    builder.build().expect("agent builds")
}

async fn turn(machine: &mut Machine, text: &str) -> MachineStep {
    machine.enqueue_user(text);
    machine.run().await.expect("the turn runs")
}

/// The checks every request of a view passes: it starts with a user
/// message, roles alternate (the scripted conversations here never put
/// two user messages in a row, so a view must not either), and every
/// tool call in it has its result and every result its call.
fn assert_valid_view(request: &RecordedRequest) {
    let sent: Vec<&Message> = request
        .messages
        .iter()
        .filter(|m| matches!(m.role, Role::User | Role::Assistant | Role::System))
        .collect();
    assert_eq!(
        sent.first().map(|m| m.role),
        Some(Role::User),
        "first message"
    );
    for pair in sent.windows(2) {
        assert!(
            !(pair[0].role == Role::User && pair[1].role == Role::User),
            "two user messages in a row: {pair:?}"
        );
    }
    let owned: Vec<Message> = sent.into_iter().cloned().collect();
    assert_paired(&owned);
}

/// A message's items, its text as one when it is a plain string.
fn items_of(message: &Message) -> Vec<Item> {
    match &message.items {
        markov_core::message::Items::Text(text) => vec![Item::text(text.clone())],
        _ => message.item_list().to_vec(),
    }
}

/// The summary a view shows as the first item of its first message, and
/// that message without it (as the history has it, but for the form of
/// its items).
fn split_summary(message: &Message) -> (Option<String>, Vec<Item>) {
    let items = items_of(message);
    match items.first() {
        Some(Item::Text { text }) if text.starts_with(SUMMARY_PREAMBLE) => (
            Some(text[SUMMARY_PREAMBLE.len()..].to_owned()),
            items[1..].to_vec(),
        ),
        _ => (None, items),
    }
}

#[test]
fn nonsense_policies_are_refused_when_built() {
    let model: Arc<dyn markov_core::Model> = Arc::new(ScriptedModel::builder().build());
    let zero = ContextPolicy::builder().keep_last_turns(0).build();
    assert_eq!(
        zero.unwrap_err(),
        ContextPolicyError::ZeroTurns {
            option: "keep_last_turns"
        }
    );
    let threshold = ContextPolicy::builder()
        .summarize(Summarize::new(Arc::clone(&model), 0))
        .build();
    assert_eq!(threshold.unwrap_err(), ContextPolicyError::ZeroThreshold);
    let prompt = ContextPolicy::builder()
        .summarize(Summarize::new(Arc::clone(&model), 10).prompt("  "))
        .build();
    assert_eq!(prompt.unwrap_err(), ContextPolicyError::EmptyPrompt);
    let kept = ContextPolicy::builder()
        .summarize(Summarize::new(model, 10).keep_last_turns(0))
        .build();
    assert!(matches!(
        kept.unwrap_err(),
        ContextPolicyError::ZeroTurns { .. }
    ));
}

#[tokio::test]
async fn the_view_keeps_the_last_turns_and_the_history_stays_whole() {
    let model = Arc::new(tool_turns(ScriptedModel::builder(), 8).build());
    let policy = ContextPolicy::builder().keep_last_turns(3).build().unwrap();
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    for n in 0..8 {
        turn(&mut machine, &format!("question {n}")).await;
    }
    // The history holds all 8 turns: question, call, result, answer.
    assert_eq!(machine.history().len(), 32);
    assert_paired(machine.history());
    let requests = model.requests();
    for request in &requests {
        assert_valid_view(request);
    }
    let last = requests.last().unwrap();
    let questions: Vec<String> = last
        .messages
        .iter()
        .filter(|m| m.role == Role::User && m.text().starts_with("question"))
        .map(Message::text)
        .collect();
    assert_eq!(questions, ["question 5", "question 6", "question 7"]);
    // The system prompt is the same as without a policy.
    assert_eq!(last.system, requests[0].system);
    assert_eq!(last.messages.last(), machine.history().get(30));
}

#[tokio::test]
async fn old_tool_results_become_stubs_that_name_what_was_left_out() {
    let mut script = ScriptedModel::builder();
    for n in 0..3 {
        script = script
            .tool_call("add", json!({"a": 1000 + n, "b": 1_000_000}))
            .text("done");
    }
    let model = Arc::new(script.build());
    let policy = ContextPolicy::builder()
        .trim_tool_results(1)
        .build()
        .unwrap();
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    for n in 0..3 {
        turn(&mut machine, &format!("add {n}")).await;
    }
    let last = model.requests().pop().unwrap();
    let results: Vec<String> = last
        .messages
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|i| match i {
            Item::ToolResult { content, .. } => Some(content.clone()),
            _ => None,
        })
        .collect();
    // The results are short ("1001000"): shorter than any stub, so kept.
    assert_eq!(results, ["1001000", "1001001", "1001002"]);
}

/// Returns a long text.
#[markov_core::tool]
async fn echo() -> String {
    "y".repeat(600)
}

#[tokio::test]
async fn long_results_of_older_turns_are_stubbed_the_current_turns_never() {
    let mut script = ScriptedModel::builder();
    for _ in 0..3 {
        script = script.tool_call("echo", json!({})).text("echoed");
    }
    let model = Arc::new(script.build());
    let policy = ContextPolicy::builder()
        .trim_tool_results(2)
        .build()
        .unwrap();
    let mut machine = Agent::builder("echo")
        .instructions("Echo.")
        .tool(Echo)
        .shared_model(Arc::clone(&model) as Arc<dyn markov_core::Model>)
        .context_policy(policy)
        .build()
        .unwrap()
        .machine();
    for n in 0..3 {
        turn(&mut machine, &format!("echo {n}")).await;
    }
    let requests = model.requests();
    // The last call (answering the third turn's result) keeps the last
    // two turns' results whole and stubs the first turn's.
    let last = requests.last().unwrap();
    let results: Vec<(String, String)> = last
        .messages
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|i| match i {
            Item::ToolResult {
                tool_use_id,
                content,
                ..
            } => Some((tool_use_id.to_string(), content.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 3);
    assert_eq!(
        results[0].1,
        format!(
            "[Result left out of the context: echo, call {}, 600 bytes]",
            results[0].0
        )
    );
    assert_eq!(results[1].1.len(), 600);
    assert_eq!(results[2].1.len(), 600);
    // The history keeps every result whole.
    assert!(
        all_results(machine.history())
            .iter()
            .all(|(_, content, _)| content.len() == 600)
    );
    for request in &requests {
        assert_valid_view(request);
    }
}

/// Returns a small image.
#[markov_core::tool]
async fn snap() -> markov_core::ToolOutcome {
    markov_core::ToolOutcome::Images {
        text: String::new(),
        images: vec![markov_core::message::ImageData::new("image/png", "AAAA")],
    }
}

#[tokio::test]
async fn a_tools_image_reaches_the_model_and_leaves_with_its_stubbed_result() {
    let mut script = ScriptedModel::builder();
    for _ in 0..3 {
        script = script.tool_call("snap", json!({})).text("seen");
    }
    let model = Arc::new(script.build());
    let policy = ContextPolicy::builder()
        .trim_tool_results(2)
        .build()
        .unwrap();
    let mut machine = Agent::builder("snap")
        .instructions("Look.")
        .tool(Snap)
        .shared_model(Arc::clone(&model) as Arc<dyn markov_core::Model>)
        .context_policy(policy)
        .build()
        .unwrap()
        .machine();
    for n in 0..3 {
        turn(&mut machine, &format!("snap {n}")).await;
    }
    let image = markov_core::message::ImageData::new("image/png", "AAAA");
    let results = |messages: &[markov_core::Message]| -> Vec<(String, Vec<_>)> {
        messages
            .iter()
            .flat_map(|m| m.item_list())
            .filter_map(|i| match i {
                Item::ToolResult {
                    content, images, ..
                } => Some((content.clone(), images.clone())),
                _ => None,
            })
            .collect()
    };
    let last = results(&model.requests().last().unwrap().messages);
    assert_eq!(last.len(), 3);
    // The oldest result is stubbed, its image left out with it and said.
    assert!(last[0].0.starts_with("[Result left out"), "{}", last[0].0);
    assert!(
        last[0].0.ends_with("\n[image image/png, 3 bytes]"),
        "{}",
        last[0].0
    );
    assert!(last[0].1.is_empty());
    assert_eq!(last[1], (String::new(), vec![image.clone()]));
    assert_eq!(last[2], (String::new(), vec![image.clone()]));
    // The history keeps every image.
    assert!(
        results(machine.history())
            .iter()
            .all(|(_, images)| images == std::slice::from_ref(&image))
    );
}

#[tokio::test]
async fn a_summary_is_made_once_per_threshold_crossing_and_stands_for_its_messages() {
    let summarizer = Arc::new(
        ScriptedModel::builder()
            .text("The user asked for sums; all were given.")
            .text("Still sums, all given.")
            .build(),
    );
    let turns = 12;
    let model = Arc::new(tool_turns(ScriptedModel::builder(), turns).build());
    // A turn is some 60 estimated tokens: the threshold is crossed every
    // few turns, and each summary brings the view back under it.
    let policy = ContextPolicy::builder()
        .summarize(
            Summarize::new(Arc::clone(&summarizer) as Arc<dyn markov_core::Model>, 400)
                .keep_last_turns(2),
        )
        .build()
        .unwrap();
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    let mut summaries_seen = Vec::new();
    for n in 0..turns {
        turn(&mut machine, &format!("question {n}")).await;
        summaries_seen.push(summarizer.calls());
    }
    let summaries: Vec<(String, std::ops::Range<u64>)> = machine
        .history()
        .iter()
        .filter_map(|m| m.as_summary().map(|(t, r)| (t.to_owned(), r)))
        .collect();
    // Once per crossing: never two summaries in one turn, and fewer
    // summaries than steps by far.
    assert_eq!(summaries.len(), summarizer.calls());
    assert!(!summaries.is_empty(), "the threshold was crossed");
    assert!(
        summaries_seen.windows(2).all(|w| w[1] - w[0] <= 1),
        "{summaries_seen:?}"
    );
    assert!(summaries.len() < turns / 2, "{summaries_seen:?}");
    // Each stands for a run of history from the start, the later ones for more.
    assert_eq!(summaries[0].1.start, 0);
    let first_end = usize::try_from(summaries[0].1.end).unwrap();
    assert!(starts_turn(&machine.history()[first_end]));
    // Every request after the first summary starts with it, then whole turns.
    let requests = model.requests();
    for request in &requests {
        assert_valid_view(request);
        assert!(tokens::estimate_messages(&request.messages) < 400 + 200);
    }
    // The summary is the first text of the first message, a question:
    // never a user message of its own before another.
    let last = requests.last().unwrap();
    let (summary, rest) = split_summary(&last.messages[0]);
    assert_eq!(summary.as_ref(), Some(&summaries.last().unwrap().0));
    assert_eq!(last.messages[0].role, Role::User);
    assert!(
        matches!(&rest[..], [Item::Text { text }] if text.starts_with("question")),
        "{rest:?}"
    );
    // The summarizer read a transcript of the turns it summarized.
    let asked = &summarizer.requests()[0];
    assert!(asked.messages[0].text().contains("User: question 0"));
    assert!(asked.tools.is_empty());
}

fn starts_turn(message: &Message) -> bool {
    message.role == Role::User
        && !message
            .item_list()
            .iter()
            .any(|i| matches!(i, Item::ToolResult { .. }))
}

#[tokio::test]
async fn a_compaction_starts_a_new_cached_prefix() {
    let model = Arc::new(tool_turns(ScriptedModel::builder(), 4).build());
    let policy = ContextPolicy::builder().keep_last_turns(2).build().unwrap();
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    for n in 0..4 {
        turn(&mut machine, &format!("question {n}")).await;
    }
    let requests = model.requests();
    let ids: Vec<HistoryId> = requests.iter().map(|r| r.history_id.unwrap()).collect();
    // Within an id, every request extends the previous one unchanged.
    for pair in requests.windows(2) {
        if pair[0].history_id == pair[1].history_id {
            assert!(pair[1].messages.starts_with(&pair[0].messages));
        }
    }
    // Turns 1 and 2 only append; turn 3 cuts turn 1 (a new id), turn 4
    // cuts turn 2 (another).
    assert_eq!(ids[0], ids[3]);
    assert_ne!(ids[3], ids[4]);
    assert_eq!(ids[4], ids[5]);
    assert_ne!(ids[5], ids[6]);
}

#[tokio::test]
async fn a_context_length_refusal_is_compacted_and_retried_once() {
    let script = tool_turns(ScriptedModel::builder(), 3)
        .error(ModelError::ContextLength(
            "prompt is too long: 5000 tokens > 4096 maximum".into(),
        ))
        .text("Fine now.");
    let model = Arc::new(script.build());
    let summarizer = Arc::new(ScriptedModel::builder().text("Three sums.").build());
    let policy = ContextPolicy::builder()
        .summarize(Summarize::new(
            Arc::clone(&summarizer) as Arc<dyn markov_core::Model>,
            1_000_000,
        ))
        .build()
        .unwrap();
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    for n in 0..3 {
        turn(&mut machine, &format!("question {n}")).await;
    }
    let last = turn(&mut machine, "and now?").await;
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(
        machine.history().last().map(Message::text).as_deref(),
        Some("Fine now.")
    );
    let requests = model.requests();
    let refused = &requests[requests.len() - 2];
    let retried = &requests[requests.len() - 1];
    // The retry holds the current turn only, the summary first in it.
    assert_eq!(retried.messages.len(), 1);
    let (summary, rest) = split_summary(&retried.messages[0]);
    assert_eq!(summary.as_deref(), Some("Three sums."));
    assert_eq!(rest, [Item::text("and now?")]);
    assert!(refused.messages.len() > retried.messages.len());
    assert_ne!(refused.history_id, retried.history_id);
    assert_eq!(summarizer.calls(), 1);
    // The summary is in the history, standing for the three turns.
    let (_, range) = machine
        .history()
        .iter()
        .find_map(|m| m.as_summary().map(|(t, r)| (t.to_owned(), r)))
        .expect("a summary");
    assert_eq!(range, 0..12);
}

#[tokio::test]
async fn without_a_summarizer_a_refusal_drops_the_older_turns() {
    let script = tool_turns(ScriptedModel::builder(), 2)
        .error(ModelError::ContextLength("too long".into()))
        .text("Fine now.");
    let model = Arc::new(script.build());
    let policy = ContextPolicy::builder()
        .keep_last_turns(50)
        .build()
        .unwrap();
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    for n in 0..2 {
        turn(&mut machine, &format!("question {n}")).await;
    }
    let last = turn(&mut machine, "and now?").await;
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    let retried = model.requests().pop().unwrap();
    assert_eq!(retried.messages.len(), 1);
    assert_eq!(retried.messages[0].text(), "and now?");
}

#[tokio::test]
async fn without_a_policy_a_refusal_ends_the_run_with_a_reason_that_says_what_to_set() {
    let model = Arc::new(
        ScriptedModel::builder()
            .error(ModelError::ContextLength("too long".into()))
            .text("answered")
            .build(),
    );
    let mut machine = agent(Arc::clone(&model), None).machine();
    let step = turn(&mut machine, "hello").await;
    assert_eq!(step.yield_reason, YieldReason::ContextExhausted);
    assert!(step.done);
    assert_eq!(step.yield_reason.as_str(), "context_exhausted");
    // Nothing of the step is recorded; the session takes the next message.
    assert_eq!(machine.history().len(), 1);
    let step = turn(&mut machine, "again").await;
    assert_eq!(step.yield_reason, YieldReason::EndTurn);
}

#[tokio::test]
async fn when_the_current_turn_alone_is_too_long_the_run_ends_with_the_reason() {
    let model = Arc::new(
        ScriptedModel::builder()
            .error(ModelError::ContextLength("too long".into()))
            .build(),
    );
    let policy = ContextPolicy::builder().keep_last_turns(4).build().unwrap();
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    let step = turn(&mut machine, "a very long question").await;
    assert_eq!(step.yield_reason, YieldReason::ContextExhausted);
    // Nothing could be left out, so the call was not made again.
    assert_eq!(model.calls(), 1);
}

#[tokio::test]
async fn other_model_errors_still_end_the_run_as_errors() {
    let model = Arc::new(
        ScriptedModel::builder()
            .error(ModelError::InvalidRequest("bad".into()))
            .build(),
    );
    let policy = ContextPolicy::builder().keep_last_turns(4).build().unwrap();
    let mut machine = agent(model, Some(policy)).machine();
    machine.enqueue_user("hi");
    let error = machine.run().await.unwrap_err();
    assert!(matches!(error, RunError::Model { .. }), "{error:?}");
}

#[tokio::test]
async fn a_restored_machine_shows_its_summary_first() {
    let summarizer = Arc::new(ScriptedModel::builder().text("Earlier sums.").build());
    let policy = ContextPolicy::builder()
        .summarize(
            Summarize::new(Arc::clone(&summarizer) as Arc<dyn markov_core::Model>, 100)
                .keep_last_turns(1),
        )
        .build()
        .unwrap();
    let model = Arc::new(tool_turns(ScriptedModel::builder(), 4).build());
    let agent = agent(Arc::clone(&model), Some(policy));
    let mut machine = agent.machine();
    for n in 0..3 {
        turn(&mut machine, &format!("question {n}")).await;
    }
    assert_eq!(summarizer.calls(), 1);
    let text = serde_json::to_string(&serialize_machine(&machine).unwrap()).unwrap();
    assert!(text.contains(r#""role":"summary""#), "{text}");
    let snapshot: SerializedMachine = serde_json::from_str(&text).unwrap();
    let mut restored = agent.restore(snapshot).unwrap();
    assert_eq!(restored.history(), machine.history());
    turn(&mut restored, "question 3").await;
    // The restored machine's first request: the summary, then what
    // follows the messages it stands for.
    let request = &model.requests()[6];
    let (summary, rest) = split_summary(&request.messages[0]);
    assert_eq!(summary.as_deref(), Some("Earlier sums."));
    assert_eq!(rest, [Item::text("question 2")]);
    assert_eq!(request.messages.last().unwrap().text(), "question 3");
    assert_valid_view(request);
}

#[tokio::test]
async fn a_nodes_policy_overrides_its_agents() {
    let model = Arc::new(tool_turns(ScriptedModel::builder(), 3).build());
    let node = Node::builder("Add numbers with your tool.")
        .name("calculator")
        .tool(Add)
        .context_policy(ContextPolicy::builder().keep_last_turns(1).build().unwrap())
        .build()
        .unwrap();
    let mut machine = Agent::builder("calculator")
        .node("calculator", node)
        .shared_model(Arc::clone(&model) as Arc<dyn markov_core::Model>)
        .context_policy(
            ContextPolicy::builder()
                .keep_last_turns(10)
                .build()
                .unwrap(),
        )
        .build()
        .unwrap()
        .machine();
    for n in 0..3 {
        turn(&mut machine, &format!("question {n}")).await;
    }
    let last = model.requests().pop().unwrap();
    assert_eq!(last.messages[0].text(), "question 2");
}

/// One scripted turn of the property below: how many tool calls its
/// answer makes before the text (0 to 2), and how long each result is.
#[derive(Debug, Clone)]
struct TurnShape {
    calls: usize,
    question: usize,
}

fn policies() -> impl Strategy<Value = (Option<usize>, Option<usize>, Option<(u64, usize)>)> {
    (
        proptest::option::of(1usize..4),
        proptest::option::of(1usize..4),
        proptest::option::of((50u64..400, 1usize..3)),
    )
        .prop_filter("a rule", |(k, t, s)| {
            k.is_some() || t.is_some() || s.is_some()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever the policy and the conversation, every request starts
    /// with a user message, pairs every call with its result, ends with
    /// the current turn whole, and keeps the system prompt; the history
    /// keeps everything.
    #[test]
    fn every_view_is_a_valid_request(
        turns in proptest::collection::vec((0usize..3, 0usize..200).prop_map(|(calls, question)| TurnShape { calls, question }), 1..10),
        (keep, trim, summarize) in policies(),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut script = ScriptedModel::builder();
            for shape in &turns {
                for c in 0..shape.calls {
                    script = script.tool_call("add", json!({"a": c, "b": shape.question}));
                }
                script = script.text("ok");
            }
            let model = Arc::new(script.build());
            let summarizer = Arc::new(ScriptedModel::new((0..20).map(|n| markov_testkit::text_response(format!("summary {n}")))));
            let mut policy = ContextPolicy::builder();
            if let Some(k) = keep { policy = policy.keep_last_turns(k); }
            if let Some(t) = trim { policy = policy.trim_tool_results(t); }
            if let Some((threshold, kept)) = summarize {
                policy = policy.summarize(Summarize::new(Arc::clone(&summarizer) as Arc<dyn markov_core::Model>, threshold).keep_last_turns(kept));
            }
            let policy = policy.build().unwrap();
            let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
            for (n, shape) in turns.iter().enumerate() {
                turn(&mut machine, &format!("q{n} {}", "w ".repeat(shape.question))).await;
            }
            assert_paired(machine.history());
            let requests = model.requests();
            let system = &requests[0].system;
            for request in &requests {
                assert_valid_view(request);
                assert_eq!(&request.system, system);
            }
            // The last request ends with the last turn as the history has it.
            let last = requests.last().unwrap();
            let current = machine.history().iter().rposition(starts_turn).unwrap();
            let tail: Vec<&Message> = machine.history()[current..machine.history().len() - 1]
                .iter()
                .filter(|m| m.role != Role::Summary)
                .collect();
            let sent = &last.messages[last.messages.len() - tail.len()..];
            for (sent, kept) in sent.iter().zip(tail) {
                // The first may show the summary first.
                let (_, items) = split_summary(sent);
                assert_eq!(sent.role, kept.role);
                assert_eq!(items, items_of(kept));
            }
        });
    }
}

/// A first turn whose question alone is some 2 300 estimated tokens,
/// past a threshold of 2 000, then a turn of `calls` tool steps: each
/// adds some 30 tokens, far less than a quarter of the threshold.
fn over_the_threshold(calls: usize) -> ScriptBuilder {
    let mut script = ScriptedModel::builder().text("Read it.");
    for n in 0..calls {
        script = script.tool_call("add", json!({"a": n, "b": 1}));
    }
    script.text("Added.")
}

fn failing_summarizer_policy(summarizer: &Arc<FailingModel>) -> ContextPolicy {
    ContextPolicy::builder()
        .summarize(
            Summarize::new(Arc::clone(summarizer) as Arc<dyn markov_core::Model>, 2_000)
                .keep_last_turns(1),
        )
        .build()
        .expect("a valid policy")
}

#[tokio::test]
async fn a_failing_summarizer_is_asked_again_at_a_new_turn_not_at_every_step() {
    let model = Arc::new(over_the_threshold(8).text("Hello again.").build());
    let summarizer = Arc::new(FailingModel::new(ModelError::Overloaded("down".into())));
    let policy = failing_summarizer_policy(&summarizer);
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    turn(&mut machine, &"w ".repeat(3_500)).await;
    assert_eq!(summarizer.calls(), 0, "one turn: nothing to summarize");
    // Nine steps over the threshold: one attempt, then none while the
    // view grows by less than a quarter of the threshold.
    let last = turn(&mut machine, "Add eight times.").await;
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(model.calls(), 10, "every step was answered");
    assert_eq!(summarizer.calls(), 1);
    // A new turn tries again.
    turn(&mut machine, "Hello?").await;
    assert_eq!(summarizer.calls(), 2);
    assert!(machine.history().iter().all(|m| m.role != Role::Summary));
}

#[tokio::test]
async fn a_failing_summarizer_is_asked_again_once_the_view_has_grown() {
    // A quarter of the threshold is 500 tokens: some 17 tool steps.
    let model = Arc::new(over_the_threshold(40).build());
    let summarizer = Arc::new(FailingModel::new(ModelError::Overloaded("down".into())));
    let policy = failing_summarizer_policy(&summarizer);
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    turn(&mut machine, &"w ".repeat(3_500)).await;
    turn(&mut machine, "Add forty times.").await;
    assert_eq!(model.calls(), 42);
    let calls = summarizer.calls();
    assert!((2..=4).contains(&calls), "{calls} attempts in 41 steps");
}

#[tokio::test]
async fn a_context_length_refusal_asks_a_failing_summarizer_even_while_it_backs_off() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text("Read it.")
            .tool_call("add", json!({"a": 1, "b": 1}))
            .error(ModelError::ContextLength("too long".into()))
            .text("Added.")
            .build(),
    );
    let summarizer = Arc::new(FailingModel::new(ModelError::Overloaded("down".into())));
    let policy = failing_summarizer_policy(&summarizer);
    let mut machine = agent(Arc::clone(&model), Some(policy)).machine();
    turn(&mut machine, &"w ".repeat(3_500)).await;
    let last = turn(&mut machine, "Add once.").await;
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    // The first step's attempt failed; the refusal at the second step
    // forces another, which fails too, and the older turn is left out.
    assert_eq!(summarizer.calls(), 2);
    let retried = model.requests().pop().unwrap();
    assert_eq!(retried.messages[0].text(), "Add once.");
}

/// A compaction model that names a vendor but has no compaction after
/// all: what an executor configured by hand may be given (an agent's
/// builder refuses it).
#[derive(Debug, Default)]
struct NoCompaction {
    asked: std::sync::atomic::AtomicUsize,
}

#[markov_core::async_trait]
impl markov_core::Model for NoCompaction {
    async fn complete(
        &self,
        _request: markov_core::ModelRequest<'_>,
    ) -> Result<markov_core::ModelResponse, ModelError> {
        Err(ModelError::InvalidRequest("not called".into()))
    }

    fn native_summaries(&self) -> Option<&str> {
        Some("test.vendor")
    }

    async fn compact(
        &self,
        _request: markov_core::ModelRequest<'_>,
    ) -> Result<markov_core::Compaction, ModelError> {
        self.asked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(markov_core::Compaction::NotOffered)
    }
}

#[tokio::test]
async fn a_native_compaction_not_offered_backs_off_like_a_failed_summarizer() {
    let model = Arc::new(over_the_threshold(8).text("Hello again.").build());
    let compactor = Arc::new(NoCompaction::default());
    let policy = ContextPolicy::builder()
        .summarize(
            Summarize::native(Arc::clone(&compactor) as Arc<dyn markov_core::Model>, 2_000)
                .keep_last_turns(1),
        )
        .build()
        .expect("a valid policy");
    let executor = markov_executor::StandardExecutor::shared(
        Arc::clone(&model) as Arc<dyn markov_core::Model>
    )
    .with_context_policy(policy);
    let agent = Agent::builder("calculator")
        .instructions("Add numbers with your tool.")
        .tool(Add)
        .executor(executor)
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    turn(&mut machine, &"w ".repeat(3_500)).await;
    let last = turn(&mut machine, "Add eight times.").await;
    assert_eq!(last.yield_reason, YieldReason::EndTurn, "never stuck");
    assert_eq!(model.calls(), 10, "every step was answered");
    let asked = || compactor.asked.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(asked(), 1, "asked once, then backed off");
    turn(&mut machine, "Hello?").await;
    assert_eq!(asked(), 2, "a new turn asks again");
    assert!(machine.history().iter().all(|m| m.role != Role::Summary));
    // Nothing was counted for calls that were not made.
    assert_eq!(machine.usage().session.requests, 11);
}
