//! The store calls one user message costs, and what stays durable when a
//! run's last write also gives up the lease.
//!
//! Every call below is a job handed to the SQLite writer thread (a
//! database in memory reads on that thread too), so the count of calls is
//! the count of hand-offs a message pays.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_store::{
    DurableMachine, OpenOptions, SessionCache, SessionId, SqliteStore, Store, StoreError, WorkerId,
};
use markov_testkit::ScriptedModel;

/// A store that names every call it passes on, and fails the calls of one
/// kind as a worker that died just before them would leave the database:
/// unwritten.
fn counted(fail: Option<&'static str>) -> Watched {
    Watched::new(SqliteStore::in_memory().expect("a database"), move |call| {
        if fail == Some(call.name()) {
            Then::Fail(StoreError::Backend(format!(
                "the worker died before {}",
                call.name()
            )))
        } else {
            Then::Pass
        }
    })
}

fn cache() -> SessionCache {
    SessionCache::new(std::num::NonZeroUsize::new(8).expect("room"), u64::MAX)
}

/// Sends `text` to session `id` as the server does (the machine kept in
/// `cache` between messages), giving up the lease with the run's last
/// write when `fold` is set, and returns the store calls it made.
async fn message(
    store: &Arc<Watched>,
    agent: &markov_executor::Agent,
    cache: &SessionCache,
    text: &str,
    fold: bool,
) -> Vec<&'static str> {
    store.take_calls();
    let mut session = DurableMachine::open_with(
        store.clone(),
        SessionId::new("s"),
        WorkerId::new("w"),
        agent,
        OpenOptions::default().cache(cache.clone()),
    )
    .await
    .expect("opened");
    let kept = session.was_kept();
    session.machine().enqueue_user(text);
    if fold {
        session.release_with_run();
    }
    session.run().await.expect("the turn runs");
    session.release().await.expect("released");
    // Test builds read a machine taken from the cache back from the store
    // to compare the two: that read is left out, the open says whether
    // the session was read back.
    let mut calls = store.take_calls();
    calls.retain(|call| *call != "load");
    if !kept {
        calls.insert(1, "load");
    }
    calls
}

#[tokio::test]
async fn a_message_whose_run_gives_up_the_lease_with_its_last_write_makes_three_store_calls() {
    let dir = Dir::new("handoffs-count");
    let model = Arc::new(
        ScriptedModel::builder()
            .text("one")
            .text("two")
            .text("three")
            .build(),
    );
    let (charter, _) = charter();
    let agent = agent_on(
        &charter,
        Arc::new(executor(model, dir.path("effects"), dir.path("marker"))),
    );
    let store = Arc::new(counted(None));
    DurableMachine::create(
        store.clone(),
        SessionId::new("s"),
        WorkerId::new("w"),
        agent.machine(),
    )
    .await
    .expect("created")
    .release()
    .await
    .expect("released");
    let cache = cache();

    // The first message reads the session back; the next find it parked.
    assert_eq!(
        message(&store, &agent, &cache, "first", true).await,
        ["acquire", "load", "append", "append_and_release"]
    );
    // Separately: the lease, the message with the run marked in
    // progress, the answer with the run ended, the lease given up.
    assert_eq!(
        message(&store, &agent, &cache, "second", false).await,
        ["acquire", "append", "append", "release"]
    );
    // Folded: the answer, the run ended and the lease given up in one.
    assert_eq!(
        message(&store, &agent, &cache, "third", true).await,
        ["acquire", "append", "append_and_release"]
    );

    let stored = store.load(&SessionId::new("s")).await.expect("loads");
    let texts: Vec<String> = stored.snapshot.history.iter().map(|m| m.text()).collect();
    assert_eq!(texts, ["first", "one", "second", "two", "third", "three"]);
    assert!(stored.run.is_none(), "no run left in progress");
    // Given up: another worker takes the session at once.
    store
        .acquire(
            &SessionId::new("s"),
            &WorkerId::new("other"),
            Duration::from_secs(5),
        )
        .await
        .expect("the lease is free");
    assert!(
        cache.contains(&SessionId::new("s")),
        "released at rest after the folded write: parked"
    );
}

#[tokio::test]
async fn a_worker_that_dies_before_the_folded_write_leaves_the_message_and_a_run_to_continue() {
    let dir = Dir::new("handoffs-crash");
    let model = Arc::new(ScriptedModel::builder().text("lost").text("again").build());
    let (charter, _) = charter();
    let agent = agent_on(
        &charter,
        Arc::new(executor(
            model.clone(),
            dir.path("effects"),
            dir.path("marker"),
        )),
    );
    let store = Arc::new(counted(Some("append_and_release")));
    DurableMachine::create(
        store.clone(),
        SessionId::new("s"),
        WorkerId::new("dead"),
        agent.machine(),
    )
    .await
    .expect("created")
    .release()
    .await
    .expect("released");

    let mut session = DurableMachine::open_with(
        store.clone(),
        SessionId::new("s"),
        WorkerId::new("dead"),
        &agent,
        OpenOptions::default().lease(Duration::from_millis(300)),
    )
    .await
    .expect("opened");
    session.machine().enqueue_user("hello");
    session.release_with_run();
    session
        .run()
        .await
        .expect_err("the worker dies before its last write");
    // Dead: it never releases.
    drop(session);

    let stored = store.load(&SessionId::new("s")).await.expect("loads");
    let texts: Vec<String> = stored.snapshot.history.iter().map(|m| m.text()).collect();
    assert_eq!(texts, ["hello"], "the message was stored before the call");
    assert!(stored.run.is_some(), "the run is left in progress");

    // Another worker takes the session once the dead one's lease expires
    // and continues the run: the message is answered, once.
    let mut waited = Duration::ZERO;
    let mut session = loop {
        match DurableMachine::open(
            store.clone(),
            SessionId::new("s"),
            WorkerId::new("next"),
            &agent,
        )
        .await
        {
            Ok(session) => break session,
            Err(markov_store::DurableError::Store(StoreError::Leased { .. }))
                if waited < Duration::from_secs(5) =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
                waited += Duration::from_millis(50);
            }
            Err(e) => panic!("cannot open the session: {e}"),
        }
    };
    assert!(session.is_interrupted(), "a run to continue");
    session.run().await.expect("the run is continued");
    session.release().await.expect("released");

    let stored = store.load(&SessionId::new("s")).await.expect("loads");
    let texts: Vec<String> = stored.snapshot.history.iter().map(|m| m.text()).collect();
    assert_eq!(texts, ["hello", "again"]);
    assert!(stored.run.is_none());
    assert_eq!(model.requests().len(), 2, "the lost answer is asked again");
}
