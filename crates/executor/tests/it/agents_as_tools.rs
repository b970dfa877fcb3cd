//! Agents as tools: an `Agent` offered to another as a tool runs its own
//! loop, with its own history, instructions, tools and limits; its answer
//! is the call's result and its usage counts in the caller's step and
//! limits.

use std::sync::Arc;

use crate::common::*;
use markov_context::{Limit, UsageLimits};
use markov_executor::{Agent, RunOptions, YieldReason};
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::Pay;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

#[markov_core::tool]
/// Reads the weather of a city.
async fn weather(
    /// The city.
    city: String,
) -> String {
    format!("sunny in {city}")
}

/// The sub-agent: looks the weather up, then answers.
fn forecaster(model: &Arc<ScriptedModel>) -> Agent {
    Agent::builder("forecaster")
        .instructions("You are the forecaster. Use your weather tool.")
        .tool(Weather)
        .shared_model(model.clone())
        .build()
        .expect("builds")
}

fn forecaster_script() -> Arc<ScriptedModel> {
    Arc::new(
        ScriptedModel::builder()
            .tool_call("weather", json!({"city": "Paris"}))
            .text("Paris: sunny.")
            .build(),
    )
}

#[tokio::test]
async fn a_sub_agent_runs_its_own_loop_and_its_answer_is_the_callers_result() {
    let sub = forecaster_script();
    let tool = forecaster(&sub)
        .as_tool("forecaster", "Forecasts the weather of a city.")
        .expect("a valid name");
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call(
                "forecaster",
                json!({"request": "What is the weather in Paris?"}),
            )
            .text("It is sunny in Paris.")
            .build(),
    );
    let agent = Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools([Arc::new(tool) as markov_core::tool::SharedTool])
        .shared_model(caller.clone())
        .build()
        .expect("builds");
    let mut machine = agent.machine();
    machine.enqueue_user("Weather in Paris?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.output().as_deref(), Some("It is sunny in Paris."));
    assert_paired(machine.history());
    let results = all_results(machine.history());
    assert_eq!(results.len(), 1, "the sub-agent's calls are its own");
    assert_eq!(results[0].1, "Paris: sunny.");
    // Its own history and instructions: the request alone, its own prompt
    // and tools.
    let first = &sub.requests()[0];
    assert!(
        first.system.contains("You are the forecaster."),
        "{}",
        first.system
    );
    assert_eq!(first.messages.len(), 1);
    assert_eq!(first.messages[0].text(), "What is the weather in Paris?");
    assert_eq!(first.tool_names(), ["weather"]);
    // The caller's model sees the tool, not the sub-agent's tools.
    assert!(caller.requests()[0].tool_names().contains(&"forecaster"));
    assert!(!caller.requests()[0].tool_names().contains(&"weather"));
}

#[tokio::test]
async fn the_sub_agents_usage_counts_in_the_callers_step_and_limits() {
    let sub = forecaster_script();
    let tool = forecaster(&sub)
        .as_tool("forecaster", "Forecasts the weather.")
        .expect("a valid name");
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call("forecaster", json!({"request": "Paris?"}))
            .text("Sunny.")
            .build(),
    );
    let build = |limits: UsageLimits| {
        Agent::builder("assistant")
            .instructions("You are the assistant.")
            .tools([Arc::new(tool.clone()) as markov_core::tool::SharedTool])
            .shared_model(caller.clone())
            .limits(RunOptions::default().usage_limits(limits))
            .build()
            .expect("builds")
    };
    let mut machine = build(UsageLimits::none()).machine();
    machine.enqueue_user("Weather?");
    let (steps, err) = run_all(&mut machine, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(
        steps[0].usage.requests, 3,
        "the step's own call and the sub-agent's two"
    );
    assert_eq!(machine.usage().session.requests, 4);

    // A turn limit of three requests: the sub-agent's two and the
    // caller's first fill it, so the caller's next call is not made.
    let sub = forecaster_script();
    let tool = forecaster(&sub)
        .as_tool("forecaster", "Forecasts the weather.")
        .expect("a valid name");
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call("forecaster", json!({"request": "Paris?"}))
            .text("Sunny.")
            .build(),
    );
    let limits = UsageLimits::builder()
        .per_turn(Limit::new().requests(3))
        .build()
        .expect("limits");
    let agent = Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools([Arc::new(tool) as markov_core::tool::SharedTool])
        .shared_model(caller.clone())
        .limits(RunOptions::default().usage_limits(limits))
        .build()
        .expect("builds");
    let mut machine = agent.machine();
    machine.enqueue_user("Weather?");
    let last = machine.run().await.expect("runs");
    assert!(last.usage_limit.is_some(), "{:?}", last.yield_reason);
    assert_eq!(caller.calls(), 1, "the caller's second call was not made");
}

#[derive(Debug, Deserialize, JsonSchema)]
#[allow(dead_code)]
struct Trip {
    /// Where to.
    city: String,
    /// How many days.
    days: u32,
}

#[tokio::test]
async fn a_typed_input_is_the_tools_schema_checked_and_read_by_the_sub_agent() {
    let sub = Arc::new(ScriptedModel::builder().text("Pack an umbrella.").build());
    let tool = Agent::builder("packer")
        .instructions("You say what to pack.")
        .shared_model(sub.clone())
        .build()
        .expect("builds")
        .as_tool("packer", "Says what to pack for a trip.")
        .expect("a valid name")
        .input::<Trip>();
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call("packer", json!({"city": "Oslo"}))
            .tool_call("packer", json!({"city": "Oslo", "days": 3}))
            .text("Umbrella.")
            .build(),
    );
    let agent = Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools([Arc::new(tool) as markov_core::tool::SharedTool])
        .shared_model(caller.clone())
        .build()
        .expect("builds");
    let mut machine = agent.machine();
    machine.enqueue_user("Packing for Oslo?");
    machine.run().await.expect("runs");
    let offered = &caller.requests()[0].tools;
    assert_eq!(offered[0].input_schema["required"], json!(["city", "days"]));
    let results = all_results(machine.history());
    assert_eq!(
        results[0].2,
        Some(true),
        "days is missing: {}",
        results[0].1
    );
    assert!(results[0].1.contains("days"), "{}", results[0].1);
    assert_eq!(results[1].1, "Pack an umbrella.");
    assert_eq!(sub.calls(), 1, "only the valid call reached the sub-agent");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&sub.requests()[0].messages[0].text())
            .expect("json"),
        json!({"city": "Oslo", "days": 3})
    );
}

#[tokio::test]
async fn a_sub_agent_that_hits_its_own_step_limit_is_an_error_result_and_the_caller_goes_on() {
    let sub = Arc::new(
        ScriptedModel::builder()
            .tool_call("weather", json!({"city": "Paris"}))
            .tool_call("weather", json!({"city": "Lyon"}))
            .build(),
    );
    let tool = Agent::builder("forecaster")
        .instructions("You are the forecaster.")
        .tool(Weather)
        .shared_model(sub.clone())
        .limits(RunOptions::default().max_steps(1))
        .build()
        .expect("builds")
        .as_tool("forecaster", "Forecasts.")
        .expect("a valid name");
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call("forecaster", json!({"request": "Paris?"}))
            .text("I could not find out.")
            .build(),
    );
    let agent = Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools([Arc::new(tool) as markov_core::tool::SharedTool])
        .shared_model(caller.clone())
        .build()
        .expect("builds");
    let mut machine = agent.machine();
    machine.enqueue_user("Weather?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.output().as_deref(), Some("I could not find out."));
    let results = all_results(machine.history());
    assert_eq!(results[0].2, Some(true));
    assert!(
        results[0].1.contains("forecaster failed"),
        "{}",
        results[0].1
    );
    assert_eq!(sub.calls(), 1, "its own limit: one step");
}

/// A cashier sub-agent whose `pay` needs approval, and an assistant that
/// calls it; both scripted.
fn cashier_and_assistant(
    pay: &Pay,
    sub: &Arc<ScriptedModel>,
    caller: &Arc<ScriptedModel>,
) -> Agent {
    let tool = Agent::builder("cashier")
        .instructions("You pay.")
        .tool_with(
            pay.clone(),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .shared_model(sub.clone())
        .build()
        .expect("builds")
        .as_tool("cashier", "Pays.")
        .expect("a valid name");
    Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools([Arc::new(tool) as markov_core::tool::SharedTool])
        .shared_model(caller.clone())
        .build()
        .expect("builds")
}

#[tokio::test]
async fn an_approval_inside_the_sub_agent_pauses_the_callers_run_and_is_decided_through_its_session()
 {
    let pay = Pay::default();
    let sub = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("Paid 5.")
            .build(),
    );
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call("cashier", json!({"request": "pay 5"}))
            .text("Done: paid 5.")
            .build(),
    );
    let mut machine = cashier_and_assistant(&pay, &sub, &caller).machine();
    machine.enqueue_user("Pay 5.");
    let paused = machine.run().await.expect("runs");
    assert_eq!(paused.yield_reason, YieldReason::AwaitingApproval);
    assert!(machine.is_awaiting_approval());
    assert!(pay.paid().is_empty(), "not before the decision");
    // The sub-agent's request is the caller's.
    let pending = machine.approvals().pending();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].tool, "cashier.pay");
    assert_eq!(pending[0].args, json!({"amount": 5}));
    machine
        .approvals()
        .approve(&pending[0].request_id)
        .expect("approves");
    let last = machine.resume().await.expect("resumes");
    assert_eq!(last.output().as_deref(), Some("Done: paid 5."));
    assert_eq!(pay.paid(), [5], "once, after the approval");
    assert_paired(machine.history());
    assert_eq!(all_results(machine.history())[0].1, "Paid 5.");
    assert_eq!(sub.calls(), 2, "the sub-agent resumed: no call asked again");
    assert_eq!(caller.calls(), 2, "the caller's answer was replayed");
    assert_eq!(
        machine.usage().session.requests,
        4,
        "every model call counted once"
    );
}

#[tokio::test]
async fn an_at_most_once_agent_tool_waiting_for_an_approval_inside_is_resumed_after_it() {
    let pay = Pay::default();
    let sub = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("Paid 5.")
            .build(),
    );
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call("cashier", json!({"request": "pay 5"}))
            .text("Done: paid 5.")
            .build(),
    );
    let tool = Agent::builder("cashier")
        .instructions("You pay.")
        .tool_with(
            pay.clone(),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .shared_model(sub.clone())
        .build()
        .expect("builds")
        .as_tool("cashier", "Pays.")
        .expect("a valid name");
    let agent = Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools_with([(
            Arc::new(tool) as markov_core::tool::SharedTool,
            ToolMetadata::new(Category::Action)
                .with_delivery(markov_core::tool::Delivery::AtMostOnce),
        )])
        .shared_model(caller.clone())
        .build()
        .expect("builds");
    let mut machine = agent.machine();
    machine.enqueue_user("Pay 5.");
    let paused = machine.run().await.expect("runs");
    assert_eq!(paused.yield_reason, YieldReason::AwaitingApproval);
    let pending = machine.approvals().pending();
    machine
        .approvals()
        .approve(&pending[0].request_id)
        .expect("approves");
    let last = machine.resume().await.expect("resumes");
    assert_eq!(last.output().as_deref(), Some("Done: paid 5."));
    assert_eq!(pay.paid(), [5], "once, after the approval");
    assert_eq!(
        all_results(machine.history())[0].1,
        "Paid 5.",
        "the waiting sub-agent resumed: its call was not answered INTERRUPTED"
    );
}

#[tokio::test]
async fn a_denial_through_the_callers_session_reaches_the_sub_agent() {
    let pay = Pay::default();
    let sub = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("The payment was declined.")
            .build(),
    );
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call("cashier", json!({"request": "pay 5"}))
            .text("Not paid.")
            .build(),
    );
    let mut machine = cashier_and_assistant(&pay, &sub, &caller).machine();
    machine.enqueue_user("Pay 5.");
    machine.run().await.expect("runs");
    let pending = machine.approvals().pending();
    machine
        .approvals()
        .decide(
            &pending[0].request_id,
            markov_policy::Decision::Deny {
                message: Some("not today".into()),
            },
        )
        .expect("denies");
    let last = machine.resume().await.expect("resumes");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert!(pay.paid().is_empty());
    assert_eq!(
        all_results(machine.history())[0].1,
        "The payment was declined."
    );
    // The sub-agent's model read the denial and its message.
    let seen = format!("{:?}", sub.requests()[1].messages);
    assert!(seen.contains("not today"), "{seen}");
}

#[tokio::test]
async fn a_waiting_sub_agent_is_kept_with_the_callers_snapshot_and_resumed_after_a_restore() {
    let pay = Pay::default();
    let sub = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .build(),
    );
    let caller = Arc::new(
        ScriptedModel::builder()
            .tool_call("cashier", json!({"request": "pay 5"}))
            .build(),
    );
    let mut machine = cashier_and_assistant(&pay, &sub, &caller).machine();
    machine.enqueue_user("Pay 5.");
    machine.run().await.expect("runs");
    let request = machine.approvals().pending()[0].request_id.clone();
    let text =
        serde_json::to_string(&markov_executor::serialize_machine(&machine).expect("serializes"))
            .expect("json");
    drop(machine);

    // Another process: the same agents built again, new models that have
    // not been asked anything, no sub-agent waiting in memory.
    let sub = Arc::new(ScriptedModel::builder().text("Paid 5.").build());
    let caller = Arc::new(ScriptedModel::builder().text("Done: paid 5.").build());
    let agent = cashier_and_assistant(&pay, &sub, &caller);
    let mut machine = agent
        .restore(serde_json::from_str(&text).expect("reads"))
        .expect("restores");
    machine.approvals().approve(&request).expect("approves");
    let last = machine.resume().await.expect("resumes");
    assert_eq!(last.output().as_deref(), Some("Done: paid 5."));
    assert_eq!(pay.paid(), [5], "once");
    assert_eq!(
        sub.calls(),
        1,
        "the sub-agent continued from its paused answer: only its last call"
    );
    assert_eq!(all_results(machine.history())[0].1, "Paid 5.");
}

/// Called where no approval can be asked for (a context made by hand),
/// the sub-agent's call that needs one is not run, and the result says why.
#[tokio::test]
async fn outside_a_machine_a_sub_agent_call_that_needs_approval_is_not_run() {
    use markov_core::tool::{DynTool, NoState, ToolContext};

    let pay = Pay::default();
    let sub = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .build(),
    );
    let tool = Agent::builder("cashier")
        .instructions("You pay.")
        .tool_with(
            pay.clone(),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .shared_model(sub)
        .build()
        .expect("builds")
        .as_tool("cashier", "Pays.")
        .expect("a valid name");
    let id = markov_core::ToolCallId::new("c1");
    let state = NoState::default();
    let err = tool
        .call_json(
            &json!({"request": "pay 5"}),
            ToolContext::new(&id, &[], &state),
        )
        .await
        .expect_err("not run");
    assert!(
        err.to_string().contains("cannot be asked for here"),
        "{err}"
    );
    assert!(pay.paid().is_empty());
}
