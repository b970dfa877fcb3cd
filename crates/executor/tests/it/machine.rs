//! Scenario tests of the machine loop with one active leaf.

use markov_executor::Agent;
use std::sync::Arc;

use crate::common::*;
use markov_charter::node::{Node, OutputConfig};
use markov_charter::transition::{Transition, transition_to};
use markov_core::async_trait;
use markov_core::message::{InstancePayload, Item, Message, Metadata, Role};
use markov_executor::{RECOVERY_TEXT, RunError, RunOptions, YieldReason, run_to_completion};
use markov_testkit::ScriptedModel;
use serde_json::json;

fn counter_node() -> Node {
    Node::builder("Count things.")
        .name("counter")
        .state(Counter {
            count: 0,
            label: "a".into(),
        })
        .tool(Add)
        .tool(Increment)
        .tool(BadUpdate)
        .tool(Reply)
        .build()
        .expect("node builds")
}

fn counter_state() -> serde_json::Value {
    json!({"count": 0, "label": "a"})
}

#[tokio::test]
async fn runs_tools_and_feeds_results_back() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("add", json!({"a": 2, "b": 3}))
            .text("5")
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model.clone());
    m.enqueue_user("2+3?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0].yield_reason, YieldReason::ToolUse);
    assert!(!steps[0].done);
    assert_eq!(steps[1].yield_reason, YieldReason::EndTurn);
    assert!(steps[1].done);
    // The first step carries the user input before its own messages.
    assert_eq!(steps[0].history[0].text(), "2+3?");
    assert_eq!(
        all_results(m.history()),
        vec![("call_1".into(), "5".into(), Some(false))]
    );
    assert_paired(m.history());
    // The second call saw the first call's result.
    let second = &model.requests()[1];
    assert_eq!(second.messages.len(), 3);
    let source = m.history()[1]
        .metadata
        .as_ref()
        .and_then(|md| md.source.clone());
    assert_eq!(source.and_then(|s| s.is_primary), Some(true));
}

#[tokio::test]
async fn unknown_tools_and_invalid_input_become_error_results() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("nope", json!({})),
                ("add", json!({"a": "two"})),
                ("add", json!({"a": 1, "b": 1})),
            ])
            .text("sorry")
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model);
    m.enqueue_user("go");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    let r = all_results(m.history());
    assert_eq!(
        r[0],
        ("call_1".into(), "Unknown tool: nope".into(), Some(true))
    );
    assert!(r[1].1.starts_with("Invalid tool input: "), "{}", r[1].1);
    assert_eq!(r[1].2, Some(true));
    assert_eq!(r[2], ("call_3".into(), "2".into(), Some(false)));
}

#[tokio::test]
async fn the_step_limit_ends_the_run_with_the_spec_error() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("add", json!({"a": 1, "b": 1}))
            .tool_call("add", json!({"a": 1, "b": 1}))
            .tool_call("add", json!({"a": 1, "b": 1}))
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model);
    m.enqueue_user("loop");
    let (steps, err) = run_all(&mut m, RunOptions::default().max_steps(2)).await;
    assert_eq!(steps.len(), 2);
    let err = err.expect("fails");
    assert_eq!(err, RunError::MaxSteps(2));
    assert_eq!(err.to_string(), "Max steps (2) exceeded");
    assert_paired(m.history());
}

#[tokio::test]
async fn a_silent_user_message_alone_does_not_run_the_executor() {
    let model = Arc::new(ScriptedModel::builder().text("never").build());
    let mut m = machine(|c| c, counter_node(), counter_state(), model.clone());
    let silent = Message::user("psst").with_metadata(Metadata {
        silent: Some(true),
        ..Metadata::default()
    });
    m.enqueue([silent.clone()]);
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none());
    assert_eq!(steps.len(), 1);
    assert!(steps[0].done);
    assert_eq!(steps[0].yield_reason, YieldReason::EndTurn);
    assert_eq!(steps[0].history, vec![silent.clone()]);
    assert_eq!(m.history(), [silent]);
    assert_eq!(model.calls(), 0);
}

#[tokio::test]
async fn silent_and_non_silent_input_both_reach_history_and_run() {
    let model = Arc::new(ScriptedModel::builder().text("hi").build());
    let mut m = machine(|c| c, counter_node(), counter_state(), model.clone());
    let silent = Message::user("context").with_metadata(Metadata {
        silent: Some(true),
        ..Metadata::default()
    });
    m.enqueue([silent, Message::user("hello")]);
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert_eq!(model.calls(), 1);
    assert_eq!(model.requests()[0].messages.len(), 2);
    assert_eq!(m.history().len(), 3);
}

#[tokio::test]
async fn an_empty_queue_ends_at_once() {
    let model = Arc::new(ScriptedModel::builder().build());
    let mut m = machine(|c| c, counter_node(), counter_state(), model.clone());
    let last = run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("one step");
    assert!(last.done);
    assert!(last.history.is_empty());
    assert_eq!(model.calls(), 0);
}

#[tokio::test]
async fn default_prompt_shows_instructions_and_state() {
    let model = Arc::new(ScriptedModel::builder().text("ok").build());
    let mut m = machine(|c| c, counter_node(), counter_state(), model.clone());
    m.enqueue_user("hi");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    let system = &model.requests()[0].system;
    assert!(system.starts_with("Count things.\n\n## Current Node State\n```json\n"));
    assert!(system.contains("\"count\": 0"), "{system}");
    // A node without transitions gets no transitions section.
    assert!(!system.contains("## Available Transitions"), "{system}");
}

#[tokio::test]
async fn a_custom_prompt_builder_is_used_verbatim() {
    let model = Arc::new(ScriptedModel::builder().text("ok").build());
    let mut m = machine(
        |c| {
            c.instructions("charter says")
                .system_prompt(|input| format!("custom for {}", input.node.instructions()))
        },
        counter_node(),
        counter_state(),
        model.clone(),
    );
    m.enqueue_user("hi");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert_eq!(model.requests()[0].system, "custom for Count things.");
}

#[tokio::test]
async fn a_tool_state_update_emits_only_the_patch() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("increment", json!({}))
            .text("done")
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model);
    m.enqueue_user("inc");
    let (steps, _) = run_all(&mut m, RunOptions::default()).await;
    let state_msgs: Vec<_> = instance_payloads(&steps[0].history)
        .filter_map(|p| match p {
            InstancePayload::State { patch, .. } => Some(patch.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(state_msgs, vec![json!({"count": 1})]);
    assert_eq!(
        steps[0].instance.state(),
        &json!({"count": 1, "label": "a"})
    );
    assert_eq!(
        all_results(m.history())[0],
        ("call_1".into(), "count is now 1".into(), Some(false))
    );
}

#[tokio::test]
async fn the_update_state_builtin_validates() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("updateState", json!({"patch": {"count": 5}})),
                ("updateState", json!({"patch": {"count": "five"}})),
            ])
            .text("done")
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model.clone());
    m.enqueue_user("set");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    let r = all_results(m.history());
    assert_eq!(
        r[0],
        ("call_1".into(), "State updated successfully".into(), None)
    );
    assert!(r[1].1.starts_with("State update failed: "), "{}", r[1].1);
    assert_eq!(r[1].2, Some(true));
    assert_eq!(m.instance().state()["count"], 5);
    // The tool list starts with updateState, whose patch schema requires nothing.
    let tools = &model.requests()[0].tools;
    assert_eq!(tools[0].name.as_str(), "updateState");
    assert!(
        tools[0].input_schema["properties"]["patch"]
            .get("required")
            .is_none()
    );
}

#[tokio::test]
async fn a_refused_update_inside_a_tool_is_an_error_result() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("bad_update", json!({}))
            .text("done")
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model);
    m.enqueue_user("go");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    let r = &all_results(m.history())[0];
    assert_eq!(r.2, Some(true));
    assert!(
        r.1.starts_with("done\n\nError: State update failed: "),
        "{}",
        r.1
    );
    assert_eq!(m.instance().state()["count"], 0);
}

#[tokio::test]
async fn a_tool_reply_is_split_between_model_and_user() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("reply", json!({}))
            .text("done")
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model);
    m.enqueue_user("go");
    let (steps, _) = run_all(&mut m, RunOptions::default()).await;
    let h = &steps[0].history;
    // user input, assistant tool_use, tool results, reply
    assert_eq!(h.len(), 4);
    assert_eq!(results(&h[2])[0].1, "read by the model");
    assert_eq!(h[3].role, Role::Assistant);
    assert_eq!(h[3].text(), "shown to the user");
}

#[tokio::test]
async fn max_tokens_recovers_once_then_ends() {
    let model = Arc::new(
        ScriptedModel::builder()
            .max_tokens("cut")
            .max_tokens("cut again")
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model);
    m.enqueue_user("long");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none());
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0].yield_reason, YieldReason::MaxTokens);
    assert!(!steps[0].done);
    assert_eq!(steps[1].yield_reason, YieldReason::MaxTokens);
    assert!(steps[1].done);
    let recovery: Vec<_> = m
        .history()
        .iter()
        .filter(|msg| msg.text() == RECOVERY_TEXT)
        .collect();
    assert_eq!(recovery.len(), 1);
    // markov's words, never the user's: a system message, which the step
    // that asks for it carries.
    assert_eq!(recovery[0].role, Role::System);
    assert!(
        m.history()
            .iter()
            .filter(|msg| msg.role == Role::User)
            .all(|msg| msg.text() == "long"),
        "the only user message is the user's"
    );
    assert!(
        steps[0]
            .history
            .iter()
            .any(|msg| msg.role == Role::System && msg.text() == RECOVERY_TEXT)
    );
}

#[tokio::test]
async fn structured_output_is_requested_and_recorded_as_output_items() {
    #[derive(schemars::JsonSchema)]
    #[allow(dead_code)]
    struct Answer {
        value: i64,
    }
    let node = Node::builder("Answer in JSON.")
        .output(OutputConfig::of::<Answer>())
        .build()
        .expect("node builds");
    let model = Arc::new(ScriptedModel::builder().text(r#"{"value": 42}"#).build());
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("answer");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    let schema = model.requests()[0]
        .output_schema
        .clone()
        .expect("schema sent");
    assert_eq!(schema["properties"]["value"]["type"], "integer");
    assert_eq!(
        m.history()[1].item_list(),
        [Item::Output {
            data: json!({"value": 42})
        }]
    );
}

#[tokio::test]
async fn the_state_of_a_new_machine_is_validated() {
    let node = counter_node();
    let agent = Agent::builder("t")
        .node("main", node.clone())
        .state(counter_state())
        .model(ScriptedModel::new([]))
        .build()
        .expect("the agent builds");
    let err = agent
        .machine_at(markov_executor::Instance::new(
            node.clone(),
            json!({"count": "x"}),
        ))
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with(&format!("Invalid state for node \"{}\": ", node.id())),
        "{err}"
    );
    // The same state given to the agent is refused when it is built.
    let built = Agent::builder("t")
        .node("main", node)
        .state(json!({"count": "x"}))
        .model(ScriptedModel::new([]))
        .build();
    assert!(
        matches!(built, Err(markov_executor::BuildError::State { .. })),
        "{built:?}"
    );
}

#[tokio::test]
async fn a_model_error_ends_the_run_and_keeps_history_paired() {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("add", json!({"a": 1, "b": 1}))
            .build(),
    );
    let mut m = machine(|c| c, counter_node(), counter_state(), model);
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert_eq!(steps.len(), 1);
    assert!(
        matches!(err, Some(RunError::Model { step: 2, .. })),
        "{err:?}"
    );
    assert_paired(m.history());
}

#[tokio::test]
async fn messages_with_the_same_id_replace_each_other_in_the_queue() {
    let model = Arc::new(ScriptedModel::builder().build());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let node = counter_node();
    let m = script_machine(
        "t",
        Arc::new(markov_executor::StandardExecutor::shared(model)),
        markov_executor::Instance::new(node, counter_state()),
    );
    m.queue().set_on_enqueue(move |msg| {
        seen2.lock().expect("lock").push(msg.text());
    });
    let with_id = |text: &str| {
        Message::assistant(text).with_metadata(Metadata {
            message_id: Some("m1".into()),
            ..Metadata::default()
        })
    };
    m.enqueue([Message::user("first"), with_id("vessel")]);
    m.enqueue([with_id("final")]);
    let queued: Vec<_> = m.queue().messages().iter().map(Message::text).collect();
    assert_eq!(queued, vec!["first", "final"]);
    assert_eq!(
        *seen.lock().expect("lock"),
        vec!["first", "vessel", "final"]
    );
}

#[tokio::test]
async fn an_instance_message_drained_with_the_input_is_applied() {
    let model = Arc::new(ScriptedModel::builder().text("ok").build());
    let mut m = machine(|c| c, counter_node(), counter_state(), model.clone());
    let id = m.instance().id().clone();
    m.enqueue([
        Message::instance(InstancePayload::State {
            instance_id: id,
            patch: json!({"count": 7}),
        }),
        Message::user("hi"),
    ]);
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert_eq!(m.instance().state()["count"], 7);
    assert!(model.requests()[0].system.contains("\"count\": 7"));
}

#[tokio::test]
async fn a_code_transition_can_carry_state() {
    let next = Node::builder("Next node.")
        .name("next")
        .state_type::<Counter>()
        .build()
        .expect("node");
    let next2 = next.clone();
    let node = Node::builder("Start.")
        .name("start")
        .state(Counter {
            count: 3,
            label: "x".into(),
        })
        .transition(
            "go",
            Transition::code("Go on", move |input| {
                let next = next2.clone();
                async move { Ok(transition_to(next, Some(input.state))) }
            }),
        )
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("transition", json!({"to": "go", "reason": "done here"}))
            .text("hello from next")
            .build(),
    );
    let mut m = machine(
        |c| c.node("next", next.clone()),
        node,
        json!({"count": 3, "label": "x"}),
        model.clone(),
    );
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[0].yield_reason, YieldReason::ToolUse);
    assert_eq!(m.instance().node().id(), next.id());
    assert_eq!(m.instance().state()["count"], 3);
    assert_eq!(
        all_results(m.history())[0].1,
        "Transition to \"go\" complete. You are now in the new context - respond to the user."
    );
    // The second call ran in the new node.
    assert!(model.requests()[1].system.starts_with("Next node."));
    // History records the transition with the serialized (ref) node.
    let payload = instance_payloads(&steps[0].history)
        .next()
        .cloned()
        .expect("transition recorded");
    match payload {
        InstancePayload::Transition { node, .. } => assert_eq!(node, json!({"ref": "next"})),
        other => panic!("unexpected payload {other:?}"),
    }
}

#[tokio::test]
async fn serial_and_ref_transitions_reset_to_the_initial_state() {
    let target = Node::builder("Target.")
        .name("target")
        .state(Counter {
            count: 100,
            label: "init".into(),
        })
        .build()
        .expect("node");
    for transition in [
        Transition::to_ref("Go to target", "target"),
        Transition::reference("toTarget"),
    ] {
        let node = Node::builder("Start.")
            .state(Counter {
                count: 1,
                label: "s".into(),
            })
            .transition("go", transition)
            .build()
            .expect("node");
        let model = Arc::new(
            ScriptedModel::builder()
                .tool_call("transition", json!({"to": "go", "reason": "r"}))
                .text("in target")
                .build(),
        );
        let mut m = machine(
            |c| {
                c.node("target", target.clone())
                    .transition("toTarget", Transition::to_ref("Shared", "target"))
            },
            node,
            json!({"count": 1, "label": "s"}),
            model,
        );
        m.enqueue_user("go");
        run_to_completion(&mut m, RunOptions::default())
            .await
            .expect("run ends");
        assert_eq!(m.instance().node().id(), target.id());
        assert_eq!(
            m.instance().state(),
            &json!({"count": 100, "label": "init"})
        );
    }
}

#[tokio::test]
async fn a_general_transition_builds_the_node_the_model_writes() {
    let node = Node::builder("Start.")
        .transition("anywhere", Transition::general("Go anywhere"))
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call(
                "transition_anywhere",
                json!({"reason": "r", "node": {"instructions": "Improvised.", "validator": {"type": "object"}, "initialState": {"mood": "good"}}}),
            )
            .text("improvising")
            .build(),
    );
    let mut m = machine(|c| c.tool(Add), node, json!({}), model.clone());
    m.enqueue_user("go");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert_eq!(m.instance().node().instructions(), "Improvised.");
    assert_eq!(m.instance().state(), &json!({"mood": "good"}));
    let requests = model.requests();
    let tools = requests[0].tool_names();
    assert!(tools.contains(&"transition_anywhere"), "{tools:?}");
}

#[tokio::test]
async fn only_one_transition_per_turn() {
    let a = Node::builder("A.").build().expect("node");
    let b = Node::builder("B.").build().expect("node");
    let node = Node::builder("Start.")
        .transition("a", Transition::to("to a", a.clone()))
        .transition("b", Transition::to("to b", b))
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([
                ("transition", json!({"to": "a", "reason": "1"})),
                ("transition", json!({"to": "b", "reason": "2"})),
            ])
            .text("in a")
            .build(),
    );
    let mut m = machine(|c| c, node, json!({}), model);
    m.enqueue_user("go");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    let r = all_results(m.history());
    assert_eq!(
        r[1],
        (
            "call_2".into(),
            "Only one transition allowed per turn".into(),
            Some(true)
        )
    );
    assert_eq!(m.instance().node().id(), a.id());
}

#[tokio::test]
async fn an_unknown_transition_is_an_error_result_not_an_abort() {
    let node = Node::builder("Start.").build().expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("transition", json!({"to": "nowhere", "reason": "r"}))
            .text("sorry")
            .build(),
    );
    let mut m = machine(|c| c, node, json!({}), model);
    m.enqueue_user("go");
    let last = run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends normally");
    assert!(last.done);
    assert_eq!(
        all_results(m.history())[0],
        (
            "call_1".into(),
            "Unknown transition: nowhere".into(),
            Some(true)
        )
    );
}

#[tokio::test]
async fn a_failing_transition_corrects_its_complete_claim() {
    let node = Node::builder("Start.")
        .transition(
            "broken",
            Transition::code("Always fails", |_input| async { Err("no way".to_owned()) }),
        )
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("transition", json!({"to": "broken", "reason": "r"}))
            .text("it failed")
            .build(),
    );
    let mut m = machine(|c| c, node.clone(), json!({}), model);
    m.enqueue_user("go");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert_eq!(
        all_results(m.history())[0],
        (
            "call_1".into(),
            "Transition to \"broken\" failed: no way".into(),
            Some(true)
        )
    );
    assert_eq!(m.instance().node().id(), node.id());
}

#[tokio::test]
async fn spawned_children_run_and_see_their_ancestors() {
    let child = Node::builder("Child work.")
        .name("child")
        .state(Counter {
            count: 9,
            label: String::new(),
        })
        .build()
        .expect("node");
    let child2 = child.clone();
    let parent = Node::builder("Parent instructions.")
        .name("parent")
        .tool(Add)
        .transition(
            "delegate",
            Transition::code("Spawn a child", move |_| {
                let child = child2.clone();
                async move { Ok(markov_charter::transition::spawn(child, None)) }
            }),
        )
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("transition", json!({"to": "delegate", "reason": "r"}))
            .tool_call("add", json!({"a": 1, "b": 2}))
            .text("child done")
            .build(),
    );
    let mut m = machine(|c| c, parent, json!({}), model.clone());
    m.enqueue_user("go");
    run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert_eq!(m.instance().children().len(), 1);
    assert_eq!(m.instance().active().node().id(), child.id());
    let system = &model.requests()[1].system;
    assert!(
        system.contains("## Ancestor Context\n### Ancestor 1: Parent instructions....\nState: {}"),
        "{system}"
    );
    // Ancestor tools are offered to the child and run for it.
    assert!(model.requests()[1].tool_names().contains(&"add"));
    assert_eq!(all_results(m.history())[1].1, "3");
}

#[test]
fn reserved_and_duplicate_tool_names_fail_at_build() {
    struct Named;
    #[async_trait]
    impl markov_core::tool::Tool for Named {
        const NAME: &'static str = "transition_x";
        type Args = NoArgs;
        type Output = String;
        type Error = std::convert::Infallible;
        fn description(&self) -> String {
            String::new()
        }
        async fn call(
            &self,
            _: NoArgs,
            _: &markov_core::tool::ToolContext<'_>,
        ) -> Result<String, std::convert::Infallible> {
            Ok(String::new())
        }
    }
    let err = Node::builder("x").tool(Named).build().unwrap_err();
    assert_eq!(
        err.to_string(),
        "Tool \"transition_x\" from node conflicts with existing tool from builtin:transition_x"
    );
    let err = Node::builder("x").tool(Add).tool(Add).build().unwrap_err();
    assert!(err.to_string().contains("duplicate tool name"), "{err}");
    let err = markov_charter::charter::Charter::builder("c")
        .node(
            "n",
            Node::builder("x")
                .transition("t", Transition::reference("missing"))
                .build()
                .expect("node"),
        )
        .build()
        .unwrap_err();
    assert_eq!(err.to_string(), "Unknown transition ref: missing");
}

/// Sets one field of its pack's state.
struct SetTheme;

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct ThemeArgs {
    theme: String,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
struct Prefs {
    theme: String,
    size: i64,
}

#[async_trait]
impl markov_core::tool::Tool for SetTheme {
    const NAME: &'static str = "set_theme";
    type Args = ThemeArgs;
    type Output = String;
    type Error = markov_core::tool::StateUpdateError;
    fn description(&self) -> String {
        "Set the theme".into()
    }
    async fn call(
        &self,
        args: ThemeArgs,
        cx: &markov_core::tool::ToolContext<'_>,
    ) -> Result<String, Self::Error> {
        cx.update_state(json!({"theme": args.theme}))?;
        Ok("ok".into())
    }
}

#[tokio::test]
async fn a_pack_tool_emits_only_its_patch() {
    let pack = markov_charter::pack::Pack::builder("prefs", "User preferences")
        .instructions("Respect the preferences.")
        .state(Prefs {
            theme: "light".into(),
            size: 12,
        })
        .tool(SetTheme)
        .build()
        .expect("pack");
    let node = Node::builder("Use packs.")
        .pack(pack)
        .build()
        .expect("node");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("set_theme", json!({"theme": "dark"}))
            .text("done")
            .build(),
    );
    let mut m = machine(|c| c, node, json!({}), model.clone());
    m.enqueue_user("dark mode");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let patches: Vec<_> = instance_payloads(&steps[0].history)
        .filter_map(|p| match p {
            InstancePayload::PackState { pack_name, patch } => {
                Some((pack_name.clone(), patch.clone()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        patches,
        vec![("prefs".to_owned(), json!({"theme": "dark"}))]
    );
    assert_eq!(
        m.instance().pack_states()["prefs"],
        json!({"theme": "dark", "size": 12})
    );
    // Pack tool successes leave `is_error` out.
    assert_eq!(
        all_results(m.history())[0],
        ("call_1".into(), "ok".into(), None)
    );
    let system = &model.requests()[0].system;
    assert!(
        system.contains("## Active Packs\n### prefs\nUser preferences\n\nInstructions:\nRespect the preferences.\n"),
        "{system}"
    );
}

#[tokio::test]
async fn a_malformed_instance_message_is_handed_back_and_the_rest_runs_next_time() {
    let model = Arc::new(ScriptedModel::builder().text("answer").build());
    let mut m = machine(|c| c, counter_node(), counter_state(), model.clone());
    let id = m.instance().id().clone();
    let bad = Message::instance(InstancePayload::Transition {
        instance_id: id,
        node: json!({"ref": "no_such_node"}),
        state: None,
    });
    m.enqueue([Message::user("hi"), bad.clone()]);
    let err = run_to_completion(&mut m, RunOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "Unknown node ref: no_such_node");
    match err {
        RunError::RefusedInstanceMessage { message, .. } => assert_eq!(*message, bad),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(model.calls(), 0);
    assert!(m.history().is_empty());
    assert_eq!(
        m.queue().messages(),
        vec![Message::user("hi")],
        "the rest waits"
    );
    // The machine is not stuck: the next run takes the input.
    let last = run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("runs");
    assert!(last.done);
    assert_eq!(model.calls(), 1);
}

#[test]
fn an_unregistered_node_with_a_broken_ref_is_refused_at_creation() {
    let node = Node::builder("x")
        .transition("t", Transition::reference("nowhere"))
        .build()
        .expect("node");
    let agent = Agent::builder("c")
        .instructions("Count.")
        .model(ScriptedModel::new([]))
        .build()
        .expect("the agent builds");
    let err = agent
        .machine_at(markov_executor::Instance::new(node, json!({})))
        .unwrap_err();
    assert_eq!(err.to_string(), "Unknown transition ref: nowhere");
}

#[tokio::test]
async fn a_failed_resume_keeps_the_rest_of_its_batch() {
    use markov_executor::{Instance, SuspendInfo};
    let model = Arc::new(ScriptedModel::builder().build());
    let node = counter_node();
    let charter = markov_charter::charter::Charter::builder("t")
        .build()
        .expect("charter");
    let root = Instance::new(node, counter_state()).with_suspended(SuspendInfo {
        suspend_id: "right".into(),
        reason: "wait".into(),
        suspended_at: std::time::SystemTime::now(),
        metadata: None,
    });
    let mut m = machine_on(
        charter,
        markov_executor::StandardExecutor::shared(model),
        root,
    )
    .expect("machine");
    let id = m.instance().id().clone();
    m.enqueue([
        Message::user("hello"),
        Message::from(markov_core::message::MessageData {
            role: Role::System,
            items: markov_core::message::Items::List(vec![Item::Resume {
                instance_id: id,
                suspend_id: "wrong".into(),
            }]),
            metadata: None,
        }),
    ]);
    let err = run_to_completion(&mut m, RunOptions::default())
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "Suspend ID mismatch: expected right, got wrong"
    );
    assert_eq!(m.queue().messages(), vec![Message::user("hello")]);
}

/// Wraps a model and keeps the history id and length of every request.
#[derive(Debug)]
struct HistoryIds {
    inner: Arc<ScriptedModel>,
    seen: std::sync::Mutex<Vec<(Option<markov_core::model::HistoryId>, usize)>>,
}

#[async_trait::async_trait]
impl markov_core::ModelLayer for HistoryIds {
    type Inner = ScriptedModel;

    fn inner(&self) -> &ScriptedModel {
        &self.inner
    }

    async fn complete(
        &self,
        request: markov_core::ModelRequest<'_>,
    ) -> Result<markov_core::ModelResponse, markov_core::ModelError> {
        self.seen
            .lock()
            .expect("lock")
            .push((request.history_id(), request.messages().len()));
        markov_core::Model::complete(&self.inner, request).await
    }
}

#[tokio::test]
async fn requests_name_the_machines_history_and_it_only_grows() {
    use markov_executor::serialize::serialize_machine;
    use markov_executor::{Instance, StandardExecutor};

    let script = || {
        Arc::new(
            ScriptedModel::builder()
                .tool_call("add", json!({"a": 2, "b": 3}))
                .tool_call("add", json!({"a": 5, "b": 1}))
                .text("6")
                .build(),
        )
    };
    let model = Arc::new(HistoryIds {
        inner: script(),
        seen: std::sync::Mutex::new(Vec::new()),
    });
    let charter = markov_charter::charter::Charter::builder("test")
        .node("main", counter_node())
        .build()
        .expect("charter builds");
    let executor: Arc<dyn markov_executor::Executor> =
        Arc::new(StandardExecutor::new(Arc::clone(&model)));
    let mut first = machine_on_shared(
        charter.clone(),
        Arc::clone(&executor),
        Instance::new(counter_node(), counter_state()),
    )
    .expect("machine builds");
    first.enqueue_user("2+3, then +1?");
    let (_, err) = run_all(&mut first, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let seen = std::mem::take(&mut *model.seen.lock().expect("lock"));
    assert_eq!(seen.len(), 3);
    let id = seen[0].0.expect("a machine names its history");
    assert!(seen.iter().all(|(i, _)| *i == Some(id)), "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0].1 < w[1].1), "{seen:?}");

    // A restored machine is another history (it may be restored twice).
    let snapshot = serialize_machine(&first).expect("serializes");
    let mut restored = restore_on(charter, executor, snapshot.into_owned()).expect("restores");
    *model.seen.lock().expect("lock") = Vec::new();
    restored.enqueue_user("again?");
    let _ = run_all(&mut restored, RunOptions::default()).await;
    let again = model.seen.lock().expect("lock").clone();
    assert!(!again.is_empty());
    assert!(
        again.iter().all(|(i, _)| i.is_some() && *i != Some(id)),
        "{again:?}"
    );
}
