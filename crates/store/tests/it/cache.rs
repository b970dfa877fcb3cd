//! Sessions kept in memory between leases: a released session at rest is
//! parked in a `SessionCache` and opened again from there — its history not
//! read back, its requests still one history for the provider's cache —
//! unless another worker wrote it meanwhile, it was restored over another
//! agent, or the cache had to make room. (Test builds also compare every
//! machine taken from the cache with the stored one.)

use std::num::NonZeroUsize;
use std::sync::Arc;

use crate::common::*;
use markov_executor::Agent;
use markov_store::{
    CreateOptions, DurableMachine, OpenOptions, SessionCache, SessionId, SqliteStore, Store,
    WorkerId,
};
use markov_testkit::ScriptedModel;

fn cache(capacity: usize) -> SessionCache {
    SessionCache::new(NonZeroUsize::new(capacity).expect("a capacity"), u64::MAX)
}

/// An agent of the payments charter on `model`.
fn agent(model: Arc<ScriptedModel>, dir: &Dir) -> Agent {
    let (charter, _) = charter();
    agent_on(
        &charter,
        Arc::new(executor(model, dir.path("effects"), dir.path("marker"))),
    )
}

/// Creates session `id` from `agent` and releases it.
async fn create(store: &Arc<SqliteStore>, id: &str, agent: &Agent) {
    DurableMachine::create(
        store.clone(),
        SessionId::new(id),
        WorkerId::new("creator"),
        agent.machine(),
    )
    .await
    .expect("created")
    .release()
    .await
    .expect("released");
}

/// Opens session `id` as `worker`, through `cache` if one is given.
async fn open(
    store: &Arc<SqliteStore>,
    id: &str,
    worker: &str,
    agent: &Agent,
    cache: Option<&SessionCache>,
) -> DurableMachine<SqliteStore> {
    let options = match cache {
        Some(cache) => OpenOptions::default().cache(cache.clone()),
        None => OpenOptions::default(),
    };
    DurableMachine::open_with(
        store.clone(),
        SessionId::new(id),
        WorkerId::new(worker),
        agent,
        options,
    )
    .await
    .expect("opened")
}

/// Sends `text` to session `id` as `worker` and releases it.
async fn turn(
    store: &Arc<SqliteStore>,
    id: &str,
    worker: &str,
    agent: &Agent,
    cache: Option<&SessionCache>,
    text: &str,
) {
    let mut session = open(store, id, worker, agent, cache).await;
    session.machine().enqueue_user(text);
    session.run().await.expect("the turn runs");
    session.release().await.expect("released");
}

/// The texts of the messages of session `id` as stored.
async fn stored_texts(store: &Arc<SqliteStore>, id: &str) -> Vec<String> {
    let stored = store.load(&SessionId::new(id)).await.expect("loads");
    stored.snapshot.history.iter().map(|m| m.text()).collect()
}

#[tokio::test]
async fn a_hot_session_opens_from_memory_and_its_requests_stay_one_history() {
    let dir = Dir::new("cache-hot");
    let store = store(&dir);
    let model = Arc::new(
        ScriptedModel::builder()
            .text("one")
            .text("two")
            .text("three")
            .build(),
    );
    let agent = agent(model.clone(), &dir);
    let cache = cache(8);
    create(&store, "hot", &agent).await;

    turn(&store, "hot", "w", &agent, Some(&cache), "first").await;
    assert!(
        cache.contains(&SessionId::new("hot")),
        "released at rest: parked"
    );
    turn(&store, "hot", "w", &agent, Some(&cache), "second").await;
    // Without the cache the session is read back: a new history.
    turn(&store, "hot", "w", &agent, None, "third").await;

    let ids: Vec<_> = model.requests().iter().map(|r| r.history_id).collect();
    assert_eq!(ids.len(), 3);
    assert!(ids.iter().all(Option::is_some), "{ids:?}");
    assert_eq!(
        ids[0], ids[1],
        "the second turn ran on the machine of the first"
    );
    assert_ne!(ids[1], ids[2], "a session read back is a new history");
    assert_eq!(
        stored_texts(&store, "hot").await,
        ["first", "one", "second", "two", "third", "three"]
    );
}

#[tokio::test]
async fn a_session_created_with_the_cache_opens_from_memory_at_its_first_message() {
    let dir = Dir::new("cache-created");
    let store = store(&dir);
    let model = Arc::new(ScriptedModel::builder().text("one").text("two").build());
    let agent = agent(model.clone(), &dir);
    let cache = cache(8);
    for id in ["kept", "other"] {
        DurableMachine::create_with(
            store.clone(),
            SessionId::new(id),
            WorkerId::new("w"),
            agent.machine(),
            CreateOptions::default().cache(cache.clone(), &agent),
        )
        .await
        .expect("created")
        .release()
        .await
        .expect("released");
    }
    assert!(
        cache.contains(&SessionId::new("kept")),
        "released at rest: parked"
    );

    let mut session = open(&store, "kept", "w", &agent, Some(&cache)).await;
    assert!(session.was_kept(), "its first message is not read back");
    session.machine().enqueue_user("first");
    session.run().await.expect("the turn runs");
    session.release().await.expect("released");
    assert_eq!(stored_texts(&store, "kept").await, ["first", "one"]);

    // Written by another worker since it was created: read again.
    turn(&store, "other", "b", &agent, None, "second").await;
    let session = open(&store, "other", "w", &agent, Some(&cache)).await;
    assert!(!session.was_kept(), "a stale machine is not taken");
    let texts: Vec<String> = session
        .machine()
        .history()
        .iter()
        .map(|m| m.text())
        .collect();
    assert_eq!(texts, ["second", "two"]);
    session.release().await.expect("released");
}

#[tokio::test]
async fn a_session_another_worker_wrote_is_read_again() {
    let dir = Dir::new("cache-stale");
    let store = store(&dir);
    let model = Arc::new(
        ScriptedModel::builder()
            .text("one")
            .text("two")
            .text("three")
            .build(),
    );
    let agent = agent(model.clone(), &dir);
    let cache = cache(8);
    create(&store, "shared", &agent).await;

    turn(&store, "shared", "a", &agent, Some(&cache), "first").await;
    assert!(cache.contains(&SessionId::new("shared")));
    // Another worker (a load balancer sent it the next message).
    turn(&store, "shared", "b", &agent, None, "second").await;
    // Back on the first worker: its parked machine is stale.
    let mut session = open(&store, "shared", "a", &agent, Some(&cache)).await;
    let texts: Vec<String> = session
        .machine()
        .history()
        .iter()
        .map(|m| m.text())
        .collect();
    assert_eq!(texts, ["first", "one", "second", "two"]);
    session.machine().enqueue_user("third");
    session.run().await.expect("the turn runs");
    session.release().await.expect("released");

    assert_eq!(
        stored_texts(&store, "shared").await,
        ["first", "one", "second", "two", "third", "three"]
    );
    let requests = model.requests();
    let third = requests.last().expect("three requests");
    assert_eq!(
        third.messages.len(),
        5,
        "the model saw the other worker's turn"
    );
    assert_ne!(requests[0].history_id, third.history_id);
}

#[tokio::test]
async fn only_a_session_at_rest_is_kept() {
    let dir = Dir::new("cache-rest");
    let store = store(&dir);
    let agent = agent(Arc::new(ScriptedModel::builder().build()), &dir);
    let cache = cache(8);
    create(&store, "busy", &agent).await;

    // Input queued and never run is not in the store: not parked.
    let session = open(&store, "busy", "w", &agent, Some(&cache)).await;
    session.machine().enqueue_user("unsent");
    session.release().await.expect("released");
    assert!(cache.is_empty());

    // A machine handed back to the caller is not parked either.
    let session = open(&store, "busy", "w", &agent, Some(&cache)).await;
    let machine = session.into_machine().await.expect("released");
    assert!(machine.history().is_empty());
    assert!(cache.is_empty());

    // At rest: parked; forgotten on demand.
    open(&store, "busy", "w", &agent, Some(&cache))
        .await
        .release()
        .await
        .expect("released");
    assert_eq!(cache.len(), 1);
    cache.forget(&SessionId::new("busy"));
    assert!(cache.is_empty());
}

#[tokio::test]
async fn the_least_recently_used_session_makes_room() {
    let dir = Dir::new("cache-lru");
    let store = store(&dir);
    let agent = agent(Arc::new(ScriptedModel::builder().build()), &dir);
    let cache = cache(2);
    for id in ["s1", "s2", "s3", "s4"] {
        create(&store, id, &agent).await;
    }
    let touch = |id: &'static str| {
        let (store, agent, cache) = (store.clone(), agent.clone(), cache.clone());
        async move {
            open(&store, id, "w", &agent, Some(&cache))
                .await
                .release()
                .await
                .expect("released");
        }
    };
    let held = |cache: &SessionCache| -> Vec<&str> {
        ["s1", "s2", "s3", "s4"]
            .into_iter()
            .filter(|id| cache.contains(&SessionId::new(*id)))
            .collect()
    };
    touch("s1").await;
    touch("s2").await;
    touch("s3").await;
    assert_eq!(held(&cache), ["s2", "s3"]);
    touch("s2").await;
    touch("s4").await;
    assert_eq!(held(&cache), ["s2", "s4"]);
}

/// The size of session `id`'s stored messages, each written as JSON.
async fn stored_bytes(store: &Arc<SqliteStore>, id: &str) -> u64 {
    let stored = store.load(&SessionId::new(id)).await.expect("loads");
    let len = |message| serde_json::to_vec(message).expect("a message writes").len() as u64;
    stored.snapshot.history.iter().map(len).sum()
}

/// Opens session `id` through `cache` and releases it at once.
async fn touch(store: &Arc<SqliteStore>, id: &str, agent: &Agent, cache: &SessionCache) {
    open(store, id, "w", agent, Some(cache))
        .await
        .release()
        .await
        .expect("released");
}

#[tokio::test]
async fn a_parked_session_weighs_its_history_as_stored() {
    let dir = Dir::new("cache-weight");
    let store = store(&dir);
    let model = Arc::new(ScriptedModel::builder().text("one").text("two").build());
    let agent = agent(model, &dir);
    let cache = cache(8);
    create(&store, "s", &agent).await;

    // Read from the store, then kept across a turn: the weight follows
    // what each step writes, and is what the store holds.
    turn(&store, "s", "w", &agent, Some(&cache), "first").await;
    assert_eq!(cache.bytes(), stored_bytes(&store, "s").await);
    turn(&store, "s", "w", &agent, Some(&cache), "second").await;
    let stored = stored_bytes(&store, "s").await;
    assert_eq!(cache.bytes(), stored);

    // Taken out while open: the cache holds nothing meanwhile.
    let session = open(&store, "s", "w", &agent, Some(&cache)).await;
    assert_eq!(cache.bytes(), 0);
    session.release().await.expect("released");
    assert_eq!(cache.bytes(), stored);

    // Another worker's cache reads the session back and weighs it whole.
    let other = cache_of_bytes(u64::MAX);
    touch(&store, "s", &agent, &other).await;
    assert_eq!(other.bytes(), stored);
    cache.forget(&SessionId::new("s"));
    assert_eq!(cache.bytes(), 0);
}

fn cache_of_bytes(max_bytes: u64) -> SessionCache {
    SessionCache::new(NonZeroUsize::new(8).expect("a capacity"), max_bytes)
}

#[tokio::test]
async fn the_histories_bytes_bound_the_cache() {
    let dir = Dir::new("cache-bytes");
    let store = store(&dir);
    let model = Arc::new(ScriptedModel::builder().text("short").text("long").build());
    let agent = agent(model, &dir);
    for id in ["small", "big"] {
        create(&store, id, &agent).await;
    }
    turn(&store, "small", "w", &agent, None, "hi").await;
    turn(&store, "big", "w", &agent, None, &"x".repeat(4000)).await;
    let (small, big) = (
        stored_bytes(&store, "small").await,
        stored_bytes(&store, "big").await,
    );
    assert!(big > 4000 && small < 1000, "{big} against {small}");

    // Room for the big history, not for both: the least recently used
    // makes room, though the count would allow eight.
    let cache = cache_of_bytes(big + small - 1);
    touch(&store, "big", &agent, &cache).await;
    assert!(cache.contains(&SessionId::new("big")));
    touch(&store, "small", &agent, &cache).await;
    assert!(cache.contains(&SessionId::new("small")));
    assert!(!cache.contains(&SessionId::new("big")), "made room");
    assert_eq!(cache.bytes(), small);

    // A history larger than the whole budget is not kept, and pushes
    // nothing out.
    let cache = cache_of_bytes(big - 1);
    touch(&store, "small", &agent, &cache).await;
    touch(&store, "big", &agent, &cache).await;
    assert!(!cache.contains(&SessionId::new("big")));
    assert!(cache.contains(&SessionId::new("small")));
    assert_eq!(cache.bytes(), small);
}

#[tokio::test]
async fn a_session_opened_by_another_agent_is_read_again() {
    let dir = Dir::new("cache-agent");
    let store = store(&dir);
    let model = Arc::new(ScriptedModel::builder().text("one").text("two").build());
    let first = agent(model.clone(), &dir);
    // Built alike, but not the same agent: its tools may differ.
    let second = agent(model.clone(), &dir);
    let cache = cache(8);
    create(&store, "agents", &first).await;

    turn(&store, "agents", "w", &first, Some(&cache), "first").await;
    turn(&store, "agents", "w", &second, Some(&cache), "second").await;

    let ids: Vec<_> = model.requests().iter().map(|r| r.history_id).collect();
    assert_ne!(ids[0], ids[1]);
    assert_eq!(
        stored_texts(&store, "agents").await,
        ["first", "one", "second", "two"]
    );
}
