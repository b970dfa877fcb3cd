//! Team conversations, durably: a handoff, a restart (the store dropped
//! and opened again), the conversation continued with the agent that held
//! it, and a hand-back; a crash at each point of a handoff loses neither
//! the user's message nor the handoff, and runs no tool twice.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_core::async_trait;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse};
use markov_executor::{Agent, Handoff, HandoffRecord, Team};
use markov_policy::{Budget, Category, Decision, PolicyConfig, ToolMetadata};
use markov_store::{
    CreateOptions, DurableError, DurableTeam, Owner, SessionId, SqliteStore, Store, StoreError,
    WorkerId, agent_session,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// Triage hands refunds to billing; billing pays (through the ledger) and
/// hands back.
fn team(dir: &Dir, triage: Arc<dyn Model>, billing: Arc<dyn Model>) -> Team {
    team_with(dir, triage, billing, ToolMetadata::new(Category::Action))
}

/// [`team`] with billing's `pay` described by `pay`.
fn team_with(
    dir: &Dir,
    triage: Arc<dyn Model>,
    billing: Arc<dyn Model>,
    pay: ToolMetadata,
) -> Team {
    let triage = Agent::builder("triage")
        .instructions("You are triage.")
        .tools([Handoff::tool("billing", "For refunds.").expect("valid")])
        .shared_model(triage)
        .build()
        .expect("builds");
    let billing = Agent::builder("billing")
        .instructions("You are billing.")
        .tool_with(Pay(dir.path("effects")), pay)
        .tools([Handoff::back().expect("valid")])
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .shared_model(billing)
        .build()
        .expect("builds");
    Team::builder()
        .agent("triage", triage)
        .agent("billing", billing)
        .build()
        .expect("team builds")
}

fn scripted(
    build: impl FnOnce(markov_testkit::ScriptBuilder) -> markov_testkit::ScriptBuilder,
) -> Arc<ScriptedModel> {
    Arc::new(build(ScriptedModel::builder()).build())
}

/// A model that must not be asked.
fn silent() -> Arc<ScriptedModel> {
    scripted(|s| s)
}

fn texts(messages: &[markov_core::Message]) -> String {
    messages
        .iter()
        .map(markov_core::Message::text)
        .collect::<Vec<_>>()
        .join("\n")
}

fn handoff(from: &str, to: &str) -> (String, String) {
    (from.to_owned(), to.to_owned())
}

fn pairs(records: &[HandoffRecord]) -> Vec<(String, String)> {
    records
        .iter()
        .map(|r| (r.from.clone(), r.to.clone()))
        .collect()
}

fn paid(dir: &Dir) -> usize {
    std::fs::read_to_string(calls_file(&dir.path("effects")))
        .unwrap_or_default()
        .lines()
        .count()
}

/// Hand off, restart, continue with billing, hand back: on any store.
async fn hand_off_restart_continue_and_hand_back<S: Store + 'static>(
    dir: &Dir,
    open: impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Arc<S>>>>,
) {
    let id = SessionId::new("team");
    let worker = WorkerId::new("w");
    {
        let store = open().await;
        let triage =
            scripted(|s| s.tool_call("transfer_to_billing", json!({"reason": "a refund"})));
        let billing = scripted(|s| s.tool_call("pay", json!({"amount": 5})).text("Refunded 5."));
        let mut session = DurableTeam::create_with(
            store,
            id.clone(),
            worker.clone(),
            team(dir, triage.clone(), billing.clone()),
            CreateOptions::default().owner(Owner::new("alice")),
        )
        .await
        .expect("created");
        let reply = session.send("Refund my 5, please.").await.expect("runs");
        assert_eq!(reply.agent, "billing");
        assert_eq!(reply.answer.as_deref(), Some("Refunded 5."));
        assert_eq!(pairs(&reply.handoffs), [handoff("triage", "billing")]);
        assert_eq!(reply.handoffs[0].reason, "a refund");
        session.release().await.expect("released");
    }
    // A new process: new models, the store opened again.
    let store = open().await;
    let info = store
        .info(&agent_session(&id, "billing"))
        .await
        .expect("billing's machine is a session of its own");
    assert_eq!(
        info.owner,
        Some(Owner::new("alice")),
        "with the conversation's owner"
    );
    let triage = scripted(|s| s.text("Glad it is sorted."));
    let billing = scripted(|s| {
        s.text("It arrives in three days.")
            .tool_call("hand_back", json!({"reason": "refund done"}))
    });
    let mut session = DurableTeam::open(
        store.clone(),
        id.clone(),
        worker.clone(),
        team(dir, triage.clone(), billing.clone()),
    )
    .await
    .expect("reopens");
    assert_eq!(session.current(), "billing");
    assert_eq!(session.state().handoffs().len(), 1);

    let reply = session.send("When does it arrive?").await.expect("runs");
    assert_eq!(reply.agent, "billing", "the agent that held it answers");
    assert!(reply.handoffs.is_empty());
    assert_eq!(reply.answer.as_deref(), Some("It arrives in three days."));
    let seen = texts(&billing.requests()[0].messages);
    assert!(
        seen.contains("Refund my 5, please."),
        "billing's history is restored: {seen}"
    );
    assert!(seen.contains("Refunded 5."), "{seen}");
    assert!(seen.contains("When does it arrive?"), "{seen}");
    assert_eq!(triage.calls(), 0);

    let reply = session.send("Thanks, that is all.").await.expect("runs");
    assert_eq!(reply.agent, "triage");
    assert_eq!(reply.answer.as_deref(), Some("Glad it is sorted."));
    assert_eq!(pairs(&reply.handoffs), [handoff("billing", "triage")]);
    // Triage is given what it has not seen: billing's part.
    let seen = texts(&triage.requests()[0].messages);
    assert!(seen.contains("It arrives in three days."), "{seen}");
    assert!(
        seen.contains("handed the conversation to you: refund done"),
        "{seen}"
    );
    assert_eq!(
        pairs(session.state().handoffs()),
        [handoff("triage", "billing"), handoff("billing", "triage")]
    );
    assert_eq!(
        texts(session.state().transcript()),
        "Refund my 5, please.\nRefunded 5.\nWhen does it arrive?\nIt arrives in three days.\nThanks, that is all.\nGlad it is sorted."
    );
    assert_eq!(paid(dir), 1);
    session.release().await.expect("released");
    // Deleting the conversation's session deletes its team state.
    assert!(store.team_state(&id).await.expect("reads").is_some());
    store.delete(&id).await.expect("deletes");
    assert!(store.team_state(&id).await.expect("reads").is_none());
}

#[tokio::test]
async fn a_team_conversation_continues_after_a_restart_with_the_agent_that_held_it() {
    let dir = Dir::new("team-sqlite");
    let path = dir.path("sessions.db");
    hand_off_restart_continue_and_hand_back(&dir, move || {
        let path = path.clone();
        Box::pin(async move { Arc::new(SqliteStore::open(&path).expect("opens")) })
    })
    .await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_conversation_continues_after_a_restart_on_postgres() {
    use markov_store::PostgresStore;
    use markov_store::testing::TempPostgres;
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let dir = Dir::new("team-postgres");
    hand_off_restart_continue_and_hand_back(&dir, move || {
        let url = url.clone();
        Box::pin(async move { Arc::new(PostgresStore::connect(&url).await.expect("connects")) })
    })
    .await;
}

/// Billing's payment needs approval: the turn pauses with billing, a new
/// message is not taken, a restart keeps the pause, the decision is
/// written with who made it, and resuming goes on with billing (the
/// approved call runs once, with no model call before it), which hands
/// back: triage answers the turn. On any store.
async fn pause_restart_decide_and_resume<S: Store + 'static>(
    dir: &Dir,
    open: impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Arc<S>>>>,
) {
    let id = SessionId::new("team-approval");
    let worker = WorkerId::new("w");
    let confirmed = || ToolMetadata::new(Category::Action).with_confirmation();
    {
        let store = open().await;
        let triage =
            scripted(|s| s.tool_call("transfer_to_billing", json!({"reason": "a refund"})));
        let billing = scripted(|s| s.tool_call("pay", json!({"amount": 5})));
        let mut session = DurableTeam::create(
            store,
            id.clone(),
            worker.clone(),
            team_with(dir, triage.clone(), billing.clone(), confirmed()),
        )
        .await
        .expect("created");
        let reply = session.send("Refund my 5, please.").await.expect("runs");
        assert!(reply.awaiting_approval, "{reply:?}");
        assert!(!reply.interrupted);
        assert_eq!(reply.agent, "billing");
        assert_eq!(reply.answer, None);
        assert_eq!(pairs(&reply.handoffs), [handoff("triage", "billing")]);
        assert!(session.is_turn_pending() && session.is_awaiting_approval());
        let pending = session.pending();
        assert_eq!(pending.len(), 1, "{pending:?}");
        assert_eq!(pending[0].tool, "pay");
        assert_eq!(paid(dir), 0, "nothing paid before the decision");
        // A message meanwhile starts nothing: the paused turn is first.
        let again = session.send("Hello?").await.expect("answers");
        assert!(again.awaiting_approval);
        assert_eq!(billing.calls(), 1);
        assert_eq!(
            texts(session.state().transcript()),
            "Refund my 5, please.",
            "the message is not taken"
        );
        session.release().await.expect("released");
    }
    // A new process: the pause is where it was.
    let store = open().await;
    let triage = scripted(|s| s.text("Anything else?"));
    let billing = scripted(|s| s.tool_call("hand_back", json!({"reason": "refund done"})));
    let mut session = DurableTeam::open(
        store.clone(),
        id.clone(),
        worker.clone(),
        team_with(dir, triage.clone(), billing.clone(), confirmed()),
    )
    .await
    .expect("reopens");
    assert_eq!(session.current(), "billing");
    assert!(session.is_awaiting_approval());
    let pending = session.pending();
    assert_eq!(pending.len(), 1);
    assert_eq!(
        session.approval_tool(&pending[0].request_id).as_deref(),
        Some("pay")
    );
    // A resume before the decision leaves the turn paused.
    let still = session.resume().await.expect("answers").expect("a turn");
    assert!(still.awaiting_approval);
    assert_eq!(billing.calls(), 0);
    let decided = session
        .decide_by(&pending[0].request_id, Decision::Approve, "alice")
        .await
        .expect("decided");
    assert_eq!(decided.tool, "pay");
    assert!(session.pending().is_empty());
    let again = session
        .decide_by(&pending[0].request_id, Decision::Approve, "alice")
        .await;
    assert!(
        matches!(again, Err(DurableError::Approval(_))),
        "decided once: {again:?}"
    );
    let reply = session.resume().await.expect("runs").expect("the turn");
    assert!(!reply.awaiting_approval);
    assert_eq!(reply.agent, "triage");
    assert_eq!(reply.answer.as_deref(), Some("Anything else?"));
    assert_eq!(
        pairs(&reply.handoffs),
        [handoff("triage", "billing"), handoff("billing", "triage")]
    );
    assert_eq!(paid(dir), 1, "paid once");
    // Billing's one model call came after the payment: it read the result.
    let seen = format!("{:?}", billing.requests()[0].messages);
    assert!(seen.contains("paid 5"), "{seen}");
    assert!(!session.is_turn_pending());
    assert_eq!(
        texts(session.state().transcript()),
        "Refund my 5, please.\nAnything else?"
    );
    let steps = store
        .steps(&agent_session(&id, "billing"), 0, 10)
        .await
        .expect("steps read");
    let approval = steps
        .iter()
        .flat_map(|s| &s.calls)
        .flat_map(|c| &c.tool_calls)
        .find_map(|c| c.approval.clone())
        .expect("the decision is in billing's step");
    assert_eq!(approval.by.as_deref(), Some("alice"));
    session.release().await.expect("released");
}

#[tokio::test]
async fn a_paused_approval_survives_a_restart_and_the_decision_resumes_the_team_turn() {
    let dir = Dir::new("team-approval-sqlite");
    let path = dir.path("sessions.db");
    pause_restart_decide_and_resume(&dir, move || {
        let path = path.clone();
        Box::pin(async move { Arc::new(SqliteStore::open(&path).expect("opens")) })
    })
    .await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_approval_survives_a_restart_and_the_decision_resumes_the_team_turn_on_postgres() {
    use markov_store::PostgresStore;
    use markov_store::testing::TempPostgres;
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let dir = Dir::new("team-approval-postgres");
    pause_restart_decide_and_resume(&dir, move || {
        let url = url.clone();
        Box::pin(async move { Arc::new(PostgresStore::connect(&url).await.expect("connects")) })
    })
    .await;
}

/// A model that never answers: the process is killed while it waits.
#[derive(Debug)]
struct Hangs;

#[async_trait]
impl Model for Hangs {
    async fn complete(&self, _request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        std::future::pending().await
    }
}

/// Answers from `script` first, then never.
#[derive(Debug)]
struct ThenHangs(ScriptedModel);

#[async_trait]
impl Model for ThenHangs {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        if self.0.remaining() == 0 {
            return Hangs.complete(request).await;
        }
        self.0.complete(request).await
    }
}

#[tokio::test]
async fn a_crash_while_the_next_agent_works_loses_nothing_and_runs_no_tool_twice() {
    let dir = Dir::new("team-crash");
    let path = dir.path("sessions.db");
    let id = SessionId::new("team");
    let lease = Duration::from_millis(600);
    {
        let store = Arc::new(SqliteStore::open(&path).expect("opens"));
        let triage =
            scripted(|s| s.tool_call("transfer_to_billing", json!({"reason": "a refund"})));
        // Billing pays, then its next model call never answers.
        let billing: Arc<dyn Model> = Arc::new(ThenHangs(
            ScriptedModel::builder()
                .tool_call("pay", json!({"amount": 5}))
                .build(),
        ));
        let mut session = DurableTeam::create_with(
            store,
            id.clone(),
            WorkerId::new("crashed"),
            team(&dir, triage, billing),
            CreateOptions::default().lease(lease),
        )
        .await
        .expect("created");
        // The process dies while billing waits for its model.
        let killed =
            tokio::time::timeout(Duration::from_millis(400), session.send("Refund my 5.")).await;
        assert!(killed.is_err(), "the turn hangs in billing's model call");
    }
    assert_eq!(paid(&dir), 1);
    // Another worker, once the crashed one's leases have expired.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let store = Arc::new(SqliteStore::open(&path).expect("opens"));
    let triage = silent();
    let billing = scripted(|s| s.text("Refunded 5."));
    let mut session = DurableTeam::open(
        store,
        id.clone(),
        WorkerId::new("next"),
        team(&dir, triage.clone(), billing.clone()),
    )
    .await
    .expect("reopens");
    assert!(session.is_turn_pending());
    assert_eq!(session.current(), "billing");
    let reply = session
        .resume()
        .await
        .expect("finishes")
        .expect("a turn was pending");
    assert_eq!(reply.agent, "billing");
    assert_eq!(reply.answer.as_deref(), Some("Refunded 5."));
    // The turn's handoff, followed before the crash, once.
    assert_eq!(pairs(&reply.handoffs), [handoff("triage", "billing")]);
    assert_eq!(session.state().handoffs().len(), 1);
    assert_eq!(paid(&dir), 1, "the payment is not made again");
    assert_eq!(triage.calls(), 0);
    // The interrupted run continued: billing's model is asked once, over
    // the user's message (once) and the payment's result.
    assert_eq!(billing.calls(), 1);
    let seen = texts(&billing.requests()[0].messages);
    assert_eq!(seen.matches("Refund my 5.").count(), 1, "{seen}");
    let sent = serde_json::to_string(&billing.requests()[0].messages).expect("encodes");
    assert_eq!(sent.matches("paid 5").count(), 1, "{sent}");
    assert_eq!(
        texts(session.state().transcript()),
        "Refund my 5.\nRefunded 5."
    );
    assert!(!session.is_turn_pending());
    assert!(session.resume().await.expect("nothing to do").is_none());
}

/// A SQLite store whose `n`-th write of a team state fails, as if the
/// process died just before it: what was written before it stays.
fn dies_at_team_write(inner: SqliteStore, n: usize) -> Watched {
    let writes = std::sync::atomic::AtomicUsize::new(0);
    Watched::new(inner, move |call| {
        if !matches!(call, Call::WriteTeamState(_)) {
            return Then::Pass;
        }
        let written = writes.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if written == n {
            return Then::Fail(StoreError::Backend("the process died here".to_owned()));
        }
        Then::Pass
    })
}

#[tokio::test]
async fn a_crash_after_a_handoff_or_an_answer_before_the_team_is_written_loses_nothing() {
    // The team's writes: 1 at creation, 2 with the user's message, 3 once
    // triage's handoff is stored, 4 once billing's answer is.
    for (dies_at, what) in [(3, "after the handoff"), (4, "after the answer")] {
        let dir = Dir::new("team-dies");
        let path = dir.path("sessions.db");
        let id = SessionId::new("team");
        let worker = WorkerId::new("w");
        {
            let store = Arc::new(dies_at_team_write(
                SqliteStore::open(&path).expect("opens"),
                dies_at,
            ));
            let triage =
                scripted(|s| s.tool_call("transfer_to_billing", json!({"reason": "a refund"})));
            let billing =
                scripted(|s| s.tool_call("pay", json!({"amount": 5})).text("Refunded 5."));
            let mut session = DurableTeam::create_with(
                store,
                id.clone(),
                worker.clone(),
                team(&dir, triage, billing),
                CreateOptions::default(),
            )
            .await
            .expect("created");
            let died = session.send("Refund my 5.").await;
            assert!(
                matches!(died, Err(DurableError::Store(StoreError::Backend(_)))),
                "{what}: {died:?}"
            );
        }
        let store = Arc::new(SqliteStore::open(&path).expect("opens"));
        let triage = silent();
        // Billing's model answers only if it is asked (not after the answer).
        let billing = scripted(|s| s.tool_call("pay", json!({"amount": 5})).text("Refunded 5."));
        let mut session = DurableTeam::open(
            store,
            id.clone(),
            worker.clone(),
            team(&dir, triage.clone(), billing.clone()),
        )
        .await
        .expect("reopens");
        assert!(session.is_turn_pending(), "{what}");
        let reply = session
            .resume()
            .await
            .expect("finishes")
            .expect("a turn was pending");
        assert_eq!(reply.agent, "billing", "{what}");
        assert_eq!(reply.answer.as_deref(), Some("Refunded 5."), "{what}");
        assert_eq!(
            triage.calls(),
            0,
            "{what}: triage's handoff is not asked again"
        );
        assert_eq!(
            pairs(session.state().handoffs()),
            [handoff("triage", "billing")],
            "{what}"
        );
        if dies_at == 4 {
            assert!(reply.step.is_none(), "finished from what was stored");
            assert_eq!(billing.calls(), 0, "billing answered before the crash");
            assert_eq!(paid(&dir), 1);
        } else {
            assert_eq!(billing.calls(), 2, "billing is given the conversation once");
            let seen = texts(&billing.requests()[0].messages);
            assert_eq!(seen.matches("Refund my 5.").count(), 1, "{seen}");
            assert_eq!(paid(&dir), 1);
        }
        assert_eq!(
            texts(session.state().transcript()),
            "Refund my 5.\nRefunded 5.",
            "{what}"
        );
    }
}

#[tokio::test]
async fn a_conversation_keeps_its_teams_name_and_one_stored_without_it_still_opens() {
    let dir = Dir::new("team-name");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let worker = WorkerId::new("w");
    let answers = || scripted(|s| s.text("Hello.").text("Again."));
    // A named team's conversation is stored with the name.
    let named = SessionId::new("named");
    let session = DurableTeam::create(
        store.clone(),
        named.clone(),
        worker.clone(),
        team(&dir, answers(), silent()).named("support"),
    )
    .await
    .expect("created");
    session.release().await.expect("released");
    let record = store
        .team_state(&named)
        .await
        .expect("reads")
        .expect("a record");
    assert_eq!(record.team(), Some("support"));
    // Another team, whose entry agent has the same name, does not open it.
    let other = DurableTeam::open(
        store.clone(),
        named.clone(),
        worker.clone(),
        team(&dir, silent(), silent()).named("sales"),
    )
    .await;
    assert!(
        matches!(&other, Err(error) if error.to_string().contains("\"support\"")),
        "{other:?}"
    );
    // A conversation stored without a name (as before teams were named)
    // opens with the team of its entry agent, and is named from its next
    // write.
    let old = SessionId::new("old");
    let session = DurableTeam::create(
        store.clone(),
        old.clone(),
        worker.clone(),
        team(&dir, silent(), silent()),
    )
    .await
    .expect("created");
    session.release().await.expect("released");
    let record = store
        .team_state(&old)
        .await
        .expect("reads")
        .expect("a record");
    assert_eq!(record.team(), None);
    let mut session = DurableTeam::open(
        store.clone(),
        old.clone(),
        worker.clone(),
        team(&dir, answers(), silent()).named("support"),
    )
    .await
    .expect("an old conversation opens");
    let reply = session.send("Hi.").await.expect("runs");
    assert_eq!(reply.answer.as_deref(), Some("Hello."));
    session.release().await.expect("released");
    let record = store
        .team_state(&old)
        .await
        .expect("reads")
        .expect("a record");
    assert_eq!(record.team(), Some("support"));
}
