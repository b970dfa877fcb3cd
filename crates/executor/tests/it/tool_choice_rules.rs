//! Tool-choice policy: the `choice` table, the [`ToolChoiceEnforcer`] model
//! wrapper on a scripted model, and the checks made when a node is built
//! (`Named`, `Required` and the extended-thinking guard).

use std::convert::Infallible;

use futures::StreamExt;
use markov_charter::ConfigError;
use markov_charter::node::{ExecutorConfig, Node, NodeBuilder};
use markov_charter::tool_choice::{OutputRestriction, ToolChoiceRule, TurnPolicy, check_thinking};
use markov_charter::transition::Transition;
use markov_core::ToolName;
use markov_core::async_trait;
use markov_core::message::{Item, Message};
use markov_core::model::{
    Model, ModelError, ModelRequest, ModelResponse, ModelSettings, StreamEvent, Thinking,
    ThinkingAllowance, ToolChoice,
};
use markov_core::tool::{TerminateResponse, Tool, ToolContext};
use markov_executor::ToolChoiceEnforcer;
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize, JsonSchema)]
struct NoArgs {}

/// A plain domain tool.
struct ListAllEntities;

#[async_trait]
impl Tool for ListAllEntities {
    const NAME: &'static str = "list_all_entities";
    type Args = NoArgs;
    type Output = Vec<String>;
    type Error = Infallible;
    fn description(&self) -> String {
        "List every entity".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<Vec<String>, Infallible> {
        Ok(vec!["customers".into(), "vendors".into()])
    }
}

/// A terminal tool.
struct Answer;

#[async_trait]
impl Tool for Answer {
    const NAME: &'static str = "answer";
    const TERMINAL: bool = true;
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Give the final answer".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok("the answer".into())
    }
}

/// A tool that ends the run.
struct Done;

#[async_trait]
impl Tool for Done {
    const NAME: &'static str = "done";
    type Args = NoArgs;
    type Output = TerminateResponse;
    type Error = Infallible;
    fn description(&self) -> String {
        "End the run".into()
    }
    async fn call(
        &self,
        _: NoArgs,
        _cx: &ToolContext<'_>,
    ) -> Result<TerminateResponse, Infallible> {
        Ok(TerminateResponse::new(None))
    }
}

const ENABLED: Thinking = Thinking::Enabled {
    budget_tokens: 2048,
};

fn policy(tool_choice: ToolChoiceRule, thinking: Option<Thinking>) -> TurnPolicy {
    TurnPolicy {
        tool_choice,
        thinking,
        ..TurnPolicy::default()
    }
}

fn named(tool: &str) -> ToolChoiceRule {
    ToolChoiceRule::Named(ToolName::new(tool).expect("valid tool name"))
}

/// A node named `worker` with a domain tool and a terminal tool.
fn worker() -> NodeBuilder {
    Node::builder("Answer from the tools.")
        .name("worker")
        .tool(ListAllEntities)
        .tool(Answer)
}

fn request<'a>(
    messages: &'a [Message],
    settings: &'a ModelSettings,
    choice: &'a ToolChoice,
) -> ModelRequest<'a> {
    ModelRequest::new("sys", messages, settings).with_tool_choice(choice)
}

fn tool_results(ids: &[&str]) -> Message {
    Message::user_items(
        ids.iter()
            .map(|id| Item::tool_result(*id, "ok", Some(false)))
            .collect(),
    )
}

/// Feeds `history` to `model`, appending each answer (and a result for each
/// of its tool calls) so the next call sees a realistic conversation.
async fn exchange<M: Model>(model: &M, history: &mut Vec<Message>) -> ModelResponse {
    let settings = ModelSettings::default();
    let response = model
        .complete(request(history, &settings, &ToolChoice::Auto))
        .await
        .expect("the scripted model answers");
    let ids: Vec<String> = response
        .tool_calls()
        .map(|(id, _, _)| id.to_string())
        .collect();
    history.push(Message::assistant_items(response.content.clone()));
    if !ids.is_empty() {
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        history.push(tool_results(&ids));
    }
    response
}

fn sent_choices(model: &ToolChoiceEnforcer<ScriptedModel>) -> Vec<ToolChoice> {
    model
        .get_ref()
        .requests()
        .into_iter()
        .map(|r| r.tool_choice)
        .collect()
}

// --- the choice table -------------------------------------------------------

#[test]
fn choice_table() {
    let tool = ToolChoice::Tool(ToolName::new("list_all_entities").expect("name"));
    let rows = [
        (ToolChoiceRule::Auto, ToolChoice::Auto, ToolChoice::Auto),
        (
            ToolChoiceRule::RequiredFirst,
            ToolChoice::Any,
            ToolChoice::Auto,
        ),
        (ToolChoiceRule::Required, ToolChoice::Any, ToolChoice::Any),
        (named("list_all_entities"), tool, ToolChoice::Auto),
        (ToolChoiceRule::None, ToolChoice::None, ToolChoice::None),
    ];
    for (policy, first, after_tool) in rows {
        assert_eq!(policy.choice(false), first, "{policy:?} before a tool ran");
        assert_eq!(
            policy.choice(true),
            after_tool,
            "{policy:?} after a tool ran"
        );
        assert_eq!(
            policy.ever_forces(),
            first.forces_tool_use() || after_tool.forces_tool_use(),
            "{policy:?}"
        );
    }
    assert_eq!(ToolChoiceRule::default(), ToolChoiceRule::Auto);
}

// --- the wrapper --------------------------------------------------------------

#[tokio::test]
async fn the_enforcer_forces_the_first_call_then_relaxes() {
    let scripted = ScriptedModel::builder()
        .tool_call("list_all_entities", json!({}))
        .text("Customer has these endpoints.")
        .build();
    let model = ToolChoiceEnforcer::new(scripted, ToolChoiceRule::RequiredFirst);
    let mut history = vec![Message::user("What endpoints does Customer have?")];
    exchange(&model, &mut history).await;
    let answer = exchange(&model, &mut history).await;
    assert!(!answer.has_tool_calls());
    assert_eq!(sent_choices(&model), [ToolChoice::Any, ToolChoice::Auto]);
}

#[tokio::test]
async fn a_new_user_message_forces_again() {
    let scripted = ScriptedModel::builder()
        .tool_call("list_all_entities", json!({}))
        .text("first answer")
        .tool_call("list_all_entities", json!({}))
        .text("second answer")
        .build();
    let model = ToolChoiceEnforcer::new(scripted, ToolChoiceRule::RequiredFirst);
    let mut history = vec![Message::user("first question")];
    exchange(&model, &mut history).await;
    exchange(&model, &mut history).await;
    history.push(Message::user("second question"));
    exchange(&model, &mut history).await;
    exchange(&model, &mut history).await;
    assert_eq!(
        sent_choices(&model),
        [
            ToolChoice::Any,
            ToolChoice::Auto,
            ToolChoice::Any,
            ToolChoice::Auto
        ]
    );
}

#[tokio::test]
async fn a_text_answer_to_the_forced_first_call_is_refused_by_the_model() {
    // Proves the override reaches the model: the caller asked for Auto, the
    // scripted (strict) model received Any and refused a text-only answer.
    let scripted = ScriptedModel::builder()
        .text("From my training data: GET /customers ...")
        .build();
    let model = ToolChoiceEnforcer::new(scripted, ToolChoiceRule::RequiredFirst);
    let history = vec![Message::user("What endpoints does Customer have?")];
    let settings = ModelSettings::default();
    let err = model
        .complete(request(&history, &settings, &ToolChoice::Auto))
        .await
        .expect_err("text is refused under Any");
    assert!(err.to_string().contains("tool choice is Any"), "{err}");
}

#[tokio::test]
async fn named_forces_the_tool_then_relaxes() {
    let scripted = ScriptedModel::builder()
        .tool_call("list_all_entities", json!({}))
        .text("done")
        .build();
    let model = ToolChoiceEnforcer::new(scripted, named("list_all_entities"));
    let mut history = vec![Message::user("go")];
    exchange(&model, &mut history).await;
    exchange(&model, &mut history).await;
    assert_eq!(
        sent_choices(&model),
        [
            ToolChoice::Tool(ToolName::new("list_all_entities").expect("name")),
            ToolChoice::Auto
        ]
    );
}

#[tokio::test]
async fn none_auto_and_required_are_applied_on_every_call() {
    for (policy, expected) in [
        (ToolChoiceRule::None, ToolChoice::None),
        (ToolChoiceRule::Auto, ToolChoice::Auto),
        (ToolChoiceRule::Required, ToolChoice::Any),
    ] {
        let scripted = ScriptedModel::builder()
            .tool_call("list_all_entities", json!({}))
            .tool_call("answer", json!({}))
            .build();
        let model = ToolChoiceEnforcer::new(scripted, policy.clone());
        let settings = ModelSettings::default();
        let mut history = vec![Message::user("go")];
        // The caller's own choice is ignored.
        let _ = model
            .complete(request(&history, &settings, &ToolChoice::Any))
            .await;
        history.push(Message::assistant_items(vec![Item::tool_use(
            "call_1",
            "list_all_entities",
            json!({}),
        )]));
        history.push(tool_results(&["call_1"]));
        let _ = model
            .complete(request(&history, &settings, &ToolChoice::Any))
            .await;
        assert_eq!(
            sent_choices(&model),
            [expected.clone(), expected],
            "{policy:?}"
        );
        assert_eq!(model.policy(), &policy);
    }
}

#[tokio::test]
async fn turn_detection_reads_only_the_messages() {
    let model = ToolChoiceEnforcer::new(
        ScriptedModel::builder().build(),
        ToolChoiceRule::RequiredFirst,
    );
    let any = &ToolChoice::Any;
    let auto = &ToolChoice::Auto;
    // No user message at all: a new turn.
    assert_eq!(model.choice_for(&[]), any);
    assert_eq!(model.choice_for(&[Message::user("q")]), any);
    // Tool results after the question: the turn has run a tool.
    let after_tool = vec![
        Message::user("q"),
        Message::assistant_items(vec![Item::tool_use("c1", "list_all_entities", json!({}))]),
        tool_results(&["c1"]),
    ];
    assert_eq!(model.choice_for(&after_tool), auto);
    // Assistant text, a restriction reminder (system) and an empty user
    // message after the results do not start a turn.
    let mut trailing = after_tool.clone();
    trailing.push(Message::assistant("thinking aloud"));
    trailing.push(Message::system("call a tool"));
    trailing.push(Message::user_items(Vec::new()));
    assert_eq!(model.choice_for(&trailing), auto);
    // New input, even next to tool results in one message, starts a turn.
    let mut mixed = after_tool.clone();
    mixed.push(Message::user_items(vec![
        Item::tool_result("c2", "ok", None),
        Item::text("and vendors?"),
    ]));
    assert_eq!(model.choice_for(&mixed), any);
    let mut next = after_tool;
    next.push(Message::assistant("answer"));
    next.push(Message::user("next question"));
    assert_eq!(model.choice_for(&next), any);
}

#[tokio::test]
async fn streaming_is_enforced_too() {
    let scripted = ScriptedModel::builder()
        .tool_call("list_all_entities", json!({}))
        .build();
    let model = ToolChoiceEnforcer::new(scripted, ToolChoiceRule::RequiredFirst);
    let history = vec![Message::user("q")];
    let settings = ModelSettings::default();
    let events: Vec<_> = model
        .stream(request(&history, &settings, &ToolChoice::Auto))
        .collect()
        .await;
    assert!(
        matches!(events.last(), Some(Ok(StreamEvent::Done(_)))),
        "{events:?}"
    );
    assert_eq!(sent_choices(&model), [ToolChoice::Any]);
}

/// A client whose capability table lets every thinking mode force tools.
#[derive(Debug)]
struct Permissive(ScriptedModel);

#[async_trait::async_trait]
impl Model for Permissive {
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

#[tokio::test]
async fn the_enforcer_checks_thinking_against_the_inner_allowance() {
    let settings = ModelSettings {
        thinking: Some(ENABLED),
        ..ModelSettings::default()
    };
    let history = vec![Message::user("q")];

    let strict = ToolChoiceEnforcer::new(
        ScriptedModel::builder()
            .tool_call("list_all_entities", json!({}))
            .build(),
        ToolChoiceRule::RequiredFirst,
    );
    let err = strict
        .complete(request(&history, &settings, &ToolChoice::Auto))
        .await
        .expect_err("refused before the request");
    assert!(matches!(err, ModelError::InvalidRequest(_)), "{err:?}");
    assert!(err.to_string().contains("RequiredFirst"), "{err}");
    assert_eq!(
        strict.get_ref().calls(),
        0,
        "the inner model was not called"
    );
    let streamed: Vec<_> = strict
        .stream(request(&history, &settings, &ToolChoice::Auto))
        .collect()
        .await;
    assert!(matches!(
        streamed.as_slice(),
        [Err(ModelError::InvalidRequest(_))]
    ));
    assert_eq!(strict.get_ref().calls(), 0);

    let permissive = ToolChoiceEnforcer::new(
        Permissive(
            ScriptedModel::builder()
                .tool_call("list_all_entities", json!({}))
                .build(),
        ),
        ToolChoiceRule::RequiredFirst,
    );
    assert!(
        permissive
            .thinking_allowance(&settings, ENABLED)
            .forced_tool_choice
    );
    permissive
        .complete(request(&history, &settings, &ToolChoice::Auto))
        .await
        .expect("the capability table allows it");
    let inner = permissive.into_inner().0;
    assert_eq!(inner.requests()[0].tool_choice, ToolChoice::Any);
}

// --- checks when a node is built --------------------------------------------

fn thinking_conflict(result: Result<Node, ConfigError>) -> (String, String) {
    match result {
        Err(ConfigError::ThinkingConflict { node, constraint }) => (node, constraint),
        Err(other) => panic!("expected a thinking conflict, got {other:?}"),
        Ok(_) => panic!("expected a thinking conflict, the node built"),
    }
}

#[test]
fn enabled_thinking_with_a_forcing_policy_is_rejected_at_build() {
    for (tool_choice, label) in [
        (ToolChoiceRule::RequiredFirst, "RequiredFirst"),
        (ToolChoiceRule::Required, "Required"),
        (named("list_all_entities"), "Named"),
    ] {
        let (node, constraint) =
            thinking_conflict(worker().policy(policy(tool_choice, Some(ENABLED))).build());
        assert_eq!(node, "worker");
        assert!(constraint.contains("extended thinking"), "{constraint}");
        assert!(
            constraint.contains(&format!("tool choice rule {label} ")),
            "{constraint}"
        );
        assert!(constraint.contains("forced tool use"), "{constraint}");
    }
}

#[test]
fn thinking_with_a_temperature_is_rejected_at_build() {
    for thinking in [ENABLED, Thinking::Adaptive] {
        let result = worker()
            .executor_config(ExecutorConfig {
                temperature: Some(0.3),
                ..ExecutorConfig::default()
            })
            .policy(policy(ToolChoiceRule::Auto, Some(thinking)))
            .build();
        let (node, constraint) = thinking_conflict(result);
        assert_eq!(node, "worker");
        assert!(constraint.contains("temperature"), "{constraint}");
    }
}

#[test]
fn the_conflict_error_names_node_and_constraint() {
    let err = worker()
        .policy(policy(ToolChoiceRule::RequiredFirst, Some(ENABLED)))
        .build()
        .expect_err("conflict");
    let text = err.to_string();
    assert!(text.starts_with("node worker: "), "{text}");
    assert!(text.contains("budget 2048"), "{text}");
}

#[test]
fn accepted_thinking_combinations() {
    // Adaptive thinking is reported to accept forced tool use.
    for tool_choice in [
        ToolChoiceRule::RequiredFirst,
        ToolChoiceRule::Required,
        named("list_all_entities"),
    ] {
        worker()
            .policy(policy(tool_choice, Some(Thinking::Adaptive)))
            .build()
            .expect("adaptive thinking may force tools");
    }
    // A fixed budget is fine when nothing is forced.
    for tool_choice in [ToolChoiceRule::Auto, ToolChoiceRule::None] {
        worker()
            .policy(policy(tool_choice, Some(ENABLED)))
            .build()
            .expect("nothing forced");
    }
    // A temperature without thinking is fine with any policy.
    worker()
        .executor_config(ExecutorConfig {
            temperature: Some(0.3),
            ..ExecutorConfig::default()
        })
        .policy(policy(ToolChoiceRule::RequiredFirst, None))
        .build()
        .expect("no thinking");
}

#[test]
fn check_thinking_follows_the_allowance() {
    let relaxed = ThinkingAllowance {
        forced_tool_choice: true,
        temperature: true,
    };
    assert!(check_thinking(ENABLED, relaxed, &ToolChoiceRule::Required, Some(0.5)).is_ok());
    assert!(check_thinking(ENABLED, ENABLED.allows(), &ToolChoiceRule::Required, None).is_err());
}

#[test]
fn named_must_name_a_tool_of_the_node() {
    let err = worker()
        .policy(policy(named("get_endpoint_documentation"), None))
        .build()
        .expect_err("unknown tool");
    assert_eq!(
        err,
        ConfigError::UnknownNamedTool {
            node: "worker".into(),
            tool: "get_endpoint_documentation".into(),
        }
    );
    let text = err.to_string();
    assert!(text.contains("worker"), "{text}");
    assert!(text.contains("get_endpoint_documentation"), "{text}");
    assert!(text.contains("does not offer"), "{text}");
    worker()
        .policy(policy(named("list_all_entities"), None))
        .build()
        .expect("a tool of the node");
}

#[test]
fn required_needs_a_way_out() {
    let err = Node::builder("Loop forever.")
        .name("looper")
        .tool(ListAllEntities)
        .policy(policy(ToolChoiceRule::Required, None))
        .build()
        .expect_err("no exit");
    assert_eq!(err, ConfigError::RequiredWithoutExit("looper".into()));
    let text = err.to_string();
    assert!(text.contains("looper"), "{text}");
    assert!(text.contains("every model call"), "{text}");
    assert!(text.contains("terminal tool"), "{text}");
    assert!(text.contains("transition"), "{text}");

    // Each way out is enough.
    let exits: [Box<dyn Fn(NodeBuilder) -> NodeBuilder>; 3] = [
        Box::new(|b| b.tool(Answer)),
        Box::new(|b| b.tool(Done)),
        Box::new(|b| {
            let next = Node::builder("Next.").build().expect("node");
            b.transition("next", Transition::to("Go on", next))
        }),
    ];
    for exit in exits {
        exit(Node::builder("Work.").tool(ListAllEntities))
            .policy(policy(ToolChoiceRule::Required, None))
            .build()
            .expect("a way out");
    }
}

#[test]
fn restriction_and_required_first_build_together() {
    let node = worker()
        .policy(TurnPolicy {
            tool_choice: ToolChoiceRule::RequiredFirst,
            restriction: OutputRestriction::enabled(),
            thinking: None,
        })
        .build()
        .expect("compatible");
    assert!(node.policy().restriction.restrict_output);
}
