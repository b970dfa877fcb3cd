//! The SQLite store: round trips, byte-identical restores, leases, approvals,
//! and a real process killed between a tool's side effect and its step.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_executor::{
    Executor, MachineOptions, RunOptions, deserialize_machine, serialize_machine,
};
use markov_runtime::registry::{
    ApprovalId, ApprovalStatus, Budget, Category, Mode, PolicyConfig, ToolMetadata, ToolRegistry,
};
use markov_store::{
    DurableError, DurableMachine, SessionId, SqliteStore, Store, StoreError, WorkerId,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

fn store(dir: &Dir) -> Arc<SqliteStore> {
    Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("the database opens"))
}

/// Two turns: notes (the tree changes), a payment, answers.
fn two_turns() -> ScriptedModel {
    ScriptedModel::builder()
        .tool_call("note", json!({}))
        .response(calls(&[("pay-1", "pay", json!({"amount": 3}))]))
        .text("Paid 3.")
        .tool_call("note", json!({}))
        .text("Noted.")
        .build()
}

#[tokio::test]
async fn a_session_round_trips_through_the_store() {
    let dir = Dir::new("round-trip");
    let store = store(&dir);
    let machine = machine(Arc::new(two_turns()), &dir);
    let id = SessionId::new("s1");
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), WorkerId::new("w"), machine)
            .await
            .expect("created");
    for text in ["pay 3", "note it"] {
        session.machine().enqueue_user(text);
        let last = session.run(RunOptions::default()).await.expect("runs");
        assert!(last.done);
    }
    let expected = serialize_machine(session.machine()).expect("serializes");
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(stored.snapshot.instance, expected.instance, "the last tree");
    assert_eq!(
        stored.snapshot.history, expected.history,
        "every message, in order"
    );
    assert_eq!(
        stored.snapshot.policy.ledger, expected.policy.ledger,
        "the ledger"
    );
    assert_eq!(
        stored.snapshot.policy.repeats, expected.policy.repeats,
        "the loop guard's counts"
    );
    assert_eq!(expected.policy.repeats.len(), 1, "the last turn's one note");
    assert!(stored.run.is_none(), "no run in progress");
    assert_eq!(stored.info.messages, expected.history.len() as u64);
    assert_eq!(stored.snapshot.instance.state, json!({"notes": 2}));

    let listed = store.list().await.expect("lists");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].charter, "payments");
    assert!(matches!(
        DurableMachine::create(
            store.clone(),
            id.clone(),
            WorkerId::new("w"),
            machine_for_dir(&dir)
        )
        .await,
        Err(DurableError::Store(StoreError::AlreadyExists(_)))
    ));
    assert!(store.delete(&id).await.expect("deletes"));
    assert!(!store.delete(&id).await.expect("deletes"));
    assert!(matches!(
        store.load(&id).await,
        Err(StoreError::NotFound(_))
    ));
}

fn machine_for_dir(dir: &Dir) -> markov_executor::Machine {
    machine(Arc::new(ScriptedModel::builder().build()), dir)
}

#[tokio::test]
async fn a_restored_session_sends_the_same_next_request_as_one_that_never_stopped() {
    let dir = Dir::new("identical");
    let store = store(&dir);
    let first = Arc::new(two_turns());
    let mut session = DurableMachine::create(
        store.clone(),
        SessionId::new("s"),
        WorkerId::new("a"),
        machine(first, &dir),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("pay 3");
    session.run(RunOptions::default()).await.expect("runs");
    let kept = session.release().await.expect("released");

    let next = || {
        Arc::new(
            ScriptedModel::builder()
                .tool_call("note", json!({}))
                .text("Noted.")
                .build(),
        )
    };
    // The machine that never stopped, on a model that records.
    let never_stopped_model = next();
    let never_stopped_snapshot = serialize_machine(&kept).expect("serializes");
    let (charter, _) = charter();
    let mut never_stopped = deserialize_machine(
        charter.clone(),
        Arc::new(executor(
            never_stopped_model.clone(),
            dir.path("effects"),
            dir.path("m"),
        )),
        never_stopped_snapshot,
        MachineOptions::default(),
    )
    .expect("the live copy");
    // The one another worker restores from the store.
    let restored_model = next();
    let executor: Arc<dyn Executor> = Arc::new(executor(
        restored_model.clone(),
        dir.path("effects"),
        dir.path("m"),
    ));
    let mut restored = DurableMachine::open(
        store,
        SessionId::new("s"),
        WorkerId::new("b"),
        charter,
        executor,
    )
    .await
    .expect("opens");

    never_stopped.enqueue_user("note it");
    markov_executor::run_to_completion(&mut never_stopped, RunOptions::default())
        .await
        .expect("runs");
    restored.machine().enqueue_user("note it");
    restored.run(RunOptions::default()).await.expect("runs");
    let a = never_stopped_model.requests();
    let b = restored_model.requests();
    assert_eq!(a.len(), 2);
    assert_eq!(a, b, "byte for byte the same requests");
    assert_eq!(
        serde_json::to_string(&a[0].messages).expect("json"),
        serde_json::to_string(&b[0].messages).expect("json")
    );
}

#[tokio::test]
async fn leases_fence_every_write() {
    let dir = Dir::new("leases");
    lease_contract(&*store(&dir), &*store(&dir)).await;
}

#[tokio::test]
async fn approvals_are_stored_with_the_session() {
    let dir = Dir::new("approvals");
    let store = store(&dir);
    let (charter, node) = charter();
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(
            Pay(dir.path("effects")),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .lock()
        .expect("locks");
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[("p1", "pay", json!({"amount": 9}))]))
            .text("Please approve.")
            .build(),
    );
    let machine = markov_executor::Machine::new(
        charter,
        markov_executor::StandardExecutor::shared(model)
            .with_registry(Arc::new(registry), Mode::TEXT),
        markov_executor::Instance::new(node, json!({"notes": 0})),
    )
    .expect("machine");
    let id = SessionId::new("approve");
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), WorkerId::new("w"), machine)
            .await
            .expect("created");
    session.machine().enqueue_user("pay 9");
    session.run(RunOptions::default()).await.expect("runs");
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(stored.snapshot.policy.approvals.len(), 1);
    let request = stored.snapshot.policy.approvals[0].request.clone();
    assert_eq!(
        stored.snapshot.policy.approvals[0].status,
        ApprovalStatus::Pending
    );

    session
        .machine()
        .approvals()
        .approve(&ApprovalId::from(request.request_id.as_str()))
        .expect("approved");
    session.persist().await.expect("written");
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(
        stored.snapshot.policy.approvals[0].status,
        ApprovalStatus::Approved
    );
    assert_eq!(lines(&dir.path("effects")), 0);
}

/// The child process of the crash test: not a test on its own (ignored),
/// run by `a_killed_worker_is_resumed_without_paying_twice`.
#[test]
#[ignore = "run as a child process by the crash test"]
fn crash_child() {
    let Some(dir) = std::env::var_os("MARKOV_CRASH_DIR") else {
        return;
    };
    let dir = Dir(dir.into());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let store = store(&dir);
        let model = Arc::new(
            ScriptedModel::builder()
                .response(calls(&[
                    ("pay-1", "pay", json!({"amount": 5})),
                    ("wait-1", "hang", json!({})),
                ]))
                .build(),
        );
        let mut session = DurableMachine::create_with_lease(
            store,
            SessionId::new("crash"),
            WorkerId::new("child"),
            machine(model, &dir),
            Duration::from_millis(500),
        )
        .await
        .expect("created");
        session.machine().enqueue_user("pay 5");
        // Never returns: `hang` waits until the process is killed.
        let _ = session.run(RunOptions::default()).await;
    });
    std::mem::forget(dir);
}

#[tokio::test]
async fn a_killed_worker_is_resumed_without_paying_twice() {
    let dir = Dir::new("crash");
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "--exact",
            "sqlite::crash_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("MARKOV_CRASH_DIR", &dir.0)
        .spawn()
        .expect("the child starts");
    // The child paid, journaled the call, and now hangs in the next tool.
    let marker = dir.path("marker");
    let mut waited = Duration::ZERO;
    while !marker.exists() {
        assert!(
            waited < Duration::from_secs(120),
            "the child never reached the hanging tool"
        );
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the child exited early: {status}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += Duration::from_millis(20);
    }
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    assert_eq!(lines(&dir.path("effects")), 1, "paid once before the crash");

    // Another worker takes the session once the dead one's lease expires.
    let store = store(&dir);
    let id = SessionId::new("crash");
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[("pay-1", "pay", json!({"amount": 5}))]))
            .text("Paid 5.")
            .build(),
    );
    let (charter, _) = charter();
    let executor: Arc<dyn Executor> = Arc::new(executor(
        model.clone(),
        dir.path("effects"),
        dir.path("marker"),
    ));
    let mut waited = Duration::ZERO;
    let mut session = loop {
        match DurableMachine::open(
            store.clone(),
            id.clone(),
            WorkerId::new("survivor"),
            charter.clone(),
            executor.clone(),
        )
        .await
        {
            Ok(session) => break session,
            Err(DurableError::Store(StoreError::Leased { .. }))
                if waited < Duration::from_secs(5) =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
                waited += Duration::from_millis(50);
            }
            Err(e) => panic!("cannot take over the session: {e}"),
        }
    };
    assert!(session.is_interrupted(), "the run was in progress");
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(
        stored.snapshot.policy.ledger.len(),
        1,
        "journaled before the crash"
    );
    assert_eq!(
        stored.snapshot.history[0].text(),
        "pay 5",
        "the input was durable"
    );

    let last = session
        .run(RunOptions::default())
        .await
        .expect("the run continues");
    assert!(last.done);
    assert_eq!(
        lines(&dir.path("effects")),
        1,
        "the completed call did not run again"
    );
    let history = session.machine().history();
    assert_eq!(history.last().map(|m| m.text()).as_deref(), Some("Paid 5."));
    let replayed = history
        .iter()
        .flat_map(|m| m.item_list())
        .find_map(|item| match item {
            markov_core::Item::ToolResult { content, .. } => Some(content.clone()),
            _ => None,
        });
    assert_eq!(replayed.as_deref(), Some(r#"{"ok":true,"data":"paid 5"}"#));
}
