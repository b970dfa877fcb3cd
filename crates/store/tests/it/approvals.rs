//! Human in the loop, durably: a session that waits for approval is stored
//! as it is — the paused answer, the requests, the calls that ran — and is
//! decided and resumed by a fresh process, with no extra model call and no
//! call run twice.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_core::Item;
use markov_core::async_trait;
use markov_core::model::Model;
use markov_executor::{Machine, StandardExecutor, YieldReason};
use markov_policy::{
    ApprovalError, ApprovalStatus, Budget, Category, Decision, Mode, PolicyConfig, ToolMetadata,
    ToolRegistry,
};
use markov_store::{
    DurableError, DurableMachine, SessionId, SqliteStore, Store, StoreError, WorkerId,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// `pay` needs approval; `note` and `hang` do not.
fn executor(model: Arc<dyn Model>, dir: &Dir, config: PolicyConfig) -> StandardExecutor {
    let registry = ToolRegistry::builder(config)
        .register(
            Pay(dir.path("effects")),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .register(Note, ToolMetadata::new(Category::Other))
        .register(Hang(dir.path("marker")), ToolMetadata::new(Category::Other))
        .lock()
        .expect("the registry locks");
    StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT)
}

fn paying_machine(model: Arc<dyn Model>, dir: &Dir, config: PolicyConfig) -> Machine {
    let (charter, _) = charter();
    markov_executor::Agent::on_charter_with_executor(
        charter,
        Arc::new(executor(model, dir, config)),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine builds")
}

/// Opens session `id` as `worker` with a fresh executor over `model`,
/// waiting for an abandoned lease to expire.
async fn open(
    dir: &Dir,
    id: &str,
    worker: &str,
    model: Arc<dyn Model>,
    config: PolicyConfig,
) -> DurableMachine<SqliteStore> {
    let (charter, _) = charter();
    let executor = Arc::new(executor(model, dir, config));
    open_when_free(store(dir), id, worker, &agent_on(&charter, executor)).await
}

fn call_count(history: &[markov_core::Message]) -> usize {
    history
        .iter()
        .flat_map(|m| m.item_list())
        .filter(|i| matches!(i, Item::ToolUse { .. }))
        .count()
}

/// The child process of the fresh-process test: creates the session, runs
/// until it waits for approval, and exits. Not a test on its own (ignored).
#[test]
#[ignore = "run as a child process by the approval tests"]
fn pause_child() {
    let Some(dir) = std::env::var_os("MARKOV_PAUSE_DIR") else {
        return;
    };
    let dir = Dir(dir.into());
    in_child(async {
        let model = Arc::new(
            ScriptedModel::builder()
                .tool_calls([("note", json!({})), ("pay", json!({"amount": 5}))])
                .build()
                .fresh_call_ids(),
        );
        let machine = paying_machine(model.clone(), &dir, PolicyConfig::new(Budget::UNLIMITED));
        let mut session = DurableMachine::create(
            store(&dir),
            SessionId::new("paused"),
            WorkerId::new("child"),
            machine,
        )
        .await
        .expect("created");
        session.machine().enqueue_user("pay 5");
        let last = session.run().await.expect("runs");
        assert_eq!(last.yield_reason, YieldReason::AwaitingApproval);
        assert_eq!(model.calls(), 1);
        session.release().await.expect("released");
    });
    // The test's directory belongs to the parent.
    std::mem::forget(dir);
}

#[tokio::test]
async fn a_paused_session_is_decided_and_resumed_by_a_fresh_process() {
    let dir = Dir::new("paused");
    let status = child_test("approvals::pause_child")
        .env("MARKOV_PAUSE_DIR", &dir.0)
        .status()
        .expect("the child runs");
    assert!(status.success(), "the child paused the session: {status}");
    assert_eq!(lines(&dir.path("effects")), 0, "nothing paid yet");

    // What the store keeps of the paused step.
    let stored = store(&dir)
        .load(&SessionId::new("paused"))
        .await
        .expect("loads");
    assert_eq!(stored.snapshot.history.len(), 1, "the user's message only");
    assert!(stored.run.is_none(), "no run in progress: it waits");
    let answers = &stored.snapshot.policy.answers;
    assert_eq!(answers.len(), 1);
    assert!(answers[0].paused);
    let approvals = &stored.snapshot.policy.approvals;
    assert_eq!(approvals.len(), 1);
    assert_eq!(approvals[0].status, ApprovalStatus::Pending);
    assert_eq!(approvals[0].request.args, json!({"amount": 5}));
    assert_eq!(
        stored.snapshot.policy.ledger.len(),
        1,
        "the note ran before the pause"
    );

    // This process: a new model, new tools, the stored session.
    let model = Arc::new(ScriptedModel::builder().text("Paid 5.").build());
    let mut session = open(
        &dir,
        "paused",
        "parent",
        model.clone(),
        PolicyConfig::new(Budget::UNLIMITED),
    )
    .await;
    assert!(session.machine().is_awaiting_approval());
    let pending = session.machine().approvals().pending();
    assert_eq!(pending.len(), 1);
    let id = pending[0].request_id.clone();
    assert!(matches!(
        session
            .decide(
                &id,
                Decision::Edit {
                    args: json!({"amount": "five"})
                }
            )
            .await,
        Err(DurableError::Approval(
            ApprovalError::InvalidArguments { .. }
        ))
    ));
    session
        .decide(&id, Decision::Approve)
        .await
        .expect("decided");
    let stored = store(&dir)
        .load(&SessionId::new("paused"))
        .await
        .expect("loads");
    assert_eq!(
        stored.snapshot.policy.approvals[0].status,
        ApprovalStatus::Approved,
        "the decision is durable before anything runs"
    );
    assert!(matches!(
        session.decide(&id, Decision::Approve).await,
        Err(DurableError::Approval(ApprovalError::AlreadyDecided { .. }))
    ));

    let last = session.resume().await.expect("resumes");
    assert!(last.done);
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
    assert_eq!(
        model.calls(),
        1,
        "the paused answer is replayed, not asked again"
    );
    let history = session.machine().history();
    assert_eq!(call_count(history), 2);
    assert_eq!(
        tool_results(history),
        [
            r#"{"ok":true,"data":"1 notes"}"#,
            r#"{"ok":true,"data":"paid 5"}"#
        ]
    );
    assert_eq!(
        session.machine().instance().state()["notes"],
        1,
        "the note's state update, made in the child, applies once"
    );
    let history = history.to_vec();
    session.release().await.expect("released");
    let stored = store(&dir)
        .load(&SessionId::new("paused"))
        .await
        .expect("loads");
    assert_eq!(stored.snapshot.history, history);
    assert!(stored.snapshot.policy.answers.is_empty());
    // The decided request stays until it expires (so deciding it again is
    // refused as already decided), but no call is held with it any more.
    assert!(
        stored
            .snapshot
            .policy
            .approvals
            .iter()
            .all(|record| record.held.is_none() && record.status != ApprovalStatus::Pending),
        "{:?}",
        stored.snapshot.policy.approvals
    );
}

#[tokio::test]
async fn a_request_that_expires_while_the_session_is_stored_is_answered_as_expired() {
    let dir = Dir::new("expired");
    // Requests that expire at once: no clock in the test.
    let config = || PolicyConfig::new(Budget::UNLIMITED).confirmation_ttl(Duration::ZERO);
    let first = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .build(),
    );
    let mut session = DurableMachine::create(
        store(&dir),
        SessionId::new("late"),
        WorkerId::new("a"),
        paying_machine(first, &dir, config()),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("pay 5");
    let last = session.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::AwaitingApproval);
    session.release().await.expect("released");

    let model = Arc::new(
        ScriptedModel::builder()
            .text("The approval expired.")
            .build(),
    );
    let mut session = open(&dir, "late", "b", model.clone(), config()).await;
    assert!(session.machine().is_awaiting_approval());
    assert!(
        session.machine().approvals().pending().is_empty(),
        "nothing left to decide"
    );
    session.resume().await.expect("resumes");
    assert_eq!(lines(&dir.path("effects")), 0);
    assert!(tool_results(session.machine().history())[0].contains("CONFIRMATION_EXPIRED"));
    assert_eq!(model.calls(), 1);
}

/// Pays (deduplicated by the call's idempotency key, as a payment
/// provider does), then, the first time, hangs: the moment a worker dies.
/// Needs approval by its own definition, and, since the provider honours
/// the key, says it may run again (at least once) rather than the default
/// of a tool that needs approval.
struct PayThenHang {
    effects: std::path::PathBuf,
    marker: std::path::PathBuf,
}

#[async_trait]
impl markov_core::tool::Tool for PayThenHang {
    const NAME: &'static str = "pay_then_hang";
    const NEEDS_APPROVAL: bool = true;
    const DELIVERY: Option<markov_core::tool::Delivery> =
        Some(markov_core::tool::Delivery::AtLeastOnce);
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
        let key = cx.idempotency_key().unwrap_or("no key").to_owned();
        let paid = std::fs::read_to_string(&self.effects).unwrap_or_default();
        if !paid.lines().any(|line| line.ends_with(&key)) {
            std::fs::write(&self.effects, format!("{paid}paid {} {key}\n", args.amount))?;
        }
        if !self.marker.exists() {
            std::fs::write(&self.marker, "paid, hanging")?;
            std::future::pending::<()>().await;
        }
        Ok(format!("paid {}", args.amount))
    }
}

fn hanging_machine(
    model: Arc<dyn Model>,
    dir: &Dir,
) -> (markov_charter::charter::Charter, StandardExecutor, Machine) {
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(
            PayThenHang {
                effects: dir.path("effects"),
                marker: dir.path("marker"),
            },
            ToolMetadata::new(Category::Action),
        )
        .lock()
        .expect("the registry locks");
    let executor = StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT);
    let (charter, _) = charter();
    let machine = markov_executor::Agent::on_charter_with_executor(
        charter.clone(),
        Arc::new(executor.clone()),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine builds");
    (charter, executor, machine)
}

#[tokio::test]
async fn a_worker_lost_while_a_resumed_call_runs_leaves_a_run_the_next_one_continues() {
    let dir = Dir::new("lost-resume");
    let first = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay_then_hang", json!({"amount": 5}))
            .build(),
    );
    let (_, _, machine) = hanging_machine(first, &dir);
    let mut session = DurableMachine::create_with(
        store(&dir),
        SessionId::new("lost"),
        WorkerId::new("a"),
        machine,
        markov_store::CreateOptions::default().lease(Duration::from_millis(300)),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("pay 5");
    let last = session.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::AwaitingApproval);
    let id = last.approvals[0].request_id.clone();
    session
        .decide(&id, Decision::Approve)
        .await
        .expect("decided");
    {
        // The approved call pays, then hangs: the worker is abandoned there.
        let resume = session.resume();
        futures::pin_mut!(resume);
        let marker = dir.path("marker");
        while !marker.exists() {
            tokio::select! {
                done = &mut resume => panic!("the resume cannot finish: {:?}", done.map(|s| s.yield_reason)),
                () = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
    }
    drop(session);
    assert_eq!(lines(&dir.path("effects")), 1);
    let stored = store(&dir)
        .load(&SessionId::new("lost"))
        .await
        .expect("loads");
    assert!(
        stored.run.is_some(),
        "the resumed run was recorded before its call ran"
    );

    let model = Arc::new(ScriptedModel::builder().text("Paid 5.").build());
    let (charter, executor, _) = hanging_machine(model.clone(), &dir);
    let mut waited = Duration::ZERO;
    let mut session = loop {
        match DurableMachine::open(
            store(&dir),
            SessionId::new("lost"),
            WorkerId::new("b"),
            &agent_on(&charter, Arc::new(executor.clone())),
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
            Err(e) => panic!("cannot take over: {e}"),
        }
    };
    assert!(session.is_interrupted());
    let last = session.run().await.expect("continues");
    assert!(last.done);
    assert_eq!(
        lines(&dir.path("effects")),
        1,
        "run again with the same idempotency key: paid once"
    );
    assert_eq!(model.calls(), 1, "no model call before the call's result");
    let history = session.machine().history();
    assert_eq!(call_count(history), 1);
    assert_eq!(tool_results(history), [r#"{"ok":true,"data":"paid 5"}"#]);
    assert!(!session.machine().is_awaiting_approval());
}
