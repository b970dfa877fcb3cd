//! The Postgres store when its database goes away: the real server this
//! binary starts is stopped and started again under a store that stays
//! the same value, which must reconnect by itself, and answer with a typed
//! error, never a hang, while the server is down.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use markov_core::Message;
use markov_executor::serialize_machine;
use markov_store::testing::{Shutdown, TempPostgres};
use markov_store::{PostgresStore, SessionId, Store, StoreError, WorkerId};
use markov_testkit::ScriptedModel;

/// Creates session `id`, leased to `holder` for a minute.
async fn create(store: &PostgresStore, id: &SessionId, holder: &WorkerId, dir: &Dir) {
    let model = Arc::new(ScriptedModel::builder().build());
    let machine = machine(model, dir);
    let snapshot = serialize_machine(&machine).expect("serializes");
    store
        .create(
            id,
            None,
            "payments",
            &snapshot,
            holder,
            Duration::from_secs(60),
        )
        .await
        .expect("created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_reconnects_after_the_server_restarts() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let store = PostgresStore::connect(&url).await.expect("connects");
    let dir = Dir::new("pg-restart");
    let id = SessionId::new("restarted");
    let worker = WorkerId::new("w");
    create(&store, &id, &worker, &dir).await;
    let before = store.load(&id).await.expect("loads").snapshot.history.len();

    for (n, mode) in [Shutdown::Fast, Shutdown::Immediate]
        .into_iter()
        .enumerate()
    {
        // Several calls at once, so that more than one connection is open
        // (and dies) when the store pools them.
        let (a, b, c) = tokio::join!(store.load(&id), store.list(None), store.load(&id));
        a.expect("loads");
        b.expect("lists");
        c.expect("loads");

        server.restart(mode).expect("the server restarts");

        let text = format!("after restart {n}");
        store
            .append(&id, &worker, bare_step(&[Message::user(text.as_str())]))
            .await
            .unwrap_or_else(|e| panic!("appends after a {mode:?} restart: {e}"));
        let loaded = store.load(&id).await.expect("loads after the restart");
        assert_eq!(loaded.snapshot.history.len(), before + n + 1);
        assert_eq!(
            loaded.snapshot.history.last(),
            Some(&Message::user(text.as_str()))
        );
        store
            .acquire(&id, &worker, Duration::from_secs(60))
            .await
            .expect("renews its lease after the restart");
        assert_eq!(store.list(None).await.expect("lists").len(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_while_the_server_is_down_fails_at_once_and_works_after_the_start() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let store = PostgresStore::connect(&url).await.expect("connects");
    let dir = Dir::new("pg-down");
    let id = SessionId::new("down");
    let worker = WorkerId::new("w");
    create(&store, &id, &worker, &dir).await;

    server.stop(Shutdown::Immediate).expect("the server stops");
    // Well within the store's wait for a connection: a refused connection
    // is an error now, not after the wait.
    let bound = Duration::from_secs(4);
    let started = Instant::now();
    let down = tokio::time::timeout(bound, store.load(&id))
        .await
        .expect("a call while the server is down returns");
    assert!(
        matches!(down, Err(StoreError::Backend(_))),
        "a typed backend error: {down:?}"
    );
    let down = tokio::time::timeout(
        bound,
        store.append(&id, &worker, bare_step(&[Message::user("lost")])),
    )
    .await
    .expect("a write while the server is down returns");
    assert!(
        matches!(down, Err(StoreError::Backend(_))),
        "a typed backend error: {down:?}"
    );
    assert!(started.elapsed() < bound);

    server.resume().expect("the server starts again");
    store
        .append(&id, &worker, bare_step(&[Message::user("back")]))
        .await
        .expect("appends once the server is back");
    let loaded = store
        .load(&id)
        .await
        .expect("loads once the server is back");
    assert_eq!(loaded.snapshot.history.last(), Some(&Message::user("back")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_connection_is_bounded() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let wait = Duration::from_millis(300);
    let store = Arc::new(
        PostgresStore::connect_with(&url, 1, wait)
            .await
            .expect("connects"),
    );
    let dir = Dir::new("pg-wait");
    let id = SessionId::new("busy");
    let worker = WorkerId::new("w");
    create(&store, &id, &worker, &dir).await;

    // Another client locks the session's row, so that the store's append
    // holds its only connection until that client commits.
    let (mut other, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("another client connects");
    let driver = tokio::spawn(connection);
    let tx = other.transaction().await.expect("begins");
    tx.query_one(
        "SELECT id FROM sessions WHERE id = $1 FOR UPDATE",
        &[&id.as_str()],
    )
    .await
    .expect("locks the row");
    let writer = {
        let (store, id, worker) = (store.clone(), id.clone(), worker.clone());
        tokio::spawn(async move {
            store
                .append(&id, &worker, bare_step(&[Message::user("waited")]))
                .await
        })
    };
    // Until the append is seen waiting for the lock (so holding the
    // connection): a lock request not granted.
    let mut blocked = false;
    for _ in 0..100 {
        let waiting: i64 = tx
            .query_one("SELECT count(*) FROM pg_locks WHERE NOT granted", &[])
            .await
            .expect("reads the locks")
            .get(0);
        if waiting > 0 {
            blocked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(blocked, "the append waits for the row lock");

    let started = Instant::now();
    let waited = tokio::time::timeout(Duration::from_secs(5), store.load(&id))
        .await
        .expect("the wait is bounded");
    let elapsed = started.elapsed();
    match waited {
        Err(StoreError::Backend(message)) => assert!(
            message.contains("timed out after 300ms"),
            "the error names the wait: {message}"
        ),
        other => panic!("a timeout, not {other:?}"),
    }
    assert!(
        elapsed >= wait && elapsed < Duration::from_secs(2),
        "failed after the wait, {elapsed:?}"
    );

    tx.commit().await.expect("commits");
    writer
        .await
        .expect("the writer task ends")
        .expect("the append goes through once the row is free");
    assert_eq!(
        store
            .load(&id)
            .await
            .expect("loads")
            .snapshot
            .history
            .last(),
        Some(&Message::user("waited"))
    );
    drop(other);
    let _ = driver.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_of_no_connections_is_refused() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    assert!(matches!(
        PostgresStore::connect_with(&url, 0, Duration::from_secs(1)).await,
        Err(StoreError::Backend(_))
    ));
}
