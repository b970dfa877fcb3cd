//! Suspension and resumption (upstream's suspend-resume.test.ts scenarios):
//! suspended subtrees leave the active leaves, a run with nothing active
//! awaits a resume, and a `resume` item in a `system` message clears the
//! suspension in one `command` step that ends the run.

use std::sync::Arc;
use std::time::SystemTime;

use crate::common::{Script, fx, instance_payloads, node, outcome, run_all, say, script_machine};
use markov_charter::node::Node;
use markov_charter::transition::{Transition, TransitionResult, suspend};
use markov_core::InstanceId;
use markov_core::message::{InstancePayload, Item, Items, Message, Role};
use markov_executor::{
    Action, Effect, Executor, Instance, Machine, RunOptions, RunState, SuspendInfo, YieldReason,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

fn info(id: &str, reason: &str) -> SuspendInfo {
    SuspendInfo {
        suspend_id: id.into(),
        reason: reason.into(),
        suspended_at: SystemTime::now(),
        metadata: None,
    }
}

fn machine(script: &Arc<Script>, root: Instance) -> Machine {
    script_machine("suspend", Arc::clone(script) as Arc<dyn Executor>, root)
}

fn resume_message(id: &InstanceId, suspend_id: &str) -> Message {
    Message::from(markov_core::message::MessageData {
        role: Role::System,
        items: Items::List(vec![Item::Resume {
            instance_id: id.clone(),
            suspend_id: suspend_id.into(),
        }]),
        metadata: None,
    })
}

// ---------------------------------------------------------------------------
// Results and tree queries.
// ---------------------------------------------------------------------------

#[test]
fn suspend_generates_an_id_and_keeps_the_reason() {
    let TransitionResult::Suspend {
        suspend_id,
        reason,
        metadata,
    } = suspend("waiting for approval")
    else {
        panic!("expected a suspend result");
    };
    assert!(!suspend_id.is_empty());
    assert_eq!(reason, "waiting for approval");
    assert_eq!(metadata, None);
    let TransitionResult::Suspend {
        suspend_id: other, ..
    } = suspend("again")
    else {
        panic!("expected a suspend result");
    };
    assert_ne!(suspend_id, other, "every suspend gets a fresh id");
}

#[test]
fn suspended_subtrees_are_not_active_leaves() {
    let root = Arc::new(Instance::new(node("root"), json!({})).with_suspended(info("s", "r")));
    assert!(root.active_leaves().is_empty());
    let root = Arc::new(Instance::new(node("root"), json!({})));
    assert_eq!(root.active_leaves().len(), 1);

    let sleeping = Instance::new(node("sleeping"), json!({})).with_suspended(info("s", "r"));
    let awake = Instance::new(node("awake"), json!({}));
    let awake_id = awake.id().clone();
    let root = Arc::new(
        Instance::new(node("root"), json!({}))
            .with_child(sleeping.with_child(Instance::new(node("below"), json!({}))))
            .with_child(awake),
    );
    let leaves = root.active_leaves();
    assert_eq!(leaves.len(), 1);
    assert_eq!(leaves[0].leaf().id(), &awake_id);
    assert_eq!(leaves[0].leaf_index(), [1]);

    // A parent whose children are all suspended is not a leaf either.
    let root = Arc::new(
        Instance::new(node("root"), json!({}))
            .with_child(Instance::new(node("a"), json!({})).with_suspended(info("a", "r")))
            .with_child(Instance::new(node("b"), json!({})).with_suspended(info("b", "r"))),
    );
    assert!(root.active_leaves().is_empty());
}

#[test]
fn suspended_instances_and_find_by_id() {
    let a = Instance::new(node("a"), json!({})).with_suspended(info("sa", "first"));
    let b = Instance::new(node("b"), json!({}));
    let c = Instance::new(node("c"), json!({})).with_suspended(info("sc", "second"));
    let (a_id, b_id, c_id) = (a.id().clone(), b.id().clone(), c.id().clone());
    let root = Arc::new(
        Instance::new(node("root"), json!({}))
            .with_child(a)
            .with_child(b)
            .with_child(c),
    );
    let suspended: Vec<_> = root
        .suspended_instances()
        .iter()
        .map(|i| i.id().clone())
        .collect();
    assert_eq!(suspended, vec![a_id, c_id]);
    assert_eq!(root.find(&b_id).map(|i| i.id().clone()), Some(b_id));
    assert!(root.find(&InstanceId::new("nobody")).is_none());
}

// ---------------------------------------------------------------------------
// awaiting_resume.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_root_suspended_by_its_executor_awaits_resume() {
    let script = Script::new().on("root", |cx| {
        let id = cx.instance().id().clone();
        let mut info = info("s-1", "needs approval");
        info.metadata = Some(json!({"ticket": 7}));
        outcome(
            vec![
                say(cx, "pausing"),
                fx(cx, Effect::Suspend { instance: id, info }),
            ],
            YieldReason::EndTurn,
        )
    });
    let mut m = machine(&script, Instance::new(node("root"), json!({})));
    let root_id = m.instance().id().clone();
    m.enqueue_user("start");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1);
    assert!(steps[0].done);
    let stored = m.instance().suspended().expect("root suspended");
    assert_eq!(stored.suspend_id, "s-1");

    m.enqueue_user("are you there?");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1);
    let step = &steps[0];
    assert_eq!(step.yield_reason, YieldReason::AwaitingResume);
    assert!(step.done);
    // Quirk kept: the step reports no history although the input was drained.
    assert!(step.history.is_empty());
    assert_eq!(
        m.history().last().map(Message::text).as_deref(),
        Some("are you there?")
    );
    assert_eq!(step.suspended_instances.len(), 1);
    let s = &step.suspended_instances[0];
    assert_eq!(s.instance_id, root_id);
    assert_eq!(s.suspend_id, "s-1");
    assert_eq!(s.reason, "needs approval");
    assert_eq!(s.metadata, Some(json!({"ticket": 7})));
    assert_eq!(
        script.calls(),
        vec!["root"],
        "nothing ran in the second run"
    );
}

#[tokio::test]
async fn a_suspend_step_is_followed_by_awaiting_resume() {
    let script = Script::new().on("child", |cx| {
        let id = cx.instance().id().clone();
        outcome(
            vec![fx(
                cx,
                Effect::Suspend {
                    instance: id,
                    info: info("wait", "blocked"),
                },
            )],
            YieldReason::Suspend,
        )
    });
    let root =
        Instance::new(node("root"), json!({})).with_child(Instance::new(node("child"), json!({})));
    let mut m = machine(&script, root);
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let reasons: Vec<_> = steps.iter().map(|s| (s.yield_reason, s.done)).collect();
    assert_eq!(
        reasons,
        vec![
            (YieldReason::Suspend, false),
            (YieldReason::AwaitingResume, true)
        ]
    );
    // The suspend step carries the input and the suspend record.
    assert_eq!(steps[0].history.len(), 2);
    assert!(matches!(
        &steps[0].history[1].items,
        Items::Instance(p) if matches!(p.as_ref(), InstancePayload::Suspend { .. })
    ));
    // The parent is not a leaf while its only child is suspended.
    assert_eq!(script.calls(), vec!["child"]);
}

#[tokio::test]
async fn input_to_a_suspended_tree_calls_no_executor() {
    let script = Script::new();
    let root = Instance::new(node("root"), json!({})).with_suspended(info("s", "r"));
    let mut m = machine(&script, root);
    m.enqueue_user("hi");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none());
    assert_eq!(steps[0].yield_reason, YieldReason::AwaitingResume);
    assert!(script.calls().is_empty());
}

// ---------------------------------------------------------------------------
// Resume.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_resume_item_clears_the_suspension_in_one_command_step_that_ends_the_run() {
    // A reply is queued so that a run that wrongly goes on is visible.
    let script = Script::new().on("root", |cx| {
        outcome(vec![say(cx, "hello")], YieldReason::EndTurn)
    });
    let root = Instance::new(node("root"), json!({})).with_suspended(info("s-1", "wait"));
    let mut m = machine(&script, root);
    let id = m.instance().id().clone();
    m.enqueue([resume_message(&id, "s-1"), Message::user("and continue")]);
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1, "the resume step ends the run");
    let step = &steps[0];
    assert_eq!(step.yield_reason, YieldReason::Command);
    assert!(!step.done);
    assert!(step.instance.suspended().is_none());
    assert!(m.instance().suspended().is_none());
    // markov's note, never the user's words: a system message.
    let notice = Message::system(format!("[Resumed instance {id}]"));
    assert_eq!(step.history, vec![notice.clone()]);
    // Quirk kept: the rest of the batch is discarded, the notice alone is recorded.
    assert_eq!(m.history(), std::slice::from_ref(&notice));
    // A snapshot keeps it markov's.
    let snapshot =
        serde_json::to_string(&markov_executor::serialize_machine(&m).expect("serializes"))
            .expect("writes");
    let read: markov_executor::SerializedMachine = serde_json::from_str(&snapshot).expect("reads");
    assert_eq!(read.history, [notice]);
    assert!(m.queue().is_empty());
    assert!(script.calls().is_empty(), "no executor ran");

    // A new user message continues the conversation.
    m.enqueue_user("continue");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0].yield_reason, YieldReason::EndTurn);
    assert!(steps[0].done);
    assert_eq!(script.calls(), vec!["root"]);
}

#[test]
fn the_run_state_is_finished_after_a_resume() {
    let script = Script::new();
    let root = Instance::new(node("root"), json!({})).with_suspended(info("s-1", "wait"));
    let mut m = machine(&script, root);
    let id = m.instance().id().clone();
    m.enqueue([resume_message(&id, "s-1"), Message::user("go")]);
    let mut state = RunState::new(RunOptions::default());
    let Action::Yield(step) = state.next(&mut m).expect("action") else {
        panic!("expected the resume step");
    };
    assert_eq!(step.yield_reason, YieldReason::Command);
    assert!(!step.done);
    assert!(state.is_finished());
    assert!(matches!(state.next(&mut m), Ok(Action::Finished)));
    // A serialized finished state stays finished.
    let saved = serde_json::to_string(&state).expect("serializes");
    let mut state: RunState = serde_json::from_str(&saved).expect("deserializes");
    assert!(matches!(state.next(&mut m), Ok(Action::Finished)));
}

#[test]
fn the_run_state_is_finished_after_a_done_step() {
    let script = Script::new();
    let mut m = machine(&script, Instance::new(node("root"), json!({})));
    m.enqueue_user("hi");
    let mut state = RunState::new(RunOptions::default());
    let Action::RunLeaves(tasks) = state.next(&mut m).expect("action") else {
        panic!("expected leaves to run");
    };
    let step = state
        .on_leaf_results(
            &mut m,
            &tasks,
            vec![Ok(outcome(vec![], YieldReason::EndTurn))],
        )
        .expect("step");
    assert!(step.done);
    assert!(state.is_finished());
    assert!(matches!(state.next(&mut m), Ok(Action::Finished)));
    // With per-leaf turn bookkeeping recorded, the state still round-trips.
    let saved = serde_json::to_string(&state).expect("serializes");
    let restored: RunState = serde_json::from_str(&saved).expect("deserializes");
    assert_eq!(restored, state);
}

#[tokio::test]
async fn a_resumed_child_runs_again() {
    let script = Script::new().on("child", |cx| {
        outcome(vec![say(cx, "back")], YieldReason::EndTurn)
    });
    let child = Instance::new(node("child"), json!({})).with_suspended(info("c-1", "wait"));
    let child_id = child.id().clone();
    let root = Instance::new(node("root"), json!({})).with_child(child);
    let mut m = machine(&script, root);

    m.enqueue_user("hi");
    let (steps, _) = run_all(&mut m, RunOptions::default()).await;
    assert_eq!(steps[0].yield_reason, YieldReason::AwaitingResume);
    assert_eq!(steps[0].suspended_instances[0].instance_id, child_id);

    m.enqueue([resume_message(&child_id, "c-1")]);
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1);
    assert!(m.instance().suspended_instances().is_empty());

    m.enqueue_user("again");
    let last = markov_executor::run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert_eq!(script.calls(), vec!["child"]);
}

#[tokio::test]
async fn resume_errors_name_the_problem() {
    let script = Script::new();
    let sleeping = Instance::new(node("sleeping"), json!({})).with_suspended(info("right", "r"));
    let awake = Instance::new(node("awake"), json!({}));
    let (sleeping_id, awake_id) = (sleeping.id().clone(), awake.id().clone());
    let root = Instance::new(node("root"), json!({}))
        .with_child(sleeping)
        .with_child(awake);

    let cases = [
        (
            resume_message(&sleeping_id, "wrong"),
            "Suspend ID mismatch: expected right, got wrong".to_owned(),
        ),
        (
            resume_message(&awake_id, "right"),
            format!("Instance {awake_id} is not suspended"),
        ),
        (
            resume_message(&InstanceId::new("ghost"), "right"),
            "Instance not found: ghost".to_owned(),
        ),
    ];
    for (message, expected) in cases {
        let mut m = machine(&script, root.clone());
        m.enqueue([message]);
        let (steps, err) = run_all(&mut m, RunOptions::default()).await;
        assert!(steps.is_empty());
        assert_eq!(err.map(|e| e.to_string()), Some(expected));
        assert!(
            m.instance()
                .find(&sleeping_id)
                .is_some_and(|i| i.suspended().is_some()),
            "a failed resume changes nothing"
        );
    }
    assert!(script.calls().is_empty());
}

// ---------------------------------------------------------------------------
// End to end through the standard executor.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn a_code_transition_suspends_and_a_resume_continues() {
    let node = Node::builder("Ask for approval when needed.")
        .name("approver")
        .transition(
            "wait_for_approval",
            Transition::code("Pause until a human approves", |input| async move {
                Ok(TransitionResult::Suspend {
                    suspend_id: "approval-1".into(),
                    reason: input.reason,
                    metadata: Some(json!({"amount": 100})),
                })
            }),
        )
        .build()
        .expect("node builds");
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call(
                "transition",
                json!({"to": "wait_for_approval", "reason": "over the limit"}),
            )
            .text("approved, carrying on")
            .build(),
    );
    let mut m = crate::common::machine(|c| c, node, json!({}), Arc::clone(&model));
    let id = m.instance().id().clone();
    m.enqueue_user("pay 100");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let reasons: Vec<_> = steps.iter().map(|s| s.yield_reason).collect();
    assert_eq!(
        reasons,
        vec![YieldReason::Suspend, YieldReason::AwaitingResume]
    );
    assert!(steps[1].done);
    let s = &steps[1].suspended_instances[0];
    assert_eq!(s.instance_id, id);
    assert_eq!(s.suspend_id, "approval-1");
    assert_eq!(s.reason, "over the limit");
    assert_eq!(s.metadata, Some(json!({"amount": 100})));
    // The suspend record in history carries the wire form.
    let record = instance_payloads(&steps[0].history)
        .find_map(|p| match p {
            InstancePayload::Suspend { suspend_info, .. } => Some(suspend_info.clone()),
            _ => None,
        })
        .expect("suspend recorded");
    assert_eq!(record["suspendId"], "approval-1");
    assert_eq!(record["metadata"], json!({"amount": 100}));
    assert_eq!(model.calls(), 1);

    m.enqueue([resume_message(&id, "approval-1")]);
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0].yield_reason, YieldReason::Command);
    assert_eq!(model.calls(), 1, "the resume alone calls no model");

    m.enqueue_user("approved");
    let last = markov_executor::run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert!(last.done);
    assert_eq!(
        last.history.last().map(Message::text).as_deref(),
        Some("approved, carrying on")
    );
    assert_eq!(model.calls(), 2);
    // The model saw the resume notice, as markov's note, not the user's.
    let notice = format!("[Resumed instance {id}]");
    let seen: Vec<_> = model.requests()[1]
        .messages
        .iter()
        .filter(|msg| msg.text() == notice)
        .map(|msg| msg.role)
        .collect();
    assert_eq!(seen, [Role::System], "{:?}", model.requests()[1].messages);
}

// ---------------------------------------------------------------------------
// Suspension next to a worker.
// ---------------------------------------------------------------------------

#[tokio::test]
async fn suspending_the_primary_while_a_worker_runs_ends_the_turn_after_one_step() {
    let script = Script::new()
        .on("primary", |cx| {
            let id = cx.instance().id().clone();
            outcome(
                vec![fx(
                    cx,
                    Effect::Suspend {
                        instance: id,
                        info: info("p", "later"),
                    },
                )],
                YieldReason::Suspend,
            )
        })
        .on("worker", |cx| {
            outcome(vec![say(cx, "step 1")], YieldReason::ToolUse)
        })
        .on("worker", |cx| {
            outcome(vec![say(cx, "step 2")], YieldReason::ToolUse)
        });
    let worker = Node::builder("Work.")
        .name("worker")
        .worker()
        .build()
        .expect("node builds");
    let root = Instance::new(node("root"), json!({}))
        .with_child(Instance::new(worker, json!({})))
        .with_child(Instance::new(node("primary"), json!({})));
    let mut m = machine(&script, root);
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    // Step 1: the primary suspends (reason suspend, not done). Step 2: only
    // the worker is active, so the reason defaults to end_turn and the turn ends.
    let reasons: Vec<_> = steps.iter().map(|s| (s.yield_reason, s.done)).collect();
    assert_eq!(
        reasons,
        vec![(YieldReason::Suspend, false), (YieldReason::EndTurn, true)]
    );
    assert_eq!(script.calls(), vec!["worker", "primary", "worker"]);
}
