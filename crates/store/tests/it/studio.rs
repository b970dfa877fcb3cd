//! The studio's record and its uses: each step's tool calls with what the
//! policy decided, a fork carrying the policy state before its step, a
//! replay that runs no recorded effect again, and no provider key or header
//! in the database, on SQLite and Postgres.

use std::sync::Arc;

use crate::common::*;
use markov_core::model::Model;
use markov_executor::{StandardExecutor, YieldReason};
use markov_policy::{
    Budget, CallOutcome, CallTrace, Category, Decision, Mode, PolicyConfig, ToolMetadata,
    ToolRegistry,
};
use markov_store::{DurableMachine, SessionId, SqliteStore, StepTrace, Store, WorkerId};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// `pay` needs approval; `note` may be called once per turn.
fn guarded_executor(model: Arc<dyn Model>, dir: &Dir) -> StandardExecutor {
    let budget = Budget::UNLIMITED.max_for(Category::Other, 1);
    let registry = ToolRegistry::builder(PolicyConfig::new(budget))
        .register(
            Pay(dir.path("effects")),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .register(Note, ToolMetadata::new(Category::Other))
        .lock()
        .expect("the registry locks");
    StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT)
}

fn guarded_agent(model: Arc<dyn Model>, dir: &Dir) -> markov_executor::Agent {
    markov_executor::Agent::on_charter_with_executor(
        charter().0,
        Arc::new(guarded_executor(model, dir)),
    )
    .state(json!({"notes": 0}))
    .build()
    .expect("the agent builds")
}

/// The tool calls each step recorded, step by step.
fn tool_calls(steps: &[StepTrace]) -> Vec<Vec<CallTrace>> {
    steps
        .iter()
        .map(|s| s.calls.iter().flat_map(|c| c.tool_calls.clone()).collect())
        .collect()
}

/// A turn whose first answer calls `note` twice (the second is over the
/// budget) and whose second calls `pay`, which waits for approval and is
/// then approved by `alice`: each step's trace says what the policy
/// decided of each call.
pub(crate) async fn decisions_contract<S: Store + 'static>(store: Arc<S>, dir: &Dir) {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[
                ("note-1", "note", json!({})),
                ("note-2", "note", json!({})),
            ]))
            .response(calls(&[("pay-1", "pay", json!({"amount": 3}))]))
            .text("Paid 3.")
            .build(),
    );
    let id = SessionId::random();
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        guarded_agent(model, dir).machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("note twice, then pay 3");
    let paused = session.run().await.expect("runs");
    assert_eq!(paused.yield_reason, YieldReason::AwaitingApproval);
    let request = session.machine().approvals().pending()[0].clone();
    session
        .decide_by(&request.request_id, Decision::Approve, "alice")
        .await
        .expect("decided");
    assert!(session.resume().await.expect("resumes").done);
    assert_eq!(lines(&dir.path("effects")), 1, "pay ran once");

    let steps = store.steps(&id, 0, 100).await.expect("steps read");
    let traced = tool_calls(&steps);
    assert_eq!(traced.len(), 4, "{traced:#?}");
    // The first answer: one note ran, the second was over the budget.
    let [ran, refused] = traced[0].as_slice() else {
        panic!("two calls in the first step: {:#?}", traced[0]);
    };
    assert_eq!(
        (ran.call_id.as_str(), ran.tool.as_str()),
        ("note-1", "note")
    );
    assert_eq!(
        ran.outcome,
        CallOutcome::Ran {
            ok: true,
            error: None
        }
    );
    assert_eq!(ran.envelope, None, "nothing kept of a call that ran");
    assert_eq!(refused.call_id.as_str(), "note-2");
    assert_eq!(
        refused.outcome,
        CallOutcome::Refused {
            stage: "budget".into(),
            error: Some("BUDGET_EXCEEDED".into())
        }
    );
    let envelope = refused.envelope.as_deref().expect("the envelope is kept");
    assert!(envelope.contains("BUDGET_EXCEEDED"), "{envelope}");
    // The second answer waited for approval.
    assert_eq!(steps[1].yield_reason, YieldReason::AwaitingApproval);
    assert_eq!(
        traced[1]
            .iter()
            .map(|c| (c.call_id.as_str(), c.outcome.clone()))
            .collect::<Vec<_>>(),
        [(
            "pay-1",
            CallOutcome::Awaiting {
                request: request.request_id.clone()
            }
        )]
    );
    // Resumed: the approved call ran, and the trace says who approved it.
    let [pay] = traced[2].as_slice() else {
        panic!("one call in the resumed step: {:#?}", traced[2]);
    };
    assert!(pay.outcome.ran(), "{pay:?}");
    let approval = pay.approval.as_ref().expect("the decision is recorded");
    assert_eq!(approval.request, request.request_id);
    assert_eq!(approval.decision, "approve");
    assert_eq!(approval.by.as_deref(), Some("alice"));
    assert!(traced[3].is_empty(), "the answer called nothing");
    // As JSON, a page reads each call's decision by name.
    let json = serde_json::to_value(&steps[0].calls[0].tool_calls).expect("serializes");
    assert_eq!(json[1]["outcome"], "refused");
    assert_eq!(json[1]["stage"], "budget");
    let json = serde_json::to_value(pay).expect("serializes");
    assert_eq!(json["approval"]["by"], "alice");
}

#[tokio::test]
async fn each_steps_calls_record_what_the_policy_decided_on_sqlite() {
    let dir = Dir::new("decisions-sqlite");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    decisions_contract(store, &dir).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_steps_calls_record_what_the_policy_decided_on_postgres() {
    let Some((_server, store)) = postgres().await else {
        return;
    };
    let dir = Dir::new("decisions-pg");
    decisions_contract(store, &dir).await;
}

#[tokio::test]
async fn a_trace_written_before_calls_were_recorded_reads_back() {
    let dir = Dir::new("decisions-old");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("note", json!({}))
            .text("Noted.")
            .build(),
    );
    let id = SessionId::random();
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        machine(model, &dir),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("note it");
    session.run().await.expect("runs");
    let step = store.steps(&id, 0, 1).await.expect("reads").remove(0);
    assert_eq!(step.calls[0].tool_calls.len(), 1, "the call is recorded");
    // The step as an earlier version wrote it: no calls' decisions.
    let mut old = serde_json::to_value(&step).expect("serializes");
    old["calls"][0]
        .as_object_mut()
        .expect("a call")
        .remove("tool_calls");
    let read: StepTrace = serde_json::from_value(old).expect("reads back");
    assert!(read.calls[0].tool_calls.is_empty());
    assert_eq!(read.calls[0].system, step.calls[0].system);
}

/// `pay` needs approval; `notify` (a side effect per execution, in
/// `notices`) does not.
fn notify_and_pay_agent(model: Arc<dyn Model>, dir: &Dir) -> markov_executor::Agent {
    // Written first, so that `notify` never hangs.
    std::fs::write(dir.path("marker"), "").expect("the marker");
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(
            Pay(dir.path("effects")),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .register(
            Notify {
                effects: dir.path("notices"),
                marker: dir.path("marker"),
            },
            ToolMetadata::new(Category::Other),
        )
        .lock()
        .expect("the registry locks");
    let executor = StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT);
    markov_executor::Agent::on_charter_with_executor(charter().0, Arc::new(executor))
        .state(json!({"notes": 0}))
        .build()
        .expect("the agent builds")
}

/// A session whose first answer notifies (runs at once) and pays (waits
/// for approval); approved by `alice`, it is resumed: the notice is
/// answered from the ledger, the payment runs. Forked at the resumed step,
/// the fork waits for approval as the source did, and resuming it never
/// notifies again.
pub(crate) async fn fork_policy_contract<S: Store + 'static>(store: Arc<S>, dir: &Dir) {
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[
                ("notify-1", "notify", json!({"to": "ops"})),
                ("pay-1", "pay", json!({"amount": 3})),
            ]))
            .text("Paid 3.")
            .build(),
    );
    let id = SessionId::random();
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        notify_and_pay_agent(model, dir).machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("tell ops, then pay 3");
    let paused = session.run().await.expect("runs");
    assert_eq!(paused.yield_reason, YieldReason::AwaitingApproval);
    assert_eq!(lines(&dir.path("notices")), 1, "notified at once");
    let request = session.machine().approvals().pending()[0].clone();
    session
        .decide_by(&request.request_id, Decision::Approve, "alice")
        .await
        .expect("decided");
    assert!(session.resume().await.expect("resumes").done);
    session.release().await.expect("released");
    assert_eq!(lines(&dir.path("notices")), 1, "not notified again");
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
    let steps = store.steps(&id, 0, 10).await.expect("steps read");
    assert!(
        steps[1].calls[0].replayed,
        "step 1 resumed the paused answer"
    );
    assert!(
        !steps[0].waiting.answers.is_empty(),
        "the pause is recorded"
    );
    assert!(
        steps[1].waiting.is_empty(),
        "nothing waits after the resume"
    );

    // Forked at the resumed step: it waits for approval, as the source did.
    let fork_model = Arc::new(ScriptedModel::builder().text("Not paid.").build());
    let fork_id = SessionId::random();
    let mut fork = DurableMachine::fork(
        store.clone(),
        &id,
        1,
        fork_id.clone(),
        WorkerId::new("developer"),
        &notify_and_pay_agent(fork_model.clone(), dir),
        markov_store::ForkOptions::default(),
    )
    .await
    .expect("forks");
    assert!(fork.machine().is_awaiting_approval());
    let pending = fork.machine().approvals().pending();
    assert_eq!(pending.len(), 1, "the request is pending in the fork");
    assert_eq!(
        (pending[0].tool.as_str(), &pending[0].args),
        ("pay", &json!({"amount": 3}))
    );
    // Decided otherwise this time.
    fork.decide_by(
        &pending[0].request_id,
        Decision::Deny { message: None },
        "bob",
    )
    .await
    .expect("decided in the fork");
    let last = fork.resume().await.expect("the fork resumes");
    assert!(last.done);
    assert_eq!(
        lines(&dir.path("notices")),
        1,
        "the call answered before the step is not run again in the fork"
    );
    assert_eq!(lines(&dir.path("effects")), 1, "the fork did not pay");
    assert_eq!(fork_model.requests().len(), 1, "only the step after it");
    let traced = tool_calls(&store.steps(&fork_id, 0, 10).await.expect("fork steps"));
    let resumed = &traced[0];
    assert_eq!(resumed.len(), 2, "{traced:#?}");
    assert!(
        matches!(resumed[0].outcome, CallOutcome::Ledger { ok: true, .. }),
        "{:?}",
        resumed[0]
    );
    assert_eq!(
        resumed[1].outcome,
        CallOutcome::Refused {
            stage: "confirm".into(),
            error: Some("CONFIRMATION_DENIED".into())
        }
    );
    let approval = resumed[1].approval.as_ref().expect("the decision");
    assert_eq!(
        (approval.decision.as_str(), approval.by.as_deref()),
        ("deny", Some("bob"))
    );
    // The source is as it was.
    let source = store.load(&id).await.expect("loads");
    assert!(source.snapshot.policy.answers.is_empty());
}

#[tokio::test]
async fn a_fork_carries_the_ledger_and_the_pending_approvals_on_sqlite() {
    let dir = Dir::new("fork-policy-sqlite");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    fork_policy_contract(store, &dir).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_carries_the_ledger_and_the_pending_approvals_on_postgres() {
    let Some((_server, store)) = postgres().await else {
        return;
    };
    let dir = Dir::new("fork-policy-pg");
    fork_policy_contract(store, &dir).await;
}

/// `notify` must never run twice (at most once, not an action); `note`
/// writes state.
fn at_most_once_agent(model: Arc<dyn Model>, dir: &Dir) -> markov_executor::Agent {
    std::fs::write(dir.path("marker"), "").expect("the marker");
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(
            Notify {
                effects: dir.path("notices"),
                marker: dir.path("marker"),
            },
            ToolMetadata::new(Category::Other)
                .with_delivery(markov_core::tool::Delivery::AtMostOnce),
        )
        .register(Note, ToolMetadata::new(Category::Other))
        .lock()
        .expect("the registry locks");
    let executor = StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT);
    markov_executor::Agent::on_charter_with_executor(charter().0, Arc::new(executor))
        .state(json!({"notes": 0}))
        .build()
        .expect("the agent builds")
}

/// Replays a session that notified ops and took a note, with `live`
/// answering where the replay parts from the recording.
async fn replay_notify(
    name: &str,
    live: ScriptedModel,
    options: markov_store::ReplayOptions,
) -> (markov_store::ReplayReport, Dir) {
    let dir = Dir::new(name);
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let model = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[
                ("notify-1", "notify", json!({"to": "ops"})),
                ("note-1", "note", json!({})),
            ]))
            .text("Done.")
            .build(),
    );
    let id = SessionId::random();
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        at_most_once_agent(model, &dir).machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("tell ops and note it");
    assert!(session.run().await.expect("runs").done);
    session.release().await.expect("released");
    assert_eq!(lines(&dir.path("notices")), 1);
    let replay_dir = Dir::new(&format!("{name}-effects"));
    let report = markov_store::replay(
        &*store,
        &id,
        Arc::new(live),
        |model| at_most_once_agent(model, &replay_dir),
        options,
    )
    .await
    .expect("replays");
    assert_eq!(report.error, None);
    (report, replay_dir)
}

fn sources(
    report: &markov_store::ReplayReport,
) -> Vec<(
    &str,
    markov_store::ToolCallSource,
    Option<markov_store::ToolEffect>,
)> {
    report
        .tool_calls
        .iter()
        .map(|c| (c.tool.as_str(), c.answered_from, c.effect))
        .collect()
}

#[tokio::test]
async fn a_replay_answers_at_most_once_and_state_writing_calls_from_the_recording() {
    use markov_store::{ToolCallSource as Source, ToolEffect as Effect};
    let (report, replay_dir) = replay_notify(
        "replay-effects",
        ScriptedModel::builder().build(),
        markov_store::ReplayMode::RecordedWhereUnchanged.into(),
    )
    .await;
    // The note's state was written again: the next request (whose system
    // prompt shows the state) is the recorded one.
    assert_eq!(report.parted_at, None, "{report:#?}");
    assert_eq!(
        sources(&report),
        [
            ("notify", Source::Recorded, Some(Effect::AtMostOnce)),
            ("note", Source::Recorded, Some(Effect::WritesState)),
        ]
    );
    assert_eq!(
        lines(&replay_dir.path("notices")),
        0,
        "the at-most-once tool never ran again"
    );
    let json = serde_json::to_value(&report.tool_calls).expect("serializes");
    assert_eq!(json[0]["effect"], "at_most_once");
    assert_eq!(json[1]["effect"], "writes_state");
}

#[tokio::test]
async fn a_replay_refuses_a_new_at_most_once_call_and_runs_a_new_state_write() {
    use markov_store::{ToolCallSource as Source, ToolEffect as Effect};
    // The live model notifies someone else, then takes two notes: the
    // second one's only effect is the state it writes on the replay's own
    // machine.
    let live = || {
        ScriptedModel::builder()
            .response(calls(&[
                ("notify-9", "notify", json!({"to": "legal"})),
                ("note-9", "note", json!({})),
                ("note-10", "note", json!({})),
            ]))
            .text("Done.")
            .build()
    };
    let (report, replay_dir) = replay_notify(
        "replay-effects-new",
        live(),
        markov_store::ReplayMode::Live.into(),
    )
    .await;
    assert_eq!(
        sources(&report),
        [
            ("notify", Source::Refused, Some(Effect::AtMostOnce)),
            // The recorded note had the same arguments: played back.
            ("note", Source::Recorded, Some(Effect::WritesState)),
            // The recording has no second one: it runs.
            ("note", Source::Live, None),
        ]
    );
    assert_eq!(lines(&replay_dir.path("notices")), 0, "nobody notified");
    let options = markov_store::ReplayOptions {
        mode: markov_store::ReplayMode::Live,
        run_tools_live: true,
    };
    let (report, replay_dir) = replay_notify("replay-effects-live", live(), options).await;
    assert_eq!(
        sources(&report)[0],
        ("notify", Source::Live, Some(Effect::AtMostOnce))
    );
    assert_eq!(lines(&replay_dir.path("notices")), 1, "asked to: it ran");
}

/// The provider key the secrets test signs in with.
const PROVIDER_KEY: &str = "sk-ant-studio-7f3a9c41e2b8d605";

/// Headers whose values are the client's or the connection's, no secret:
/// the scan looks for every other header value the provider received.
const PLAIN_HEADERS: [&str; 8] = [
    "host",
    "content-type",
    "content-length",
    "accept",
    "accept-encoding",
    "anthropic-version",
    "user-agent",
    "connection",
];

/// Runs a session (a tool call, then an answer) through an Anthropic
/// client with a key against the fake provider, on `store`; returns the
/// header values the provider received that are not [`PLAIN_HEADERS`]
/// (the key among them).
async fn session_through_a_provider<S: Store + 'static>(store: Arc<S>, dir: &Dir) -> Vec<String> {
    use markov_testkit::http::{FakeServer, Reply, anthropic};
    let server = FakeServer::scripted(vec![
        Reply::json(200, anthropic::tool_use("toolu_1", "note", &json!({}))),
        Reply::json(200, anthropic::text("Noted.")),
    ])
    .await;
    let client = markov_providers::Anthropic::builder()
        .api_key(PROVIDER_KEY)
        .base_url(server.base_url())
        .model("claude-test")
        .max_retries(0)
        .build()
        .expect("a client");
    let mut session = DurableMachine::create(
        store,
        SessionId::random(),
        WorkerId::new("w"),
        machine(Arc::new(client), dir),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("note it");
    let last = session.run().await.expect("runs");
    assert!(last.done);
    session.release().await.expect("released");
    let requests = server.requests();
    assert_eq!(requests.len(), 2, "both answers came from the provider");
    let secret: Vec<String> = requests
        .iter()
        .flat_map(|r| r.headers.iter())
        .filter(|(name, _)| !PLAIN_HEADERS.contains(&name.as_str()))
        .map(|(_, value)| value.clone())
        .collect();
    assert!(
        secret.iter().any(|v| v.contains(PROVIDER_KEY)),
        "the key was sent: {:?}",
        requests[0].headers
    );
    secret
}

/// Fails when any of `secrets` occurs in `bytes` (what `place` holds).
fn assert_none_in(bytes: &[u8], secrets: &[String], place: &str) {
    for secret in secrets {
        assert!(
            !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "{place} holds a header value the provider received: {secret:?}"
        );
    }
}

#[tokio::test]
async fn no_provider_key_or_header_reaches_the_sqlite_file() {
    let dir = Dir::new("secrets-sqlite");
    let path = dir.path("sessions.db");
    let store = Arc::new(SqliteStore::open(&path).expect("opens"));
    let secrets = session_through_a_provider(store.clone(), &dir).await;
    let steps = {
        let id = &store.list(None).await.expect("lists")[0].id;
        store.steps(id, 0, 10).await.expect("steps read")
    };
    assert_eq!(steps.len(), 2, "the steps were recorded");
    let mut scanned = 0;
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let file = path.with_file_name(format!("sessions.db{suffix}"));
        if let Ok(bytes) = std::fs::read(&file) {
            scanned += bytes.len();
            assert_none_in(&bytes, &secrets, &file.display().to_string());
        }
    }
    assert!(scanned > 0, "the database files were read");
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_provider_key_or_header_reaches_the_postgres_database() {
    let Some(server) = markov_store::testing::TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let dir = Dir::new("secrets-pg");
    let store = Arc::new(
        markov_store::PostgresStore::connect(&url)
            .await
            .expect("connects"),
    );
    let secrets = session_through_a_provider(store, &dir).await;
    // Every row of every table, each as the text of all its columns.
    let (raw, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connects");
    let connection = tokio::spawn(connection);
    let tables: Vec<String> = raw
        .query(
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'",
            &[],
        )
        .await
        .expect("lists the tables")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(tables.iter().any(|t| t == "step_traces"), "{tables:?}");
    let mut dump = String::new();
    for table in &tables {
        let text: String = raw
            .query_one(
                &format!("SELECT coalesce(string_agg(t::text, E'\\n'), '') FROM \"{table}\" t"),
                &[],
            )
            .await
            .expect("reads the table")
            .get(0);
        dump.push_str(&text);
    }
    assert!(dump.contains("Noted."), "the session is in the dump");
    assert_none_in(dump.as_bytes(), &secrets, "the Postgres database");
    drop(raw);
    let _ = connection.await;
}

/// A session of `recorded + 2` steps on `store`: a real turn (two steps),
/// then `recorded` steps appended as copies of its second step, each
/// adding one user message `m<n>`.
async fn long_session<S: Store + 'static>(store: Arc<S>, dir: &Dir, recorded: u64) -> SessionId {
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("note", json!({}))
            .text("Noted.")
            .build(),
    );
    let id = SessionId::random();
    let holder = WorkerId::new("w");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        holder.clone(),
        machine(model, dir),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("note it");
    session.run().await.expect("runs");
    session.release().await.expect("released");
    store
        .acquire(&id, &holder, std::time::Duration::from_secs(600))
        .await
        .expect("leased");
    let template = store.steps(&id, 1, 1).await.expect("reads").remove(0);
    let base = template.history_to;
    for n in 0..recorded {
        let messages = [markov_core::Message::user(format!("m{n}"))];
        let mut trace = template.clone();
        trace.history_from = base + n;
        trace.history_to = base + n + 1;
        trace.calls[0].history_len = base + n;
        store
            .append(
                &id,
                &holder,
                markov_store::StepRecord {
                    trace: Some(&trace),
                    ..bare_step(&messages)
                },
            )
            .await
            .expect("appended");
    }
    store.release(&id, &holder).await.expect("released");
    id
}

/// The last page of a session of a few thousand steps: its steps and the
/// messages they added are read by range, and a fork at its last step
/// finds the tree it started from, recorded thousands of steps before.
pub(crate) async fn last_page_contract<S: Store + 'static>(store: Arc<S>, dir: &Dir) {
    const RECORDED: u64 = 2_000;
    let id = long_session(store.clone(), dir, RECORDED).await;
    let total = RECORDED + 2;
    let page = store
        .steps(&id, total - 50, 50)
        .await
        .expect("the last page");
    assert_eq!(
        page.iter().map(|s| s.index).collect::<Vec<_>>(),
        (total - 50..total).collect::<Vec<_>>()
    );
    assert!(
        store
            .steps(&id, total, 50)
            .await
            .expect("past the end")
            .is_empty()
    );
    let (first, last) = (&page[0], &page[49]);
    let count = usize::try_from(last.history_to - first.history_from).expect("small");
    let messages = store
        .messages(&id, first.history_from, count)
        .await
        .expect("the page's messages");
    let texts: Vec<String> = messages.iter().map(markov_core::Message::text).collect();
    let expected: Vec<String> = (RECORDED - 50..RECORDED).map(|n| format!("m{n}")).collect();
    assert_eq!(texts, expected, "the messages the page's steps added");
    assert!(
        store
            .messages(&id, last.history_to, 10)
            .await
            .expect("past the end")
            .is_empty()
    );
    assert!(matches!(
        store.messages(&SessionId::new("none"), 0, 1).await,
        Err(markov_store::StoreError::NotFound(_))
    ));
    // A fork at the last step: its history is the session's before it.
    let fork = DurableMachine::fork(
        store.clone(),
        &id,
        total - 1,
        SessionId::random(),
        WorkerId::new("developer"),
        &agent_on(
            &charter().0,
            Arc::new(executor(
                Arc::new(ScriptedModel::builder().text("Fine.").build()),
                dir.path("effects"),
                dir.path("marker"),
            )),
        ),
        markov_store::ForkOptions::default(),
    )
    .await
    .expect("forks at the last step");
    assert_eq!(fork.machine().history().len() as u64, last.history_from);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_page_of_a_long_session_is_read_by_range_on_sqlite() {
    let dir = Dir::new("last-page-sqlite");
    let store = Arc::new(
        SqliteStore::open_with(
            dir.path("sessions.db"),
            markov_store::Durability::ProcessCrash,
        )
        .expect("opens"),
    );
    last_page_contract(store, &dir).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_page_of_a_long_session_is_read_by_range_on_postgres() {
    let Some((_server, store)) = postgres().await else {
        return;
    };
    let dir = Dir::new("last-page-pg");
    last_page_contract(store, &dir).await;
}
