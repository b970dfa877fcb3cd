//! Machines for the store's tests: a payments node whose tools go through a
//! registry, so answered calls land in the idempotency ledger; and the
//! child processes the crash tests run and kill.

#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::Item;
use markov_core::async_trait;
use markov_core::model::{Model, ModelResponse, StopReason};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Machine, StandardExecutor};
use markov_policy::{Budget, Category, Mode, PolicyConfig, ToolMetadata, ToolRegistry};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

mod watched;
pub use watched::{Call, Then, Watched};

#[derive(Debug, Deserialize, JsonSchema)]
pub struct PayArgs {
    pub amount: u32,
}

/// Pays, as a payment provider would: the payment is one line in a file
/// (a side effect another process can count), deduplicated by the call's
/// idempotency key like a provider's idempotency header. Every execution of
/// the tool, deduplicated or not, is a line of `<file>.calls`. With
/// `MARKOV_HANG_AFTER_PAY` set, it hangs right after paying (before its
/// result is recorded): the moment to kill the process.
pub struct Pay(pub PathBuf);

#[async_trait]
impl Tool for Pay {
    const NAME: &'static str = "pay";
    type Args = PayArgs;
    type Output = String;
    type Error = std::io::Error;
    fn description(&self) -> String {
        "Pay an amount".into()
    }
    async fn call(&self, args: PayArgs, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let key = cx.idempotency_key().unwrap_or("no key").to_owned();
        append(&calls_file(&self.0), &format!("call {key}"))?;
        let paid = std::fs::read_to_string(&self.0).unwrap_or_default();
        if !paid.lines().any(|line| line.ends_with(&key)) {
            append(&self.0, &format!("paid {} {key}", args.amount))?;
        }
        if std::env::var_os("MARKOV_HANG_AFTER_PAY").is_some() {
            let _ = std::fs::write(self.0.with_file_name("marker"), "paid, hanging");
            std::future::pending::<()>().await;
        }
        Ok(format!("paid {}", args.amount))
    }
}

/// Where [`Pay`] counts its executions.
pub fn calls_file(effects: &std::path::Path) -> PathBuf {
    effects.with_extension("calls")
}

fn append(path: &std::path::Path, line: &str) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    writeln!(file, "{line}")?;
    file.sync_all()
}

/// Answers as a real provider does: the same conversation gets the same
/// tool calls, with new ids every time it is asked (Anthropic and OpenAI
/// never repeat an id). `steps[n]` is what it calls after `n` of its own
/// answers since the last user text; once they are used up it replies with
/// text: `reply` after a request that mentions paying, `You said: <text>`
/// otherwise.
#[derive(Debug)]
pub struct ProviderLike {
    steps: Vec<Vec<(&'static str, Value)>>,
    reply: String,
    served: std::sync::atomic::AtomicUsize,
}

impl ProviderLike {
    pub fn new(steps: Vec<Vec<(&'static str, Value)>>, reply: &str) -> Self {
        ProviderLike {
            steps,
            reply: reply.to_owned(),
            served: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// How many times it was asked.
    pub fn served(&self) -> usize {
        self.served.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Whether `m` is a user's text (not tool results).
pub fn is_user_text(m: &markov_core::Message) -> bool {
    m.role == markov_core::message::Role::User
        && !m
            .item_list()
            .iter()
            .any(|i| matches!(i, Item::ToolResult { .. }))
}

#[async_trait::async_trait]
impl Model for ProviderLike {
    async fn complete(
        &self,
        request: markov_core::model::ModelRequest<'_>,
    ) -> Result<ModelResponse, markov_core::model::ModelError> {
        self.served
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let last_user = request.messages().iter().rposition(is_user_text);
        let question = last_user
            .map(|at| request.messages()[at].text())
            .unwrap_or_default();
        let answered = last_user.map_or(0, |at| {
            request.messages()[at..]
                .iter()
                .filter(|m| m.role == markov_core::message::Role::Assistant)
                .count()
        });
        let calls = match self.steps.get(answered) {
            Some(calls) if question.contains("pay") => calls,
            _ => {
                let reply = if question.contains("pay") {
                    self.reply.clone()
                } else {
                    format!("You said: {question}")
                };
                return Ok(markov_testkit::text_response(reply));
            }
        };
        Ok(ModelResponse::new(
            calls
                .iter()
                .map(|(name, input)| {
                    Item::tool_use(
                        format!("toolu_{}", uuid::Uuid::new_v4().simple()),
                        *name,
                        input.clone(),
                    )
                })
                .collect(),
            StopReason::ToolUse,
        ))
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct NoArgs {}

/// The first time, writes a marker file and never finishes (the moment to
/// kill a process, or to abandon a worker); once the marker exists it
/// answers at once, as it does for the worker that resumes the session.
pub struct Hang(pub PathBuf);

#[async_trait]
impl Tool for Hang {
    const NAME: &'static str = "hang";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Wait".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        if !self.0.exists() {
            let _ = std::fs::write(&self.0, "hanging");
            std::future::pending::<()>().await;
        }
        Ok("waited".into())
    }
}

/// The node's state.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Ledger {
    pub notes: u32,
}

/// Counts notes in its state (so the tree changes).
pub struct Note;

#[async_trait]
impl Tool for Note {
    const NAME: &'static str = "note";
    type Args = NoArgs;
    type Output = String;
    type Error = markov_core::tool::StateUpdateError;
    fn description(&self) -> String {
        "Take a note".into()
    }
    async fn call(&self, _: NoArgs, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let n = cx.state_json()["notes"].as_u64().unwrap_or(0) + 1;
        cx.update_state(json!({ "notes": n }))?;
        Ok(format!("{n} notes"))
    }
}

/// Files a test writes to, in a fresh temporary directory.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "markov-store-{name}-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Dir(dir)
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn charter() -> (Charter, Node) {
    let node = Node::builder("Handle payments.")
        .name("main")
        .state(Ledger { notes: 0 })
        .build()
        .expect("node builds");
    let charter = Charter::builder("payments")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    (charter, node)
}

/// The agent that opens sessions of `charter`'s nodes on `executor` (the
/// first node is where new ones start).
pub fn agent_on(
    charter: &Charter,
    executor: Arc<dyn markov_executor::Executor>,
) -> markov_executor::Agent {
    markov_executor::Agent::with_executor(charter.name(), executor)
        .nodes(
            charter
                .nodes()
                .map(|(name, node)| (name.to_owned(), node.clone())),
        )
        .build()
        .expect("the agent builds")
}

/// Opens session `id` as `worker` once no other worker holds its lease
/// (waiting at most five seconds for a dead worker's lease to expire).
pub async fn open_when_free(
    store: Arc<markov_store::SqliteStore>,
    id: &str,
    worker: &str,
    agent: &markov_executor::Agent,
) -> markov_store::DurableMachine<markov_store::SqliteStore> {
    use markov_store::{DurableError, DurableMachine, SessionId, StoreError, WorkerId};
    let mut waited = std::time::Duration::ZERO;
    loop {
        match DurableMachine::open(
            store.clone(),
            SessionId::new(id),
            WorkerId::new(worker),
            agent,
        )
        .await
        {
            Ok(session) => return session,
            Err(DurableError::Store(StoreError::Leased { .. }))
                if waited < std::time::Duration::from_secs(5) =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                waited += std::time::Duration::from_millis(50);
            }
            Err(e) => panic!("cannot open session {id:?}: {e}"),
        }
    }
}

/// The contents of the tool results in `history`, in order.
pub fn tool_results(history: &[markov_core::Message]) -> Vec<String> {
    history
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|item| match item {
            Item::ToolResult { content, .. } => Some(content.clone()),
            _ => None,
        })
        .collect()
}

pub fn executor(model: Arc<dyn Model>, effects: PathBuf, marker: PathBuf) -> StandardExecutor {
    executor_with_budget(model, effects, marker, Budget::UNLIMITED)
}

/// [`executor`] with a per-turn call budget.
pub fn executor_with_budget(
    model: Arc<dyn Model>,
    effects: PathBuf,
    marker: PathBuf,
    budget: Budget,
) -> StandardExecutor {
    let registry = ToolRegistry::builder(PolicyConfig::new(budget))
        .register(Pay(effects), ToolMetadata::new(Category::Action))
        .register(Hang(marker), ToolMetadata::new(Category::Other))
        .register(Note, ToolMetadata::new(Category::Other))
        .lock()
        .expect("the registry locks");
    StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT)
}

pub fn machine(model: Arc<dyn Model>, dir: &Dir) -> Machine {
    let (charter, _) = charter();
    markov_executor::Agent::on_charter_with_executor(
        charter,
        Arc::new(executor(model, dir.path("effects"), dir.path("marker"))),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine builds")
}

/// A response calling tools with the given ids.
pub fn calls(list: &[(&str, &str, Value)]) -> ModelResponse {
    ModelResponse::new(
        list.iter()
            .map(|(id, name, input)| Item::tool_use(*id, *name, input.clone()))
            .collect(),
        StopReason::ToolUse,
    )
}

/// Lines in a file (0 when it does not exist).
pub fn lines(path: &PathBuf) -> usize {
    std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
}

/// A step that writes `messages` and nothing else (no tree, policy,
/// run, usage or trace); the struct update syntax sets what a test adds:
/// `StepRecord { trace: Some(&trace), ..bare_step(&[]) }`.
pub fn bare_step(messages: &[markov_core::Message]) -> markov_store::StepRecord<'_> {
    markov_store::StepRecord {
        messages,
        tree: None,
        approvals: None,
        repeats: None,
        counters: None,
        answers: &[],
        run: None,
        usage: None,
        trace: None,
    }
}

/// The lease contract every store keeps, seen from two workers' handles on
/// one database (`first` and `second` may be the same store): a live lease
/// refuses the other worker's lease and writes, an expired one passes to
/// it, and the old holder is fenced out. Every write the lease lets through
/// makes a new revision, a refused one does not, and a release says the
/// revision it left (nothing for a worker that does not hold the lease).
pub async fn lease_contract(first: &dyn markov_store::Store, second: &dyn markov_store::Store) {
    use markov_store::{SessionId, StoreError, WorkerId};
    use std::time::Duration;

    let dir = Dir::new("leases");
    let id = SessionId::new("leased");
    let (a, b) = (WorkerId::new("a"), WorkerId::new("b"));
    let model = Arc::new(ScriptedModel::builder().build());
    let machine = machine(model, &dir);
    let snapshot = markov_executor::serialize_machine(&machine).expect("serializes");
    let created = first
        .create(
            &id,
            None,
            "payments",
            &snapshot,
            &a,
            Duration::from_millis(400),
        )
        .await
        .expect("created");
    assert!(matches!(
        second.acquire(&id, &b, Duration::from_secs(60)).await,
        Err(StoreError::Leased { holder, .. }) if holder == a
    ));
    let empty = bare_step(&[]);
    assert!(matches!(
        second.append(&id, &b, empty).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let renewed = first
        .acquire(&id, &a, Duration::from_millis(400))
        .await
        .expect("the holder renews");
    assert_eq!(
        renewed.revision, created.revision,
        "a refused write makes no revision"
    );
    first
        .append(&id, &a, empty)
        .await
        .expect("the holder writes");
    first
        .journal_answers(&id, &a, &[])
        .await
        .expect("the holder journals");
    let written = first
        .acquire(&id, &a, Duration::from_millis(400))
        .await
        .expect("the holder renews");
    assert_eq!(
        written.revision.get(),
        created.revision.get() + 2,
        "every write makes a revision"
    );

    // a dies; its lease expires; b takes over, and a is fenced out.
    tokio::time::sleep(Duration::from_millis(450)).await;
    let taken = second
        .acquire(&id, &b, Duration::from_secs(60))
        .await
        .expect("b takes the expired lease");
    assert_eq!(taken.revision, written.revision);
    assert!(matches!(
        first.append(&id, &a, empty).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert_eq!(
        first.release(&id, &a).await.expect("a no-op"),
        None,
        "a worker without the lease releases nothing"
    );
    assert_eq!(
        second.release(&id, &b).await.expect("released"),
        Some(written.revision),
        "the fenced write made no revision"
    );
    let again = first
        .acquire(&id, &a, Duration::from_secs(60))
        .await
        .expect("free again");
    assert_eq!(again.revision, written.revision);

    // The same id created again starts from another revision.
    assert!(second.delete(&id).await.expect("deleted"));
    let recreated = second
        .create(
            &id,
            None,
            "payments",
            &snapshot,
            &b,
            Duration::from_secs(60),
        )
        .await
        .expect("created again");
    assert_ne!(recreated.revision, again.revision);
}

/// What every store keeps about owners and API keys: a session created
/// for an owner lists for that owner only, `info` reads it without its
/// history, and keys are added, found, revoked once and listed.
pub async fn owners_and_keys_contract<S>(store: Arc<S>)
where
    S: markov_store::Store + markov_store::KeyStore + 'static,
{
    use markov_store::{
        ApiKeyRecord, CreateOptions, DurableMachine, Owner, SessionId, StoreError, WorkerId,
    };
    let dir = Dir::new("owners");
    let (alice, bob) = (Owner::new("alice"), Owner::new("bob"));
    for (id, owner) in [
        ("a1", Some(&alice)),
        ("a2", Some(&alice)),
        ("b1", Some(&bob)),
        ("n", None),
    ] {
        let mut options = CreateOptions::default();
        if let Some(owner) = owner {
            options = options.owner(owner.clone());
        }
        let machine = machine(Arc::new(ScriptedModel::builder().build()), &dir);
        DurableMachine::create_with(
            store.clone(),
            SessionId::new(id),
            WorkerId::new("w"),
            machine,
            options,
        )
        .await
        .expect("created")
        .release()
        .await
        .expect("released");
    }
    let ids = |infos: Vec<markov_store::SessionInfo>| {
        let mut ids: Vec<String> = infos
            .into_iter()
            .map(|i| i.id.as_str().to_owned())
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(
        ids(store.list(Some(&alice)).await.expect("lists")),
        ["a1", "a2"]
    );
    assert_eq!(ids(store.list(Some(&bob)).await.expect("lists")), ["b1"]);
    assert_eq!(
        ids(store.list(None).await.expect("lists")),
        ["a1", "a2", "b1", "n"]
    );
    let info = store.info(&SessionId::new("b1")).await.expect("info");
    assert_eq!(info.owner, Some(bob.clone()));
    assert_eq!(info.charter, "payments");
    assert_eq!(
        store.info(&SessionId::new("n")).await.expect("info").owner,
        None
    );
    assert!(matches!(
        store.info(&SessionId::new("nope")).await,
        Err(StoreError::NotFound(_))
    ));

    // Leasing on behalf of an owner checks whose the session is in the
    // same call.
    let (first, second) = (WorkerId::new("w1"), WorkerId::new("w2"));
    let ttl = std::time::Duration::from_secs(30);
    let b1 = SessionId::new("b1");
    let lease = store
        .acquire_owned(&b1, &bob, &first, ttl)
        .await
        .expect("bob leases his own session");
    assert_eq!(
        (lease.holder.as_str(), lease.charter.as_str()),
        ("w1", "payments")
    );
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    for holder in [&first, &second] {
        assert!(
            matches!(
                store.acquire_owned(&b1, &alice, holder, ttl).await,
                Err(StoreError::NotFound(_))
            ),
            "another owner's session is not found, whoever holds it"
        );
    }
    match store.acquire(&b1, &second, ttl).await {
        Err(StoreError::Leased {
            holder, expires_at, ..
        }) => assert_eq!(
            (holder, expires_at),
            (first.clone(), lease.expires_at),
            "the lease is as bob's lease left it: not renewed by alice's tries"
        ),
        other => panic!("b1 is leased to w1: {other:?}"),
    }
    assert!(
        matches!(
            store.acquire_owned(&b1, &bob, &second, ttl).await,
            Err(StoreError::Leased { .. })
        ),
        "the owner's session another worker holds is leased"
    );
    assert!(matches!(
        store
            .acquire_owned(&SessionId::new("a1"), &bob, &second, ttl)
            .await,
        Err(StoreError::NotFound(_))
    ));
    let a1 = store
        .acquire(&SessionId::new("a1"), &first, ttl)
        .await
        .expect("a free session another owner asked for stays free");
    assert_eq!(a1.charter, "payments");
    for (id, owner) in [("n", &alice), ("nope", &bob)] {
        assert!(
            matches!(
                store
                    .acquire_owned(&SessionId::new(id), owner, &first, ttl)
                    .await,
                Err(StoreError::NotFound(_))
            ),
            "{id}: nobody's session, and none, are not found"
        );
    }
    for id in ["a1", "b1"] {
        store
            .release(&SessionId::new(id), &first)
            .await
            .expect("released");
    }

    let key = ApiKeyRecord {
        id: "k1".into(),
        principal: "alice".into(),
        roles: vec!["approver".into()],
        hash: "hash-of-the-secret".into(),
        created_at: 1,
        revoked_at: None,
    };
    let generation = store.key_generation().await.expect("reads");
    store.add_key(&key).await.expect("added");
    assert!(store.add_key(&key).await.is_err(), "an id is never reused");
    assert_eq!(store.key("k1").await.expect("reads"), Some(key.clone()));
    assert_eq!(store.key("k2").await.expect("reads"), None);
    assert_eq!(
        store.key_generation().await.expect("reads"),
        generation,
        "adding a key leaves what is cached true"
    );
    assert!(store.revoke_key("k1").await.expect("revokes"));
    let revoked = store.key_generation().await.expect("reads");
    assert!(revoked > generation, "a revocation raises the generation");
    assert!(!store.revoke_key("k1").await.expect("revokes"), "once");
    assert!(
        !store.revoke_key("k2").await.expect("revokes"),
        "no such key"
    );
    assert_eq!(
        store.key_generation().await.expect("reads"),
        revoked,
        "a revocation that revokes nothing leaves it"
    );
    let keys = store.keys().await.expect("lists");
    assert_eq!(keys.len(), 1);
    assert!(keys[0].revoked_at.is_some());
    assert_eq!(keys[0].roles, ["approver"]);
}

/// The model's name in the usage contract, and its price: $1 per million
/// input tokens (cached ones too), $2 per million output.
const HOUSE_MODEL: &str = "house-model";

/// An agent on the payments charter whose model answers `texts`, each
/// having used `input` tokens of input (100 more read from the cache), 10
/// of output and `reasoning` reasoning tokens, priced at the house model's
/// price.
pub fn metered_agent(dir: &Dir, answers: &[(&str, u64, u64)]) -> markov_executor::Agent {
    use markov_context::{ModelPrice, Prices};
    use markov_core::Usd;
    use markov_core::model::Usage;
    let script = answers.iter().map(|(text, input, reasoning)| {
        ModelResponse::new(vec![Item::text(*text)], StopReason::EndTurn)
            .with_usage(Usage {
                input_tokens: *input,
                output_tokens: 10,
                cache_read_input_tokens: 100,
                reasoning_tokens: *reasoning,
                ..Usage::default()
            })
            .with_model(HOUSE_MODEL)
    });
    let model: Arc<dyn Model> = Arc::new(ScriptedModel::new(script));
    let prices = Prices::only_given().model(
        HOUSE_MODEL,
        ModelPrice::per_million_tokens(Usd::from_cents(100), Usd::from_cents(200)),
    );
    let (charter, _) = charter();
    markov_executor::Agent::on_charter_with_executor(
        charter,
        Arc::new(executor(model, dir.path("effects"), dir.path("marker")).with_prices(prices)),
    )
    .state(json!({"notes": 0}))
    .build()
    .expect("the agent builds")
}

/// What a session used is written with each step and read back by the
/// worker that opens it next: tokens (reasoning included), requests and
/// cost, the session's and the turn's. Returns the session's id and its
/// usage, for the caller to read back from a reopened store.
pub async fn usage_contract<S: markov_store::Store + ?Sized + 'static>(
    store: Arc<S>,
    dir: &Dir,
) -> (markov_store::SessionId, markov_context::UsageTotals) {
    use markov_core::Usd;
    use markov_store::{DurableMachine, SessionId, WorkerId};
    let agent = metered_agent(dir, &[("one", 1_000, 4), ("two", 2_000, 6)]);
    let id = SessionId::new("metered");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w1"),
        agent.machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("first");
    session.run().await.expect("runs");
    let first = *session.machine().usage();
    assert_eq!(first.session.requests, 1);
    session.release().await.expect("released");

    let mut session = DurableMachine::open(store.clone(), id.clone(), WorkerId::new("w2"), &agent)
        .await
        .expect("opens");
    assert_eq!(*session.machine().usage(), first, "read back as written");
    session.machine().enqueue_user("second");
    session.run().await.expect("runs");
    let total = *session.machine().usage();
    assert_eq!(total.session.requests, 2);
    assert_eq!(total.session.reasoning_tokens, 10);
    assert_eq!(total.session.input_tokens, 3_000);
    // 1100 × $1/M + 10 × $2/M, then 2100 × $1/M + 10 × $2/M.
    assert_eq!(total.session.cost, Usd::from_micros(1_120 + 2_120));
    assert_eq!(total.turn.requests, 1, "the second turn's own");
    session.release().await.expect("released");
    let stored = store.load(&id).await.expect("loads");
    assert_eq!(stored.snapshot.usage, total);
    (id, total)
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct NotifyArgs {
    pub to: String,
}

/// Sends a notification: a side effect that honours no idempotency key, one
/// line in `effects` per execution. The first time (no `marker` yet) it
/// writes the marker right after its effect and never finishes: the moment
/// to kill a process or abandon a worker. Its contract ([`Delivery`]) is
/// whatever it is registered with.
///
/// [`Delivery`]: markov_core::tool::Delivery
pub struct Notify {
    pub effects: PathBuf,
    pub marker: PathBuf,
}

#[async_trait]
impl Tool for Notify {
    const NAME: &'static str = "notify";
    type Args = NotifyArgs;
    type Output = String;
    type Error = std::io::Error;
    fn description(&self) -> String {
        "Notify someone".into()
    }
    async fn call(&self, args: NotifyArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        append(&self.effects, &format!("notified {}", args.to))?;
        if !self.marker.exists() {
            std::fs::write(&self.marker, "notified, hanging")?;
            std::future::pending::<()>().await;
        }
        Ok(format!("notified {}", args.to))
    }
}

/// An executor whose registry has [`Notify`] (writing to `dir`'s `notices`
/// and `marker`) with `metadata`, and [`Note`].
pub fn notify_executor(
    model: Arc<dyn Model>,
    dir: &Dir,
    metadata: ToolMetadata,
) -> StandardExecutor {
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(
            Notify {
                effects: dir.path("notices"),
                marker: dir.path("marker"),
            },
            metadata,
        )
        .register(Note, ToolMetadata::new(Category::Other))
        .lock()
        .expect("the registry locks");
    StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT)
}

/// The one tool result of `history` (a resumed step answers each call
/// exactly once), with whether it is an error.
pub fn only_result(history: &[markov_core::Message]) -> (String, bool) {
    let results: Vec<(String, bool)> = history
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|item| match item {
            Item::ToolResult {
                content, is_error, ..
            } => Some((content.clone(), is_error.unwrap_or(false))),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 1, "exactly one result: {results:?}");
    results.into_iter().next().unwrap_or_default()
}

/// Now, in Unix seconds.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

/// What every store keeps about ended browser sign-ins: one ended on
/// `store` reads back as ended on `other` (a second handle on the same
/// database, as another worker has), one never ended does not, ending
/// again keeps the later expiry, and a record whose expiry has passed is
/// swept by a later write.
pub async fn ended_sign_ins_contract(
    store: &dyn markov_store::KeyStore,
    other: &dyn markov_store::KeyStore,
) {
    let now = now_secs();
    assert!(!store.sign_in_ended("a").await.expect("reads"));
    store.end_sign_in("a", now + 3600).await.expect("ends");
    assert!(store.sign_in_ended("a").await.expect("reads"));
    assert!(
        other.sign_in_ended("a").await.expect("reads"),
        "another worker on the database sees it"
    );
    assert!(!other.sign_in_ended("b").await.expect("reads"), "not ended");

    // Ending it again with an earlier expiry does not shorten it.
    other.end_sign_in("a", now - 60).await.expect("ends again");
    store.end_sign_in("stale", now - 60).await.expect("ends");
    assert!(
        store.sign_in_ended("stale").await.expect("reads"),
        "kept until a later write"
    );
    other.end_sign_in("c", now + 3600).await.expect("ends");
    assert!(
        !store.sign_in_ended("stale").await.expect("reads"),
        "an expired record is swept by the next write"
    );
    assert!(
        store.sign_in_ended("a").await.expect("reads"),
        "still ended"
    );
    assert!(store.sign_in_ended("c").await.expect("reads"));
}

/// Blocks every text that holds its word.
#[derive(Debug)]
pub struct Forbid(pub &'static str);

#[async_trait]
impl markov_guard::Guard for Forbid {
    fn name(&self) -> &str {
        "forbid"
    }
    async fn check(&self, text: &str) -> markov_guard::Verdict {
        if text.contains(self.0) {
            markov_guard::Verdict::block("it mentions a forbidden word")
        } else {
            markov_guard::Verdict::Pass
        }
    }
}

/// An input guard's rewrite and block are what the store keeps: a session
/// whose first message was redacted and whose second was blocked, reopened
/// from `store`, holds the redacted text and markov's note, never the
/// user's original words; the model of the next turn reads neither.
pub async fn guarded_input_contract<S: markov_store::Store + ?Sized + 'static>(
    store: Arc<S>,
    dir: &Dir,
) {
    use markov_store::{DurableMachine, SessionId, WorkerId};

    let guarded = |model: Arc<ScriptedModel>| -> Arc<dyn markov_executor::Executor> {
        Arc::new(
            executor(model, dir.path("effects"), dir.path("marker")).with_guards(
                markov_guard::Guards::new()
                    .input(markov_guard::PiiRedactor::new())
                    .input(Forbid("secret plan")),
            ),
        )
    };
    let (charter, _) = charter();
    let first = Arc::new(ScriptedModel::builder().text("Noted.").build());
    let id = SessionId::new("guarded");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        agent_on(&charter, guarded(first.clone())).machine(),
    )
    .await
    .expect("created");
    session
        .machine()
        .enqueue_user("Write to ann@example.com please.");
    let step = session.run().await.expect("runs");
    assert_eq!(step.yield_reason, markov_executor::YieldReason::EndTurn);
    session.machine().enqueue_user("Tell me the secret plan.");
    let step = session.run().await.expect("runs");
    assert_eq!(step.yield_reason, markov_executor::YieldReason::Blocked);
    assert_eq!(first.calls(), 1, "the blocked message cost no model call");
    drop(session);

    let next = Arc::new(ScriptedModel::builder().text("Sunny.").build());
    let mut reopened =
        open_until_free(store, &id, &agent_on(&charter, guarded(next.clone()))).await;
    let texts: Vec<(markov_core::Role, String)> = reopened
        .machine()
        .history()
        .iter()
        .map(|m| (m.role, m.text()))
        .filter(|(_, t)| !t.is_empty())
        .collect();
    assert_eq!(
        texts,
        [
            (
                markov_core::Role::User,
                "Write to [EMAIL_1] please.".to_owned()
            ),
            (markov_core::Role::Assistant, "Noted.".to_owned()),
            (
                markov_core::Role::System,
                "[guard] The message was blocked by forbid: it mentions a forbidden word."
                    .to_owned()
            ),
        ],
        "the stored history"
    );
    reopened.machine().enqueue_user("And the weather?");
    let step = reopened.run().await.expect("the next turn runs");
    assert_eq!(step.yield_reason, markov_executor::YieldReason::EndTurn);
    let request = serde_json::to_string(&next.requests()[0].messages).expect("serializes");
    assert!(
        !request.contains("ann@example.com") && !request.contains("secret plan"),
        "{request}"
    );
}

/// Opens session `id` of `store`, waiting at most five seconds for the
/// lease a dropped session left.
async fn open_until_free<S: markov_store::Store + ?Sized + 'static>(
    store: Arc<S>,
    id: &markov_store::SessionId,
    agent: &markov_executor::Agent,
) -> markov_store::DurableMachine<S> {
    use markov_store::{DurableError, DurableMachine, StoreError, WorkerId};
    let mut waited = std::time::Duration::ZERO;
    loop {
        match DurableMachine::open(store.clone(), id.clone(), WorkerId::new("w"), agent).await {
            Ok(session) => return session,
            Err(DurableError::Store(StoreError::Leased { .. }))
                if waited < std::time::Duration::from_secs(5) =>
            {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                waited += std::time::Duration::from_millis(50);
            }
            Err(e) => panic!("cannot open session {id}: {e}"),
        }
    }
}

/// The SQLite store in `dir`'s `sessions.db`.
pub fn store(dir: &Dir) -> Arc<markov_store::SqliteStore> {
    Arc::new(markov_store::SqliteStore::open(dir.path("sessions.db")).expect("the database opens"))
}

/// A PostgreSQL store on a new database of a temporary server (which the
/// first value keeps running), or `None` (outside CI) when PostgreSQL is
/// not installed.
#[cfg(feature = "postgres")]
pub async fn postgres() -> Option<(
    markov_store::testing::TempPostgres,
    Arc<markov_store::PostgresStore>,
)> {
    let server = markov_store::testing::TempPostgres::for_test()?;
    let url = server.new_database().expect("a database");
    let store = markov_store::PostgresStore::connect(&url)
        .await
        .expect("connects");
    Some((server, Arc::new(store)))
}

/// Two turns: notes (the tree changes), a payment, answers.
pub fn two_turns() -> ScriptedModel {
    ScriptedModel::builder()
        .tool_call("note", json!({}))
        .response(calls(&[("pay-1", "pay", json!({"amount": 3}))]))
        .text("Paid 3.")
        .tool_call("note", json!({}))
        .text("Noted.")
        .build()
}

/// This test binary run again as the ignored test `test` (its full path,
/// `module::name`): a child process the test waits for or kills.
pub fn child_test(test: &str) -> std::process::Command {
    let mut command = std::process::Command::new(std::env::current_exe().expect("the test binary"));
    command.args([
        "--exact",
        test,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    command
}

/// Runs `body`, the work of a child process, on a runtime of its own.
pub fn in_child<F: std::future::Future>(body: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(body)
}

/// Runs the ignored test `child` of this binary as a child process, with
/// `MARKOV_CRASH_DIR` and `MARKOV_CRASH_MODE` set (and
/// `MARKOV_HANG_AFTER_PAY` when `hang_after_pay`), until a tool of it
/// writes `dir`'s `marker` and hangs; then kills it (SIGKILL).
pub async fn kill_when_it_hangs(child: &str, dir: &Dir, mode: &str, hang_after_pay: bool) {
    let mut command = child_test(child);
    command
        .env("MARKOV_CRASH_DIR", &dir.0)
        .env("MARKOV_CRASH_MODE", mode);
    if hang_after_pay {
        command.env("MARKOV_HANG_AFTER_PAY", "1");
    }
    let mut child = command.spawn().expect("the child starts");
    let marker = dir.path("marker");
    let mut waited = std::time::Duration::ZERO;
    while !marker.exists() {
        assert!(
            waited < std::time::Duration::from_secs(120),
            "the child never reached the hanging tool"
        );
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the child exited early: {status}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        waited += std::time::Duration::from_millis(20);
    }
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
}
