//! Several active leaves in one step (upstream's
//! parallel-execution.test.ts): leaf indices, the one-primary rule, workers
//! running concurrently with the primary, worker warnings and cedes, and
//! message attribution.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::common::{Call, Script, cede_fx, node, outcome, run_all, say, script_machine};
use async_trait::async_trait;
use markov_charter::node::Node;
use markov_charter::transition::CedeContent;
use markov_core::message::{InstancePayload, Items, Message, Role, Source};
use markov_executor::{
    Entry, Executor, Instance, LeafContext, LeafOutcome, Machine, RunError, RunOptions, YieldReason,
};
use serde_json::json;

// ---------------------------------------------------------------------------
// Scenario helpers over the shared scripted executor (`crate::common::Script`).
// ---------------------------------------------------------------------------

/// The leaf cedes with `content`.
fn cede(cx: &LeafContext<'_>, content: Option<&str>) -> Entry {
    cede_fx(cx, content.map(|c| CedeContent::Text(c.to_owned())))
}

fn worker(name: &str) -> Node {
    Node::builder(format!("{name} works."))
        .name(name)
        .worker()
        .build()
        .expect("node builds")
}

fn machine(executor: Arc<dyn Executor>, root: Instance) -> Machine {
    script_machine("parallel", executor, root)
}

/// root → [worker "helper", primary "main"].
fn worker_and_primary() -> Instance {
    Instance::new(node("root"), json!({}))
        .with_child(Instance::new(worker("helper"), json!({})))
        .with_child(Instance::new(node("main"), json!({})))
}

/// Captures `tracing` output on this thread while the guard lives.
struct Logs(Arc<Mutex<Vec<u8>>>);

/// Tests that capture logs run one at a time, each into its own buffer.
static CAPTURE: Mutex<()> = Mutex::new(());

/// The buffer of the capture under way, if any.
static CURRENT: Mutex<Option<Arc<Mutex<Vec<u8>>>>> = Mutex::new(None);

/// One global subscriber for the whole test binary, installed once: tracing
/// caches each callsite's interest globally, and a thread-local subscriber
/// coming and going while other tests run can leave a warning disabled for
/// the capturing test. A global one keeps warnings enabled for good.
fn install_global_subscriber() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(|| {
                let current = CURRENT.lock().unwrap_or_else(|p| p.into_inner()).clone();
                Sink(current)
            })
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        tracing::callsite::rebuild_interest_cache();
    });
}

/// Holds the capture; dropping it stops the capture, then frees the lock.
struct Capture {
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl Drop for Capture {
    fn drop(&mut self) {
        *CURRENT.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

impl Logs {
    fn capture() -> (Self, Capture) {
        let serial = CAPTURE.lock().unwrap_or_else(|p| p.into_inner());
        install_global_subscriber();
        let buf = Arc::new(Mutex::new(Vec::new()));
        *CURRENT.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&buf));
        (Logs(buf), Capture { _serial: serial })
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }
}

/// Writes into the capture under way, or nowhere.
struct Sink(Option<Arc<Mutex<Vec<u8>>>>);

impl io::Write for Sink {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if let Some(buf) = &self.0 {
            buf.lock().expect("lock").extend_from_slice(data);
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Worker flags and leaves.
// ---------------------------------------------------------------------------

#[test]
fn worker_flags_of_nodes_and_instances() {
    assert!(!node("standard").is_worker());
    assert!(worker("helper").is_worker());
    assert!(!Instance::new(node("standard"), json!({})).is_worker());
    assert!(Instance::new(worker("helper"), json!({})).is_worker());
}

#[test]
fn active_leaves_have_indices_paths_and_worker_flags() {
    let summary = |root: Instance| {
        Arc::new(root)
            .active_leaves()
            .iter()
            .map(|l| (l.leaf_index().to_vec(), l.path().len(), l.is_worker()))
            .collect::<Vec<_>>()
    };
    // A single root.
    assert_eq!(
        summary(Instance::new(node("root"), json!({}))),
        vec![(vec![], 1, false)]
    );
    // Parent and child.
    assert_eq!(
        summary(
            Instance::new(node("root"), json!({}))
                .with_child(Instance::new(node("child"), json!({})))
        ),
        vec![(vec![0], 2, false)]
    );
    // A worker and a standard child.
    assert_eq!(
        summary(worker_and_primary()),
        vec![(vec![0], 2, true), (vec![1], 2, false)]
    );
    // Nested.
    assert_eq!(
        summary(
            Instance::new(node("root"), json!({}))
                .with_child(Instance::new(worker("helper"), json!({})))
                .with_child(
                    Instance::new(node("mid"), json!({}))
                        .with_child(Instance::new(node("deep"), json!({})))
                )
        ),
        vec![(vec![0], 2, true), (vec![1, 0], 3, false)]
    );
    // The path runs root … leaf and ancestors() excludes the leaf.
    let root = Arc::new(Instance::new(node("root"), json!({})).with_child(
        Instance::new(node("mid"), json!({})).with_child(Instance::new(node("deep"), json!({}))),
    ));
    let leaves = root.active_leaves();
    let names: Vec<_> = leaves[0]
        .path()
        .iter()
        .map(|i| i.node().name().unwrap_or("?"))
        .collect();
    assert_eq!(names, vec!["root", "mid", "deep"]);
    assert_eq!(leaves[0].ancestors().len(), 2);
    assert_eq!(leaves[0].leaf().node().name(), Some("deep"));
}

#[tokio::test]
async fn two_primary_leaves_are_an_error() {
    let script = Script::new();
    let root = Instance::new(node("root"), json!({}))
        .with_child(Instance::new(node("a"), json!({})))
        .with_child(Instance::new(node("b"), json!({})));
    let mut m = machine(script.clone(), root);
    m.enqueue_user("hi");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(steps.is_empty());
    let err = err.expect("fails");
    assert_eq!(err, RunError::TooManyPrimaryLeaves(2));
    assert_eq!(
        err.to_string(),
        "Invalid state: 2 non-worker active leaves. At most one instance can receive user input per step."
    );
    assert!(script.calls().is_empty(), "no executor ran");
}

// ---------------------------------------------------------------------------
// Workers next to the primary.
// ---------------------------------------------------------------------------

/// Every leaf waits until all `expected` leaves have started: run one after
/// the other, the first would give up.
struct Rendezvous {
    expected: usize,
    arrived: AtomicUsize,
    calls: Mutex<Vec<Call>>,
}

#[async_trait]
impl Executor for Rendezvous {
    async fn run_leaf(&self, cx: LeafContext<'_>) -> Result<LeafOutcome, RunError> {
        self.calls.lock().expect("lock").push(Call::of(&cx));
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let mut spins = 0;
        while self.arrived.load(Ordering::SeqCst) < self.expected {
            spins += 1;
            if spins > 10_000 {
                return Err(RunError::Executor("leaves did not run concurrently".into()));
            }
            tokio::task::yield_now().await;
        }
        Ok(if cx.is_worker() {
            outcome(vec![cede(&cx, None)], YieldReason::Cede)
        } else {
            outcome(vec![say(&cx, "done")], YieldReason::EndTurn)
        })
    }
}

#[tokio::test]
async fn a_worker_and_the_primary_run_concurrently_in_one_step() {
    let exec = Arc::new(Rendezvous {
        expected: 2,
        arrived: AtomicUsize::new(0),
        calls: Mutex::new(Vec::new()),
    });
    let mut m = machine(exec.clone(), worker_and_primary());
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1);
    assert!(steps[0].done);
    let calls = exec.calls.lock().expect("lock").clone();
    let seen: Vec<_> = calls
        .iter()
        .map(|c| (c.node.as_str(), c.step, c.worker))
        .collect();
    assert_eq!(seen, vec![("helper", 1, true), ("main", 1, false)]);
}

#[tokio::test]
async fn a_worker_ending_its_turn_warns_and_the_run_still_finishes() {
    let (logs, _guard) = Logs::capture();
    let script = Script::new()
        .on("helper", |cx| {
            outcome(vec![say(cx, "I am done")], YieldReason::EndTurn)
        })
        .on("main", |cx| {
            outcome(vec![say(cx, "answer")], YieldReason::EndTurn)
        });
    let mut m = machine(script.clone(), worker_and_primary());
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1);
    assert!(steps[0].done);
    assert_eq!(steps[0].yield_reason, YieldReason::EndTurn);
    let text = logs.text();
    assert!(text.contains("returned end_turn without ceding"), "{text}");
    // The worker did not cede: it is still there.
    assert_eq!(m.instance().children().len(), 2);
}

#[tokio::test]
async fn a_busy_worker_abandoned_by_the_primarys_end_turn_is_warned_about() {
    let (logs, _guard) = Logs::capture();
    let script = Script::new()
        .on("helper", |cx| {
            outcome(vec![say(cx, "still working")], YieldReason::ToolUse)
        })
        .on("main", |cx| {
            outcome(vec![say(cx, "answer")], YieldReason::EndTurn)
        });
    let mut m = machine(script.clone(), worker_and_primary());
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1, "the primary's end_turn ends the turn");
    assert!(steps[0].done);
    let text = logs.text();
    assert!(text.contains("worker returned tool_use"), "{text}");
}

#[tokio::test]
async fn a_worker_works_then_cedes_while_the_primary_works_then_ends() {
    let script = Script::new()
        .on("helper", |cx| {
            outcome(vec![say(cx, "w1")], YieldReason::ToolUse)
        })
        .on("helper", |cx| {
            outcome(
                vec![say(cx, "w2"), cede(cx, Some("found it"))],
                YieldReason::Cede,
            )
        })
        .on("main", |cx| {
            outcome(vec![say(cx, "p1")], YieldReason::ToolUse)
        })
        .on("main", |cx| {
            outcome(vec![say(cx, "p2")], YieldReason::EndTurn)
        });
    let mut m = machine(script.clone(), worker_and_primary());
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let reasons: Vec<_> = steps.iter().map(|s| (s.yield_reason, s.done)).collect();
    assert_eq!(
        reasons,
        vec![(YieldReason::ToolUse, false), (YieldReason::EndTurn, true)]
    );
    // Two leaves ran: no dedicated cede step and no cede content on the step.
    assert!(steps[1].cede_content.is_none());
    assert_eq!(m.instance().children().len(), 1);
    assert_eq!(m.instance().active().node().name(), Some("main"));
    // The cede content still reaches history, after the step's messages.
    let last = m.history().last().expect("history");
    assert_eq!(last.role, Role::User);
    assert_eq!(last.text(), "found it");
    assert_eq!(script.calls(), vec!["helper", "main", "helper", "main"]);
}

#[tokio::test]
async fn a_worker_ceding_while_the_primary_ends_the_turn_is_removed() {
    let script = Script::new()
        .on("helper", |cx| {
            outcome(vec![cede(cx, None)], YieldReason::Cede)
        })
        .on("main", |cx| {
            outcome(vec![say(cx, "answer")], YieldReason::EndTurn)
        });
    let mut m = machine(script.clone(), worker_and_primary());
    m.enqueue_user("go");
    let last = markov_executor::run_to_completion(&mut m, RunOptions::default())
        .await
        .expect("run ends");
    assert!(last.done);
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    let children = last.instance.children();
    assert_eq!(children.len(), 1);
    assert!(!children[0].is_worker());
    assert_eq!(children[0].node().name(), Some("main"));
}

#[tokio::test]
async fn messages_are_attributed_to_their_leaf() {
    let script = Script::new()
        .on("helper", |cx| {
            outcome(
                vec![say(cx, "from the worker"), cede(cx, None)],
                YieldReason::Cede,
            )
        })
        .on("main", |cx| {
            outcome(vec![say(cx, "from the primary")], YieldReason::EndTurn)
        });
    let mut m = machine(script.clone(), worker_and_primary());
    let helper_id = m.instance().children()[0].id().clone();
    let main_id = m.instance().children()[1].id().clone();
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let h = &steps[0].history;
    assert_eq!(h.len(), 4, "{h:?}");
    assert_eq!(h[0].text(), "go");
    assert!(h[0].metadata.is_none());
    let source = |msg: &Message| msg.metadata.as_ref().and_then(|md| md.source.clone());
    let worker_source = Source {
        instance_id: Some(helper_id.clone()),
        is_primary: Some(false),
        external: None,
    };
    let primary_source = Source {
        instance_id: Some(main_id),
        is_primary: Some(true),
        external: None,
    };
    // The worker's messages come first: leaves run in tree order and enqueue in turn.
    assert_eq!(h[1].role, Role::Assistant);
    assert_eq!(source(&h[1]), Some(worker_source.clone()));
    assert!(matches!(
        &h[2].items,
        Items::Instance(p) if matches!(p.as_ref(), InstancePayload::Cede { instance_id, .. } if *instance_id == helper_id)
    ));
    assert_eq!(source(&h[2]), Some(worker_source));
    assert_eq!(h[3].role, Role::Assistant);
    assert_eq!(source(&h[3]), Some(primary_source));
    assert_eq!(m.history().len(), 4);
}

#[tokio::test]
async fn only_workers_end_the_turn_after_one_step() {
    let script = Script::new()
        .on("a", |cx| outcome(vec![say(cx, "a1")], YieldReason::ToolUse))
        .on("b", |cx| outcome(vec![say(cx, "b1")], YieldReason::ToolUse));
    let root = Instance::new(node("root"), json!({}))
        .with_child(Instance::new(worker("a"), json!({})))
        .with_child(Instance::new(worker("b"), json!({})));
    let mut m = machine(script.clone(), root);
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0].yield_reason, YieldReason::EndTurn);
    assert!(steps[0].done);
    assert_eq!(script.calls(), vec!["a", "b"]);
}

#[tokio::test]
async fn when_two_leaves_cede_only_the_first_content_is_delivered() {
    let script = Script::new()
        .on("a", |cx| {
            outcome(vec![cede(cx, Some("from a"))], YieldReason::Cede)
        })
        .on("b", |cx| {
            outcome(vec![cede(cx, Some("from b"))], YieldReason::Cede)
        });
    let root = Instance::new(node("root"), json!({}))
        .with_child(Instance::new(worker("a"), json!({})))
        .with_child(Instance::new(worker("b"), json!({})));
    let mut m = machine(script.clone(), root);
    let a_id = m.instance().children()[0].id().clone();
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    // Two leaves: no cede step; no primary: end_turn after one step.
    assert_eq!(steps.len(), 1);
    assert_eq!(steps[0].yield_reason, YieldReason::EndTurn);
    assert!(steps[0].cede_content.is_none());
    assert!(m.instance().children().is_empty());
    let delivered: Vec<_> = m
        .history()
        .iter()
        .filter(|msg| msg.role == Role::User && msg.text().starts_with("from "))
        .collect();
    assert_eq!(delivered.len(), 1);
    assert_eq!(delivered[0].text(), "from a");
    assert_eq!(delivered[0].source_instance(), Some(&a_id));
}

#[tokio::test]
async fn a_primary_ceding_next_to_a_worker_yields_cede_without_content() {
    let script = Script::new()
        .on("helper", |cx| {
            outcome(vec![say(cx, "w")], YieldReason::ToolUse)
        })
        .on("main", |cx| {
            outcome(vec![cede(cx, Some("bye"))], YieldReason::Cede)
        })
        // Then root's children are the worker alone: one step, end_turn.
        .on("helper", |cx| {
            outcome(vec![say(cx, "w2")], YieldReason::ToolUse)
        });
    let mut m = machine(script.clone(), worker_and_primary());
    m.enqueue_user("go");
    let (steps, err) = run_all(&mut m, RunOptions::default()).await;
    assert!(err.is_none(), "{err:?}");
    let reasons: Vec<_> = steps
        .iter()
        .map(|s| (s.yield_reason, s.done, s.cede_content.clone()))
        .collect();
    assert_eq!(
        reasons,
        vec![
            (YieldReason::Cede, false, None),
            (YieldReason::EndTurn, true, None)
        ]
    );
    assert_eq!(m.instance().children().len(), 1);
    assert!(m.instance().children()[0].is_worker());
}

/// A worker that answers at once and a primary that never does.
struct SlowPrimary;

#[async_trait::async_trait]
impl Executor for SlowPrimary {
    async fn run_leaf(&self, cx: LeafContext<'_>) -> Result<LeafOutcome, RunError> {
        if cx.is_worker() {
            return Ok(outcome(
                vec![say(&cx, "worker result")],
                YieldReason::ToolUse,
            ));
        }
        std::future::pending::<()>().await;
        Ok(outcome(Vec::new(), YieldReason::EndTurn))
    }
}

#[tokio::test]
async fn a_cancelled_step_keeps_what_the_finished_leaves_produced() {
    let mut m = machine(Arc::new(SlowPrimary), worker_and_primary());
    m.enqueue_user("go");
    let cancelled = tokio::time::timeout(
        std::time::Duration::from_millis(50),
        run_all(&mut m, RunOptions::default()),
    )
    .await;
    assert!(cancelled.is_err(), "the primary never finishes");
    assert!(
        !m.history().iter().any(|msg| msg.text() == "worker result"),
        "not recorded yet: the step did not complete"
    );
    // Queued, so the next run records it rather than losing it.
    assert_eq!(m.queue().len(), 1);
}
