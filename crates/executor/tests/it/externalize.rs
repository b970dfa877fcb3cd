//! Externalized state: the `[core]` scenarios of upstream's
//! `externalize-state.test.ts`, plus registration, removal, errors,
//! sequence numbers and hydration.

use crate::common::{machine_on_shared, restore_on};
use std::sync::{Arc, Mutex};

use markov_charter::charter::Charter;
use markov_charter::command::{Command, CommandContext, CommandError, CommandResult};
use markov_charter::externalize::{
    ExternalContext, ExternalizeError, MutationEvent, Scope, SetStateOptions, StateHandler,
};
use markov_charter::node::Node;
use markov_charter::pack::Pack;
use markov_charter::transition::CedeContent;
use markov_core::InstanceId;
use markov_core::async_trait;
use markov_core::message::{InstancePayload, Message};
use markov_executor::{
    CommandOptions, Effect, Instance, Machine, RunOptions, YieldReason, run_command,
    serialize_machine,
};
use serde_json::{Value, json};

use crate::common::{Counter, NoArgs, Script, cede_fx, fx, outcome, run_all, say};

/// What the handlers of a test saw, in order.
#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl Log {
    fn push(&self, line: impl Into<String>) {
        self.0.lock().expect("lock").push(line.into());
    }
    fn lines(&self) -> Vec<String> {
        self.0.lock().expect("lock").clone()
    }
}

/// A handler that logs every call and, when `accept`, applies each patch.
fn handler(log: &Arc<Log>, accept: bool) -> StateHandler {
    let log = Arc::clone(log);
    StateHandler::new(move |cx: &ExternalContext| {
        log.push(format!("register {}", cx.scope().id()));
        let (l, handle) = (Arc::clone(&log), cx.clone());
        cx.on_mutation(move |state: &Value, event: &MutationEvent| {
            l.push(format!(
                "mutation #{} step {} state {} patch {}",
                event.sequence, event.step_number, state, event.patch
            ));
            if accept {
                handle.set_state(event.patch.clone(), SetStateOptions::patch())?;
            }
            Ok(())
        });
        let l = Arc::clone(&log);
        cx.on_step(move |step, events| {
            let numbers: Vec<String> = events
                .iter()
                .map(|e| format!("#{}@{}", e.sequence, e.step_number))
                .collect();
            l.push(format!(
                "step {} {} [{}]",
                step.step_number,
                step.yield_reason,
                numbers.join(",")
            ));
            Ok(())
        });
        let l = Arc::clone(&log);
        cx.on_hydrate(move |state| {
            l.push(format!("hydrate {state}"));
            Ok(())
        });
        let l = Arc::clone(&log);
        let id = cx.scope().id().to_owned();
        Ok(Some(Box::new(move || l.push(format!("cleanup {id}")))))
    })
}

fn counter_node(name: &str, handler: Option<StateHandler>) -> Node {
    let b = Node::builder(format!("{name} instructions."))
        .name(name)
        .state(Counter {
            count: 0,
            label: String::new(),
        });
    match handler {
        Some(h) => b.state_handler(h),
        None => b,
    }
    .build()
    .expect("node builds")
}

fn state_message(instance: &InstanceId, patch: Value) -> Message {
    Message::instance(InstancePayload::State {
        instance_id: instance.clone(),
        patch,
    })
}

fn pack_state_message(pack: &str, patch: Value) -> Message {
    Message::instance(InstancePayload::PackState {
        pack_name: pack.to_owned(),
        patch,
    })
}

fn machine_over(node: &Node, state: Value, script: Arc<Script>) -> Machine {
    let charter = Charter::builder("ext")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    machine_on_shared(charter, script, Instance::new(node.clone(), state)).expect("machine builds")
}

// ------------------------------------------------------------------ [core]

#[tokio::test]
async fn node_handler_applies_the_patch_of_a_state_message() {
    let log = Arc::new(Log::default());
    let node = counter_node("main", Some(handler(&log, true)));
    let mut machine = machine_over(&node, json!({"count": 1, "label": ""}), Script::new());
    let id = machine.instance().id().clone();
    machine.enqueue([state_message(&id, json!({"count": 7}))]);

    let (steps, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(steps.len(), 1);
    assert_eq!(
        machine.instance().state(),
        &json!({"count": 7, "label": ""})
    );
    // The step's snapshot already has it: the write landed in the apply phase.
    assert_eq!(steps[0].instance.state()["count"], 7);
    let lines = log.lines();
    assert!(
        lines.contains(
            &r#"mutation #1 step 0 state {"count":1,"label":""} patch {"count":7}"#.into()
        ),
        "{lines:?}"
    );
}

#[tokio::test]
async fn observing_pack_handler_leaves_the_pack_state_unchanged() {
    let log = Arc::new(Log::default());
    let pack = Pack::builder("prefs", "User preferences")
        .state(json!({"theme": "light"}))
        .state_handler(handler(&log, false))
        .build()
        .expect("pack builds");
    let node = Node::builder("Main.")
        .name("main")
        .pack(pack)
        .build()
        .expect("node builds");
    let mut machine = machine_over(&node, json!({}), Script::new());
    assert_eq!(
        machine.instance().pack_states()["prefs"],
        json!({"theme": "light"})
    );
    machine.enqueue([pack_state_message("prefs", json!({"theme": "dark"}))]);

    let (_, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(
        machine.instance().pack_states()["prefs"],
        json!({"theme": "light"})
    );
    let lines = log.lines();
    assert_eq!(lines[0], "register pack:prefs");
    assert!(
        lines.contains(
            &r#"mutation #1 step 0 state {"theme":"light"} patch {"theme":"dark"}"#.into()
        ),
        "{lines:?}"
    );
}

/// `bump`: writes count + 10 through `update_state`.
struct Bump;

#[async_trait]
impl Command for Bump {
    const NAME: &'static str = "bump";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Bump the counter".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        let c: Counter = cx.state().map_err(CommandError::failed)?;
        cx.update_state(json!({"count": c.count + 10}))?;
        Ok(CommandResult::done())
    }
}

#[tokio::test]
async fn node_command_on_an_externalized_node_changes_state_only_through_the_handler() {
    let log = Arc::new(Log::default());
    let node = Node::builder("Main.")
        .name("main")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .command(Bump)
        .state_handler(handler(&log, true))
        .build()
        .expect("node builds");
    let mut machine = machine_over(&node, json!({"count": 1, "label": ""}), Script::new());

    let out = run_command(&mut machine, "bump", json!({}), CommandOptions::default()).await;
    assert!(out.result.success, "{:?}", out.result);
    assert_eq!(
        machine.instance().state()["count"],
        1,
        "the tree keeps the old state"
    );
    assert_eq!(machine.queue().len(), 2, "command record + state message");

    let (_, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(machine.instance().state()["count"], 11);
    assert!(
        log.lines()
            .iter()
            .any(|l| l.contains(r#"patch {"count":11}"#))
    );
}

#[tokio::test]
async fn a_state_message_drained_with_user_input_reaches_the_first_step() {
    let log = Arc::new(Log::default());
    let node = counter_node("main", Some(handler(&log, true)));
    let script = Script::new().on("main", |cx| {
        outcome(vec![say(cx, "hello")], YieldReason::EndTurn)
    });
    let mut machine = machine_over(&node, json!({"count": 1, "label": ""}), script);
    let id = machine.instance().id().clone();
    machine.enqueue([Message::user("hi"), state_message(&id, json!({"count": 2}))]);

    let (steps, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(steps.len(), 1);
    assert_eq!(machine.instance().state()["count"], 2);
    let step_lines: Vec<String> = log
        .lines()
        .into_iter()
        .filter(|l| l.starts_with("step "))
        .collect();
    assert_eq!(step_lines, ["step 1 end_turn [#1@0]"]);
}

// ------------------------------------------------------ registration, removal

#[tokio::test]
async fn scopes_register_on_creation_and_hydrate_after_the_handler() {
    let log = Arc::new(Log::default());
    let node = counter_node("main", Some(handler(&log, true)));
    let machine = machine_over(&node, json!({"count": 3, "label": ""}), Script::new());
    let id = machine.instance().id().clone();
    assert_eq!(
        log.lines(),
        [
            format!("register node:{id}"),
            r#"hydrate {"count":3,"label":""}"#.to_owned(),
        ]
    );
    drop(machine);
    assert_eq!(log.lines().last(), Some(&format!("cleanup node:{id}")));
}

#[tokio::test]
async fn a_ceded_instance_is_unregistered_and_cleaned_up() {
    let log = Arc::new(Log::default());
    let child = counter_node("child", Some(handler(&log, true)));
    let root = crate::common::node("root");
    let script = Script::new()
        .on("child", |cx| {
            outcome(
                vec![cede_fx(cx, Some(CedeContent::Text("done".into())))],
                YieldReason::Cede,
            )
        })
        .on("root", |cx| {
            outcome(vec![say(cx, "back")], YieldReason::EndTurn)
        });
    let tree = Instance::new(root.clone(), json!({}))
        .with_child(Instance::new(child, json!({"count": 0, "label": ""})));
    let charter = Charter::builder("ext").build().expect("charter builds");
    let mut machine = machine_on_shared(charter, script, tree).expect("machine builds");
    let child_id = machine.instance().children()[0].id().clone();
    assert_eq!(log.lines()[0], format!("register node:{child_id}"));

    machine.enqueue_user("go");
    let (steps, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(steps.len(), 2);
    assert!(machine.instance().children().is_empty());
    assert!(log.lines().contains(&format!("cleanup node:{child_id}")));
}

#[tokio::test]
async fn a_transition_to_a_node_without_handler_unregisters_the_scope() {
    let log = Arc::new(Log::default());
    let node = counter_node("main", Some(handler(&log, true)));
    let plain = counter_node("plain", None);
    let to = plain.clone();
    let script = Script::new().on("main", move |cx| {
        outcome(
            vec![fx(
                cx,
                Effect::Transition {
                    instance: cx.instance().id().clone(),
                    node: to.clone(),
                    state: json!({"count": 0, "label": ""}),
                },
            )],
            YieldReason::EndTurn,
        )
    });
    let mut machine = machine_over(&node, json!({"count": 0, "label": ""}), script);
    let id = machine.instance().id().clone();
    let handle_log = Arc::clone(&log);
    machine.enqueue_user("go");
    let (_, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(machine.instance().node().name(), Some("plain"));
    assert!(handle_log.lines().contains(&format!("cleanup node:{id}")));

    // Not externalized any more: a state message is applied as usual.
    machine.enqueue([state_message(&id, json!({"count": 5}))]);
    let (_, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(machine.instance().state()["count"], 5);
    assert_eq!(
        log.lines()
            .iter()
            .filter(|l| l.starts_with("mutation"))
            .count(),
        0
    );
}

#[tokio::test]
async fn a_failing_handler_is_not_registered() {
    let node = Node::builder("Main.")
        .name("main")
        .externalize(|_cx| Err(ExternalizeError::handler("store unavailable")))
        .build()
        .expect("node builds");
    let mut machine = machine_over(&node, json!({"count": 1}), Script::new());
    let id = machine.instance().id().clone();
    machine.enqueue([state_message(&id, json!({"count": 2}))]);
    let (_, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    // Applied as usual: nobody owns the scope.
    assert_eq!(machine.instance().state(), &json!({"count": 2}));
}

#[tokio::test]
async fn deserialization_registers_the_scopes_again() {
    let log = Arc::new(Log::default());
    let node = counter_node("main", Some(handler(&log, true)));
    let machine = machine_over(&node, json!({"count": 4, "label": ""}), Script::new());
    let id = machine.instance().id().clone();
    let snapshot = serialize_machine(&machine).expect("serializes");
    let again = restore_on(
        machine.charter().clone(),
        Script::new(),
        snapshot.into_owned(),
    )
    .expect("deserializes");
    let registrations = log
        .lines()
        .iter()
        .filter(|l| **l == format!("register node:{id}"))
        .count();
    assert_eq!(registrations, 2);
    assert_eq!(again.instance().state()["count"], 4);
}

// ----------------------------------------------------------- events, errors

#[tokio::test]
async fn sequence_numbers_increase_per_machine() {
    let log = Arc::new(Log::default());
    let pack = Pack::builder("prefs", "Preferences")
        .state_handler(handler(&log, true))
        .build()
        .expect("pack builds");
    let node = Node::builder("Main.")
        .name("main")
        .pack(pack)
        .state_handler(handler(&log, true))
        .build()
        .expect("node builds");
    let mut machine = machine_over(&node, json!({}), Script::new());
    let id = machine.instance().id().clone();
    machine.enqueue([
        state_message(&id, json!({"a": 1})),
        pack_state_message("prefs", json!({"b": 2})),
    ]);
    run_all(&mut machine, RunOptions::default()).await;
    machine.enqueue([state_message(&id, json!({"a": 3}))]);
    run_all(&mut machine, RunOptions::default()).await;

    let sequences: Vec<String> = log
        .lines()
        .into_iter()
        .filter(|l| l.starts_with("mutation"))
        .map(|l| l.split(' ').nth(1).unwrap_or_default().to_owned())
        .collect();
    assert_eq!(sequences, ["#1", "#2", "#3"]);
    assert_eq!(machine.instance().state(), &json!({"a": 3}));
    assert_eq!(machine.instance().pack_states()["prefs"], json!({"b": 2}));
    // Each scope's step callback saw only its own events.
    let steps: Vec<String> = log
        .lines()
        .into_iter()
        .filter(|l| l.starts_with("step"))
        .collect();
    assert_eq!(
        steps,
        [
            "step 0 end_turn [#2@0]",
            "step 0 end_turn [#1@0]",
            "step 0 end_turn []",
            "step 0 end_turn [#3@0]",
        ]
    );
}

/// Keeps the context so a test can write from outside any callback.
fn keeping(slot: &Arc<Mutex<Option<ExternalContext>>>) -> StateHandler {
    let slot = Arc::clone(slot);
    StateHandler::new(move |cx: &ExternalContext| {
        *slot.lock().expect("lock") = Some(cx.clone());
        Ok(None)
    })
}

fn context(slot: &Arc<Mutex<Option<ExternalContext>>>) -> ExternalContext {
    slot.lock().expect("lock").clone().expect("registered")
}

#[tokio::test]
async fn set_state_validates_and_reports_typed_errors() {
    let node_slot = Arc::new(Mutex::new(None));
    let pack_slot = Arc::new(Mutex::new(None));
    let pack = Pack::builder("prefs", "Preferences")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .state_handler(keeping(&pack_slot))
        .build()
        .expect("pack builds");
    let node = Node::builder("Main.")
        .name("main")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .pack(pack)
        .state_handler(keeping(&node_slot))
        .build()
        .expect("node builds");
    let mut machine = machine_over(&node, json!({"count": 1, "label": ""}), Script::new());
    let id = machine.instance().id().clone();
    let (node_cx, pack_cx) = (context(&node_slot), context(&pack_slot));
    assert!(matches!(node_cx.scope(), Scope::Node { instance_id, .. } if *instance_id == id));
    assert!(matches!(pack_cx.scope(), Scope::Pack { pack_name, .. } if pack_name == "prefs"));

    let err = node_cx
        .set_state(json!({"count": "many"}), SetStateOptions::patch())
        .expect_err("invalid");
    assert!(matches!(err, ExternalizeError::NodeValidation { .. }));
    assert!(
        err.to_string().starts_with(&format!(
            "Externalized node state validation failed ({id}): "
        )),
        "{err}"
    );
    let err = pack_cx
        .set_state(json!({"label": "x"}), SetStateOptions::replace())
        .expect_err("count is missing");
    assert!(
        err.to_string()
            .starts_with("Externalized pack state validation failed (prefs): "),
        "{err}"
    );
    assert_eq!(
        machine.instance().state()["count"],
        1,
        "nothing was written"
    );

    // A write from outside any callback lands at the next synchronisation.
    let written = node_cx
        .set_state(json!({"count": 9}), SetStateOptions::patch().revision(3))
        .expect("valid");
    assert_eq!(written, json!({"count": 9, "label": ""}));
    assert_eq!(node_cx.state(), written);
    machine.sync_externalized();
    assert_eq!(machine.instance().state(), &written);
    pack_cx
        .set_state(
            json!({"count": 2, "label": "p"}),
            SetStateOptions::replace(),
        )
        .expect("valid");
    machine.sync_externalized();
    assert_eq!(
        machine.instance().pack_states()["prefs"],
        json!({"count": 2, "label": "p"})
    );

    drop(machine);
    let err = node_cx
        .set_state(json!({"count": 1}), SetStateOptions::patch())
        .expect_err("gone");
    assert_eq!(
        err.to_string(),
        format!("Externalized node instance not found: {id}")
    );
    let err = pack_cx
        .set_state(json!({"count": 1}), SetStateOptions::patch())
        .expect_err("gone");
    assert_eq!(err.to_string(), "Externalized pack not found: prefs");
}

#[tokio::test]
async fn a_removed_instance_refuses_writes() {
    let slot = Arc::new(Mutex::new(None));
    let child = counter_node("child", Some(keeping(&slot)));
    let root = crate::common::node("root");
    let charter = Charter::builder("ext").build().expect("charter builds");
    let tree = Instance::new(root, json!({}))
        .with_child(Instance::new(child, json!({"count": 0, "label": ""})));
    let mut machine = machine_on_shared(charter, Script::new(), tree).expect("machine builds");
    let child_id = machine.instance().children()[0].id().clone();
    let cx = context(&slot);

    // The child is dropped by a queued cede message.
    machine.enqueue([Message::instance(InstancePayload::Cede {
        instance_id: child_id.clone(),
        content: None,
    })]);
    let (_, error) = run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert!(machine.instance().children().is_empty());
    let err = cx
        .set_state(json!({"count": 1}), SetStateOptions::patch())
        .expect_err("gone");
    assert_eq!(
        err,
        ExternalizeError::NodeNotFound(child_id.clone()),
        "{err}"
    );
}
