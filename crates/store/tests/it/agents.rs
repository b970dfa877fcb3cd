//! Agents as tools, durably: a sub-agent waiting for an approval is stored
//! with the caller's session, and the session reopened by another worker
//! continues it once the request is decided, running nothing twice; a
//! worker killed inside a sub-agent (or a sub-agent's sub-agent) leaves a
//! session whose next worker continues inside it, asking no recorded
//! answer again and repeating no side effect, even when the sub-agent is
//! an at-most-once tool; a worker killed once a sub-agent finished, before
//! its caller recorded the result, leaves that result recorded; the
//! sub-agents' steps are in the caller's step traces, under the call that
//! ran them.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use markov_charter::node::Node;
use markov_charter::transition::Transition;
use markov_core::Item;
use markov_core::tool::{Delivery, SharedTool};
use markov_executor::{Agent, YieldReason};
use markov_policy::{Budget, Category, Decision, PolicyConfig, ToolMetadata};
use markov_store::{DurableMachine, SessionId, SqliteStore, Store, WorkerId};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// The assistant, whose `cashier` tool is a sub-agent with `pay`, which
/// needs approval; both answer from scripts.
fn assistant(dir: &Dir, sub: ScriptedModel, caller: ScriptedModel) -> Agent {
    let cashier = Agent::builder("cashier")
        .instructions("You pay.")
        .tool_with(
            Pay(dir.path("effects")),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(sub)
        .build()
        .expect("builds")
        .as_tool("cashier", "Pays.")
        .expect("a valid name");
    Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools([Arc::new(cashier) as markov_core::tool::SharedTool])
        .model(caller)
        .build()
        .expect("builds")
}

#[tokio::test]
async fn a_sub_agent_waiting_for_approval_is_stored_with_the_session_and_continued_by_another_worker()
 {
    let dir = Dir::new("sub-agent");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let agent = assistant(
        &dir,
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .build(),
        ScriptedModel::builder()
            .tool_call("cashier", json!({"request": "pay 5"}))
            .build(),
    );
    let mut session = DurableMachine::create(
        store.clone(),
        SessionId::new("sub"),
        WorkerId::new("first"),
        agent.machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("Pay 5.");
    let paused = session.run().await.expect("runs");
    assert_eq!(paused.yield_reason, YieldReason::AwaitingApproval);
    let request = paused.approvals[0].request_id.clone();
    assert_eq!(paused.approvals[0].tool, "cashier.pay");
    session.release().await.expect("released");
    assert_eq!(lines(&dir.path("effects")), 0, "nothing paid yet");

    // Another worker, the agents built again: nothing waits in memory.
    let sub = ScriptedModel::builder().text("Paid 5.").build();
    let caller = ScriptedModel::builder().text("Done: paid 5.").build();
    let agent = assistant(&dir, sub, caller);
    let mut session = open_when_free(store, "sub", "second", &agent).await;
    session
        .decide(&request, Decision::Approve)
        .await
        .expect("decided");
    let last = session.resume().await.expect("resumes");
    assert_eq!(last.output().as_deref(), Some("Done: paid 5."));
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
}

/// The models of the crash tests' agents, each counting what it is asked.
struct Models {
    /// The assistant, which calls its sub-agent once, then answers.
    caller: Arc<ProviderLike>,
    /// The `desk` sub-agent between them when nested, which calls the
    /// clerk once, then answers.
    desk: Arc<ProviderLike>,
    /// The `clerk` sub-agent, which notifies (at most once) and waits.
    clerk: Arc<ProviderLike>,
}

/// The request every agent passes down (the scripted models call tools
/// only for a request that mentions paying).
const REQUEST: &str = "pay: notify ops";

impl Models {
    fn new(mode: &str) -> Self {
        let clerk = match mode {
            // The notification and the wait in one answer: killed after the
            // notification's result was recorded, before the clerk's next
            // model call.
            "after-tool" => vec![vec![("notify", json!({"to": "ops"})), ("hang", json!({}))]],
            // The notification, then an answer that waits: killed after
            // that second answer was recorded.
            // A payment (at least once, deduplicated by its key) that
            // hangs right after paying: nothing of it is recorded.
            "inside-pay" => vec![vec![("pay", json!({"amount": 5}))]],
            // The notification, then the answer: killed once the clerk
            // finished, before the assistant's ledger recorded its result.
            "after-result" => vec![vec![("notify", json!({"to": "ops"}))]],
            // The clerk hands the work to a helper it spawns, which
            // notifies, then waits: killed inside the spawned helper.
            "spawned" => vec![
                vec![("transition", json!({"to": "delegate", "reason": "help"}))],
                vec![("notify", json!({"to": "ops"}))],
                vec![("hang", json!({}))],
            ],
            "after-answer" | "nested" | "at-most-once" => vec![
                vec![("notify", json!({"to": "ops"}))],
                vec![("hang", json!({}))],
            ],
            other => panic!("unknown mode {other}"),
        };
        let first = if mode == "nested" { "desk" } else { "clerk" };
        Models {
            caller: Arc::new(ProviderLike::new(
                vec![vec![(first, json!({ "request": REQUEST }))]],
                "Done: ops notified.",
            )),
            desk: Arc::new(ProviderLike::new(
                vec![vec![("clerk", json!({ "request": REQUEST }))]],
                "The clerk notified ops.",
            )),
            clerk: Arc::new(ProviderLike::new(clerk, "Notified ops.")),
        }
    }
}

/// The assistant of the crash tests: its `clerk` tool is a sub-agent with
/// `notify` (at most once, counted in `notices`) and `hang` (writes
/// `marker` and hangs the first time); nested, the assistant's tool is
/// `desk`, a sub-agent whose own tool is the clerk. In `at-most-once`
/// mode the clerk is an at-most-once tool of the assistant's.
fn crash_assistant(dir: &Dir, mode: &str, models: &Models) -> Agent {
    let nested = mode == "nested";
    // The notification itself never hangs: its marker is there already.
    let quiet = dir.path("notify-marker");
    std::fs::write(&quiet, "never hang").expect("writes");
    let clerk = if mode == "spawned" {
        spawning_clerk(dir, &quiet, models)
    } else {
        clerk(dir, &quiet, models)
    };
    let clerk = clerk
        .as_tool("clerk", "Notifies people.")
        .expect("a valid name");
    let tool: SharedTool = if nested {
        let desk = Agent::builder("desk")
            .instructions("You hand work to the clerk.")
            .tools([Arc::new(clerk) as SharedTool])
            .shared_model(models.desk.clone())
            .build()
            .expect("builds")
            .as_tool("desk", "Hands work to the clerk.")
            .expect("a valid name");
        Arc::new(desk)
    } else {
        Arc::new(clerk)
    };
    assistant_with(tool, mode, models)
}

/// The clerk: `notify` (at most once, never hanging), `hang` and `pay`.
fn clerk(dir: &Dir, quiet: &std::path::Path, models: &Models) -> Agent {
    Agent::builder("clerk")
        .instructions("You notify people.")
        .tool_with(
            Notify {
                effects: dir.path("notices"),
                marker: quiet.to_owned(),
            },
            ToolMetadata::new(Category::Action).with_delivery(Delivery::AtMostOnce),
        )
        .tool_with(Hang(dir.path("marker")), ToolMetadata::new(Category::Other))
        .tool_with(
            Pay(dir.path("effects")),
            ToolMetadata::new(Category::Action),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .shared_model(models.clerk.clone())
        .build()
        .expect("builds")
}

/// A clerk whose one tool is the `delegate` transition: it spawns a
/// helper, whose tools are `notify` (never hanging) and `hang`.
fn spawning_clerk(dir: &Dir, quiet: &std::path::Path, models: &Models) -> Agent {
    let helper = Node::builder("You notify people.")
        .name("helper")
        .tool(Notify {
            effects: dir.path("notices"),
            marker: quiet.to_owned(),
        })
        .tool(Hang(dir.path("marker")))
        .build()
        .expect("the helper builds");
    let main = Node::builder("You hand work to a helper.")
        .name("main")
        .transition(
            "delegate",
            Transition::code("Hand the work to a helper", move |_| {
                let helper = helper.clone();
                async move { Ok(markov_charter::transition::spawn(helper, None)) }
            }),
        )
        .build()
        .expect("the clerk's node builds");
    Agent::builder("clerk")
        .node("main", main)
        .shared_model(models.clerk.clone())
        .build()
        .expect("builds")
}

/// The rest of the assistant.
fn assistant_with(tool: SharedTool, mode: &str, models: &Models) -> Agent {
    let assistant = Agent::builder("assistant").instructions("You are the assistant.");
    if mode == "at-most-once" {
        return assistant
            .tools_with([(
                tool,
                ToolMetadata::new(Category::Action).with_delivery(Delivery::AtMostOnce),
            )])
            .shared_model(models.caller.clone())
            .build()
            .expect("builds");
    }
    assistant
        .tools([tool])
        .shared_model(models.caller.clone())
        .build()
        .expect("builds")
}

/// The crash child's store: in `after-result` mode, the write of the
/// assistant's ledger entry for the clerk's call (its result, once the
/// clerk finished) writes `marker` and never returns, the moment to kill
/// the process; everything else goes to the SQLite store.
fn hangs_at_result(inner: SqliteStore, marker: Option<std::path::PathBuf>) -> Watched {
    Watched::new(inner, move |call| match (call, &marker) {
        (Call::Journal(entry), Some(marker)) if entry.tool == "clerk" && !entry.started => {
            std::fs::write(marker, "the clerk finished, hanging").expect("writes");
            Then::Hang
        }
        _ => Then::Pass,
    })
}

/// The child process of the sub-agent crash tests: not a test on its own
/// (ignored).
#[test]
#[ignore = "run as a child process by the sub-agent crash tests"]
fn crash_child() {
    let (Some(dir), Some(mode)) = (
        std::env::var_os("MARKOV_CRASH_DIR"),
        std::env::var("MARKOV_CRASH_MODE").ok(),
    ) else {
        return;
    };
    let dir = Dir(dir.into());
    in_child(async {
        let models = Models::new(&mode);
        let agent = crash_assistant(&dir, &mode, &models);
        let store = hangs_at_result(
            SqliteStore::open(dir.path("sessions.db")).expect("the database opens"),
            (mode == "after-result").then(|| dir.path("marker")),
        );
        let mut session = DurableMachine::create_with(
            Arc::new(store),
            SessionId::new("crash"),
            WorkerId::new("child"),
            agent.machine(),
            markov_store::CreateOptions::default().lease(Duration::from_millis(500)),
        )
        .await
        .expect("created");
        session.machine().enqueue_user(REQUEST);
        // Never returns: the clerk's `hang` (or `pay`, or the store's
        // write of the clerk's result) hangs until the process is killed.
        let ran = session.run().await;
        panic!("the run ended: {ran:?}");
    });
    std::mem::forget(dir);
}

/// Kills a worker inside the clerk (`mode`), then lets another worker,
/// with agents and models built afresh, finish the session; returns those
/// models and the reopened session.
async fn crash_and_resume(dir: &Dir, mode: &str) -> (Models, DurableMachine<SqliteStore>) {
    let inside_pay = mode == "inside-pay";
    kill_when_it_hangs("agents::crash_child", dir, mode, inside_pay).await;
    if !inside_pay {
        assert_eq!(
            lines(&dir.path("notices")),
            1,
            "notified once before the crash"
        );
    }
    let models = Models::new(mode);
    let agent = crash_assistant(dir, mode, &models);
    let mut session = open_when_free(store(dir), "crash", "survivor", &agent).await;
    assert!(session.is_interrupted(), "the run was in progress");
    let last = session.run().await.expect("the run continues");
    assert!(last.done);
    assert_eq!(last.output().as_deref(), Some("Done: ops notified."));
    assert_eq!(
        models.caller.served(),
        1,
        "the assistant was asked only for its final answer"
    );
    (models, session)
}

/// The results the assistant's history holds, as the model read them.
fn results(session: &DurableMachine<SqliteStore>) -> Vec<String> {
    tool_results(session.machine().history())
}

#[tokio::test]
async fn a_worker_killed_in_a_sub_agent_after_its_at_most_once_tool_ran_resumes_inside_it() {
    let dir = Dir::new("sub-after-tool");
    let (models, session) = crash_and_resume(&dir, "after-tool").await;
    assert_eq!(lines(&dir.path("notices")), 1, "notified exactly once");
    assert_eq!(
        models.clerk.served(),
        1,
        "the clerk's recorded answer was replayed: it was asked only for its final answer"
    );
    assert_eq!(results(&session), ["Notified ops."]);
    // The resumed step's trace holds each of the clerk's steps once: the
    // replayed one and the final one.
    let steps = store(&dir)
        .steps(&SessionId::new("crash"), 0, 10)
        .await
        .expect("steps");
    let subs: Vec<usize> = steps
        .iter()
        .flat_map(|s| &s.sub_agents)
        .map(|s| s.step.messages.len())
        .collect();
    assert_eq!(
        subs,
        [3, 1],
        "the user message, the answer and its results; then the reply"
    );
}

#[tokio::test]
async fn a_worker_killed_inside_a_sub_agents_payment_pays_it_again_with_the_same_key() {
    let dir = Dir::new("sub-inside-pay");
    let (models, _session) = crash_and_resume(&dir, "inside-pay").await;
    assert_eq!(lines(&dir.path("effects")), 1, "paid once");
    let calls = std::fs::read_to_string(calls_file(&dir.path("effects"))).expect("calls");
    let keys: Vec<&str> = calls.lines().collect();
    assert_eq!(keys.len(), 2, "the interrupted payment ran again");
    assert_eq!(
        keys[0], keys[1],
        "with the same idempotency key: the sub-agent is the same conversation"
    );
    assert_eq!(models.clerk.served(), 1, "its answer was replayed");
}

#[tokio::test]
async fn a_worker_killed_in_a_sub_agent_after_its_answer_was_recorded_asks_no_answer_again() {
    let dir = Dir::new("sub-after-answer");
    let (models, session) = crash_and_resume(&dir, "after-answer").await;
    assert_eq!(lines(&dir.path("notices")), 1, "notified exactly once");
    assert_eq!(
        models.clerk.served(),
        1,
        "both recorded answers of the clerk were replayed: it was asked only for its final answer"
    );
    assert_eq!(results(&session), ["Notified ops."]);
}

#[tokio::test]
async fn a_worker_killed_in_a_nested_sub_agent_resumes_inside_it() {
    let dir = Dir::new("sub-nested");
    let (models, session) = crash_and_resume(&dir, "nested").await;
    assert_eq!(lines(&dir.path("notices")), 1, "notified exactly once");
    assert_eq!(
        models.clerk.served(),
        1,
        "the nested clerk's recorded answers were replayed"
    );
    assert_eq!(
        models.desk.served(),
        1,
        "the desk's recorded answer was replayed: it was asked only for its final answer"
    );
    assert_eq!(results(&session), ["The clerk notified ops."]);
}

#[tokio::test]
async fn a_worker_killed_inside_an_at_most_once_sub_agent_resumes_it_from_its_journal() {
    let dir = Dir::new("sub-at-most-once");
    let (models, session) = crash_and_resume(&dir, "at-most-once").await;
    assert_eq!(lines(&dir.path("notices")), 1, "notified exactly once");
    assert_eq!(
        models.clerk.served(),
        1,
        "the clerk resumed from its records: it was asked only for its final answer"
    );
    assert_eq!(
        results(&session),
        ["Notified ops."],
        "the assistant read the clerk's real answer, not INTERRUPTED"
    );
}

#[tokio::test]
async fn a_worker_killed_inside_an_instance_a_sub_agent_spawned_resumes_inside_it() {
    let dir = Dir::new("sub-spawned");
    let (models, session) = crash_and_resume(&dir, "spawned").await;
    assert_eq!(lines(&dir.path("notices")), 1, "notified exactly once");
    assert_eq!(
        models.clerk.served(),
        1,
        "the clerk's and its helper's recorded answers were replayed: only the helper's final answer was asked"
    );
    assert_eq!(results(&session), ["Notified ops."]);
}

#[tokio::test]
async fn a_worker_killed_after_a_sub_agent_finished_answers_with_its_recorded_result() {
    let dir = Dir::new("sub-after-result");
    let (models, session) = crash_and_resume(&dir, "after-result").await;
    assert_eq!(lines(&dir.path("notices")), 1, "notified exactly once");
    assert_eq!(
        models.clerk.served(),
        0,
        "the clerk's result was recorded before the crash: its last model call is not asked again"
    );
    assert_eq!(results(&session), ["Notified ops."]);
}

/// The id of the one tool call in `history`.
fn only_call_id(history: &[markov_core::Message]) -> String {
    let ids: Vec<String> = history
        .iter()
        .flat_map(|m| m.item_list())
        .filter_map(|item| match item {
            Item::ToolUse { id, .. } => Some(id.to_string()),
            _ => None,
        })
        .collect();
    assert_eq!(ids.len(), 1, "one call: {ids:?}");
    ids[0].clone()
}

#[tokio::test]
async fn a_sub_agents_steps_are_step_traces_of_the_callers_session_under_its_call() {
    let dir = Dir::new("sub-traced");
    // Nothing hangs here: the marker is there already.
    std::fs::write(dir.path("marker"), "never hang").expect("writes");
    let models = Models::new("nested");
    let agent = crash_assistant(&dir, "nested", &models);
    let store = store(&dir);
    let id = SessionId::new("traced");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        agent.machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user(REQUEST);
    let last = session.run().await.expect("runs");
    assert_eq!(last.output().as_deref(), Some("Done: ops notified."));
    let call = only_call_id(session.machine().history());

    let steps = store.steps(&id, 0, 10).await.expect("steps");
    assert_eq!(steps.len(), 2, "the call, then the answer");
    assert!(steps[1].sub_agents.is_empty());
    let subs = &steps[0].sub_agents;
    let seen: Vec<(Vec<String>, &str, usize)> = subs
        .iter()
        .map(|s| {
            (
                s.calls.iter().map(ToString::to_string).collect(),
                s.step.agent.as_str(),
                s.step.messages.len(),
            )
        })
        .collect();
    assert_eq!(
        seen.len(),
        5,
        "three steps of the clerk, two of the desk: {seen:?}"
    );
    for (calls, _, _) in &seen {
        assert_eq!(calls[0], call, "each under the assistant's call");
    }
    let clerk: Vec<_> = seen.iter().filter(|(c, _, _)| c.len() == 2).collect();
    let desk: Vec<_> = seen.iter().filter(|(c, _, _)| c.len() == 1).collect();
    assert_eq!(
        clerk.len(),
        3,
        "the clerk's steps, nested under the desk's call"
    );
    assert!(clerk.iter().all(|(_, agent, _)| *agent == "clerk"));
    assert_eq!(desk.len(), 2);
    assert!(desk.iter().all(|(_, agent, _)| *agent == "desk"));
    // The clerk's first step: its user message, its answer, the result.
    let first = &subs
        .iter()
        .find(|s| s.calls.len() == 2)
        .expect("a clerk step")
        .step;
    assert_eq!(first.history_from, 0);
    assert_eq!(first.messages[0].text(), REQUEST);
    assert_eq!(first.messages.len(), 3);
    assert!(
        first.calls[0].system.contains("You notify people."),
        "its model call is recorded, its system prompt read back"
    );
    let done = subs.iter().filter(|s| s.step.done).count();
    assert_eq!(done, 2, "each sub-agent's run ends once");
}
