//! The Postgres store against a real PostgreSQL server this test binary
//! starts itself (Debian's `postgresql` package, on a temporary directory
//! and a loopback port): round trips, leases between two workers, claims
//! that never collide, and a machine resumed by another worker.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_executor::{Executor, RunOptions, serialize_machine};
use markov_store::testing::TempPostgres;
use markov_store::{
    DurableMachine, PostgresStore, SessionId, StepRecord, Store, StoreError, WorkerId,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// A server of the test's own, stopped when the test ends (statics are
/// never dropped, so a shared one would outlive the process); `None` when
/// PostgreSQL is not installed outside CI — in CI that is a failure, never
/// a skip.
pub(crate) fn server() -> Option<TempPostgres> {
    if !TempPostgres::is_installed() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "PostgreSQL is not installed, and CI must run the Postgres tests (.ci/run installs it)"
        );
        eprintln!("skipped: PostgreSQL not installed");
        return None;
    }
    Some(TempPostgres::start().expect("PostgreSQL starts"))
}

fn two_turns() -> ScriptedModel {
    ScriptedModel::builder()
        .tool_call("note", json!({}))
        .response(calls(&[("pay-1", "pay", json!({"amount": 3}))]))
        .text("Paid 3.")
        .tool_call("note", json!({}))
        .text("Noted.")
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_round_trips_through_postgres() {
    let Some(server) = server() else { return };
    let url = server.new_database().expect("a database");
    let store = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let dir = Dir::new("pg-round-trip");
    let id = SessionId::new("s1");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        machine(Arc::new(two_turns()), &dir),
    )
    .await
    .expect("created");
    for text in ["pay 3", "note it"] {
        session.machine().enqueue_user(text);
        session.run(RunOptions::default()).await.expect("runs");
    }
    let expected = serialize_machine(session.machine()).expect("serializes");
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(
        stored.snapshot, expected,
        "tree, history, approvals, ledger, counts"
    );
    assert!(stored.run.is_none());
    assert_eq!(lines(&dir.path("effects")), 1);

    let listed = store.list().await.expect("lists");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].messages, expected.history.len() as u64);
    let again = serialize_machine(&machine(Arc::new(two_turns()), &dir)).expect("serializes");
    assert!(matches!(
        store
            .create(
                &id,
                "payments",
                &again,
                &WorkerId::new("w"),
                Duration::from_secs(5)
            )
            .await,
        Err(StoreError::AlreadyExists(_))
    ));
    assert!(store.delete(&id).await.expect("deletes"));
    assert!(matches!(
        store.load(&id).await,
        Err(StoreError::NotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_never_write_the_same_session() {
    let Some(server) = server() else { return };
    let url = server.new_database().expect("a database");
    // Two connections: two worker processes.
    let first = PostgresStore::connect(&url).await.expect("connects");
    let second = PostgresStore::connect(&url).await.expect("connects");
    lease_contract(&first, &second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_never_take_the_same_session() {
    let Some(server) = server() else { return };
    let url = server.new_database().expect("a database");
    let first = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let second = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let dir = Dir::new("pg-claims");
    let snapshot = serialize_machine(&machine(Arc::new(two_turns()), &dir)).expect("serializes");
    let crashed = WorkerId::new("crashed");
    let run = markov_executor::RunState::new(RunOptions::default());
    // Four sessions whose runs were in progress when their worker died.
    for n in 0..4 {
        let id = SessionId::new(format!("s{n}"));
        first
            .create(
                &id,
                "payments",
                &snapshot,
                &crashed,
                Duration::from_millis(100),
            )
            .await
            .expect("created");
        first
            .append(
                &id,
                &crashed,
                StepRecord {
                    messages: &[],
                    tree: None,
                    approvals: None,
                    repeats: None,
                    run: Some(&run),
                },
            )
            .await
            .expect("written");
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (x, y) = (WorkerId::new("x"), WorkerId::new("y"));
    let mut claimed = Vec::new();
    for _ in 0..3 {
        let (a, b) = tokio::join!(
            first.claim_interrupted(&x, Duration::from_secs(60)),
            second.claim_interrupted(&y, Duration::from_secs(60)),
        );
        claimed.extend(a.expect("claims").map(|l| l.session));
        claimed.extend(b.expect("claims").map(|l| l.session));
    }
    claimed.sort();
    let unique: std::collections::BTreeSet<_> = claimed.iter().cloned().collect();
    assert_eq!(
        claimed.len(),
        4,
        "every interrupted session was claimed: {claimed:?}"
    );
    assert_eq!(unique.len(), 4, "none twice: {claimed:?}");
    assert!(
        first
            .claim_interrupted(&x, Duration::from_secs(60))
            .await
            .expect("claims")
            .is_none(),
        "all are leased now"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_worker_resumes_an_interrupted_run_without_paying_twice() {
    let Some(server) = server() else { return };
    let url = server.new_database().expect("a database");
    let dead = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let dir = Dir::new("pg-resume");
    // The first worker pays, journals, then hangs in the next tool; it is
    // abandoned there, as a crashed process would be.
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[
                ("pay-1", "pay", json!({"amount": 5})),
                ("wait-1", "hang", json!({})),
            ]))
            .build(),
    );
    let mut first = DurableMachine::create_with_lease(
        dead.clone(),
        SessionId::new("resume"),
        WorkerId::new("first"),
        machine(model, &dir),
        Duration::from_millis(300),
    )
    .await
    .expect("created");
    first.machine().enqueue_user("pay 5");
    let abandoned =
        tokio::time::timeout(Duration::from_millis(500), first.run(RunOptions::default())).await;
    assert!(abandoned.is_err(), "the first worker never finished");
    drop(first);
    assert_eq!(lines(&dir.path("effects")), 1);

    let survivor = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let lease = survivor
        .claim_interrupted(&WorkerId::new("second"), Duration::from_secs(60))
        .await
        .expect("claims")
        .expect("the interrupted session");
    assert_eq!(lease.session, SessionId::new("resume"));
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[("pay-1", "pay", json!({"amount": 5}))]))
            .text("Paid 5.")
            .build(),
    );
    let (charter, _) = charter();
    let executor: Arc<dyn Executor> =
        Arc::new(executor(model, dir.path("effects"), dir.path("marker")));
    let mut session = DurableMachine::open(
        survivor.clone(),
        SessionId::new("resume"),
        WorkerId::new("second"),
        charter,
        executor,
    )
    .await
    .expect("opens");
    assert!(session.is_interrupted());
    let last = session.run(RunOptions::default()).await.expect("continues");
    assert!(last.done);
    assert_eq!(
        lines(&dir.path("effects")),
        1,
        "the journaled payment was not repeated"
    );
    // The first worker, back from the dead, is fenced out.
    assert!(matches!(
        dead.acquire(
            &SessionId::new("resume"),
            &WorkerId::new("first"),
            Duration::from_secs(1)
        )
        .await,
        Err(StoreError::Leased { .. })
    ));
}
