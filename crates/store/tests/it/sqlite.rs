//! The SQLite store: round trips, byte-identical restores, leases and
//! approvals (the crash tests are in `exactly_once`).

use std::sync::Arc;

use crate::common::*;
use markov_core::model::{ModelResponse, StopReason};
use markov_core::{Item, Message};
use markov_executor::{Agent, Executor, RunOptions, SerializedMachine, serialize_machine};
use markov_policy::{
    ApprovalId, ApprovalStatus, Budget, Category, Mode, PolicyConfig, ToolMetadata, ToolRegistry,
};
use markov_policy::{IdempotencyLedger, RecordedAnswer};
use markov_store::{
    DurableError, DurableMachine, KeyStore, SessionId, SqliteStore, Store, StoreError, WorkerId,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

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
        let last = session.run().await.expect("runs");
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
    assert!(
        stored.snapshot.policy.ledger.is_empty(),
        "a finished turn leaves no answered call to replay: {:?}",
        stored.snapshot.policy.ledger
    );
    assert_eq!(
        stored.snapshot.policy.repeats, expected.policy.repeats,
        "the loop guard's counts"
    );
    assert_eq!(expected.policy.repeats.len(), 1, "the last turn's one note");
    assert!(stored.run.is_none(), "no run in progress");
    assert_eq!(stored.info.messages, expected.history.len() as u64);
    assert_eq!(stored.snapshot.instance.state, json!({"notes": 2}));

    let listed = store.list(None).await.expect("lists");
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
    session.run().await.expect("runs");
    let kept = session.into_machine().await.expect("released");

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
    let never_stopped_snapshot = serialize_machine(&kept).expect("serializes").into_owned();
    let (charter, _) = charter();
    let mut never_stopped = Agent::on_charter_with_executor(
        charter.clone(),
        Arc::new(executor(
            never_stopped_model.clone(),
            dir.path("effects"),
            dir.path("m"),
        )),
    )
    .state(json!({"notes": 0}))
    .build()
    .expect("the agent builds")
    .restore(never_stopped_snapshot)
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
        &agent_on(&charter, executor),
    )
    .await
    .expect("opens");

    never_stopped.enqueue_user("note it");
    markov_executor::run_to_completion(&mut never_stopped, RunOptions::default())
        .await
        .expect("runs");
    restored.machine().enqueue_user("note it");
    restored.run().await.expect("runs");
    // The same requests, but of two machines: two histories.
    let of_any_history = |requests: Vec<markov_testkit::RecordedRequest>| {
        requests
            .into_iter()
            .map(|r| markov_testkit::RecordedRequest {
                history_id: None,
                ..r
            })
            .collect::<Vec<_>>()
    };
    let a = of_any_history(never_stopped_model.requests());
    let b = of_any_history(restored_model.requests());
    assert_eq!(a.len(), 2);
    assert_eq!(a, b, "byte for byte the same requests");
    assert_eq!(
        serde_json::to_string(&a[0].messages).expect("json"),
        serde_json::to_string(&b[0].messages).expect("json")
    );
}

#[tokio::test]
async fn a_machine_taken_out_of_the_store_runs_its_next_tool_step_in_memory() {
    let dir = Dir::new("into-machine");
    let store = store(&dir);
    let id = SessionId::new("s");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("a"),
        machine(Arc::new(two_turns()), &dir),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("pay 3");
    assert!(session.run().await.expect("runs").done);
    let stored_before = store.load(&id).await.expect("loads").info.messages;
    let mut kept = session.into_machine().await.expect("released");

    // The second turn's first step calls a tool: it runs, with no lease.
    kept.enqueue_user("note it");
    let last = kept.run().await.expect("the tool step runs in memory");
    assert!(last.done);
    let snapshot = serialize_machine(&kept).expect("serializes");
    assert_eq!(snapshot.instance.state, json!({"notes": 2}));
    // Nothing of it reached the store, which another worker may lease.
    assert_eq!(
        store.load(&id).await.expect("loads").info.messages,
        stored_before
    );
    DurableMachine::open(store, id, WorkerId::new("b"), &agent_for(&dir))
        .await
        .expect("another worker takes the session");
}

fn agent_for(dir: &Dir) -> Agent {
    let (charter, _) = charter();
    let model: Arc<dyn markov_core::Model> = Arc::new(ScriptedModel::builder().build());
    agent_on(
        &charter,
        Arc::new(executor(model, dir.path("effects"), dir.path("m"))),
    )
}

/// Every number of a session reads back as the double it was written as:
/// tool-call arguments in the history, in the answers of the step in
/// flight and in the ledger, and the instance's state. (An argument one
/// digit off no longer matches the digest a ledger stub keeps of it.)
#[test]
fn every_float_of_a_session_reads_back_bit_identical() {
    use proptest::prelude::*;
    let dir = Dir::new("floats");
    let store = store(&dir);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let session = std::sync::atomic::AtomicU64::new(0);
    let finite = any::<f64>().prop_filter("JSON numbers are finite", |x| x.is_finite());
    proptest!(ProptestConfig::with_cases(64), |(x in finite)| {
        let n = session.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = SessionId::new(format!("s{n}"));
        let holder = WorkerId::new("w");
        let number = json!({"x": x});
        let call = Message::assistant_items(vec![Item::tool_use("c1", "pay", number.clone())]);
        let mut snapshot = serialize_machine(&machine_for_dir(&dir))
            .expect("serializes")
            .into_owned();
        snapshot.instance.state = number.clone();
        snapshot.history.push(Message::user("pay"));
        snapshot.history.push(call);
        let answer = RecordedAnswer {
            instance: snapshot.instance.id.clone(),
            history_len: 1,
            response: ModelResponse::new(
                vec![Item::tool_use("c2", "pay", number.clone())],
                StopReason::ToolUse,
            ),
            paused: false,
        };
        // An answered call of the answer in flight (the ledger keeps no
        // other across a load).
        let key = IdempotencyLedger::key_of(1, Some(&answer.instance), &"c2".into());
        snapshot.policy.turn = 1;
        snapshot.policy.answers.push(answer.clone());
        snapshot.policy.ledger.push(
            serde_json::from_value(json!({
                "key": key, "tool": "pay", "args": number,
                "result": {"content": "paid", "isError": false},
                "recordedAt": 0, "turn": 1,
            }))
            .expect("a ledger entry"),
        );
        let stored = runtime.block_on(async {
            let borrowed = SerializedMachine {
                format_version: snapshot.format_version,
                instance: snapshot.instance.clone(),
                history: &snapshot.history[..],
                policy: snapshot.policy.clone(),
                usage: snapshot.usage,
            };
            store
                .create(&id, None, "payments", &borrowed, &holder, std::time::Duration::from_secs(60))
                .await
                .expect("created");
            store
                .journal_answers(&id, &holder, std::slice::from_ref(&answer))
                .await
                .expect("journaled");
            store.load(&id).await.expect("loads")
        });
        let bits = |value: &serde_json::Value| value["x"].as_f64().map(f64::to_bits);
        let want = Some(x.to_bits());
        prop_assert_eq!(bits(&stored.snapshot.instance.state), want, "the state");
        let args = stored.snapshot.history.iter().flat_map(|m| m.tool_uses()).map(|(_, _, a)| bits(a)).collect::<Vec<_>>();
        prop_assert_eq!(args, vec![want], "the history's call");
        prop_assert_eq!(bits(&stored.snapshot.policy.ledger[0].args), want, "the ledger");
        let answered = stored.snapshot.policy.answers[0].response.tool_calls().map(|(_, _, a)| bits(a)).collect::<Vec<_>>();
        prop_assert_eq!(answered, vec![want], "the answer in flight");
    });
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
    let (charter, _) = charter();
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
    let machine = markov_executor::Agent::on_charter_with_executor(
        charter,
        Arc::new(
            markov_executor::StandardExecutor::shared(model)
                .with_registry(Arc::new(registry), Mode::TEXT),
        ),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine");
    let id = SessionId::new("approve");
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), WorkerId::new("w"), machine)
            .await
            .expect("created");
    session.machine().enqueue_user("pay 9");
    session.run().await.expect("runs");
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

#[tokio::test]
async fn sessions_belong_to_their_owner_and_keys_are_kept_hashed() {
    let dir = Dir::new("owners-sqlite");
    owners_and_keys_contract(store(&dir)).await;
}

#[tokio::test]
async fn usage_survives_reopening_the_database() {
    let dir = Dir::new("usage-reopen");
    let (id, total) = usage_contract(store(&dir), &dir).await;
    // Another process opens the same file.
    let reopened = store(&dir);
    let stored = reopened.load(&id).await.expect("loads");
    assert_eq!(stored.snapshot.usage, total);
}

#[tokio::test]
async fn a_database_written_before_usage_was_kept_opens_and_keeps_it_from_then_on() {
    let dir = Dir::new("usage-migration");
    let agent = metered_agent(&dir, &[("one", 1_000, 0)]);
    let id = SessionId::new("old");
    {
        let store = store(&dir);
        let session = DurableMachine::create(
            store.clone(),
            id.clone(),
            WorkerId::new("w"),
            agent.machine(),
        )
        .await
        .expect("created");
        session.release().await.expect("released");
    }
    // The database as an earlier version left it: no usage column.
    let raw = rusqlite::Connection::open(dir.path("sessions.db")).expect("opens");
    raw.execute_batch("ALTER TABLE sessions DROP COLUMN usage")
        .expect("the column is dropped");
    drop(raw);

    let store = store(&dir);
    let stored = store.load(&id).await.expect("an old session loads");
    assert!(stored.snapshot.usage.is_empty());
    let mut session = DurableMachine::open(store.clone(), id.clone(), WorkerId::new("w"), &agent)
        .await
        .expect("opens");
    session.machine().enqueue_user("hello");
    session.run().await.expect("runs");
    let used = *session.machine().usage();
    assert_eq!(used.session.requests, 1);
    session.release().await.expect("released");
    assert_eq!(store.load(&id).await.expect("loads").snapshot.usage, used);
}

#[tokio::test]
async fn a_tool_results_images_survive_the_store() {
    use markov_core::message::ImageData;
    let dir = Dir::new("images");
    let store = store(&dir);
    let id = SessionId::new("images");
    let holder = WorkerId::new("w");
    let mut snapshot = serialize_machine(&machine_for_dir(&dir))
        .expect("serializes")
        .into_owned();
    let result = Item::tool_result_with_images(
        "c1",
        "the chart",
        Some(false),
        vec![ImageData::new("image/png", "iVBORw0KGgo=")],
    );
    snapshot.history.push(Message::user("chart it"));
    snapshot
        .history
        .push(Message::assistant_items(vec![Item::tool_use(
            "c1",
            "chart",
            json!({}),
        )]));
    snapshot
        .history
        .push(Message::user_items(vec![result.clone()]));
    let borrowed = SerializedMachine {
        format_version: snapshot.format_version,
        instance: snapshot.instance.clone(),
        history: &snapshot.history[..],
        policy: snapshot.policy.clone(),
        usage: snapshot.usage,
    };
    store
        .create(
            &id,
            None,
            "charts",
            &borrowed,
            &holder,
            std::time::Duration::from_secs(60),
        )
        .await
        .expect("created");
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(stored.snapshot.history, snapshot.history);
    assert_eq!(
        stored
            .snapshot
            .history
            .last()
            .map(|m| m.item_list().to_vec()),
        Some(vec![result])
    );
}

#[tokio::test]
async fn an_ended_sign_in_is_ended_for_every_handle_on_the_file_and_expired_ones_are_swept() {
    let dir = Dir::new("ended-sign-ins");
    ended_sign_ins_contract(&*store(&dir), &*store(&dir)).await;
    // In memory, the writer's connection answers the reads.
    let memory = SqliteStore::in_memory().expect("a database");
    ended_sign_ins_contract(&memory, &memory).await;
    // After a restart.
    assert!(store(&dir).sign_in_ended("a").await.expect("reads"));
}

#[tokio::test]
async fn a_database_written_before_sign_ins_were_ended_in_it_opens_and_ends_them() {
    use markov_store::ApiKeyRecord;
    let dir = Dir::new("ended-sign-ins-migration");
    let key = ApiKeyRecord {
        id: "k1".into(),
        principal: "alice".into(),
        roles: vec![],
        hash: "hash".into(),
        created_at: 1,
        revoked_at: None,
    };
    store(&dir).add_key(&key).await.expect("added");
    // The database as an earlier version left it: no such table.
    let raw = rusqlite::Connection::open(dir.path("sessions.db")).expect("opens");
    raw.execute_batch("DROP TABLE ended_sign_ins")
        .expect("the table is dropped");
    drop(raw);

    let store = store(&dir);
    assert_eq!(store.key("k1").await.expect("reads"), Some(key));
    assert!(!store.sign_in_ended("s").await.expect("reads"));
    store.end_sign_in("s", now_secs() + 60).await.expect("ends");
    assert!(store.sign_in_ended("s").await.expect("reads"));
}

#[tokio::test]
async fn an_input_guards_rewrite_and_block_are_what_sqlite_keeps() {
    let dir = Dir::new("sqlite-guarded-input");
    guarded_input_contract(store(&dir), &dir).await;
}

/// Whether `table` of the database at `path` is `WITHOUT ROWID`.
fn without_rowid(path: &std::path::Path, table: &str) -> bool {
    let raw = rusqlite::Connection::open(path).expect("opens");
    raw.query_row(
        "SELECT wr FROM pragma_table_list WHERE schema = 'main' AND name = ?1",
        [table],
        |r| r.get(0),
    )
    .expect("the table is there")
}

#[tokio::test]
async fn a_database_whose_body_tables_are_without_rowid_is_rebuilt_once_and_keeps_every_row() {
    let dir = Dir::new("rowid-migration");
    let long = "a paragraph of the user's, long enough to spill out of a b-tree cell. ".repeat(40);
    let agent = metered_agent(&dir, &[("one", 1_000, 0), ("two", 1_000, 0)]);
    let id = SessionId::new("old");
    let (history, steps) = {
        let store = store(&dir);
        let mut session = DurableMachine::create(
            store.clone(),
            id.clone(),
            WorkerId::new("w"),
            agent.machine(),
        )
        .await
        .expect("created");
        session.machine().enqueue_user(long.as_str());
        session.run().await.expect("runs");
        session.release().await.expect("released");
        let stored = store.load(&id).await.expect("loads");
        let steps = store.steps(&id, 0, 100).await.expect("steps");
        assert!(!steps.is_empty(), "the turn's step was recorded");
        (stored.snapshot.history, steps)
    };
    // The database as an earlier version left it: the tables that hold
    // bodies were WITHOUT ROWID.
    let path = dir.path("sessions.db");
    let raw = rusqlite::Connection::open(&path).expect("opens");
    raw.execute_batch(
        "BEGIN;
         CREATE TABLE messages_old (session_id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (session_id, seq)) WITHOUT ROWID;
         INSERT INTO messages_old SELECT * FROM messages; DROP TABLE messages; ALTER TABLE messages_old RENAME TO messages;
         CREATE TABLE step_traces_old (session_id TEXT NOT NULL, idx INTEGER NOT NULL, recorded_at INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (session_id, idx)) WITHOUT ROWID;
         INSERT INTO step_traces_old SELECT * FROM step_traces; DROP TABLE step_traces; ALTER TABLE step_traces_old RENAME TO step_traces;
         CREATE INDEX step_traces_age ON step_traces (recorded_at);
         CREATE TABLE step_contents_old (hash TEXT PRIMARY KEY, body TEXT NOT NULL) WITHOUT ROWID;
         INSERT INTO step_contents_old SELECT * FROM step_contents; DROP TABLE step_contents; ALTER TABLE step_contents_old RENAME TO step_contents;
         CREATE TABLE team_states_old (session_id TEXT PRIMARY KEY, body TEXT NOT NULL) WITHOUT ROWID;
         DROP TABLE team_states; ALTER TABLE team_states_old RENAME TO team_states;
         COMMIT;",
    )
    .expect("the old tables");
    drop(raw);
    for table in ["messages", "step_traces", "step_contents", "team_states"] {
        assert!(
            without_rowid(&path, table),
            "{table} is as an earlier version made it"
        );
    }

    let store = store(&dir);
    for table in ["messages", "step_traces", "step_contents", "team_states"] {
        assert!(!without_rowid(&path, table), "{table} was rebuilt");
    }
    let raw = rusqlite::Connection::open(&path).expect("opens");
    let age_index: i64 = raw
        .query_row(
            "SELECT COUNT(*) FROM sqlite_schema WHERE type = 'index' AND name = 'step_traces_age'",
            [],
            |r| r.get(0),
        )
        .expect("counted");
    assert_eq!(age_index, 1, "the traces' age index is back");
    drop(raw);
    let stored = store.load(&id).await.expect("an old session loads");
    assert_eq!(stored.snapshot.history, history, "every message, in order");
    assert_eq!(
        store.steps(&id, 0, 100).await.expect("steps"),
        steps,
        "every step"
    );
    let mut session = DurableMachine::open(store.clone(), id.clone(), WorkerId::new("w"), &agent)
        .await
        .expect("opens");
    session.machine().enqueue_user(long.as_str());
    session.run().await.expect("runs on");
    session.release().await.expect("released");
    assert_eq!(
        store.load(&id).await.expect("loads").snapshot.history.len(),
        history.len() + 2
    );
    assert_eq!(
        store.steps(&id, 0, 100).await.expect("steps").len(),
        steps.len() + 1
    );
    // Opened again: nothing left to rebuild, nothing changes.
    drop(store);
    let again = self::store(&dir);
    assert_eq!(
        again.load(&id).await.expect("loads").snapshot.history.len(),
        history.len() + 2
    );
}
