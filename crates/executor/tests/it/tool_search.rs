//! Tool search: deferred tools are not offered until `search_tools` finds
//! them; what it finds is appended to the offered list for the turn (or the
//! session), survives a snapshot, and runs through the same policies as
//! any offered tool (approvals, budgets, at-most-once).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::async_trait;
use markov_core::tool::{DynTool, ToolCallError, ToolContext, ToolDefinition, ToolOutcome};
use markov_executor::{
    Action, Instance, Machine, RunOptions, RunState, StandardExecutor, YieldReason, run_leaves,
    serialize_machine,
};
use markov_policy::{
    Budget, Category, FoundScope, Journal, LedgerEntry, Mode, PolicyConfig, RecordedAnswer,
    ToolMetadata, ToolRegistry, ToolRegistryBuilder, ToolSearch,
};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::Pay;
use serde_json::{Value, json};

/// A deferred tool that only answers its name: the haystack.
#[derive(Debug)]
struct Filler(ToolDefinition);

#[async_trait]
impl DynTool for Filler {
    fn definition(&self) -> &ToolDefinition {
        &self.0
    }
    async fn call_json(&self, _: &Value, _: ToolContext<'_>) -> Result<ToolOutcome, ToolCallError> {
        Ok(ToolOutcome::Value(json!(self.0.name.as_str())))
    }
}

/// `lookup` offered up front, `pay` deferred (with `pay_metadata`) among
/// 40 deferred fillers about weather stations.
fn registry(config: PolicyConfig, pay: &Pay, pay_metadata: ToolMetadata) -> Arc<ToolRegistry> {
    let mut b: ToolRegistryBuilder = ToolRegistry::builder(config)
        .register(Lookup, ToolMetadata::new(Category::Retrieval))
        .register(pay.clone(), pay_metadata.deferred());
    for i in 0..40 {
        let def = ToolDefinition::new(
            format!("station_{i}"),
            format!("Reads the weather at station {i}"),
            json!({"type": "object", "properties": {"unit": {"type": "string"}}}),
        )
        .expect("a valid name");
        b = b.register_shared(
            Arc::new(Filler(def)),
            ToolMetadata::new(Category::Retrieval).deferred(),
        );
    }
    Arc::new(b.lock().expect("the registry locks"))
}

#[markov_core::tool]
/// Looks a customer up.
async fn lookup(
    /// Who.
    who: String,
) -> String {
    format!("{who} is a customer")
}

fn charter_and_node() -> (Charter, Node) {
    let node = Node::builder("You help with payments.")
        .name("main")
        .build()
        .expect("node builds");
    let charter = Charter::builder("search")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    (charter, node)
}

fn machine(model: &Arc<ScriptedModel>, registry: Arc<ToolRegistry>) -> Machine {
    let (charter, node) = charter_and_node();
    machine_on(
        charter,
        StandardExecutor::shared(model.clone()).with_registry(registry, Mode::TEXT),
        Instance::new(node, json!({})),
    )
    .expect("machine builds")
}

fn offered(model: &ScriptedModel) -> Vec<Vec<String>> {
    model
        .requests()
        .iter()
        .map(|r| r.tool_names().iter().map(|n| (*n).to_owned()).collect())
        .collect()
}

fn contents(m: &Machine) -> Vec<String> {
    all_results(m.history())
        .into_iter()
        .map(|(_, c, _)| c)
        .collect()
}

#[tokio::test]
async fn a_deferred_tool_is_offered_only_once_found_appended_at_the_end_and_runs() {
    let pay = Pay::default();
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "pay an amount"}))
            .tool_call("pay", json!({"amount": 5}))
            .text("Paid.")
            .build(),
    );
    let mut m = machine(
        &model,
        registry(
            PolicyConfig::new(Budget::UNLIMITED),
            &pay,
            ToolMetadata::new(Category::Action),
        ),
    );
    m.enqueue_user("pay 5");
    let (_, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_paired(m.history());
    assert_eq!(pay.paid(), [5]);
    let offered = offered(&model);
    assert_eq!(offered[0], ["lookup", "search_tools"], "nothing deferred");
    assert_eq!(
        offered[1],
        ["lookup", "search_tools", "pay"],
        "the found tool after the others: the earlier list is a prefix"
    );
    assert_eq!(offered[2], offered[1]);
    let results = contents(&m);
    assert!(
        results[0].starts_with(r#"{"ok":true,"data":{"note":"These tools are now offered: call them directly.","tools":[{"description":"Pays an amount.","name":"pay"}"#),
        "{}",
        results[0]
    );
    assert_eq!(results[1], r#"{"ok":true,"data":"paid 5"}"#);
}

#[tokio::test]
async fn found_tools_are_offered_for_the_turn_by_default_and_for_the_session_when_set() {
    for (scope, second_turn) in [
        (FoundScope::Turn, vec!["lookup", "search_tools"]),
        (FoundScope::Session, vec!["lookup", "search_tools", "pay"]),
    ] {
        let pay = Pay::default();
        let model = Arc::new(
            ScriptedModel::builder()
                .tool_call("search_tools", json!({"query": "pay"}))
                .text("Found it.")
                .text("Hello again.")
                .build(),
        );
        let config =
            PolicyConfig::new(Budget::UNLIMITED).tool_search(ToolSearch::new().scope(scope));
        let mut m = machine(
            &model,
            registry(config, &pay, ToolMetadata::new(Category::Action)),
        );
        m.enqueue_user("find a way to pay");
        run_all(&mut m, RunOptions::default()).await;
        m.enqueue_user("hi");
        run_all(&mut m, RunOptions::default()).await;
        let offered = offered(&model);
        assert_eq!(offered[1], ["lookup", "search_tools", "pay"], "{scope:?}");
        assert_eq!(offered[2], second_turn, "{scope:?}");
    }
}

#[tokio::test]
async fn what_was_found_is_kept_by_the_snapshot_and_offered_after_a_restore() {
    let pay = Pay::default();
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "pay"}))
            .text("Found it.")
            .build(),
    );
    let config = || {
        PolicyConfig::new(Budget::UNLIMITED)
            .tool_search(ToolSearch::new().scope(FoundScope::Session))
    };
    let mut m = machine(
        &model,
        registry(config(), &pay, ToolMetadata::new(Category::Action)),
    );
    m.enqueue_user("find a way to pay");
    run_all(&mut m, RunOptions::default()).await;
    let text = serde_json::to_string(&serialize_machine(&m).expect("serializes")).expect("json");
    drop(m);

    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 3}))
            .text("Paid.")
            .build(),
    );
    let (charter, _) = charter_and_node();
    let mut m = restore_on(
        charter,
        Arc::new(StandardExecutor::shared(model.clone()).with_registry(
            registry(config(), &pay, ToolMetadata::new(Category::Action)),
            Mode::TEXT,
        )),
        serde_json::from_str(&text).expect("reads"),
    )
    .expect("restores");
    m.enqueue_user("pay 3");
    run_all(&mut m, RunOptions::default()).await;
    assert_eq!(offered(&model)[0], ["lookup", "search_tools", "pay"]);
    assert_eq!(pay.paid(), [3]);
}

#[tokio::test]
async fn a_found_tool_that_needs_approval_pauses_the_run_like_an_offered_one() {
    let pay = Pay::default();
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "pay"}))
            .tool_call("pay", json!({"amount": 5}))
            .text("Paid.")
            .build(),
    );
    let mut m = machine(
        &model,
        registry(
            PolicyConfig::new(Budget::UNLIMITED),
            &pay,
            ToolMetadata::new(Category::Action).with_confirmation(),
        ),
    );
    m.enqueue_user("pay 5");
    let last = m.run().await.expect("runs");
    assert_eq!(last.yield_reason, YieldReason::AwaitingApproval);
    assert!(pay.paid().is_empty(), "not before the approval");
    m.approvals()
        .approve(&last.approvals[0].request_id)
        .expect("approves");
    m.resume().await.expect("resumes");
    assert_eq!(pay.paid(), [5]);
    assert_paired(m.history());
}

#[tokio::test]
async fn a_found_tool_is_charged_to_the_turn_budget_like_an_offered_one() {
    let pay = Pay::default();
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "pay"}))
            .tool_call("pay", json!({"amount": 1}))
            .tool_call("pay", json!({"amount": 2}))
            .text("Stopped.")
            .build(),
    );
    let mut m = machine(
        &model,
        registry(
            PolicyConfig::new(Budget::UNLIMITED.max_calls(2)),
            &pay,
            ToolMetadata::new(Category::Action),
        ),
    );
    m.enqueue_user("pay twice");
    run_all(&mut m, RunOptions::default()).await;
    assert_eq!(
        pay.paid(),
        [1],
        "the search and one payment fill the budget"
    );
    assert!(
        contents(&m)[2].contains("BUDGET_EXCEEDED"),
        "{:?}",
        contents(&m)
    );
}

#[tokio::test]
async fn a_search_in_a_mode_finds_only_the_tools_that_mode_allows() {
    let pay = Pay::default();
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "pay"}))
            .text("Nothing.")
            .build(),
    );
    let mut m = machine(
        &model,
        registry(
            PolicyConfig::new(Budget::UNLIMITED),
            &pay,
            ToolMetadata::new(Category::Action).with_modes([Mode::VOICE]),
        ),
    );
    m.enqueue_user("pay");
    run_all(&mut m, RunOptions::default()).await;
    assert!(
        contents(&m)[0].contains(r#""tools":[]"#),
        "{:?}",
        contents(&m)
    );
    assert_eq!(offered(&model)[1], ["lookup", "search_tools"]);
}

// --- at most once ------------------------------------------------------------

#[derive(Default)]
struct Kept {
    answers: Mutex<Vec<RecordedAnswer>>,
    ledger: Mutex<Vec<LedgerEntry>>,
}

struct AppJournal(Arc<Kept>);

#[async_trait]
impl Journal for AppJournal {
    async fn write(&self, entry: &LedgerEntry) -> Result<(), String> {
        self.0.ledger.lock().expect("lock").push(entry.clone());
        Ok(())
    }

    async fn write_answers(&self, answers: &[RecordedAnswer]) -> Result<(), String> {
        *self.0.answers.lock().expect("lock") = answers.to_vec();
        Ok(())
    }
}

/// A found at-most-once tool whose call is interrupted after its effect is
/// answered `INTERRUPTED` after a restore and never runs again, exactly as
/// an offered one.
#[tokio::test]
async fn a_found_at_most_once_call_interrupted_is_answered_interrupted_after_a_restore() {
    let sent = Arc::new(AtomicUsize::new(0));
    let hung = Arc::new(AtomicBool::new(false));
    let email = SendEmail {
        sent: Arc::clone(&sent),
        hung: Arc::clone(&hung),
    };
    let registry = Arc::new(
        ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
            .register(email, ToolMetadata::new(Category::Action).deferred())
            .lock()
            .expect("locks"),
    );
    let (charter, node) = charter_and_node();
    let model = Arc::new(
        ScriptedModel::builder()
            .tool_call("search_tools", json!({"query": "email"}))
            .tool_call("send_email", json!({}))
            .text("Not sure it went.")
            .build()
            .fresh_call_ids(),
    );
    let executor = || {
        Arc::new(
            StandardExecutor::shared(model.clone()).with_registry(registry.clone(), Mode::TEXT),
        )
    };
    let mut machine =
        machine_on_shared(charter.clone(), executor(), Instance::new(node, json!({})))
            .expect("machine");
    let kept = Arc::new(Kept::default());
    machine
        .policy_state()
        .set_journal(Arc::new(AppJournal(Arc::clone(&kept))));
    machine.enqueue_user("send it");
    let mut state = RunState::new(RunOptions::default());
    // The search step runs to its end.
    let Action::RunLeaves(tasks) = state.next(&mut machine).expect("a step") else {
        panic!("the step runs a leaf");
    };
    let results = run_leaves(&machine, &state, &tasks).await;
    state
        .on_leaf_results(&mut machine, &tasks, results)
        .expect("recorded");
    // The email step dies while the tool runs.
    let tasks = loop {
        match state.next(&mut machine).expect("a step") {
            Action::RunLeaves(tasks) => break tasks,
            _ => continue,
        }
    };
    let mut saved = serialize_machine(&machine)
        .expect("serializes")
        .into_owned();
    assert_eq!(
        saved.policy.found.len(),
        1,
        "the found tool is in the snapshot"
    );
    let saved_run = state.clone();
    let interrupted = tokio::time::timeout(
        Duration::from_millis(300),
        run_leaves(&machine, &state, &tasks),
    )
    .await;
    assert!(interrupted.is_err(), "the step never finished");
    assert_eq!(sent.load(Ordering::SeqCst), 1);
    drop(machine);

    saved.policy.answers = kept.answers.lock().expect("lock").clone();
    saved.policy.ledger = kept.ledger.lock().expect("lock").clone();
    let mut machine = restore_on(charter, executor(), saved).expect("restores");
    let mut state = saved_run;
    loop {
        match state.next(&mut machine).expect("steps") {
            Action::RunLeaves(tasks) => {
                let results = run_leaves(&machine, &state, &tasks).await;
                state
                    .on_leaf_results(&mut machine, &tasks, results)
                    .expect("recorded");
            }
            Action::Yield(_) => {}
            _ => break,
        }
    }
    assert_eq!(sent.load(Ordering::SeqCst), 1, "not sent again");
    assert_paired(machine.history());
    let results = contents(&machine);
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[1].contains("\"INTERRUPTED\""), "{}", results[1]);
}

// --- a provider's own tool search ----------------------------------------------

/// A scripted model whose provider searches tools itself, keeping the
/// deferred tools of each request.
#[derive(Debug)]
struct Native {
    inner: Arc<ScriptedModel>,
    deferred: Mutex<Vec<Vec<String>>>,
}

#[async_trait]
impl markov_core::model::ModelLayer for Native {
    type Inner = ScriptedModel;

    fn inner(&self) -> &ScriptedModel {
        &self.inner
    }

    async fn complete(
        &self,
        request: markov_core::model::ModelRequest<'_>,
    ) -> Result<markov_core::model::ModelResponse, markov_core::model::ModelError> {
        self.deferred.lock().expect("lock").push(
            request
                .deferred_tools()
                .iter()
                .map(|n| n.as_str().to_owned())
                .collect(),
        );
        markov_core::model::Model::complete(&*self.inner, request).await
    }

    fn native_tool_search(&self) -> bool {
        true
    }
}

#[tokio::test]
async fn a_provider_with_its_own_tool_search_is_sent_every_tool_with_the_deferred_marked() {
    for native in [true, false] {
        let pay = Pay::default();
        let scripted = Arc::new(
            ScriptedModel::builder()
                .tool_call("pay", json!({"amount": 4}))
                .text("Paid.")
                .build(),
        );
        let model = Arc::new(Native {
            inner: Arc::clone(&scripted),
            deferred: Mutex::new(Vec::new()),
        });
        let config =
            PolicyConfig::new(Budget::UNLIMITED).tool_search(ToolSearch::new().native(native));
        let (charter, node) = charter_and_node();
        let mut m = machine_on(
            charter,
            StandardExecutor::shared(model.clone()).with_registry(
                registry(config, &pay, ToolMetadata::new(Category::Action)),
                Mode::TEXT,
            ),
            Instance::new(node, json!({})),
        )
        .expect("machine builds");
        m.enqueue_user("pay 4");
        run_all(&mut m, RunOptions::default()).await;
        // The provider found `pay`; its call runs through the registry.
        assert_eq!(pay.paid(), [4], "native: {native}");
        let offered = offered(&scripted);
        let deferred = model.deferred.lock().expect("lock").clone();
        if native {
            assert_eq!(offered[0].len(), 42, "lookup, pay and the 40 fillers");
            assert!(!offered[0].iter().any(|n| n == "search_tools"));
            assert_eq!(deferred[0].len(), 41, "pay and the fillers");
            assert_eq!(deferred[0][0], "pay");
            assert!(!deferred[0].iter().any(|n| n == "lookup"));
        } else {
            assert_eq!(offered[0], ["lookup", "search_tools"]);
            assert!(deferred[0].is_empty());
        }
    }
}
