//! The Postgres store against a real PostgreSQL server this test binary
//! starts itself (Debian's `postgresql` package, on a temporary directory
//! and a loopback port): round trips, leases between two workers, claims
//! that never collide, and a machine resumed by another worker.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_core::async_trait;
use markov_executor::{Executor, RunOptions, serialize_machine};
use markov_store::testing::TempPostgres;
use markov_store::{
    DurableMachine, PostgresStore, SessionId, StepRecord, Store, StoreError, WorkerId,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// Claims, as worker `second`, a session a dead worker left interrupted,
/// polling (five seconds at most) until its lease has run out.
async fn claim_when_expired(store: &PostgresStore) -> Option<markov_store::Lease> {
    let mut claimed = None;
    for _ in 0..100 {
        claimed = store
            .claim_interrupted(&WorkerId::new("second"), Duration::from_secs(60))
            .await
            .expect("claims");
        if claimed.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    claimed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_round_trips_through_postgres() {
    let Some((_server, store)) = postgres().await else {
        return;
    };
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
        session.run().await.expect("runs");
    }
    let expected = serialize_machine(session.machine())
        .expect("serializes")
        .into_owned();
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(
        stored.snapshot, expected,
        "tree, history, approvals, ledger, counts"
    );
    assert!(stored.run.is_none());
    assert_eq!(lines(&dir.path("effects")), 1);

    let listed = store.list(None).await.expect("lists");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].messages, expected.history.len() as u64);
    let fresh = machine(Arc::new(two_turns()), &dir);
    let again = serialize_machine(&fresh).expect("serializes");
    assert!(matches!(
        store
            .create(
                &id,
                None,
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
async fn usage_survives_reconnecting_to_postgres() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let dir = Dir::new("pg-usage");
    let store = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let (id, total) = usage_contract(store, &dir).await;
    // Another worker process, its own connections.
    let other = PostgresStore::connect(&url).await.expect("connects");
    let stored = other.load(&id).await.expect("loads");
    assert_eq!(stored.snapshot.usage, total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_never_write_the_same_session() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    // Two connections: two worker processes.
    let first = PostgresStore::connect(&url).await.expect("connects");
    let second = PostgresStore::connect(&url).await.expect("connects");
    lease_contract(&first, &second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_never_take_the_same_session() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let first = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let second = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let dir = Dir::new("pg-claims");
    let machine = machine(Arc::new(two_turns()), &dir);
    let snapshot = serialize_machine(&machine).expect("serializes");
    let crashed = WorkerId::new("crashed");
    let run = markov_executor::RunState::new(RunOptions::default());
    // Four sessions whose runs were in progress when their worker died.
    for n in 0..4 {
        let id = SessionId::new(format!("s{n}"));
        first
            .create(
                &id,
                None,
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
                    run: Some(&run),
                    ..bare_step(&[])
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
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let dead = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let dir = Dir::new("pg-resume");
    // The first worker pays, journals, then hangs in the next tool; it is
    // abandoned there, as a crashed process would be. The model answers as
    // real providers do: new call ids every time it is asked.
    let steps = || vec![vec![("pay", json!({"amount": 5})), ("hang", json!({}))]];
    let model = Arc::new(ProviderLike::new(steps(), "Paid 5."));
    let mut first = DurableMachine::create_with(
        dead.clone(),
        SessionId::new("resume"),
        WorkerId::new("first"),
        machine(model, &dir),
        markov_store::CreateOptions::default().lease(Duration::from_millis(300)),
    )
    .await
    .expect("created");
    first.machine().enqueue_user("pay 5");
    let abandoned = tokio::time::timeout(Duration::from_millis(500), first.run()).await;
    assert!(abandoned.is_err(), "the first worker never finished");
    drop(first);
    assert_eq!(lines(&dir.path("effects")), 1);

    let survivor = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    // The dead worker's lease runs out.
    let claimed = claim_when_expired(&survivor).await;
    let lease = claimed.expect("the interrupted session");
    assert_eq!(lease.session, SessionId::new("resume"));
    let model = Arc::new(ProviderLike::new(steps(), "Paid 5."));
    let (charter, _) = charter();
    let executor: Arc<dyn Executor> = Arc::new(executor(
        model.clone(),
        dir.path("effects"),
        dir.path("marker"),
    ));
    let mut session = DurableMachine::open(
        survivor.clone(),
        SessionId::new("resume"),
        WorkerId::new("second"),
        &agent_on(&charter, executor),
    )
    .await
    .expect("opens");
    assert!(session.is_interrupted());
    let last = session.run().await.expect("continues");
    assert!(last.done);
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
    assert_eq!(
        lines(&calls_file(&dir.path("effects"))),
        1,
        "the journaled payment was answered from the ledger"
    );
    assert_eq!(model.served(), 1, "the model was asked only for the reply");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_at_most_once_call_abandoned_by_its_worker_is_answered_interrupted_by_another() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let dir = Dir::new("pg-at-most-once");
    let steps = || vec![vec![("notify", json!({"to": "ops"}))]];
    let at_most_once = || {
        markov_policy::ToolMetadata::new(markov_policy::Category::Action)
            .with_delivery(markov_core::tool::Delivery::AtMostOnce)
    };
    // The first worker notifies, then hangs; it is abandoned there, as a
    // crashed process would be.
    let model = Arc::new(ProviderLike::new(steps(), "Paid 5."));
    let (charter, _) = charter();
    let machine = markov_executor::Agent::on_charter_with_executor(
        charter.clone(),
        Arc::new(notify_executor(model, &dir, at_most_once())),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine builds");
    let dead = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let mut first = DurableMachine::create_with(
        dead,
        SessionId::new("once"),
        WorkerId::new("first"),
        machine,
        markov_store::CreateOptions::default().lease(Duration::from_millis(300)),
    )
    .await
    .expect("created");
    first.machine().enqueue_user("pay 5");
    let abandoned = tokio::time::timeout(Duration::from_millis(500), first.run()).await;
    assert!(abandoned.is_err(), "the first worker never finished");
    drop(first);
    assert_eq!(lines(&dir.path("notices")), 1);

    let survivor = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let claimed = claim_when_expired(&survivor).await;
    claimed.expect("the interrupted session");
    let model = Arc::new(ProviderLike::new(steps(), "Paid 5."));
    let executor: Arc<dyn Executor> =
        Arc::new(notify_executor(model.clone(), &dir, at_most_once()));
    let mut session = DurableMachine::open(
        survivor,
        SessionId::new("once"),
        WorkerId::new("second"),
        &agent_on(&charter, executor),
    )
    .await
    .expect("opens");
    assert!(session.is_interrupted());
    let mut named = Vec::new();
    let last = session
        .run_each_step(|step| named.extend(step.interrupted.clone()))
        .await
        .expect("continues");
    assert!(last.done);
    assert_eq!(lines(&dir.path("notices")), 1, "not notified again");
    let (result, is_error) = only_result(session.machine().history());
    assert!(is_error && result.contains("\"INTERRUPTED\""), "{result}");
    assert_eq!(named.len(), 1, "named to the application");
    assert_eq!(named[0].tool, "notify");
    assert_eq!(named[0].args, json!({"to": "ops"}));
    assert_eq!(model.served(), 1, "the model was asked only for the reply");
}

/// A payment whose side effect is followed by the database going down.
struct PayThenStopTheDatabase {
    pay: Pay,
    server: Arc<TempPostgres>,
    stopped: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl markov_core::tool::Tool for PayThenStopTheDatabase {
    const NAME: &'static str = "pay";
    type Args = PayArgs;
    type Output = String;
    type Error = std::io::Error;
    fn description(&self) -> String {
        "Pay an amount".into()
    }
    async fn call(
        &self,
        args: PayArgs,
        cx: &markov_core::tool::ToolContext<'_>,
    ) -> Result<String, std::io::Error> {
        let paid = self.pay.call(args, cx).await?;
        if !self.stopped.swap(true, std::sync::atomic::Ordering::SeqCst) {
            self.server
                .stop(markov_store::testing::Shutdown::Fast)
                .map_err(std::io::Error::other)?;
        }
        Ok(paid)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_stopped_after_a_payment_fails_the_run_and_the_resumed_session_pays_once() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let server = Arc::new(server);
    let url = server.new_database().expect("a database");
    let store = Arc::new(
        PostgresStore::connect_with(&url, 2, Duration::from_secs(2))
            .await
            .expect("connects"),
    );
    let dir = Dir::new("pg-stopped");
    let effects = dir.path("effects");
    let machine_parts = || {
        let registry = markov_policy::ToolRegistry::builder(markov_policy::PolicyConfig::new(
            markov_policy::Budget::UNLIMITED,
        ))
        .register(
            PayThenStopTheDatabase {
                pay: Pay(effects.clone()),
                server: Arc::clone(&server),
                stopped: std::sync::atomic::AtomicBool::new(dir.path("stopped-once").exists()),
            },
            markov_policy::ToolMetadata::new(markov_policy::Category::Action),
        )
        .lock()
        .expect("the registry locks");
        let model = Arc::new(ProviderLike::new(
            vec![vec![("pay", json!({"amount": 8}))]],
            "Paid 8.",
        ));
        markov_executor::StandardExecutor::shared(model)
            .with_registry(Arc::new(registry), markov_policy::Mode::TEXT)
    };
    let (charter, _) = charter();
    let machine = markov_executor::Agent::on_charter_with_executor(
        charter.clone(),
        Arc::new(machine_parts()),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine");
    let mut session = DurableMachine::create(
        store.clone(),
        SessionId::new("stopped"),
        WorkerId::new("w"),
        machine,
    )
    .await
    .expect("created");
    session.machine().enqueue_user("pay 8");
    let failed = session.run().await;
    assert!(
        matches!(
            &failed,
            Err(markov_store::DurableError::Store(StoreError::Backend(_)))
        ),
        "the step could not be written: {failed:?}"
    );
    assert_eq!(lines(&effects), 1, "paid before the database stopped");
    drop(session);
    std::fs::write(dir.path("stopped-once"), "").expect("a flag");

    // The database comes back; the same store reconnects, and the session
    // is opened again as a restarted worker would.
    server.resume().expect("the server starts again");
    let mut session = DurableMachine::open(
        store.clone(),
        SessionId::new("stopped"),
        WorkerId::new("w"),
        &agent_on(&charter, Arc::new(machine_parts())),
    )
    .await
    .expect("opens");
    let last = session.run().await.expect("continues");
    assert!(last.done);
    assert_eq!(lines(&effects), 1, "paid once");
    assert_eq!(
        lines(&calls_file(&effects)),
        2,
        "the unrecorded call ran again, with the same idempotency key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_paused_by_one_worker_is_decided_and_resumed_by_another() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let dir = Dir::new("pg-paused");
    let paying = |model: Arc<dyn markov_core::model::Model>| {
        let registry = markov_policy::ToolRegistry::builder(markov_policy::PolicyConfig::new(
            markov_policy::Budget::UNLIMITED,
        ))
        .register(
            Pay(dir.path("effects")),
            markov_policy::ToolMetadata::new(markov_policy::Category::Action).with_confirmation(),
        )
        .register(
            Note,
            markov_policy::ToolMetadata::new(markov_policy::Category::Other),
        )
        .lock()
        .expect("the registry locks");
        markov_executor::StandardExecutor::shared(model)
            .with_registry(Arc::new(registry), markov_policy::Mode::TEXT)
    };
    let first_model = Arc::new(
        ScriptedModel::builder()
            .tool_calls([("note", json!({})), ("pay", json!({"amount": 4}))])
            .build()
            .fresh_call_ids(),
    );
    let (charter, _) = charter();
    let machine = markov_executor::Agent::on_charter_with_executor(
        charter.clone(),
        Arc::new(paying(first_model.clone())),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine builds");
    let one = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let mut first = DurableMachine::create(
        one,
        SessionId::new("paused"),
        WorkerId::new("first"),
        machine,
    )
    .await
    .expect("created");
    first.machine().enqueue_user("pay 4");
    let last = first.run().await.expect("runs");
    assert_eq!(
        last.yield_reason,
        markov_executor::YieldReason::AwaitingApproval
    );
    first.release().await.expect("released");

    let other = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let model = Arc::new(ScriptedModel::builder().text("Paid 4.").build());
    let mut second = DurableMachine::open(
        other.clone(),
        SessionId::new("paused"),
        WorkerId::new("second"),
        &agent_on(&charter, Arc::new(paying(model.clone()))),
    )
    .await
    .expect("opens");
    let pending = second.machine().approvals().pending();
    assert_eq!(pending.len(), 1);
    second
        .decide(
            &pending[0].request_id,
            markov_policy::Decision::Edit {
                args: json!({"amount": 3}),
            },
        )
        .await
        .expect("decided");
    let last = second.resume().await.expect("resumes");
    assert!(last.done);
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
    assert!(
        std::fs::read_to_string(dir.path("effects"))
            .unwrap_or_default()
            .starts_with("paid 3 "),
        "with the approved arguments"
    );
    assert_eq!(first_model.calls(), 1);
    assert_eq!(model.calls(), 1, "no extra round trip");
    assert_eq!(second.machine().instance().state()["notes"], 1);
    let expected = serialize_machine(second.machine())
        .expect("serializes")
        .into_owned();
    second.release().await.expect("released");
    let stored = other.load(&SessionId::new("paused")).await.expect("loads");
    assert_eq!(stored.snapshot, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_belong_to_their_owner_and_keys_are_kept_in_postgres() {
    let Some((_server, store)) = postgres().await else {
        return;
    };
    owners_and_keys_contract(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_sign_in_is_ended_for_every_worker_on_postgres_and_expired_ones_are_swept() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let first = PostgresStore::connect(&url).await.expect("connects");
    let second = PostgresStore::connect(&url).await.expect("connects");
    ended_sign_ins_contract(&first, &second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_database_written_before_sign_ins_were_ended_in_it_upgrades() {
    use markov_store::{ApiKeyRecord, KeyStore};
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let key = ApiKeyRecord {
        id: "k1".into(),
        principal: "alice".into(),
        roles: vec![],
        hash: "hash".into(),
        created_at: 1,
        revoked_at: None,
    };
    {
        let store = PostgresStore::connect(&url).await.expect("connects");
        store.add_key(&key).await.expect("added");
    }
    // The database as an earlier version left it: no such table.
    let (raw, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connects");
    let connection = tokio::spawn(connection);
    raw.batch_execute("DROP TABLE ended_sign_ins")
        .await
        .expect("the table is dropped");
    drop(raw);
    let _ = connection.await;

    let store = PostgresStore::connect(&url).await.expect("upgrades");
    assert_eq!(store.key("k1").await.expect("reads"), Some(key));
    assert!(!store.sign_in_ended("s").await.expect("reads"));
    store.end_sign_in("s", now_secs() + 60).await.expect("ends");
    assert!(store.sign_in_ended("s").await.expect("reads"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_guards_rewrite_and_block_are_what_postgres_keeps() {
    let Some((_server, store)) = postgres().await else {
        return;
    };
    let dir = Dir::new("pg-guarded-input");
    guarded_input_contract(store, &dir).await;
}
