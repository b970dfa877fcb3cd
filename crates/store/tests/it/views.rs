//! A session under a context policy that windows, stubs and summarizes:
//! every step's request is rebuilt from the store byte for byte as the
//! model received it (on SQLite and Postgres, as both wire formats encode
//! it), and a fork at any step sends that step's request again.

use std::sync::Arc;

use crate::common::Dir;
use markov_charter::context::{ContextPolicy, Summarize};
use markov_core::model::ModelRequest;
use markov_core::{Message, Model};
use markov_executor::Agent;
use markov_store::{DurableMachine, ForkOptions, SessionId, SqliteStore, Store, WorkerId};
use markov_testkit::{RecordedRequest, ScriptedModel};
use serde_json::json;

/// Looks a topic up: `bytes` bytes of notes.
#[markov_core::tool]
async fn look(
    /// How long the notes are.
    bytes: usize,
) -> String {
    "n".repeat(bytes)
}

/// The turns of the session, each a look-up and an answer: the results
/// grow, so the window cuts before the first summary is due.
const TURNS: usize = 7;

/// How long the `turn`th look-up's result is: short at first (the
/// window cuts the first turn out), then long (a summary is due).
fn result_bytes(turn: usize) -> usize {
    if turn < 5 { 100 } else { 2_400 }
}

/// The model's answers from the `n`th step on (two per turn).
fn script_from(n: usize) -> ScriptedModel {
    let mut builder = ScriptedModel::builder();
    for step in n..2 * TURNS {
        let turn = step / 2;
        builder = if step % 2 == 0 {
            builder.response(crate::common::calls(&[(
                &format!("look-{turn}"),
                "look",
                json!({ "bytes": result_bytes(turn) }),
            )]))
        } else {
            builder.text(format!("Answer {turn}."))
        };
    }
    builder.build()
}

/// The agent: the last four turns in view, the results of all but the
/// current turn stubbed, and a summary of all but the last two turns once
/// the view passes 400 tokens, written by `summarizer`.
fn agent(model: Arc<ScriptedModel>, summarizer: Arc<ScriptedModel>) -> Agent {
    let policy = ContextPolicy::builder()
        .keep_last_turns(4)
        .trim_tool_results(1)
        .summarize(Summarize::new(summarizer as Arc<dyn Model>, 400).keep_last_turns(2))
        .build()
        .expect("a valid policy");
    Agent::builder("researcher")
        .instructions("Look things up with your tool.")
        .tool(Look)
        .shared_model(model)
        .context_policy(policy)
        .build()
        .expect("the agent builds")
}

fn summarizer(prefix: &str) -> Arc<ScriptedModel> {
    let mut builder = ScriptedModel::builder();
    for n in 0..TURNS {
        builder = builder.text(format!("{prefix} summary {n}."));
    }
    Arc::new(builder.build())
}

/// The request a fake provider recorded.
fn recorded(r: &RecordedRequest) -> ModelRequest<'_> {
    ModelRequest::new(&r.system, &r.messages, &r.settings)
        .with_tools(&r.tools)
        .with_provider_tools(&r.provider_tools)
        .with_tool_choice(&r.tool_choice)
        .with_output_schema(r.output_schema.as_ref())
}

/// The Anthropic Messages and OpenAI Chat wire bodies of `request`.
fn wire_bodies(request: &ModelRequest<'_>) -> [(&'static str, Vec<u8>); 2] {
    let anthropic = markov_providers::Anthropic::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .expect("builds");
    let openai = markov_providers::OpenAi::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .expect("builds");
    [
        (
            "Anthropic Messages",
            anthropic
                .request_body_uncached(request, false)
                .expect("encodes"),
        ),
        (
            "OpenAI Chat",
            openai
                .request_body_uncached(request, false)
                .expect("encodes"),
        ),
    ]
}

/// Runs the session on `store`; its id and the requests the model received.
async fn run_session<S: Store + 'static>(store: &Arc<S>, id: &SessionId) -> Vec<RecordedRequest> {
    let model = Arc::new(script_from(0));
    let summaries = summarizer("Original");
    let mut session = DurableMachine::create(
        Arc::clone(store),
        id.clone(),
        WorkerId::new("w"),
        agent(Arc::clone(&model), Arc::clone(&summaries)).machine(),
    )
    .await
    .expect("created");
    for turn in 0..TURNS {
        session
            .machine()
            .enqueue_user(format!("Look up topic {turn}."));
        assert!(session.run().await.expect("runs").done);
    }
    session.release().await.expect("released");
    assert!(summaries.calls() >= 1, "the view was summarized");
    model.requests()
}

/// Every step's request, rebuilt from what `store` recorded, is the one
/// the model received; the session's views windowed, stubbed and
/// summarized along the way.
pub(crate) async fn views_contract<S: Store + 'static>(store: Arc<S>) {
    let id = SessionId::new("viewed");
    let requests = run_session(&store, &id).await;
    let history: Vec<Message> = store.load(&id).await.expect("loads").snapshot.history;
    let steps = store.steps(&id, 0, 100).await.expect("the steps read");
    assert_eq!(steps.len(), requests.len(), "a step per model call");
    let (mut cut, mut stubbed, mut summarized) = (false, false, false);
    for (n, (step, sent)) in steps.iter().zip(&requests).enumerate() {
        let call = &steps[n].calls[0];
        if let Some(view) = &call.view {
            cut |= view.from > 0 && view.summary.is_none();
            stubbed |= view.stubbed_to > view.from;
            summarized |= view.summary.is_some();
        }
        let rebuilt = step.request(&history).expect("the request rebuilds");
        let rebuilt = rebuilt.as_request();
        assert_eq!(
            rebuilt.messages(),
            sent.messages.as_slice(),
            "step {n}: the messages"
        );
        assert_eq!(rebuilt.system(), sent.system, "step {n}: the system prompt");
        for ((vendor, body), (_, sent)) in wire_bodies(&rebuilt)
            .into_iter()
            .zip(wire_bodies(&recorded(sent)))
        {
            assert_eq!(
                String::from_utf8_lossy(&body),
                String::from_utf8_lossy(&sent),
                "step {n}: the {vendor} body"
            );
        }
    }
    assert!(cut, "a view left turns out before any summary");
    assert!(stubbed, "a view stubbed results");
    assert!(summarized, "a view showed a summary");
}

#[tokio::test]
async fn every_step_under_a_context_policy_is_rebuilt_on_sqlite() {
    let dir = Dir::new("views-sqlite");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    views_contract(store).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_under_a_context_policy_is_rebuilt_on_postgres() {
    let Some((_server, store)) = crate::common::postgres().await else {
        return;
    };
    views_contract(store).await;
}

#[tokio::test]
async fn a_fork_at_any_step_under_a_context_policy_sends_that_steps_request_again() {
    let dir = Dir::new("views-fork");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let id = SessionId::new("viewed");
    let original = run_session(&store, &id).await;
    let steps = store.steps(&id, 0, 100).await.expect("the steps read");
    let mut after_a_change = 0;
    for (n, sent) in original.iter().enumerate() {
        let replay = Arc::new(script_from(n));
        // A fork that summarized again would show another summary.
        let summaries = summarizer("Forked");
        let mut fork = DurableMachine::fork(
            Arc::clone(&store),
            &id,
            n as u64,
            SessionId::new(format!("fork-{n}")),
            WorkerId::new("developer"),
            &agent(Arc::clone(&replay), Arc::clone(&summaries)),
            ForkOptions::default(),
        )
        .await
        .expect("forks");
        fork.run().await.expect("the fork runs");
        let first = replay
            .requests()
            .into_iter()
            .next()
            .expect("the fork called the model");
        assert_eq!(first.messages, sent.messages, "step {n}: the messages");
        for ((vendor, body), (_, sent)) in wire_bodies(&recorded(&first))
            .into_iter()
            .zip(wire_bodies(&recorded(sent)))
        {
            assert_eq!(
                String::from_utf8_lossy(&body),
                String::from_utf8_lossy(&sent),
                "step {n}: the {vendor} body"
            );
        }
        after_a_change += usize::from(steps[n].calls[0].view.is_some());
    }
    assert!(
        after_a_change > 2,
        "forks at steps whose view had changed the history"
    );
}
