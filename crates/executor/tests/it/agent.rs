//! The `Agent`: one value built once, validated, and run by everything.

use std::sync::Arc;

use markov_charter::ConfigError;
use markov_charter::node::Node;
use markov_core::message::Item;
use markov_executor::{Agent, BuildError, RunError, StandardExecutor, serialize_machine};
use markov_policy::{Category, ToolMetadata};
use markov_testkit::ScriptedModel;
use serde_json::json;

use crate::common::*;

fn scripted() -> ScriptedModel {
    ScriptedModel::builder()
        .tool_call("add", json!({"a": 2, "b": 3}))
        .text("5")
        .build()
}

#[tokio::test]
async fn a_one_node_agent_runs_its_tools_and_answers() {
    let model = Arc::new(scripted());
    let agent = Agent::builder("calculator")
        .instructions("Add.")
        .tool(Add)
        .shared_model(model.clone())
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("2 + 3?");
    let last = machine.run().await.expect("runs");
    assert!(last.done);
    assert_eq!(
        all_results(machine.history()),
        [("call_1".to_owned(), "5".to_owned(), Some(false))]
    );
    // The node is named after the agent, and its prompt has no empty
    // sections: no state, no transitions, no updateState.
    let request = &model.requests()[0];
    assert_eq!(request.system, "Add.");
    assert_eq!(request.tool_names(), ["add"]);
    assert_eq!(agent.start_node().name(), Some("calculator"));
}

#[tokio::test]
async fn machines_of_one_agent_are_separate_conversations() {
    let agent = Agent::builder("calculator")
        .instructions("Add.")
        .tool(Add)
        .model(
            ScriptedModel::builder()
                .tool_call("add", json!({"a": 2, "b": 3}))
                .text("5")
                .text("hello")
                .build(),
        )
        .build()
        .expect("agent builds");
    let mut first = agent.clone().machine();
    first.enqueue_user("2 + 3?");
    first.run().await.expect("runs");
    let mut second = agent.machine();
    second.enqueue_user("hi");
    second.run().await.expect("runs");
    assert_eq!(first.history().len(), 4);
    assert_eq!(second.history().len(), 2);
    assert_ne!(first.instance().id(), second.instance().id());
}

#[tokio::test]
async fn the_agents_step_limit_bounds_every_run() {
    let model = ScriptedModel::builder()
        .tool_call("add", json!({"a": 1, "b": 1}))
        .tool_call("add", json!({"a": 1, "b": 1}))
        .tool_call("add", json!({"a": 1, "b": 1}))
        .text("done")
        .build();
    let agent = Agent::builder("looper")
        .instructions("Add.")
        .tool(Add)
        .model(model)
        .max_steps(2)
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("go");
    assert!(matches!(machine.run().await, Err(RunError::MaxSteps(2))));
    assert_paired(machine.history());
}

#[tokio::test]
async fn a_restored_conversation_continues_with_the_agent() {
    let agent = Agent::builder("calculator")
        .instructions("Add.")
        .tool(Add)
        .model(
            ScriptedModel::builder()
                .text("first")
                .text("second")
                .build(),
        )
        .max_steps(3)
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("one");
    machine.run().await.expect("runs");
    let snapshot = serialize_machine(&machine)
        .expect("serializes")
        .into_owned();
    let mut restored = agent.restore(snapshot).expect("restores");
    assert_eq!(restored.history(), machine.history());
    assert_eq!(restored.run_options().max_steps, 3);
    restored.enqueue_user("two");
    restored.run().await.expect("runs");
    assert_eq!(restored.history().len(), 4);
}

/// A tool given with `tool_with` runs under the policy pipeline and
/// answers with its plain text, like a node's tool.
#[tokio::test]
async fn a_tool_with_a_policy_is_offered_and_answers_in_plain_text() {
    let model = Arc::new(scripted());
    let agent = Agent::builder("calculator")
        .instructions("Add.")
        .tool_with(Add, ToolMetadata::new(Category::Other))
        .shared_model(model.clone())
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("2 + 3?");
    machine.run().await.expect("runs");
    assert_eq!(model.requests()[0].tool_names(), ["add"]);
    assert_eq!(
        all_results(machine.history()),
        [("call_1".to_owned(), "5".to_owned(), Some(false))]
    );
    // The call went through the pipeline: the turn's budget counted it.
    assert!(!machine.policy_state().snapshot().budgets.is_empty());
}

#[tokio::test]
async fn several_nodes_start_at_the_first_or_the_one_named() {
    let agent = Agent::builder("desk")
        .node("triage", node("triage"))
        .node("billing", node("billing"))
        .start("billing")
        .model(ScriptedModel::builder().text("hi").build())
        .build()
        .expect("agent builds");
    assert_eq!(agent.start_node().name(), Some("billing"));
    assert_eq!(agent.charter().nodes().count(), 2);
}

#[tokio::test]
async fn streamed_copies_the_agent_with_its_model_calls_streamed() {
    let agent = Agent::builder("greeter")
        .instructions("Greet.")
        .model(ScriptedModel::builder().text("Hello there").build())
        .build()
        .expect("agent builds");
    let deltas = Arc::new(std::sync::Mutex::new(0usize));
    let seen = Arc::clone(&deltas);
    let streamed = agent
        .streamed(move |_| *seen.lock().expect("lock") += 1)
        .expect("a standard executor streams");
    let mut machine = streamed.machine();
    machine.enqueue_user("hi");
    machine.run().await.expect("runs");
    assert!(*deltas.lock().expect("lock") > 0);
    let custom = Agent::builder("custom")
        .instructions("Greet.")
        .executor(StandardExecutor::new(ScriptedModel::builder().build()))
        .build()
        .expect("agent builds");
    assert!(custom.streamed(|_| {}).is_err());
}

fn build_error(builder: markov_executor::AgentBuilder) -> BuildError {
    builder.build().expect_err("the agent must not build")
}

#[test]
fn conflicting_options_are_build_errors_that_name_them() {
    let model = || ScriptedModel::builder().build();
    let error = build_error(
        Agent::builder("a")
            .instructions("x")
            .model(model())
            .executor(StandardExecutor::new(model())),
    );
    assert!(
        matches!(
            error,
            BuildError::Conflict {
                option: "model",
                with: "executor",
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "agent \"a\": `model` cannot be used with `executor`: an executor brings its own model"
    );
    let error = build_error(
        Agent::builder("a")
            .instructions("x")
            .settings(Default::default())
            .executor(StandardExecutor::new(model())),
    );
    assert!(
        matches!(
            error,
            BuildError::Conflict {
                option: "settings",
                ..
            }
        ),
        "{error:?}"
    );
    let error = build_error(
        Agent::builder("a")
            .instructions("x")
            .tool_with(Add, ToolMetadata::new(Category::Other))
            .executor(StandardExecutor::new(model())),
    );
    assert!(
        matches!(
            error,
            BuildError::Conflict {
                option: "tool_with",
                ..
            }
        ),
        "{error:?}"
    );
    let error = build_error(
        Agent::builder("a")
            .instructions("x")
            .node("other", node("other"))
            .model(model()),
    );
    assert!(
        matches!(
            error,
            BuildError::Conflict {
                option: "instructions",
                with: "node",
                ..
            }
        ),
        "{error:?}"
    );
    let error = build_error(Agent::builder("a").tool(Add).model(model()));
    assert!(
        matches!(
            error,
            BuildError::Conflict {
                option: "tool",
                with: "no instructions",
                ..
            }
        ),
        "{error:?}"
    );
    let error = build_error(
        Agent::builder("a")
            .instructions("x")
            .policies(markov_policy::PolicyConfig::new(
                markov_policy::Budget::UNLIMITED,
            ))
            .model(model()),
    );
    assert!(
        matches!(
            error,
            BuildError::Conflict {
                option: "policies",
                ..
            }
        ),
        "{error:?}"
    );
}

#[test]
fn missing_parts_and_bad_parts_are_named() {
    let model = || ScriptedModel::builder().build();
    assert!(matches!(
        build_error(Agent::builder("a").instructions("x")),
        BuildError::NoModel { agent } if agent == "a"
    ));
    assert!(matches!(
        build_error(Agent::builder("a").model(model())),
        BuildError::NoNode { .. }
    ));
    assert!(matches!(
        build_error(Agent::builder("a").node("n", node("n")).start("m").model(model())),
        BuildError::UnknownStart { node, .. } if node == "m"
    ));
    // Two tools of one name: the node and the tool are named.
    let error = build_error(
        Agent::builder("a")
            .instructions("x")
            .tool(Add)
            .tool(Add)
            .model(model()),
    );
    assert!(
        matches!(
            &error,
            BuildError::Node { node, source: ConfigError::DuplicateTool(tool), .. }
                if node == "a" && tool == "add"
        ),
        "{error:?}"
    );
    let error = build_error(
        Agent::builder("a")
            .instructions("x")
            .tool_with(Add, ToolMetadata::new(Category::Other))
            .tool_with(Add, ToolMetadata::new(Category::Other))
            .model(model()),
    );
    assert!(matches!(error, BuildError::Tool { .. }), "{error:?}");
    assert!(error.to_string().contains("\"add\""), "{error}");
}

#[test]
fn a_start_state_the_node_refuses_is_a_build_error() {
    let counter = Node::builder("Count.")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .build()
        .expect("node builds");
    let error = build_error(
        Agent::builder("a")
            .node("count", counter)
            .state(json!({"count": "many"}))
            .model(ScriptedModel::builder().build()),
    );
    assert!(matches!(error, BuildError::State { .. }), "{error:?}");
}

#[tokio::test]
async fn the_output_type_of_a_one_node_agent_is_asked_for() {
    #[derive(serde::Deserialize, schemars::JsonSchema, Debug, PartialEq)]
    struct Sum {
        sum: i64,
    }
    let model = Arc::new(ScriptedModel::builder().text(r#"{"sum": 5}"#).build());
    let agent = Agent::builder("calculator")
        .instructions("Add.")
        .output::<Sum>()
        .shared_model(model.clone())
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("2 + 3?");
    let sum = machine.run_typed::<Sum>().await.expect("typed answer");
    assert_eq!(sum.value, Sum { sum: 5 });
    assert!(model.requests()[0].output_schema.is_some());
    assert!(machine.history().iter().any(|m| {
        m.item_list()
            .iter()
            .any(|i| matches!(i, Item::Output { .. }))
    }));
}

#[tokio::test]
async fn a_steps_output_is_what_the_user_reads() {
    let agent = Agent::builder("calculator")
        .instructions("Add.")
        .tool(Add)
        .model(scripted())
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("2 + 3?");
    let (steps, err) = run_all(&mut machine, Default::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 2);
    assert_eq!(
        steps[0].output(),
        None,
        "a step of tool calls has no output"
    );
    assert_eq!(steps[1].output().as_deref(), Some("5"));
}

#[test]
fn an_agent_on_a_charter_takes_its_nodes_and_refuses_others() {
    let main = Node::builder("Count.").build().expect("node");
    let charter = markov_charter::charter::Charter::builder("counter")
        .node("main", main.clone())
        .build()
        .expect("charter");
    let agent = Agent::on_charter(charter.clone())
        .model(ScriptedModel::new([]))
        .build()
        .expect("agent builds");
    assert_eq!(agent.name(), "counter");
    assert_eq!(agent.start_node().id(), main.id());
    for (option, built) in [
        (
            "node",
            Agent::on_charter(charter.clone())
                .node("other", Node::builder("x").build().expect("node"))
                .model(ScriptedModel::new([]))
                .build(),
        ),
        (
            "instructions",
            Agent::on_charter(charter.clone())
                .instructions("x")
                .model(ScriptedModel::new([]))
                .build(),
        ),
        (
            "charter",
            Agent::on_charter(charter.clone())
                .charter(|c| c)
                .model(ScriptedModel::new([]))
                .build(),
        ),
    ] {
        match built {
            Err(BuildError::Conflict {
                option: o, with, ..
            }) => {
                assert_eq!((o, with), (option, "on_charter"));
            }
            other => panic!("{option}: {other:?}"),
        }
    }
}

/// Labels things (its arguments are a map, which some providers' schema
/// dialects cannot express).
#[markov_core::tool]
async fn tag(
    /// The labels, by thing.
    labels: std::collections::BTreeMap<String, String>,
) -> usize {
    labels.len()
}

/// A state with a map in it.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
struct Tally {
    counts: std::collections::BTreeMap<String, u32>,
}

/// A model that refuses, at build time, every schema holding a map (as
/// Gemini's client does), and records the tool lists it was asked about.
#[derive(Debug, Default)]
struct NoMaps {
    asked: std::sync::Mutex<Vec<(Vec<String>, bool)>>,
}

fn has_map(schema: &serde_json::Value) -> bool {
    match schema {
        serde_json::Value::Object(fields) => fields.iter().any(|(key, value)| {
            (key == "additionalProperties" && value.is_object()) || has_map(value)
        }),
        serde_json::Value::Array(items) => items.iter().any(has_map),
        _ => false,
    }
}

#[markov_core::async_trait]
impl markov_core::Model for NoMaps {
    async fn complete(
        &self,
        _request: markov_core::ModelRequest<'_>,
    ) -> Result<markov_core::ModelResponse, markov_core::ModelError> {
        Ok(markov_testkit::text_response("fine"))
    }

    fn check_tools(
        &self,
        tools: &[markov_core::ToolDefinition],
        output_schema: Option<&serde_json::Value>,
    ) -> Result<(), markov_core::Unsupported> {
        self.asked.lock().expect("not poisoned").push((
            tools.iter().map(|t| t.name.to_string()).collect(),
            output_schema.is_some(),
        ));
        if let Some(tool) = tools.iter().find(|t| has_map(&t.input_schema)) {
            return Err(markov_core::Unsupported::tool(
                tool.name.clone(),
                format!("tool {:?} has a map", tool.name.as_str()),
            ));
        }
        match output_schema {
            Some(schema) if has_map(schema) => Err(markov_core::Unsupported::output_type(
                "the output type has a map",
            )),
            _ => Ok(()),
        }
    }
}

#[test]
fn a_model_refuses_what_it_cannot_be_offered_when_the_agent_is_built() {
    // A node's own tool.
    let error = build_error(
        Agent::builder("labeller")
            .instructions("Label.")
            .tool(Tag)
            .model(NoMaps::default()),
    );
    let BuildError::Unsupported {
        node: refused_node,
        source,
        ..
    } = &error
    else {
        panic!("{error:?}")
    };
    assert_eq!(refused_node, "labeller");
    assert_eq!(source.tool.as_ref().map(|t| t.as_str()), Some("tag"));
    assert_eq!(
        error.to_string(),
        "agent \"labeller\", node \"labeller\": the model cannot be offered tool \"tag\": tool \"tag\" has a map"
    );

    // A tool the charter adds: the state update of a node whose state has a map.
    let tally = Node::builder("Count.")
        .name("tally")
        .state(Tally::default())
        .build()
        .expect("node builds");
    let error = build_error(
        Agent::builder("counter")
            .node("start", node("start"))
            .node("tally", tally)
            .model(NoMaps::default()),
    );
    assert!(
        matches!(
            &error,
            BuildError::Unsupported { node, source, .. }
                if node == "tally"
                    && source.tool.as_ref().map(|t| t.as_str()) == Some("updateState")
        ),
        "{error:?}"
    );

    // A tool of the registry, offered to every node.
    let error = build_error(
        Agent::builder("labeller")
            .instructions("Label.")
            .tool_with(Tag, ToolMetadata::new(Category::Other))
            .model(NoMaps::default()),
    );
    assert!(
        matches!(&error, BuildError::Unsupported { source, .. }
            if source.tool.as_ref().map(|t| t.as_str()) == Some("tag")),
        "{error:?}"
    );

    // The output type.
    let error = build_error(
        Agent::builder("counter")
            .instructions("Count.")
            .output::<Tally>()
            .model(NoMaps::default()),
    );
    assert!(
        matches!(&error, BuildError::Unsupported { source, .. } if source.tool.is_none()),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains("cannot be offered its output type"),
        "{error}"
    );
}

#[test]
fn every_node_is_checked_with_the_tools_it_will_be_offered() {
    use markov_charter::transition::Transition;

    let model = Arc::new(NoMaps::default());
    let inline = Node::builder("Labels.")
        .name("labels")
        .output(markov_charter::node::OutputConfig::of::<u32>())
        .build()
        .expect("node builds");
    let mover = Node::builder("Move on.")
        .name("first")
        .tool(Add)
        .transition("next", Transition::to_ref("Go on.", "second"))
        .transition("aside", Transition::to("Step aside.", inline))
        .build()
        .expect("node builds");
    Agent::builder("mover")
        .node("first", mover)
        .node("second", node("second"))
        .shared_model(model.clone())
        .build()
        .expect("no map anywhere");
    let asked = model.asked.lock().expect("not poisoned").clone();
    assert_eq!(
        asked,
        [
            (vec!["transition".to_owned(), "add".to_owned()], false),
            (Vec::new(), false),
            // The node the transition holds inline, with its output type.
            (Vec::new(), true),
        ]
    );

    // A node held inline is refused by its own name.
    let inline = Node::builder("Labels.")
        .name("labels")
        .tool(Tag)
        .build()
        .expect("node builds");
    let mover = Node::builder("Move on.")
        .name("first")
        .transition("aside", Transition::to("Step aside.", inline))
        .build()
        .expect("node builds");
    let error = build_error(
        Agent::builder("mover")
            .node("first", mover)
            .model(NoMaps::default()),
    );
    assert!(
        matches!(&error, BuildError::Unsupported { node, .. } if node == "labels"),
        "{error:?}"
    );
}

#[tokio::test]
async fn each_step_names_the_model_that_answered_it() {
    use markov_core::model::{ModelResponse, StopReason};

    let agent = Agent::builder("calculator")
        .instructions("Add.")
        .tool(Add)
        .model(
            ScriptedModel::builder()
                .response(
                    ModelResponse::new(
                        vec![Item::tool_use("c1", "add", json!({"a": 2, "b": 3}))],
                        StopReason::ToolUse,
                    )
                    .with_model("big-model-2025"),
                )
                .response(
                    ModelResponse::new(vec![Item::text("5")], StopReason::EndTurn)
                        .with_model("small-model-2025"),
                )
                .text("no name")
                .build(),
        )
        .build()
        .expect("agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("2 + 3?");
    let mut models = Vec::new();
    {
        let mut run = std::pin::pin!(markov_executor::run_machine(
            &mut machine,
            Default::default()
        ));
        while let Some(step) = futures::StreamExt::next(&mut run).await {
            models.push(step.expect("a step").model);
        }
    }
    assert_eq!(
        models,
        [
            Some("big-model-2025".to_owned()),
            Some("small-model-2025".to_owned())
        ]
    );
    machine.enqueue_user("and?");
    let last = machine.run().await.expect("runs");
    assert_eq!(last.model, None, "the answer named no model");
}
