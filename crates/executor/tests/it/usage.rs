//! Usage and cost: what each step, turn, run and session used, priced at
//! the agent's prices, and limits that stop a run before the model call
//! that could pass them.

use std::sync::Arc;

use crate::common::*;
use markov_charter::context::{ContextPolicy, Summarize};
use markov_core::model::{ModelResponse, ModelSettings, StopReason, Usage};
use markov_core::{Item, Role, Usd};
use markov_executor::{
    Agent, AgentBuilder, BuildError, Limit, LimitKind, LimitScope, ModelPrice, Prices, RunError,
    UsageLimits, UsageLimitsError, YieldReason, serialize_machine,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

const MODEL: &str = "house-model";

/// $1 per million input tokens, $2 per million output, $0.10 per million
/// read from the cache.
fn prices() -> Prices {
    Prices::only_given().model(
        MODEL,
        ModelPrice::per_million_tokens(Usd::from_cents(100), Usd::from_cents(200))
            .cache_read(Usd::from_cents(10)),
    )
}

fn used(input: u64, output: u64) -> Usage {
    Usage {
        input_tokens: input,
        output_tokens: output,
        ..Usage::default()
    }
}

/// A call of `add` that used `usage`, answered by the house model.
fn add_call(id: &str, usage: Usage) -> ModelResponse {
    ModelResponse::new(
        vec![Item::tool_use(id, "add", json!({"a": 1, "b": 2}))],
        StopReason::ToolUse,
    )
    .with_usage(usage)
    .with_model(MODEL)
}

fn answer(text: &str, usage: Usage) -> ModelResponse {
    ModelResponse::new(vec![Item::text(text)], StopReason::EndTurn)
        .with_usage(usage)
        .with_model(MODEL)
}

fn agent(model: &Arc<ScriptedModel>, build: impl FnOnce(AgentBuilder) -> AgentBuilder) -> Agent {
    let settings = ModelSettings {
        model: Some(MODEL.into()),
        max_tokens: 100,
        ..ModelSettings::default()
    };
    build(
        Agent::builder("metered")
            .instructions("Add.")
            .tool(Add)
            .shared_model(Arc::clone(model) as Arc<dyn markov_core::Model>)
            .settings(settings)
            .prices(prices()),
    )
    .build()
    .expect("agent builds")
}

#[tokio::test]
async fn usage_is_accounted_per_step_turn_run_and_session_with_its_cost() {
    let reasoned = Usage {
        reasoning_tokens: 7,
        cache_read_input_tokens: 1_000,
        ..used(2_000, 50)
    };
    let model = Arc::new(
        ScriptedModel::builder()
            .response(add_call("c1", reasoned))
            .response(answer("3", used(3_000, 10)))
            .response(answer("again 3", used(4_000, 20)))
            .build(),
    );
    let agent = agent(&model, |a| a);
    let mut machine = agent.machine();
    machine.enqueue_user("1 + 2?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    // 2000 × $1/M + 50 × $2/M + 1000 × $0.10/M = $0.0022, then
    // 3000 × $1/M + 10 × $2/M = $0.00302.
    let first = Usage {
        requests: 1,
        cost: Usd::from_micros(2_200),
        ..reasoned
    };
    let second = Usage {
        requests: 1,
        cost: Usd::from_micros(3_020),
        ..used(3_000, 10)
    };
    let mut turn = first;
    turn += second;
    assert_eq!(last.usage, second);
    assert_eq!(last.run_usage, turn);
    assert_eq!(last.totals.turn, turn);
    assert_eq!(machine.usage().session, turn);
    assert_eq!(machine.usage().session.reasoning_tokens, 7);
    assert_eq!(machine.usage().session.requests, 2);

    // The next user message starts a turn: its total starts over, the
    // session's goes on.
    machine.enqueue_user("And again?");
    let last = machine.run().await.expect("runs");
    let third = Usage {
        requests: 1,
        cost: Usd::from_micros(4_040),
        ..used(4_000, 20)
    };
    assert_eq!(last.totals.turn, third);
    assert_eq!(last.run_usage, third);
    let mut session = turn;
    session += third;
    assert_eq!(machine.usage().session, session);
    assert_eq!(machine.usage().session.cost, Usd::from_micros(9_260));
}

#[tokio::test]
async fn usage_survives_a_snapshot_and_a_restore() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(add_call(
                "c1",
                Usage {
                    reasoning_tokens: 3,
                    ..used(500, 40)
                },
            ))
            .response(answer("3", used(600, 5)))
            .build(),
    );
    let agent = agent(&model, |a| a);
    let mut machine = agent.machine();
    machine.enqueue_user("1 + 2?");
    machine.run().await.expect("runs");
    let before = *machine.usage();
    assert_eq!(before.session.requests, 2);
    assert!(!before.session.cost.is_zero());

    let text =
        serde_json::to_string(&serialize_machine(&machine).expect("serializes")).expect("writes");
    let restored = agent
        .restore(serde_json::from_str(&text).expect("reads"))
        .expect("restores");
    assert_eq!(*restored.usage(), before);
    assert_eq!(restored.usage().session.reasoning_tokens, 3);

    // A snapshot written before usage was kept has none, and opens.
    let mut old: serde_json::Value = serde_json::from_str(&text).expect("reads");
    old.as_object_mut().expect("an object").remove("usage");
    let restored = agent
        .restore(serde_json::from_value(old).expect("reads"))
        .expect("an old snapshot restores");
    assert!(restored.usage().is_empty());
}

#[tokio::test]
async fn a_per_run_request_limit_stops_before_the_call_and_the_next_turn_goes_on() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(add_call("c1", used(10, 1)))
            .response(add_call("c2", used(10, 1)))
            .response(answer("done", used(10, 1)))
            .response(answer("next turn", used(10, 1)))
            .build(),
    );
    let limits = UsageLimits::builder()
        .per_run(Limit::new().requests(2))
        .build()
        .expect("limits");
    let agent = agent(&model, |a| a.usage_limits(limits));
    let mut machine = agent.machine();
    machine.enqueue_user("Add twice.");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::UsageLimit);
    assert!(last.done);
    let limit = last.usage_limit.expect("names the limit");
    assert_eq!(
        (limit.scope, limit.kind, limit.limit, limit.used),
        (LimitScope::Run, LimitKind::Requests, 2, 2)
    );
    assert!(
        limit.to_string().contains("per-run limit on requests"),
        "{limit}"
    );
    // The third call was never made: two requests reached the model.
    assert_eq!(model.calls(), 2);
    // Nothing lost: both calls have their results, the last step's
    // results end the history.
    assert_paired(machine.history());
    assert_eq!(all_results(machine.history()).len(), 2);
    assert_eq!(machine.history().last().map(|m| m.role), Some(Role::User));

    // The next run is a new run: it goes on.
    machine.enqueue_user("Go on.");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(model.calls(), 3);
    assert_eq!(machine.usage().session.requests, 3);
}

#[tokio::test]
async fn a_per_turn_token_limit_resets_with_the_next_turn() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(add_call("c1", used(1_000, 50)))
            .response(answer("3", used(1_000, 50)))
            .response(answer("hello again", used(1_000, 50)))
            .build(),
    );
    // The first call uses 1050 tokens; the second could use its input
    // (a few dozen tokens of estimate) and 100 of output: 1200 is not
    // enough for both, and enough for each alone.
    let limits = UsageLimits::builder()
        .per_turn(Limit::new().tokens(1_200))
        .build()
        .expect("limits");
    let agent = agent(&model, |a| a.usage_limits(limits));
    let mut machine = agent.machine();
    machine.enqueue_user("1 + 2?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::UsageLimit);
    let limit = last.usage_limit.expect("names the limit");
    assert_eq!(
        (limit.scope, limit.kind),
        (LimitScope::Turn, LimitKind::Tokens)
    );
    assert_eq!(limit.used, 1_050);
    assert!(limit.used + limit.estimate > 1_200, "{limit:?}");
    assert!(limit.estimate >= 100, "the output's max_tokens is counted");
    assert_eq!(model.calls(), 1, "stopped before the second call");

    // The next user turn has its own 1200 tokens.
    machine.enqueue_user("Hello?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(model.calls(), 2);
    assert_eq!(last.totals.turn.total_tokens(), 1_050);
    assert_eq!(machine.usage().session.total_tokens(), 2_100);
}

#[tokio::test]
async fn a_per_session_cost_limit_stops_every_later_turn() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(answer("one", used(100_000, 0)))
            .response(answer("two", used(100_000, 0)))
            .build(),
    );
    // The first call costs $0.10; a second could cost as much and more.
    let limits = UsageLimits::builder()
        .per_session(Limit::new().cost(Usd::from_cents(15)))
        .build()
        .expect("limits");
    let agent = agent(&model, |a| a.usage_limits(limits));
    let mut machine = agent.machine();
    machine.enqueue_user("First.");
    assert_eq!(
        machine.run().await.expect("runs").yield_reason,
        YieldReason::EndTurn
    );
    assert_eq!(machine.usage().session.cost, Usd::from_cents(10));
    // Fill the history so the next call's estimate passes the rest.
    machine.enqueue_user("x".repeat(300_000));
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::UsageLimit);
    let limit = last.usage_limit.expect("names the limit");
    assert_eq!(
        (limit.scope, limit.kind),
        (LimitScope::Session, LimitKind::Cost)
    );
    assert_eq!(limit.used, Usd::from_cents(10).as_nanos());
    assert!(limit.to_string().contains("$0.15"), "{limit}");
    assert_eq!(model.calls(), 1);
    // The input that started the turn is kept.
    assert_eq!(machine.history().len(), 3);
    // And a later turn, however short, stops too: the session's total
    // only grows.
    machine.enqueue_user("Short.");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::UsageLimit);
    assert_eq!(model.calls(), 1);
}

#[tokio::test]
async fn a_cost_limit_on_a_model_without_a_price_is_refused_before_the_call() {
    let model = Arc::new(ScriptedModel::builder().text("free?").build());
    let limits = UsageLimits::builder()
        .per_run(Limit::new().cost(Usd::from_cents(1)))
        .build()
        .expect("limits");
    let agent = agent(&model, |a| {
        a.usage_limits(limits).prices(Prices::only_given())
    });
    let mut machine = agent.machine();
    machine.enqueue_user("hi");
    let error = machine.run().await.expect_err("no price");
    assert!(
        matches!(&error, RunError::NoPrice { model: Some(m) } if m == MODEL),
        "{error}"
    );
    assert_eq!(model.calls(), 0);
}

#[tokio::test]
async fn zero_unreachable_and_misplaced_limits_are_build_errors() {
    assert_eq!(
        UsageLimits::builder()
            .per_session(Limit::new().tokens(0))
            .build(),
        Err(UsageLimitsError::Zero {
            scope: LimitScope::Session,
            kind: LimitKind::Tokens
        })
    );
    assert!(matches!(
        UsageLimits::builder()
            .per_turn(Limit::new().requests(5))
            .per_session(Limit::new().requests(4))
            .build(),
        Err(UsageLimitsError::Conflict {
            kind: LimitKind::Requests,
            inner: LimitScope::Turn,
            outer: LimitScope::Session
        })
    ));
    let limits = UsageLimits::builder()
        .per_run(Limit::new().requests(1))
        .build()
        .expect("limits");
    let executor = markov_executor::StandardExecutor::new(ScriptedModel::builder().build());
    let refused = Agent::builder("custom")
        .instructions("Hi.")
        .executor(executor)
        .usage_limits(limits)
        .build()
        .expect_err("an executor of its own checks no limits");
    assert!(
        matches!(
            refused,
            BuildError::Conflict {
                option: "usage_limits",
                ..
            }
        ),
        "{refused}"
    );
}

/// The summarizer's model, priced at $10 per million input tokens and
/// $20 per million output.
const SUMMARIZER: &str = "summary-model";

fn summarizer_prices() -> Prices {
    prices().model(
        SUMMARIZER,
        ModelPrice::per_million_tokens(Usd::from_cents(1_000), Usd::from_cents(2_000)),
    )
}

/// A summarizer named [`SUMMARIZER`] that may answer `max_tokens`.
fn summarize(model: &Arc<ScriptedModel>, threshold: u64, max_tokens: u32) -> Summarize {
    Summarize::new(Arc::clone(model) as Arc<dyn markov_core::Model>, threshold)
        .keep_last_turns(1)
        .settings(ModelSettings {
            model: Some(SUMMARIZER.into()),
            max_tokens,
            ..ModelSettings::default()
        })
}

fn summary(text: &str, usage: Usage) -> ModelResponse {
    ModelResponse::new(vec![Item::text(text)], StopReason::EndTurn)
        .with_usage(usage)
        .with_model(SUMMARIZER)
}

#[tokio::test]
async fn the_summarizers_calls_are_counted_and_priced_at_its_own_model() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(answer("first", used(1_000, 10)))
            .response(answer("second", used(1_000, 10)))
            .build(),
    );
    let summarizer = Arc::new(
        ScriptedModel::builder()
            .response(summary("The user said hello.", used(2_000, 100)))
            .build(),
    );
    // The first turn's question alone passes the threshold: the second
    // turn's call summarizes it first.
    let policy = ContextPolicy::builder()
        .summarize(summarize(&summarizer, 50, 500))
        .build()
        .expect("policy");
    let agent = agent(&model, |a| {
        a.context_policy(policy).prices(summarizer_prices())
    });
    let mut machine = agent.machine();
    machine.enqueue_user("w ".repeat(200));
    machine.run().await.expect("runs");
    let before = *machine.usage();
    machine.enqueue_user("And now?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(summarizer.calls(), 1);
    // 1000 × $1/M + 10 × $2/M for the model, 2000 × $10/M + 100 × $20/M
    // for the summarizer.
    let expected = Usage {
        requests: 2,
        cost: Usd::from_micros(1_020 + 22_000),
        ..used(3_000, 110)
    };
    assert_eq!(last.usage, expected);
    assert_eq!(last.run_usage, expected);
    assert_eq!(last.totals.turn, expected);
    let mut session = before.session;
    session += expected;
    assert_eq!(machine.usage().session, session);
    assert_eq!(machine.usage().session.unpriced_requests, 0);
    // Stored with the session, like any usage.
    let text =
        serde_json::to_string(&serialize_machine(&machine).expect("serializes")).expect("writes");
    let restored = agent
        .restore(serde_json::from_str(&text).expect("reads"))
        .expect("restores");
    assert_eq!(restored.usage().session, session);
}

#[tokio::test]
async fn an_unpriced_summarizer_counts_as_unpriced() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(answer("first", used(10, 1)))
            .response(answer("second", used(10, 1)))
            .build(),
    );
    let summarizer = Arc::new(
        ScriptedModel::builder()
            .response(summary("Hello.", used(200, 5)))
            .build(),
    );
    let policy = ContextPolicy::builder()
        .summarize(summarize(&summarizer, 50, 500))
        .build()
        .expect("policy");
    // `prices()` does not price the summarizer's model.
    let agent = agent(&model, |a| a.context_policy(policy));
    let mut machine = agent.machine();
    machine.enqueue_user("w ".repeat(200));
    machine.run().await.expect("runs");
    machine.enqueue_user("And now?");
    let last = machine.run().await.expect("runs");
    assert_eq!(summarizer.calls(), 1);
    assert_eq!(last.usage.requests, 2);
    assert_eq!(last.usage.unpriced_requests, 1);
    assert_eq!(last.usage.input_tokens, 210);
}

#[tokio::test]
async fn a_limit_refuses_the_summarizers_call_and_the_main_call_is_not_made_either() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(answer("first", used(100, 10)))
            .response(answer("never", used(100, 10)))
            .build(),
    );
    let summarizer = Arc::new(
        ScriptedModel::builder()
            .response(summary("never", used(1, 1)))
            .build(),
    );
    // The summarizer may answer 50 000 tokens: more than a turn's 20 000,
    // which the model's own call (100 tokens of answer) would fit in.
    let policy = ContextPolicy::builder()
        .summarize(summarize(&summarizer, 50, 50_000))
        .build()
        .expect("policy");
    let limits = UsageLimits::builder()
        .per_turn(Limit::new().tokens(20_000))
        .build()
        .expect("limits");
    let agent = agent(&model, |a| {
        a.context_policy(policy)
            .prices(summarizer_prices())
            .usage_limits(limits)
    });
    let mut machine = agent.machine();
    machine.enqueue_user("w ".repeat(200));
    machine.run().await.expect("runs");
    machine.enqueue_user("And now?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::UsageLimit);
    let limit = last.usage_limit.expect("names the limit");
    assert_eq!(
        (limit.scope, limit.kind),
        (LimitScope::Turn, LimitKind::Tokens)
    );
    assert!(limit.estimate >= 50_000, "{limit:?}");
    assert_eq!(summarizer.calls(), 0, "the summarizer was not called");
    assert_eq!(model.calls(), 1, "nor was the model");
    assert!(last.usage.is_empty());
    // Nothing lost: the question is in the history, unsummarized.
    assert_eq!(
        machine.history().last().map(|m| m.text()).as_deref(),
        Some("And now?")
    );
    assert!(machine.history().iter().all(|m| m.role != Role::Summary));
}

#[tokio::test]
async fn the_summarizers_reservation_counts_against_the_main_call() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(answer("first", used(10, 1)))
            .response(answer("never", used(10, 1)))
            .build(),
    );
    let summarizer = Arc::new(
        ScriptedModel::builder()
            .response(summary("Hello.", used(200, 5)))
            .build(),
    );
    let policy = ContextPolicy::builder()
        .summarize(summarize(&summarizer, 50, 500))
        .build()
        .expect("policy");
    // One request per turn: the summarizer's takes it.
    let limits = UsageLimits::builder()
        .per_turn(Limit::new().requests(1))
        .build()
        .expect("limits");
    let agent = agent(&model, |a| {
        a.context_policy(policy)
            .prices(summarizer_prices())
            .usage_limits(limits)
    });
    let mut machine = agent.machine();
    machine.enqueue_user("w ".repeat(200));
    machine.run().await.expect("runs");
    machine.enqueue_user("And now?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::UsageLimit);
    assert_eq!(summarizer.calls(), 1);
    assert_eq!(model.calls(), 1, "the main call was refused");
    // The summary is recorded and its call counted.
    assert_eq!(last.usage.requests, 1);
    assert_eq!(last.usage.input_tokens, 200);
    assert_eq!(machine.usage().turn.requests, 1);
    assert!(machine.history().iter().any(|m| m.role == Role::Summary));
}

#[tokio::test]
async fn a_cost_limit_refuses_an_unpriced_summarizer_like_an_unpriced_model() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(answer("first", used(10, 1)))
            .build(),
    );
    let summarizer = Arc::new(ScriptedModel::builder().text("Hello.").build());
    let policy = ContextPolicy::builder()
        .summarize(summarize(&summarizer, 50, 500))
        .build()
        .expect("policy");
    let limits = UsageLimits::builder()
        .per_session(Limit::new().cost(Usd::from_cents(100)))
        .build()
        .expect("limits");
    let agent = agent(&model, |a| a.context_policy(policy).usage_limits(limits));
    let mut machine = agent.machine();
    machine.enqueue_user("w ".repeat(200));
    machine.run().await.expect("runs");
    machine.enqueue_user("And now?");
    let error = machine.run().await.expect_err("no price");
    assert!(
        matches!(&error, RunError::NoPrice { model: Some(m) } if m == SUMMARIZER),
        "{error}"
    );
    assert_eq!(summarizer.calls(), 0);
}

#[tokio::test]
async fn a_token_limit_admits_the_view_that_is_sent_not_the_whole_history() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(answer("a long read", used(100_000, 10)))
            .response(answer("short", used(20, 5)))
            .build(),
    );
    let policy = ContextPolicy::builder()
        .keep_last_turns(1)
        .build()
        .expect("policy");
    // A first turn of some 100 000 estimated tokens, without limits.
    let unlimited = agent(&model, |a| a.context_policy(policy.clone()));
    let mut machine = unlimited.machine();
    machine.enqueue_user("x".repeat(300_000));
    machine.run().await.expect("runs");
    let snapshot = serialize_machine(&machine).expect("serializes");
    let text = serde_json::to_string(&snapshot).expect("writes");
    // The same session under a per-turn limit far below the history and
    // far above the view (the last turn only).
    let limits = UsageLimits::builder()
        .per_turn(Limit::new().tokens(5_000))
        .build()
        .expect("limits");
    let limited = agent(&model, |a| a.context_policy(policy).usage_limits(limits));
    let mut machine = limited
        .restore(serde_json::from_str(&text).expect("reads"))
        .expect("restores");
    machine.enqueue_user("Short.");
    let last = machine.run().await.expect("runs");
    assert_eq!(
        last.yield_reason,
        YieldReason::EndTurn,
        "{:?}",
        last.usage_limit
    );
    assert_eq!(model.calls(), 2);
    assert_eq!(model.requests()[1].messages.len(), 1);
}

#[tokio::test]
async fn the_retry_after_a_context_length_refusal_is_admitted_again() {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(answer("first", used(10, 1)))
            .error(markov_core::ModelError::ContextLength("too long".into()))
            .response(answer("never", used(10, 1)))
            .build(),
    );
    let policy = ContextPolicy::builder()
        .keep_last_turns(10)
        .build()
        .expect("policy");
    // One request per run: the refused request keeps its reservation, so
    // the retry, a second request, does not fit.
    let limits = UsageLimits::builder()
        .per_run(Limit::new().requests(1))
        .build()
        .expect("limits");
    let agent = agent(&model, |a| a.context_policy(policy).usage_limits(limits));
    let mut machine = agent.machine();
    machine.enqueue_user("First.");
    machine.run().await.expect("runs");
    machine.enqueue_user("Second.");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::UsageLimit);
    let limit = last.usage_limit.expect("names the limit");
    assert_eq!(
        (limit.scope, limit.kind, limit.used),
        (LimitScope::Run, LimitKind::Requests, 1)
    );
    assert_eq!(model.calls(), 2, "the retry was not made");
    // The refused request was not billed: nothing counted.
    assert!(last.usage.is_empty());
    assert_eq!(machine.usage().session.requests, 1);
}
