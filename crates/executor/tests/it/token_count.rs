//! Exact token counts under a context policy (`TokenCount::Provider`):
//! the model's own count decides a crossing the estimate sees, the count
//! is asked near a crossing only, and a model without one leaves the
//! decision to the estimate.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use markov_charter::context::{ContextPolicy, Summarize, TokenCount};
use markov_core::model::InputTokenCount;
use markov_core::tokens;
use markov_core::{Model, ModelError, ModelRequest, ModelResponse};
use markov_executor::{Agent, Machine};
use markov_testkit::{ScriptBuilder, ScriptedModel};
use serde_json::json;

use crate::common::*;

/// The summary threshold, in tokens: some 25 turns of the script below.
const THRESHOLD: u64 = 1_500;

/// How the wrapped model counts.
#[derive(Debug, Clone, Copy)]
enum Counts {
    /// Half the estimate of the request's messages: the estimate is
    /// twice too high, as it is for some texts.
    Half,
    /// Every count fails.
    Fails,
}

/// A scripted model whose count is [`Counts`], recording each count.
#[derive(Debug)]
struct Counting {
    inner: Arc<ScriptedModel>,
    counts: Counts,
    asked: AtomicUsize,
    answers: Mutex<Vec<u64>>,
}

#[markov_core::async_trait]
impl Model for Counting {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        self.inner.complete(request).await
    }

    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        match self.counts {
            Counts::Half => {
                let tokens = tokens::estimate_messages(request.messages()) / 2;
                self.answers.lock().expect("lock").push(tokens);
                Ok(InputTokenCount::Counted(tokens))
            }
            Counts::Fails => Err(ModelError::Overloaded("no counts today".into())),
        }
    }
}

/// `turns` turns, each a call of `add` and a text answer.
fn script(turns: usize) -> ScriptBuilder {
    let mut script = ScriptedModel::builder();
    for n in 0..turns {
        script = script
            .tool_call("add", json!({"a": n, "b": 1}))
            .text(format!("The sum is {}.", n + 1));
    }
    script
}

fn new_summarizer() -> Arc<ScriptedModel> {
    let mut script = ScriptedModel::builder();
    for n in 0..50 {
        script = script.text(format!("Summary {n}: sums were asked and given."));
    }
    Arc::new(script.build())
}

fn machine(model: Arc<dyn Model>, summarizer: &Arc<ScriptedModel>, count: TokenCount) -> Machine {
    let policy = ContextPolicy::builder()
        .summarize(
            Summarize::new(Arc::clone(summarizer) as Arc<dyn Model>, THRESHOLD).keep_last_turns(2),
        )
        .token_count(count)
        .build()
        .expect("a policy");
    Agent::builder("calculator")
        .instructions("Add numbers with your tool.")
        .tool(Add)
        .shared_model(model)
        .context_policy(policy)
        .build()
        .expect("agent builds")
        .machine()
}

async fn run_turns(machine: &mut Machine, turns: usize) {
    for n in 0..turns {
        machine.enqueue_user(format!("question {n}"));
        machine.run().await.expect("the turn runs");
    }
}

fn summaries(machine: &Machine) -> Vec<std::ops::Range<u64>> {
    machine
        .history()
        .iter()
        .filter_map(|m| m.as_summary().map(|(_, range)| range))
        .collect()
}

#[tokio::test]
async fn the_models_count_decides_and_is_asked_only_near_a_crossing() {
    let turns = 120;
    let inner = Arc::new(script(turns).build());
    let model = Arc::new(Counting {
        inner: Arc::clone(&inner),
        counts: Counts::Half,
        asked: AtomicUsize::new(0),
        answers: Mutex::new(Vec::new()),
    });
    let summarizer = new_summarizer();
    let mut counted = machine(
        Arc::clone(&model) as Arc<dyn Model>,
        &summarizer,
        TokenCount::Provider,
    );
    run_turns(&mut counted, turns).await;

    let asked = model.asked.load(Ordering::SeqCst);
    let answers = model.answers.lock().unwrap().clone();
    let made = summaries(&counted);
    assert!(!made.is_empty(), "the exact count passed the threshold");
    // A summary follows each count past the threshold, and no other.
    let passed = answers.iter().filter(|&&t| t > THRESHOLD).count();
    assert_eq!(made.len(), passed, "{answers:?}");
    assert_eq!(summarizer.calls(), made.len());
    // The steps whose view the estimate put past the threshold: the count
    // was asked on few of them, not on each.
    let over = inner
        .requests()
        .iter()
        .filter(|r| tokens::estimate_messages(&r.messages) > THRESHOLD)
        .count();
    assert!(asked > 0);
    assert!(
        asked * 3 < over,
        "asked {asked} times on {over} steps past the estimate"
    );
    // Each view sent was within the threshold by the model's count.
    for request in inner.requests() {
        assert!(tokens::estimate_messages(&request.messages) / 2 <= THRESHOLD + 200);
    }
    // A count is no billed call: the session's requests are the calls.
    let requests = counted.usage().session.requests;
    let calls = inner.calls() as u64;
    assert!(
        requests == calls || requests == calls + summarizer.calls() as u64,
        "{requests} requests for {calls} calls and {asked} counts"
    );

    // The estimate alone summarizes about twice as often.
    let estimated_summarizer = new_summarizer();
    let mut estimated = machine(
        Arc::new(script(turns).build()),
        &estimated_summarizer,
        TokenCount::Estimate,
    );
    run_turns(&mut estimated, turns).await;
    assert!(
        summaries(&estimated).len() > made.len(),
        "{} by the estimate, {} by the count",
        summaries(&estimated).len(),
        made.len()
    );
}

#[tokio::test]
async fn a_model_without_counts_leaves_the_decision_to_the_estimate() {
    let turns = 60;
    let by_estimate = {
        let summarizer = new_summarizer();
        let mut machine = machine(
            Arc::new(script(turns).build()),
            &summarizer,
            TokenCount::Estimate,
        );
        run_turns(&mut machine, turns).await;
        summaries(&machine)
    };
    assert!(!by_estimate.is_empty());
    // A scripted model offers no count.
    let summarizer = new_summarizer();
    let mut uncounted = machine(
        Arc::new(script(turns).build()),
        &summarizer,
        TokenCount::Provider,
    );
    run_turns(&mut uncounted, turns).await;
    assert_eq!(summaries(&uncounted), by_estimate);

    // A count that fails leaves it to the estimate too, and is asked once
    // per crossing (the summary follows at once), not on every step.
    let failing = Arc::new(Counting {
        inner: Arc::new(script(turns).build()),
        counts: Counts::Fails,
        asked: AtomicUsize::new(0),
        answers: Mutex::new(Vec::new()),
    });
    let summarizer = new_summarizer();
    let mut failed = machine(
        Arc::clone(&failing) as Arc<dyn Model>,
        &summarizer,
        TokenCount::Provider,
    );
    run_turns(&mut failed, turns).await;
    assert_eq!(summaries(&failed), by_estimate);
    assert_eq!(failing.asked.load(Ordering::SeqCst), by_estimate.len());
}
