//! Scenario tests of tool-choice enforcement in the standard loop: the first
//! call of a turn forced, later calls relaxed, the ways out of `Required`, the
//! interplay with output restriction, the extended-thinking guard against the
//! client's capability table, and the seed's end-to-end table (a worker that
//! must query its domain tools instead of answering from training data).

use std::convert::Infallible;
use std::sync::Arc;

use crate::common::*;
use markov_charter::ConfigError;
use markov_charter::charter::Charter;
use markov_charter::node::{Node, NodeBuilder};
use markov_charter::tool_choice::{
    DEFAULT_RESTRICTION_MESSAGE, OutputRestriction, ToolChoiceRule, TurnPolicy,
};
use markov_charter::transition::Transition;
use markov_core::ToolName;
use markov_core::async_trait;
use markov_core::message::{Message, Role};
use markov_core::model::{
    Model, ModelError, ModelRequest, ModelResponse, ModelSettings, Thinking, ThinkingAllowance,
    ToolChoice,
};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::ToolChoiceEnforcer;
use markov_executor::{
    Instance, Machine, MachineStep, RunError, RunOptions, StandardExecutor, YieldReason,
};
use markov_testkit::ScriptedModel;
use markov_tools_std::{Finish, Respond};
use proptest::prelude::*;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

// --- domain tools (the seed's Business Central worker) -----------------------

/// Lists the entities of the local index.
struct ListAllEntities;

#[derive(Deserialize, JsonSchema)]
struct NoArgs {}

#[async_trait]
impl Tool for ListAllEntities {
    const NAME: &'static str = "list_all_entities";
    type Args = NoArgs;
    type Output = Vec<String>;
    type Error = Infallible;
    fn description(&self) -> String {
        "List every Business Central entity in the local index".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<Vec<String>, Infallible> {
        Ok(vec!["customers".into(), "vendors".into(), "items".into()])
    }
}

/// Documents one entity's endpoints.
struct GetEndpointDocumentation;

#[derive(Deserialize, JsonSchema)]
struct EntityArgs {
    /// The entity, as `list_all_entities` names it.
    entity: String,
}

#[derive(Serialize)]
struct EndpointDoc {
    entity: String,
    endpoints: Vec<&'static str>,
}

#[async_trait]
impl Tool for GetEndpointDocumentation {
    const NAME: &'static str = "get_endpoint_documentation";
    type Args = EntityArgs;
    type Output = EndpointDoc;
    type Error = Infallible;
    fn description(&self) -> String {
        "Get the documentation of an entity's endpoints".into()
    }
    async fn call(
        &self,
        args: EntityArgs,
        _cx: &ToolContext<'_>,
    ) -> Result<EndpointDoc, Infallible> {
        Ok(EndpointDoc {
            entity: args.entity,
            endpoints: vec![
                "GET /customers",
                "POST /customers",
                "PATCH /customers({id})",
            ],
        })
    }
}

/// Searches the user's documents.
struct KnowledgeSearch;

#[derive(Deserialize, JsonSchema)]
struct SearchArgs {
    /// What to look for.
    query: String,
}

#[async_trait]
impl Tool for KnowledgeSearch {
    const NAME: &'static str = "knowledge_search";
    type Args = SearchArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Search the user's documents".into()
    }
    async fn call(&self, args: SearchArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok(format!(
            "1 match for {:?}: SLA.pdf p.3, response within 4 hours",
            args.query
        ))
    }
}

const DOMAIN_TOOLS: [&str; 3] = [
    "list_all_entities",
    "get_endpoint_documentation",
    "knowledge_search",
];

// --- fixtures ------------------------------------------------------------------

fn turn_policy(tool_choice: ToolChoiceRule) -> TurnPolicy {
    TurnPolicy {
        tool_choice,
        ..TurnPolicy::default()
    }
}

fn named(tool: &str) -> ToolChoiceRule {
    ToolChoiceRule::Named(ToolName::new(tool).expect("valid tool name"))
}

/// The seed's worker: domain tools only.
fn bc_agent(tool_choice: ToolChoiceRule) -> Node {
    Node::builder("Answer questions about Business Central from your tools.")
        .name("bc-agent")
        .tool(ListAllEntities)
        .tool(GetEndpointDocumentation)
        .tool(KnowledgeSearch)
        .policy(turn_policy(tool_choice))
        .build()
        .expect("node builds")
}

/// A node named `worker` with `add` and whatever `extra` adds.
fn worker(policy: TurnPolicy, extra: impl FnOnce(NodeBuilder) -> NodeBuilder) -> Node {
    extra(Node::builder("Work with tools.").name("worker").tool(Add))
        .policy(policy)
        .build()
        .expect("node builds")
}

fn choices(model: &ScriptedModel) -> Vec<ToolChoice> {
    model
        .requests()
        .into_iter()
        .map(|r| r.tool_choice)
        .collect()
}

fn tool(name: &str) -> ToolChoice {
    ToolChoice::Tool(ToolName::new(name).expect("valid tool name"))
}

/// The names of the tools called in `steps`, in order.
fn called(steps: &[MachineStep]) -> Vec<String> {
    steps
        .iter()
        .flat_map(|s| &s.history)
        .flat_map(|m| m.tool_uses().map(|(_, name, _)| name.to_owned()))
        .collect()
}

fn add() -> (&'static str, Value) {
    ("add", json!({"a": 1, "b": 2}))
}

/// A machine over `node` whose executor has `defaults` and calls `model`.
fn machine_with(node: Node, defaults: ModelSettings, model: Arc<dyn Model>) -> Machine {
    let charter = Charter::builder("test")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    machine_on(
        charter,
        StandardExecutor::shared(model).with_settings(defaults),
        Instance::new(node, json!({})),
    )
    .expect("machine builds")
}

// --- RequiredFirst -------------------------------------------------------------

#[tokio::test]
async fn required_first_forces_the_first_call_then_ends_with_text() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .text("3")
            .build(),
    );
    let node = worker(turn_policy(ToolChoiceRule::RequiredFirst), |b| b);
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(choices(&model), [ToolChoice::Any, ToolChoice::Auto]);
    // The loop ends naturally: text after one tool call, no step limit.
    assert_eq!(steps.len(), 2);
    let last = steps.last().expect("a step");
    assert!(last.done);
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(m.history().last().map(Message::text).as_deref(), Some("3"));
}

#[tokio::test]
async fn a_second_user_turn_forces_again() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .text("3")
            .tool_calls([add()])
            .tool_calls([add()])
            .text("3 again")
            .build(),
    );
    let node = worker(turn_policy(ToolChoiceRule::RequiredFirst), |b| b);
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    m.enqueue_user("and again?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert!(steps.last().is_some_and(|s| s.done));
    assert_eq!(
        choices(&model),
        [
            ToolChoice::Any,
            ToolChoice::Auto,
            ToolChoice::Any,
            ToolChoice::Auto,
            ToolChoice::Auto,
        ]
    );
}

#[tokio::test]
async fn a_transition_into_a_required_first_node_forces_again() {
    let next = Node::builder("Next node.")
        .name("next")
        .tool(Add)
        .policy(turn_policy(ToolChoiceRule::RequiredFirst))
        .build()
        .expect("node");
    let start = worker(turn_policy(ToolChoiceRule::RequiredFirst), |b| {
        b.transition("next", Transition::to("Go on", next.clone()))
    });
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .tool_call("transition", json!({"to": "next", "reason": "done here"}))
            .tool_calls([add()])
            .text("done in next")
            .build(),
    );
    let mut m = machine(|c| c, start, json!({}), model.clone());
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 4);
    assert_eq!(m.instance().node().id(), next.id());
    assert_eq!(
        choices(&model),
        [
            ToolChoice::Any,
            ToolChoice::Auto,
            // Entering `next` starts its turn over.
            ToolChoice::Any,
            ToolChoice::Auto,
        ]
    );
    assert!(model.requests()[2].system.starts_with("Next node."));
}

#[tokio::test]
async fn a_text_answer_under_a_forced_choice_is_the_models_error() {
    let model = Arc::new(ScriptedModel::builder().text("no tools needed").build());
    let node = worker(turn_policy(ToolChoiceRule::RequiredFirst), |b| b);
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(steps.is_empty());
    match err {
        Some(RunError::Model {
            step: 1,
            source: ModelError::InvalidRequest(message),
        }) => assert!(message.contains("tool choice is Any"), "{message}"),
        other => panic!("expected the scripted model's refusal, got {other:?}"),
    }
}

// --- Required and Named --------------------------------------------------------

#[tokio::test]
async fn required_ends_through_a_terminal_tool() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .tool_call("respond", json!({"text": "It is 3."}))
            .build(),
    );
    let node = worker(turn_policy(ToolChoiceRule::Required), |b| b.tool(Respond));
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(choices(&model), [ToolChoice::Any, ToolChoice::Any]);
    let last = steps.last().expect("a step");
    assert!(last.done);
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(last.response.as_deref(), Some("It is 3."));
}

#[tokio::test]
async fn required_ends_through_finish() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .tool_call("finish", json!({"note": "added"}))
            .build(),
    );
    let node = worker(turn_policy(ToolChoiceRule::Required), |b| b.tool(Finish));
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(choices(&model), [ToolChoice::Any, ToolChoice::Any]);
    let last = steps.last().expect("a step");
    assert!(last.done);
    let termination = last.termination.as_ref().expect("finish ended the run");
    assert_eq!(termination.message.as_deref(), Some("added"));
}

#[tokio::test]
async fn required_ends_at_the_step_limit() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .tool_calls([add()])
            .tool_calls([add()])
            .build(),
    );
    let node = worker(turn_policy(ToolChoiceRule::Required), |b| b.tool(Respond));
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("loop");
    let (steps, err) = run_all(&mut m, RunOptions::default().max_steps(3)).await;
    assert_eq!(steps.len(), 3);
    assert_eq!(err, Some(RunError::MaxSteps(3)));
    assert_eq!(choices(&model), vec![ToolChoice::Any; 3]);
    assert_paired(m.history());
}

#[tokio::test]
async fn named_sends_the_tool_then_auto() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .text("3")
            .build(),
    );
    let node = worker(turn_policy(named("add")), |b| b);
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(choices(&model), [tool("add"), ToolChoice::Auto]);
}

#[tokio::test]
async fn none_forbids_tool_calls() {
    let model = Arc::new(ScriptedModel::builder().tool_calls([add()]).build());
    let node = worker(turn_policy(ToolChoiceRule::None), |b| b);
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert_eq!(choices(&model), [ToolChoice::None]);
    assert!(
        matches!(&err, Some(RunError::Model { source: ModelError::InvalidRequest(m), .. }) if m.contains("None")),
        "{err:?}"
    );
}

// --- interplay with output restriction ------------------------------------------

#[tokio::test]
async fn restriction_applies_to_later_tool_less_answers() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .text("3, I think")
            .tool_call("finish", json!({}))
            .build(),
    );
    let node = worker(
        TurnPolicy {
            tool_choice: ToolChoiceRule::RequiredFirst,
            restriction: OutputRestriction::enabled(),
            thinking: None,
        },
        |b| b.tool(Finish),
    );
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    // Forced first call, then the restriction (not the tool choice) keeps the
    // model from ending with text.
    assert_eq!(
        choices(&model),
        [ToolChoice::Any, ToolChoice::Auto, ToolChoice::Auto]
    );
    let reasons: Vec<YieldReason> = steps.iter().map(|s| s.yield_reason).collect();
    assert_eq!(
        reasons,
        [
            YieldReason::ToolUse,
            YieldReason::Restricted,
            YieldReason::EndTurn
        ]
    );
    let reminders: Vec<String> = m
        .history()
        .iter()
        .filter(|msg| msg.role == Role::System)
        .map(Message::text)
        .collect();
    assert_eq!(reminders, [DEFAULT_RESTRICTION_MESSAGE]);
    assert!(steps.last().is_some_and(|s| s.termination.is_some()));
}

#[tokio::test]
async fn restriction_does_not_lift_the_forced_first_call() {
    let model = Arc::new(ScriptedModel::builder().text("straight answer").build());
    let node = worker(
        TurnPolicy {
            tool_choice: ToolChoiceRule::RequiredFirst,
            restriction: OutputRestriction::enabled(),
            thinking: None,
        },
        |b| b.tool(Finish),
    );
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("1+2?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(
        matches!(err, Some(RunError::Model { step: 1, .. })),
        "{err:?}"
    );
    assert!(!m.history().iter().any(|msg| msg.role == Role::System));
}

// --- the extended-thinking guard, against the client's capability table -----------

/// A client whose capability table lets a fixed thinking budget force tools.
#[derive(Debug)]
struct ForcesUnderThinking(Arc<ScriptedModel>);

#[async_trait::async_trait]
impl Model for ForcesUnderThinking {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        self.0.complete(request).await
    }

    fn thinking_allowance(&self, _: &ModelSettings, _: Thinking) -> ThinkingAllowance {
        ThinkingAllowance {
            forced_tool_choice: true,
            temperature: false,
        }
    }
}

fn enabled_thinking() -> ModelSettings {
    ModelSettings {
        thinking: Some(Thinking::Enabled {
            budget_tokens: 2048,
        }),
        ..ModelSettings::default()
    }
}

#[tokio::test]
async fn the_executor_rejects_thinking_with_forced_tools_before_any_request() {
    let model = Arc::new(ScriptedModel::builder().tool_calls([add()]).build());
    // The node itself builds: the thinking comes from the executor's defaults.
    let node = worker(turn_policy(ToolChoiceRule::RequiredFirst), |b| b);
    let mut m = machine_with(node, enabled_thinking(), model.clone());
    m.enqueue_user("1+2?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(steps.is_empty());
    match err {
        Some(RunError::Config(ConfigError::ThinkingConflict { node, constraint })) => {
            assert_eq!(node, "worker");
            assert!(constraint.contains("RequiredFirst"), "{constraint}");
        }
        other => panic!("expected a thinking conflict, got {other:?}"),
    }
    assert_eq!(model.calls(), 0, "no request was made");
}

#[tokio::test]
async fn a_capability_table_that_permits_forced_tools_passes_the_check() {
    let scripted = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .text("3")
            .build(),
    );
    let node = worker(turn_policy(ToolChoiceRule::RequiredFirst), |b| b);
    let model = Arc::new(ForcesUnderThinking(scripted.clone()));
    let mut m = machine_with(node, enabled_thinking(), model);
    m.enqueue_user("1+2?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let requests = scripted.requests();
    assert_eq!(requests[0].tool_choice, ToolChoice::Any);
    assert_eq!(requests[0].settings.thinking, enabled_thinking().thinking);
}

#[tokio::test]
async fn the_merged_temperature_is_checked() {
    // The node's thinking is fine alone; the temperature comes from the
    // executor's defaults, so only the final settings show the conflict.
    let model = Arc::new(ScriptedModel::builder().text("hi").build());
    let node = worker(
        TurnPolicy {
            thinking: Some(Thinking::Adaptive),
            ..TurnPolicy::default()
        },
        |b| b,
    );
    let defaults = ModelSettings {
        temperature: Some(0.3),
        ..ModelSettings::default()
    };
    let mut m = machine_with(node, defaults, model.clone());
    m.enqueue_user("hi");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    match err {
        Some(RunError::Config(ConfigError::ThinkingConflict { node, constraint })) => {
            assert_eq!(node, "worker");
            assert!(constraint.contains("temperature"), "{constraint}");
        }
        other => panic!("expected a thinking conflict, got {other:?}"),
    }
    assert_eq!(model.calls(), 0);
}

// --- the wrapper around a model, inside the loop -----------------------------------

#[tokio::test]
async fn the_enforcer_wraps_any_model_in_the_loop() {
    // The node says Auto; the wrapper alone forces the first call.
    let scripted = Arc::new(
        ScriptedModel::builder()
            .tool_calls([add()])
            .text("3")
            .build(),
    );
    let node = worker(TurnPolicy::default(), |b| b);
    let model = Arc::new(ToolChoiceEnforcer::new(
        scripted.clone(),
        ToolChoiceRule::RequiredFirst,
    ));
    let mut m = machine_with(node, ModelSettings::default(), model);
    m.enqueue_user("1+2?");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(choices(&scripted), [ToolChoice::Any, ToolChoice::Auto]);
}

// --- the seed's end-to-end table ---------------------------------------------------

/// One row: a query, the calls the model makes (in order, one per response)
/// and its final answer.
struct Row {
    query: &'static str,
    calls: Vec<(&'static str, Value)>,
    answer: &'static str,
    expect_in_results: &'static str,
}

fn seed_table() -> Vec<Row> {
    vec![
        Row {
            query: "What endpoints does Customer have?",
            calls: vec![
                ("list_all_entities", json!({})),
                ("get_endpoint_documentation", json!({"entity": "customers"})),
            ],
            answer: "Customer has GET, POST and PATCH endpoints.",
            expect_in_results: "POST /customers",
        },
        Row {
            query: "Search my documents for SLA terms",
            calls: vec![("knowledge_search", json!({"query": "SLA terms"}))],
            answer: "Your SLA promises a response within 4 hours.",
            expect_in_results: "within 4 hours",
        },
    ]
}

#[tokio::test]
async fn each_query_makes_a_domain_tool_call_before_the_answer() {
    for row in seed_table() {
        let mut script = ScriptedModel::builder();
        for (name, input) in &row.calls {
            script = script.tool_call(name, input.clone());
        }
        let model = Arc::new(script.text(row.answer).build());
        let mut m = machine(
            |c| c,
            bc_agent(ToolChoiceRule::RequiredFirst),
            json!({}),
            model.clone(),
        );
        m.enqueue_user(row.query);
        let (steps, err) = run_all(&mut m, RunOptions::default()).await;
        assert!(err.is_none(), "{}: {err:?}", row.query);
        let names = called(&steps);
        assert!(
            names.iter().any(|n| DOMAIN_TOOLS.contains(&n.as_str())),
            "{}: {names:?}",
            row.query
        );
        let expected: Vec<&str> = row.calls.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, expected, "{}", row.query);
        // The tool results reached the model before it answered.
        let results = all_results(m.history());
        assert!(
            results
                .iter()
                .any(|(_, content, _)| content.contains(row.expect_in_results)),
            "{}: {results:?}",
            row.query
        );
        let last = steps.last().expect("a step");
        assert!(last.done && last.yield_reason == YieldReason::EndTurn);
        assert_eq!(
            m.history().last().map(Message::text).as_deref(),
            Some(row.answer)
        );
        // Forced once, then the model chained tools and ended on its own.
        let mut expected_choices = vec![ToolChoice::Any];
        expected_choices.resize(row.calls.len() + 1, ToolChoice::Auto);
        assert_eq!(choices(&model), expected_choices, "{}", row.query);
    }
}

#[tokio::test]
async fn answering_from_training_data_first_is_refused() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text("Customer has the endpoints GET /customers and POST /customers.")
            .build(),
    );
    let mut m = machine(
        |c| c,
        bc_agent(ToolChoiceRule::RequiredFirst),
        json!({}),
        model.clone(),
    );
    m.enqueue_user("What endpoints does Customer have?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(steps.is_empty());
    assert!(
        matches!(&err, Some(RunError::Model { step: 1, source: ModelError::InvalidRequest(msg) }) if msg.contains("tool choice is Any")),
        "{err:?}"
    );
    // No answer was recorded: the first call cannot skip the tools.
    assert!(!m.history().iter().any(|msg| msg.role == Role::Assistant));
}

#[tokio::test]
async fn under_auto_the_same_script_skips_the_tools() {
    // The seed's bug, for contrast: nothing stops a training-data answer.
    let model = Arc::new(
        ScriptedModel::builder()
            .text("From memory: GET /customers.")
            .build(),
    );
    let mut m = machine(
        |c| c,
        bc_agent(ToolChoiceRule::Auto),
        json!({}),
        model.clone(),
    );
    m.enqueue_user("What endpoints does Customer have?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert!(called(&steps).is_empty());
}

// --- property: runs end, and forced turns contain a tool call -----------------------

#[derive(Debug, Clone, Copy)]
enum Action {
    Add,
    Respond,
    Text,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![Just(Action::Add), Just(Action::Respond), Just(Action::Text)]
}

fn policy_strategy() -> impl Strategy<Value = ToolChoiceRule> {
    prop_oneof![
        Just(ToolChoiceRule::Auto),
        Just(ToolChoiceRule::RequiredFirst),
        Just(ToolChoiceRule::Required),
        Just(named("add")),
        Just(ToolChoiceRule::None),
    ]
}

const MAX_STEPS: usize = 8;

fn script(actions: &[Action]) -> ScriptedModel {
    actions
        .iter()
        .fold(ScriptedModel::builder(), |b, a| match a {
            Action::Add => b.tool_calls([add()]),
            Action::Respond => b.tool_call("respond", json!({"text": "scripted"})),
            Action::Text => b.text("plain text"),
        })
        .build()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn runs_end_and_forced_turns_call_a_tool(
        policy in policy_strategy(),
        actions in prop::collection::vec(action(), 0..20),
        turns in 1usize..4,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let model = Arc::new(script(&actions));
            let node = worker(turn_policy(policy.clone()), |b| b.tool(Respond));
            let mut m = machine(|c| c, node, json!({}), model.clone());
            for turn in 0..turns {
                m.enqueue_user(format!("question {turn}"));
                let (steps, err) =
                    run_all(&mut m, RunOptions::default().max_steps(MAX_STEPS)).await;
                prop_assert!(steps.len() <= MAX_STEPS);
                if let Some(err) = err {
                    // Only a refusal, an exhausted script or the step limit
                    // may end a run early.
                    prop_assert!(
                        matches!(err, RunError::Model { .. } | RunError::MaxSteps(MAX_STEPS)),
                        "{:?}", err
                    );
                    break;
                }
                let last = steps.last().expect("a run that ends normally has a step");
                prop_assert!(last.done);
                let forced = matches!(
                    policy,
                    ToolChoiceRule::RequiredFirst | ToolChoiceRule::Required
                );
                if forced && last.yield_reason == YieldReason::EndTurn {
                    prop_assert!(
                        !called(&steps).is_empty(),
                        "{:?}: a forced turn ended without a tool call", policy
                    );
                }
            }
            prop_assert!(model.calls() <= MAX_STEPS * turns);
            Ok(())
        })?;
    }
}

#[tokio::test]
async fn an_instance_policy_wins_over_the_nodes() {
    use markov_charter::tool_choice::ToolChoiceRule;
    use markov_executor::{Instance, StandardExecutor};
    let node = markov_charter::node::Node::builder("Auto node.")
        .tool(crate::common::Add)
        .build()
        .expect("node");
    let model = std::sync::Arc::new(
        markov_testkit::ScriptedModel::builder()
            .tool_call("add", serde_json::json!({"a": 1, "b": 1}))
            .text("2")
            .build(),
    );
    let charter = markov_charter::charter::Charter::builder("t")
        .build()
        .expect("charter");
    let root =
        Instance::new(node, serde_json::json!({})).with_tool_choice(ToolChoiceRule::RequiredFirst);
    let mut m =
        machine_on(charter, StandardExecutor::shared(model.clone()), root).expect("machine");
    m.enqueue_user("1+1");
    markov_executor::run_to_completion(&mut m, markov_executor::RunOptions::default())
        .await
        .expect("run ends");
    let choices: Vec<_> = model
        .requests()
        .iter()
        .map(|r| r.tool_choice.clone())
        .collect();
    assert_eq!(
        choices,
        vec![
            markov_core::model::ToolChoice::Any,
            markov_core::model::ToolChoice::Auto
        ]
    );
}
