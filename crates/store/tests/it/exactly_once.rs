//! Exactly once, with real faults: a worker process killed mid-step, a full
//! disk, a stolen lease, a corrupt row. The model answers as real providers
//! do, with new call ids every time it is asked, so nothing here leans on
//! ids staying the same.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_core::Item;
use markov_core::async_trait;
use markov_core::tool::Delivery;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Executor, Machine, RunOptions, StandardExecutor, YieldReason};
use markov_policy::{
    Budget, Category, Decision, Mode, PolicyConfig, ToolErrorKind, ToolMetadata, ToolRegistry,
};
use markov_store::{
    DurableError, DurableMachine, SessionId, SqliteStore, Store, StoreError, WorkerId,
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

/// What the crash child runs, by `MARKOV_CRASH_MODE`.
fn child_steps(mode: &str) -> Vec<Vec<(&'static str, serde_json::Value)>> {
    match mode {
        // The payment completes (its ledger entry is written), the next
        // call of the same answer hangs.
        "after-ledger" => vec![vec![("pay", json!({"amount": 5})), ("hang", json!({}))]],
        // The payment hangs right after its side effect: nothing of it is
        // recorded but the model's answer.
        "inside-pay" => vec![vec![("pay", json!({"amount": 5}))]],
        // A note (charged to the turn's budget), then the payment hangs.
        "budget" => vec![
            vec![("note", json!({}))],
            vec![("pay", json!({"amount": 5}))],
            vec![("note", json!({}))],
        ],
        // A result too large to keep whole, then a hang.
        "big" => vec![vec![("big", json!({})), ("hang", json!({}))]],
        // The same, called with a double that a parser without exact float
        // reading brings back one digit off.
        "big-float" => vec![vec![
            ("big", json!({"ratio": 212.918_907_267_134_59})),
            ("hang", json!({})),
        ]],
        // An at-most-once notification hangs right after its side effect
        // (stated at most once, or by default as a tool that needs
        // approval).
        "inside-notify" | "approved-notify" | "approved-notify-again" => {
            vec![vec![("notify", json!({"to": "ops"}))]]
        }
        other => panic!("unknown crash mode {other}"),
    }
}

fn crash_budget() -> Budget {
    Budget::UNLIMITED.max_calls(2)
}

#[derive(Debug, Deserialize, JsonSchema)]
struct NoArgs {}

/// Returns nine megabytes (more than the ledger's default bound) and counts
/// its executions in a file.
struct Big(std::path::PathBuf);

#[async_trait]
impl Tool for Big {
    const NAME: &'static str = "big";
    type Args = NoArgs;
    type Output = String;
    type Error = std::io::Error;
    fn description(&self) -> String {
        "A large report".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, std::io::Error> {
        let mut runs = std::fs::read_to_string(&self.0).unwrap_or_default();
        runs.push_str("ran\n");
        std::fs::write(&self.0, runs)?;
        Ok("x".repeat(9 << 20))
    }
}

/// The crash test's executor: the common payments registry plus `big`.
fn crash_executor(
    model: Arc<dyn markov_core::model::Model>,
    dir: &Dir,
    mode: &str,
) -> StandardExecutor {
    match mode {
        "inside-notify" => {
            return notify_executor(
                model,
                dir,
                ToolMetadata::new(Category::Action).with_delivery(Delivery::AtMostOnce),
            );
        }
        // Nothing said of its delivery: needing approval makes it at most
        // once.
        "approved-notify" => {
            return notify_executor(
                model,
                dir,
                ToolMetadata::new(Category::Action).with_confirmation(),
            );
        }
        // Opted back into at least once: it runs again on resume.
        "approved-notify-again" => {
            return notify_executor(
                model,
                dir,
                ToolMetadata::new(Category::Action)
                    .with_confirmation()
                    .with_delivery(Delivery::AtLeastOnce),
            );
        }
        _ => {}
    }
    if mode.starts_with("big") {
        let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
            .register(
                Big(dir.path("big-runs")),
                ToolMetadata::new(Category::Retrieval),
            )
            .register(Hang(dir.path("marker")), ToolMetadata::new(Category::Other))
            .lock()
            .expect("the registry locks");
        return StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT);
    }
    let budget = if mode == "budget" {
        crash_budget()
    } else {
        Budget::UNLIMITED
    };
    executor_with_budget(model, dir.path("effects"), dir.path("marker"), budget)
}

/// The child process of the crash tests: not a test on its own (ignored).
#[test]
#[ignore = "run as a child process by the crash tests"]
fn crash_child() {
    let (Some(dir), Some(mode)) = (
        std::env::var_os("MARKOV_CRASH_DIR"),
        std::env::var("MARKOV_CRASH_MODE").ok(),
    ) else {
        return;
    };
    let dir = Dir(dir.into());
    in_child(async {
        let model = Arc::new(ProviderLike::new(child_steps(&mode), "Paid 5."));
        let (charter, _) = charter();
        let machine = markov_executor::Agent::on_charter_with_executor(
            charter,
            Arc::new(crash_executor(model, &dir, &mode)),
        )
        .state(json!({"notes": 0}))
        .build()
        .map(|agent| agent.machine())
        .expect("machine builds");
        let mut session = DurableMachine::create_with(
            store(&dir),
            SessionId::new("crash"),
            WorkerId::new("child"),
            machine,
            markov_store::CreateOptions::default().lease(Duration::from_millis(500)),
        )
        .await
        .expect("created");
        session.machine().enqueue_user("pay 5");
        if mode.starts_with("approved-notify") {
            let paused = session.run().await.expect("runs until the approval");
            assert_eq!(paused.yield_reason, YieldReason::AwaitingApproval);
            let request = session.machine().approvals().pending()[0]
                .request_id
                .clone();
            session
                .decide(&request, Decision::Approve)
                .await
                .expect("approved");
            // Never returns: the approved call hangs.
            let _ = session.resume().await;
        }
        // Never returns: a tool hangs until the process is killed.
        let _ = session.run().await;
    });
    std::mem::forget(dir);
}

/// Runs the crash child in `mode` until it hangs, then kills it (SIGKILL).
async fn kill_child_when_it_hangs(dir: &Dir, mode: &str) {
    let hang_after_pay = mode == "inside-pay" || mode == "budget";
    kill_when_it_hangs("exactly_once::crash_child", dir, mode, hang_after_pay).await;
}

/// Opens the dead child's session as another worker once its lease expired.
async fn take_over(dir: &Dir, mode: &str, model: Arc<ProviderLike>) -> DurableMachine<SqliteStore> {
    let (charter, _) = charter();
    let executor: Arc<dyn Executor> = Arc::new(crash_executor(model, dir, mode));
    open_when_free(
        store(dir),
        "crash",
        "survivor",
        &agent_on(&charter, executor),
    )
    .await
}

/// The ids of the tool calls in `history`, in order.
fn call_ids(history: &[markov_core::Message]) -> Vec<String> {
    history
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|item| match item {
            Item::ToolUse { id, .. } => Some(id.to_string()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_worker_killed_after_a_payment_is_resumed_without_paying_twice() {
    let dir = Dir::new("killed-after-ledger");
    kill_child_when_it_hangs(&dir, "after-ledger").await;
    let effects = dir.path("effects");
    assert_eq!(lines(&effects), 1, "paid once before the crash");
    let recorded = store(&dir)
        .load(&SessionId::new("crash"))
        .await
        .expect("loads");
    assert_eq!(
        recorded.snapshot.policy.answers.len(),
        1,
        "the answer was durable before its tools ran"
    );
    let answered: Vec<String> = recorded.snapshot.policy.answers[0]
        .response
        .tool_calls()
        .map(|(id, _, _)| id.to_string())
        .collect();

    let model = Arc::new(ProviderLike::new(child_steps("after-ledger"), "Paid 5."));
    let mut session = take_over(&dir, "after-ledger", model.clone()).await;
    assert!(session.is_interrupted(), "the run was in progress");
    let last = session.run().await.expect("the run continues");
    assert!(last.done);
    assert_eq!(lines(&effects), 1, "paid once");
    assert_eq!(
        lines(&calls_file(&effects)),
        1,
        "the completed call was answered from the ledger"
    );
    let history = session.machine().history();
    assert_eq!(
        call_ids(history),
        answered,
        "the resumed step answered the recorded calls"
    );
    assert_eq!(
        model.served(),
        1,
        "the model was asked only for the final reply"
    );
    assert_eq!(history.last().map(|m| m.text()).as_deref(), Some("Paid 5."));
    assert_eq!(
        tool_results(history),
        [
            r#"{"ok":true,"data":"paid 5"}"#,
            r#"{"ok":true,"data":"waited"}"#
        ]
    );
}

#[tokio::test]
async fn a_worker_killed_inside_the_payment_resumes_it_with_the_same_idempotency_key() {
    let dir = Dir::new("killed-inside-pay");
    kill_child_when_it_hangs(&dir, "inside-pay").await;
    let effects = dir.path("effects");
    assert_eq!(lines(&effects), 1, "paid before the crash");

    let model = Arc::new(ProviderLike::new(child_steps("inside-pay"), "Paid 5."));
    let mut session = take_over(&dir, "inside-pay", model).await;
    let last = session.run().await.expect("the run continues");
    assert!(last.done);
    let calls = std::fs::read_to_string(calls_file(&effects)).expect("calls");
    let keys: Vec<&str> = calls.lines().collect();
    assert_eq!(
        keys.len(),
        2,
        "the interrupted call ran again: nothing recorded that it finished"
    );
    assert_eq!(keys[0], keys[1], "with the same idempotency key");
    assert!(!keys[0].ends_with("no key"), "{keys:?}");
    assert_eq!(
        lines(&effects),
        1,
        "so the payment provider deduplicated it: paid once"
    );
}

/// Kills the crash child of `mode` inside its at-most-once `notify` call,
/// resumes its session in another worker, and checks that the call was
/// answered `INTERRUPTED`, once, without running again, and named to the
/// application in a step.
async fn an_interrupted_notification_is_not_sent_again(mode: &str) {
    let dir = Dir::new(mode);
    kill_child_when_it_hangs(&dir, mode).await;
    let notices = dir.path("notices");
    assert_eq!(lines(&notices), 1, "notified before the crash");
    let recorded = store(&dir)
        .load(&SessionId::new("crash"))
        .await
        .expect("loads");
    let started: Vec<_> = recorded
        .snapshot
        .policy
        .ledger
        .iter()
        .filter(|e| e.started)
        .collect();
    assert_eq!(started.len(), 1, "the start was durable before the effect");
    let answered: Vec<String> = recorded.snapshot.policy.answers[0]
        .response
        .tool_calls()
        .map(|(id, _, _)| id.to_string())
        .collect();

    let model = Arc::new(ProviderLike::new(child_steps(mode), "Paid 5."));
    let mut session = take_over(&dir, mode, model.clone()).await;
    assert!(session.is_interrupted(), "the run was in progress");
    let mut steps = Vec::new();
    let last = session
        .run_each_step(|step| steps.push(step.clone()))
        .await
        .expect("the run continues");
    assert!(last.done);
    assert_eq!(lines(&notices), 1, "not run again");
    let history = session.machine().history();
    assert_eq!(
        call_ids(history),
        answered,
        "the recorded call was answered"
    );
    let (result, is_error) = only_result(history);
    assert!(is_error, "{result}");
    let envelope: serde_json::Value = serde_json::from_str(&result).expect("an envelope");
    assert_eq!(
        envelope["error"]["type"],
        ToolErrorKind::Interrupted.as_str(),
        "{result}"
    );
    let message = envelope["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("outcome is unknown") && message.contains("not run again"),
        "{message}"
    );
    let interrupted: Vec<_> = steps.iter().flat_map(|s| s.interrupted.clone()).collect();
    assert_eq!(interrupted.len(), 1, "named once to the application");
    assert_eq!(interrupted[0].call_id.to_string(), answered[0]);
    assert_eq!(interrupted[0].tool, "notify");
    assert_eq!(interrupted[0].args, json!({"to": "ops"}));
    assert_eq!(
        model.served(),
        1,
        "the model was asked only for the reply after the interrupted result"
    );
    assert_eq!(history.last().map(|m| m.text()).as_deref(), Some("Paid 5."));
}

#[tokio::test]
async fn a_worker_killed_inside_an_at_most_once_call_answers_it_interrupted_and_never_runs_it_again()
 {
    an_interrupted_notification_is_not_sent_again("inside-notify").await;
}

#[tokio::test]
async fn an_approved_call_is_at_most_once_by_default_and_a_crash_inside_it_never_runs_it_again() {
    an_interrupted_notification_is_not_sent_again("approved-notify").await;
}

#[tokio::test]
async fn an_approved_call_opted_into_at_least_once_runs_again_after_a_crash_inside_it() {
    let mode = "approved-notify-again";
    let dir = Dir::new(mode);
    kill_child_when_it_hangs(&dir, mode).await;
    let notices = dir.path("notices");
    assert_eq!(lines(&notices), 1, "notified before the crash");
    let model = Arc::new(ProviderLike::new(child_steps(mode), "Paid 5."));
    let mut session = take_over(&dir, mode, model).await;
    let mut steps = Vec::new();
    let last = session
        .run_each_step(|step| steps.push(step.clone()))
        .await
        .expect("the run continues");
    assert!(last.done);
    assert_eq!(lines(&notices), 2, "run again: nothing recorded its start");
    let (result, is_error) = only_result(session.machine().history());
    assert!(!is_error && result.contains("notified ops"), "{result}");
    assert!(steps.iter().all(|s| s.interrupted.is_empty()));
}

#[tokio::test]
async fn new_input_to_an_interrupted_session_waits_for_the_interrupted_answer() {
    let dir = Dir::new("new-input");
    kill_child_when_it_hangs(&dir, "after-ledger").await;
    let model = Arc::new(ProviderLike::new(child_steps("after-ledger"), "Paid 5."));
    let mut session = take_over(&dir, "after-ledger", model.clone()).await;
    session.machine().enqueue_user("thanks");
    let last = session.run().await.expect("runs");
    assert!(last.done);
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
    let texts: Vec<(markov_core::message::Role, String)> = session
        .machine()
        .history()
        .iter()
        .filter(|m| !m.text().is_empty())
        .map(|m| (m.role, m.text()))
        .collect();
    use markov_core::message::Role::{Assistant, User};
    assert_eq!(
        texts,
        [
            (User, "pay 5".to_owned()),
            (Assistant, "Paid 5.".to_owned()),
            (User, "thanks".to_owned()),
            (Assistant, "You said: thanks".to_owned()),
        ],
        "the interrupted turn finished first, then the new input was answered"
    );
}

#[tokio::test]
async fn the_budgets_of_a_turn_survive_a_crash_inside_it() {
    let dir = Dir::new("budget");
    kill_child_when_it_hangs(&dir, "budget").await;
    let model = Arc::new(ProviderLike::new(child_steps("budget"), "Paid 5."));
    let mut session = take_over(&dir, "budget", model).await;
    let last = session.run().await.expect("the run continues");
    assert!(last.done);
    let results = tool_results(session.machine().history());
    assert_eq!(results.len(), 3, "{results:?}");
    assert!(
        results[0].contains("\"ok\":true"),
        "the first note: {}",
        results[0]
    );
    assert!(results[1].contains("paid 5"), "the payment: {}", results[1]);
    assert!(
        results[2].contains("BUDGET_EXCEEDED"),
        "the third call of the turn is over its budget of two: {}",
        results[2]
    );
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
}

#[tokio::test]
async fn a_result_too_large_for_the_ledger_still_keeps_its_call_from_running_again() {
    let dir = Dir::new("big");
    kill_child_when_it_hangs(&dir, "big").await;
    assert_eq!(lines(&dir.path("big-runs")), 1);
    let model = Arc::new(ProviderLike::new(child_steps("big"), "Done."));
    // The question of this mode mentions paying, so the model calls tools.
    let mut session = take_over(&dir, "big", model).await;
    let last = session.run().await.expect("the run continues");
    assert!(last.done);
    assert_eq!(
        lines(&dir.path("big-runs")),
        1,
        "the large call did not run again"
    );
    let results = tool_results(session.machine().history());
    assert!(
        results[0].contains("too large to keep"),
        "{}",
        &results[0][..200.min(results[0].len())]
    );
}

#[tokio::test]
async fn a_large_result_of_a_call_with_a_float_argument_is_replayed_after_a_crash() {
    let dir = Dir::new("big-float");
    kill_child_when_it_hangs(&dir, "big-float").await;
    assert_eq!(lines(&dir.path("big-runs")), 1);
    let model = Arc::new(ProviderLike::new(child_steps("big-float"), "Done."));
    let mut session = take_over(&dir, "big-float", model).await;
    let last = session.run().await.expect("the run continues");
    assert!(last.done);
    assert_eq!(
        lines(&dir.path("big-runs")),
        1,
        "the call did not run again"
    );
    let results = tool_results(session.machine().history());
    // The stored answer's arguments read back bit-identical, so they match
    // the digest the ledger kept of them: the call is known complete.
    assert!(
        results[0].contains("too large to keep"),
        "{}",
        &results[0][..200.min(results[0].len())]
    );
}

/// A payment whose side effect fills the disk the database is on: the
/// writes after it fail for real (`SQLITE_FULL`).
struct PayAndFill {
    pay: Pay,
    ballast: std::path::PathBuf,
    /// Set once the disk was filled (it is filled only once).
    filled: std::path::PathBuf,
}

#[async_trait]
impl Tool for PayAndFill {
    const NAME: &'static str = "pay";
    type Args = PayArgs;
    type Output = String;
    type Error = std::io::Error;
    fn description(&self) -> String {
        "Pay an amount".into()
    }
    async fn call(&self, args: PayArgs, cx: &ToolContext<'_>) -> Result<String, std::io::Error> {
        let paid = self.pay.call(args, cx).await?;
        if !self.filled.exists() {
            std::fs::write(&self.filled, "filled")?;
            use std::io::Write;
            let mut file = std::fs::File::create(&self.ballast)?;
            let chunk = vec![0u8; 64 << 10];
            // Until the disk is full: the error is the point.
            while file
                .write_all(&chunk)
                .and_then(|()| file.sync_all())
                .is_ok()
            {}
        }
        Ok(paid)
    }
}

/// A small tmpfs of its own, unmounted when dropped.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(dir: &Dir) -> Option<SmallDisk> {
        let at = dir.path("tmpfs");
        std::fs::create_dir_all(&at).ok()?;
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=2m", "tmpfs"])
            .arg(&at)
            .status()
            .is_ok_and(|s| s.success());
        if mounted {
            Some(SmallDisk(at))
        } else if std::env::var_os("CI").is_some() {
            panic!("CI must be able to mount a tmpfs (run as root) for the full-disk test");
        } else {
            eprintln!("skipped: this user cannot mount a tmpfs for the full-disk test");
            None
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_full_disk_after_a_payment_fails_the_run_and_the_resumed_session_pays_once() {
    let dir = Dir::new("full-disk");
    let Some(disk) = SmallDisk::mount(&dir) else {
        return;
    };
    let database = disk.0.join("sessions.db");
    let effects = dir.path("effects");
    let ballast = disk.0.join("ballast");
    let session_for = |store: Arc<SqliteStore>| {
        let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
            .register(
                PayAndFill {
                    pay: Pay(effects.clone()),
                    ballast: ballast.clone(),
                    filled: dir.path("filled"),
                },
                ToolMetadata::new(Category::Action),
            )
            .lock()
            .expect("the registry locks");
        let model = Arc::new(ProviderLike::new(
            vec![vec![("pay", json!({"amount": 7}))]],
            "Paid 7.",
        ));
        let executor =
            StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT);
        (store, executor)
    };

    let (store, executor) = session_for(Arc::new(SqliteStore::open(&database).expect("opens")));
    let (charter, _) = charter();
    let machine =
        markov_executor::Agent::on_charter_with_executor(charter.clone(), Arc::new(executor))
            .state(json!({"notes": 0}))
            .build()
            .map(|agent| agent.machine())
            .expect("machine");
    let mut session =
        DurableMachine::create(store, SessionId::new("full"), WorkerId::new("w"), machine)
            .await
            .expect("created");
    session.machine().enqueue_user("pay 7");
    let failed = session.run().await;
    assert!(
        matches!(&failed, Err(DurableError::Store(StoreError::Backend(e))) if e.contains("full")),
        "the step could not be written: {failed:?}"
    );
    assert_eq!(lines(&effects), 1, "paid before the disk filled");
    drop(session);

    // The operator frees the disk; a new process opens the session.
    std::fs::remove_file(&ballast).expect("the ballast goes");
    let (store, executor) = session_for(Arc::new(SqliteStore::open(&database).expect("opens")));
    let mut session = DurableMachine::open(
        store,
        SessionId::new("full"),
        WorkerId::new("w"),
        &agent_on(&charter, Arc::new(executor)),
    )
    .await
    .expect("opens");
    let last = session.run().await.expect("the run continues");
    assert!(last.done);
    assert_eq!(lines(&effects), 1, "paid once");
    assert_eq!(
        session
            .machine()
            .history()
            .last()
            .map(|m| m.text())
            .as_deref(),
        Some("Paid 7.")
    );
}

#[derive(Debug, Deserialize, JsonSchema)]
struct SleepArgs {
    ms: u64,
}

/// Takes its time.
struct Slow;

#[async_trait]
impl Tool for Slow {
    const NAME: &'static str = "slow";
    type Args = SleepArgs;
    type Output = String;
    type Error = std::convert::Infallible;
    fn description(&self) -> String {
        "Work for a while".into()
    }
    async fn call(&self, args: SleepArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        tokio::time::sleep(Duration::from_millis(args.ms)).await;
        Ok("worked".into())
    }
}

fn slow_then_pay_machine(dir: &Dir, ms: u64) -> Machine {
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(Slow, ToolMetadata::new(Category::Other))
        .register(
            Pay(dir.path("effects")),
            ToolMetadata::new(Category::Action),
        )
        .lock()
        .expect("the registry locks");
    let model = Arc::new(ProviderLike::new(
        vec![vec![
            ("slow", json!({"ms": ms})),
            ("pay", json!({"amount": 1})),
        ]],
        "Paid 1.",
    ));
    let (charter, _) = charter();
    markov_executor::Agent::on_charter_with_executor(
        charter,
        Arc::new(StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT)),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine")
}

/// Creates session `id` for worker `first` with a 300 ms lease and runs,
/// in a task of its own, a turn that works for `ms` and then pays.
async fn run_slow_then_pay(
    dir: &Dir,
    store: &Arc<SqliteStore>,
    id: &SessionId,
    ms: u64,
) -> tokio::task::JoinHandle<Result<(), DurableError>> {
    let mut session = DurableMachine::create_with(
        store.clone(),
        id.clone(),
        WorkerId::new("first"),
        slow_then_pay_machine(dir, ms),
        markov_store::CreateOptions::default().lease(Duration::from_millis(300)),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("pay 1");
    tokio::spawn(async move { session.run().await.map(|_| ()) })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_longer_than_the_lease_keeps_it() {
    let dir = Dir::new("heartbeat");
    let store = store(&dir);
    let id = SessionId::new("long");
    let run = run_slow_then_pay(&dir, &store, &id, 1500).await;
    // Another worker keeps trying while the slow tool runs five leases long.
    for _ in 0..25 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            matches!(
                store
                    .acquire(&id, &WorkerId::new("second"), Duration::from_secs(60))
                    .await,
                Err(StoreError::Leased { .. })
            ),
            "the session was taken from the worker running its tool"
        );
    }
    run.await
        .expect("joins")
        .expect("the first worker finishes its run");
    assert_eq!(lines(&dir.path("effects")), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_lost_its_lease_runs_nothing_more_and_says_so() {
    let dir = Dir::new("lost-lease");
    let store = store(&dir);
    let id = SessionId::new("stolen");
    let run = run_slow_then_pay(&dir, &store, &id, 1000).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    // An operator (or a bug elsewhere) hands the session to another worker
    // while the slow tool runs.
    store
        .release(&id, &WorkerId::new("first"))
        .await
        .expect("released");
    store
        .acquire(&id, &WorkerId::new("second"), Duration::from_secs(60))
        .await
        .expect("the second worker takes it");
    let outcome = run.await.expect("joins");
    assert!(
        matches!(
            outcome,
            Err(DurableError::Store(StoreError::LeaseLost { .. }))
        ),
        "{outcome:?}"
    );
    assert_eq!(
        lines(&dir.path("effects")),
        0,
        "the payment after the lost lease never ran"
    );
}

#[tokio::test]
async fn a_corrupt_row_is_repaired_and_the_session_opens_again() {
    let dir = Dir::new("repair");
    let store = store(&dir);
    let id = SessionId::new("broken");
    let model = Arc::new(ProviderLike::new(vec![vec![("note", json!({}))]], "Noted."));
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        machine(model.clone(), &dir),
    )
    .await
    .expect("created");
    for text in ["pay attention", "and again, pay attention"] {
        session.machine().enqueue_user(text);
        session.run().await.expect("runs");
    }
    // The row of the second turn's tool results goes bad on disk; what
    // reads back ends with a call that has no result, so the repair cuts
    // back to before that call.
    let history = session.machine().history().to_vec();
    let bad = history
        .iter()
        .rposition(|m| {
            m.item_list()
                .iter()
                .any(|i| matches!(i, Item::ToolResult { .. }))
        })
        .expect("the second turn's results");
    let call = history[..bad]
        .iter()
        .rposition(|m| {
            m.item_list()
                .iter()
                .any(|i| matches!(i, Item::ToolUse { .. }))
        })
        .expect("the second turn's call");
    session.release().await.expect("released");
    let raw = rusqlite::Connection::open(dir.path("sessions.db")).expect("opens");
    raw.execute(
        "UPDATE messages SET body = '{\"role\":\"user\",\"items\":[{\"type\":' WHERE session_id = 'broken' AND seq = ?1",
        [bad as i64],
    )
    .expect("corrupted");
    drop(raw);
    let (charter, _) = charter();
    let executor: Arc<dyn Executor> = Arc::new(executor(
        model.clone(),
        dir.path("effects"),
        dir.path("marker"),
    ));
    let opened = DurableMachine::open(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        &agent_on(&charter, executor.clone()),
    )
    .await;
    assert!(
        matches!(
            &opened,
            Err(DurableError::Store(StoreError::Corrupt { .. }))
        ),
        "{opened:?}"
    );

    store
        .acquire(&id, &WorkerId::new("w"), Duration::from_secs(60))
        .await
        .expect("leased");
    let report = store
        .repair(&id, &WorkerId::new("w"))
        .await
        .expect("repaired");
    assert_eq!(
        report.messages_kept, call as u64,
        "up to the second turn's call"
    );
    assert_eq!(report.messages_dropped, (history.len() - call) as u64);
    assert_eq!(
        report.first_unreadable.as_ref().map(|(at, _)| *at),
        Some(bad as u64)
    );
    assert!(report.to_string().contains("did not read back"), "{report}");
    let mut session = DurableMachine::open(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        &agent_on(&charter, executor),
    )
    .await
    .expect("opens after the repair");
    assert_eq!(session.machine().history(), &history[..call]);
    session.machine().enqueue_user("pay attention once more");
    let last = session.run().await.expect("runs again");
    assert!(last.done);
    assert!(
        store
            .repair(&id, &WorkerId::new("w"))
            .await
            .expect("checks")
            .is_clean()
    );
}

/// A balance that changes between turns.
struct Balance(std::sync::atomic::AtomicU32);

#[async_trait]
impl Tool for Balance {
    const NAME: &'static str = "balance";
    type Args = NoArgs;
    type Output = String;
    type Error = std::convert::Infallible;
    fn description(&self) -> String {
        "The balance".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let n = self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(format!("balance {}", 100 - n))
    }
}

#[tokio::test]
async fn a_call_id_reused_in_a_later_turn_is_a_new_call() {
    let model = Arc::new(
        markov_testkit::ScriptedModel::builder()
            .response(calls(&[("same-id", "balance", json!({}))]))
            .text("First.")
            .response(calls(&[("same-id", "balance", json!({}))]))
            .text("Second.")
            .build(),
    );
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(Balance(0.into()), ToolMetadata::new(Category::Retrieval))
        .lock()
        .expect("locks");
    let (charter, _) = charter();
    let mut machine = markov_executor::Agent::on_charter_with_executor(
        charter,
        Arc::new(StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT)),
    )
    .state(json!({"notes": 0}))
    .build()
    .map(|agent| agent.machine())
    .expect("machine");
    for text in ["balance?", "and now?"] {
        machine.enqueue_user(text);
        markov_executor::run_to_completion(&mut machine, RunOptions::default())
            .await
            .expect("runs");
    }
    let results = tool_results(machine.history());
    assert_eq!(
        results,
        [
            r#"{"ok":true,"data":"balance 100"}"#,
            r#"{"ok":true,"data":"balance 99"}"#
        ],
        "the second turn's call ran: never the earlier turn's stale answer"
    );
}
