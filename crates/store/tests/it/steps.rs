//! Every step recorded: read back in pages, each step's request rebuilt
//! exactly as the model received it, on SQLite and Postgres.

use std::sync::Arc;

use crate::common::*;
use markov_core::Message;
use markov_store::{DurableMachine, SessionId, SqliteStore, StepTrace, Store, WorkerId};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// Runs two turns on `store` and checks that each model call's request is
/// rebuilt from the recorded steps exactly as the model received it.
pub(crate) async fn steps_contract<S: Store + 'static>(store: Arc<S>, dir: &Dir) {
    let model = Arc::new(two_turns());
    let machine = machine(model.clone(), dir);
    let id = SessionId::random();
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), WorkerId::new("w"), machine)
            .await
            .expect("created");
    for text in ["pay 3", "note it"] {
        session.machine().enqueue_user(text);
        assert!(session.run().await.expect("runs").done);
    }
    let history: Vec<Message> = store.load(&id).await.expect("loads").snapshot.history;
    let steps: Vec<StepTrace> = store.steps(&id, 0, 100).await.expect("steps read");
    let requests = model.requests();
    assert_eq!(
        steps.len(),
        requests.len(),
        "one recorded step per model call"
    );
    for (n, (step, sent)) in steps.iter().zip(&requests).enumerate() {
        assert_eq!(step.index, n as u64, "steps are numbered in order");
        let rebuilt = step.request(&history).expect("the request rebuilds");
        let rebuilt = rebuilt.as_request();
        assert_eq!(rebuilt.system(), sent.system, "step {n}: system prompt");
        assert_eq!(
            rebuilt.messages(),
            sent.messages.as_slice(),
            "step {n}: messages"
        );
        assert_eq!(rebuilt.tools(), sent.tools.as_slice(), "step {n}: tools");
        assert_eq!(
            rebuilt.tool_choice(),
            &sent.tool_choice,
            "step {n}: tool choice"
        );
        assert_eq!(rebuilt.settings(), &sent.settings, "step {n}: settings");
        assert!(step.history_to >= step.history_from);
    }
    // The steps partition the history the runs added.
    for pair in steps.windows(2) {
        assert_eq!(
            pair[0].history_to, pair[1].history_from,
            "steps follow each other"
        );
    }
    assert_eq!(
        steps.last().map(|s| s.history_to),
        Some(history.len() as u64),
        "the last step ends the history"
    );
    assert_eq!(steps[1].calls[0].tools.len(), steps[0].calls[0].tools.len());
    // Paged: from an index, at most a limit.
    let page = store.steps(&id, 2, 2).await.expect("a page");
    assert_eq!(page, steps[2..4].to_vec(), "a page is the steps it names");
    assert!(
        store
            .steps(&id, 99, 10)
            .await
            .expect("past the end")
            .is_empty()
    );
    // Deleting the session deletes its steps.
    assert!(store.delete(&id).await.expect("deletes"));
    assert!(
        store.steps(&id, 0, 10).await.is_err(),
        "no session, no steps"
    );
}

#[tokio::test]
async fn every_step_is_recorded_and_its_request_rebuilt_on_sqlite() {
    let dir = Dir::new("steps-sqlite");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    steps_contract(store, &dir).await;
}

#[tokio::test]
async fn a_machine_outside_a_store_records_no_calls() {
    let dir = Dir::new("steps-off");
    let machine = machine(Arc::new(two_turns()), &dir);
    assert!(!machine.records_calls(), "off unless a store records steps");
    machine.enqueue_user("pay 3");
    let mut machine = machine;
    let step = machine.run().await.expect("runs");
    assert!(
        step.calls.is_empty(),
        "nothing built for a machine without a store"
    );
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_is_recorded_and_its_request_rebuilt_on_postgres() {
    let Some((_server, store)) = postgres().await else {
        return;
    };
    let dir = Dir::new("steps-pg");
    steps_contract(store, &dir).await;
}

/// The script's answers from the `n`th on.
fn script_from(n: usize) -> ScriptedModel {
    let mut builder = ScriptedModel::builder();
    for i in n..5 {
        builder = match i {
            0 | 3 => builder.tool_call("note", json!({})),
            1 => builder.response(calls(&[("pay-1", "pay", json!({"amount": 3}))])),
            2 => builder.text("Paid 3."),
            _ => builder.text("Noted."),
        };
    }
    builder.build()
}

fn agent(model: Arc<ScriptedModel>, dir: &Dir) -> markov_executor::Agent {
    markov_executor::Agent::on_charter_with_executor(
        charter().0,
        Arc::new(executor(model, dir.path("effects"), dir.path("marker"))),
    )
    .state(json!({"notes": 0}))
    .build()
    .expect("the agent builds")
}

#[tokio::test]
async fn a_fork_at_any_step_sends_that_steps_request_again() {
    let dir = Dir::new("fork");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let model = Arc::new(two_turns());
    let id = SessionId::new("original");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        agent(model.clone(), &dir).machine(),
    )
    .await
    .expect("created");
    for text in ["pay 3", "note it"] {
        session.machine().enqueue_user(text);
        assert!(session.run().await.expect("runs").done);
    }
    session.release().await.expect("released");
    let original = model.requests();
    assert_eq!(original.len(), 5);
    for (n, sent) in original.iter().enumerate() {
        let replay = Arc::new(script_from(n));
        let fork_id = SessionId::new(format!("fork-{n}"));
        let mut fork = DurableMachine::fork(
            store.clone(),
            &id,
            n as u64,
            fork_id.clone(),
            WorkerId::new("developer"),
            &agent(replay.clone(), &dir),
            markov_store::ForkOptions::default(),
        )
        .await
        .expect("forks");
        let last = fork.run().await.expect("the fork runs");
        assert!(last.done, "the fork finishes the turn");
        let first = replay
            .requests()
            .into_iter()
            .next()
            .expect("the fork called the model");
        assert_eq!(first.system, sent.system, "step {n}: the system prompt");
        assert_eq!(first.messages, sent.messages, "step {n}: the messages");
        assert_eq!(first.tools, sent.tools, "step {n}: the tools");
        assert_eq!(
            first.tool_choice, sent.tool_choice,
            "step {n}: the tool choice"
        );
        assert_eq!(first.settings, sent.settings, "step {n}: the settings");
        // Byte for byte, as the Anthropic and OpenAI wire bodies say it.
        for (vendor, body) in wire_bodies(&first, sent) {
            assert_eq!(body.0, body.1, "step {n}: the {vendor} body");
        }
        assert!(
            store.info(&fork_id).await.is_ok(),
            "the fork is a session of its own"
        );
    }
}

#[tokio::test]
async fn a_fork_can_ask_something_else() {
    let dir = Dir::new("fork-edit");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let model = Arc::new(two_turns());
    let id = SessionId::new("original");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        agent(model.clone(), &dir).machine(),
    )
    .await
    .expect("created");
    session.machine().enqueue_user("pay 3");
    session.run().await.expect("runs");
    session.release().await.expect("released");
    let replay = Arc::new(ScriptedModel::builder().text("Sure.").build());
    let mut fork = DurableMachine::fork(
        store.clone(),
        &id,
        0,
        SessionId::new("edited"),
        WorkerId::new("developer"),
        &agent(replay.clone(), &dir),
        markov_store::ForkOptions {
            edit_user: Some("pay 4".into()),
            ..Default::default()
        },
    )
    .await
    .expect("forks");
    fork.run().await.expect("runs");
    let first = replay.requests().into_iter().next().expect("called");
    let asked: Vec<String> = first
        .messages
        .iter()
        .filter(|m| is_user_text(m))
        .map(|m| m.text())
        .collect();
    assert_eq!(asked, ["pay 4"], "the edited question, not the original");
}

/// Two wire bodies to compare.
type BodyPair = (Vec<u8>, Vec<u8>);

/// The Anthropic Messages and OpenAI Chat bodies of two recorded
/// requests, as the providers' encoders write them.
fn wire_bodies(
    a: &markov_testkit::RecordedRequest,
    b: &markov_testkit::RecordedRequest,
) -> Vec<(&'static str, BodyPair)> {
    fn request(r: &markov_testkit::RecordedRequest) -> markov_core::model::ModelRequest<'_> {
        markov_core::model::ModelRequest::new(&r.system, &r.messages, &r.settings)
            .with_tools(&r.tools)
            .with_provider_tools(&r.provider_tools)
            .with_tool_choice(&r.tool_choice)
            .with_output_schema(r.output_schema.as_ref())
    }
    let anthropic = markov_providers::Anthropic::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .expect("builds");
    let openai = markov_providers::OpenAi::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .expect("builds");
    let claude = |r| {
        anthropic
            .request_body_uncached(&request(r), false)
            .expect("encodes")
    };
    let gpt = |r| {
        openai
            .request_body_uncached(&request(r), false)
            .expect("encodes")
    };
    vec![
        ("Anthropic Messages", (claude(a), claude(b))),
        ("OpenAI Chat", (gpt(a), gpt(b))),
    ]
}

async fn recorded_session(dir: &Dir) -> (Arc<SqliteStore>, SessionId) {
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let id = SessionId::new("recorded");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        agent(Arc::new(two_turns()), dir).machine(),
    )
    .await
    .expect("created");
    for text in ["pay 3", "note it"] {
        session.machine().enqueue_user(text);
        assert!(session.run().await.expect("runs").done);
    }
    session.release().await.expect("released");
    (store, id)
}

#[tokio::test]
async fn a_step_s_system_prompt_and_tools_are_stored_once_for_all_its_steps() {
    let dir = Dir::new("steps-kept-once");
    let (store, id) = recorded_session(&dir).await;
    let steps = store.steps(&id, 0, 10).await.expect("the steps");
    assert!(steps.len() >= 3, "{} steps", steps.len());
    drop(store);
    let conn = rusqlite::Connection::open(dir.path("sessions.db")).expect("opens");
    let bodies: Vec<String> = conn
        .prepare("SELECT body FROM step_traces")
        .and_then(|mut s| s.query_map([], |row| row.get(0))?.collect())
        .expect("the traces");
    assert_eq!(bodies.len(), steps.len());
    let system = &steps[0].calls[0].system;
    for body in &bodies {
        // Each names its contents by hash, and holds none of them.
        assert!(body.contains(r#""system":{"$content":""#), "{body}");
        assert!(body.contains(r#""tools":{"$content":""#), "{body}");
        assert!(!body.contains(&**system), "{body}");
    }
    // The prompt and the tools, the same in every step: one row each.
    let contents: i64 = conn
        .query_row("SELECT COUNT(*) FROM step_contents", [], |row| row.get(0))
        .expect("counted");
    let distinct = |field: fn(&markov_executor::ModelCall) -> String| {
        let mut seen: Vec<String> = steps
            .iter()
            .flat_map(|s| s.calls.iter().map(field))
            .collect();
        seen.sort();
        seen.dedup();
        seen.len() as i64
    };
    let prompts = distinct(|c| c.system.to_string());
    let tools = distinct(|c| serde_json::to_string(&c.tools).unwrap_or_default());
    assert_eq!(
        contents,
        prompts + tools,
        "{prompts} prompts, {tools} tool lists"
    );
    assert!(
        contents < 2 * steps.len() as i64,
        "{contents} contents for {} steps",
        steps.len()
    );
}

/// A step's contents written through `store` by a write that was rolled
/// back (its lease lost) are offered again by the next write that names
/// them, so that the step it records reads back whole; a write after that
/// finds them kept and reads back whole too.
pub(crate) async fn kept_contents_contract<S: Store + 'static>(store: Arc<S>, dir: &Dir) {
    // A recorded step from another store: contents this one has never seen.
    let (source, recorded) = recorded_session(dir).await;
    let trace = source
        .steps(&recorded, 0, 1)
        .await
        .expect("the steps")
        .remove(0);
    let step = markov_store::StepRecord {
        trace: Some(&trace),
        ..bare_step(&[])
    };
    let new_session = |name: &str, holder: &str| {
        let (store, id, holder) = (store.clone(), SessionId::new(name), WorkerId::new(holder));
        let machine = machine(Arc::new(two_turns()), dir);
        async move {
            let session = DurableMachine::create(store, id.clone(), holder, machine)
                .await
                .expect("created");
            // A session the test writes to through the store alone.
            drop(session);
            id
        }
    };
    let ttl = std::time::Duration::from_secs(60);

    let lost = new_session("lost", "first").await;
    store
        .release(&lost, &WorkerId::new("first"))
        .await
        .expect("released");
    store
        .acquire(&lost, &WorkerId::new("second"), ttl)
        .await
        .expect("leased to another");
    let refused = store.append(&lost, &WorkerId::new("first"), step).await;
    assert!(
        matches!(refused, Err(markov_store::StoreError::LeaseLost { .. })),
        "{refused:?}"
    );

    let kept = new_session("kept", "third").await;
    for _ in 0..2 {
        store
            .append(&kept, &WorkerId::new("third"), step)
            .await
            .expect("appended");
    }
    let read = store
        .steps(&kept, 0, 10)
        .await
        .expect("its steps read back");
    let ours: Vec<_> = read
        .iter()
        .filter(|s| {
            s.calls
                .first()
                .is_some_and(|c| c.node == trace.calls[0].node)
        })
        .collect();
    assert!(ours.len() >= 2, "{} of {} steps", ours.len(), read.len());
    for step in ours.iter().rev().take(2) {
        assert_eq!(step.calls[0].system, trace.calls[0].system);
        assert_eq!(step.calls[0].tools, trace.calls[0].tools);
    }
}

#[tokio::test]
async fn contents_a_rolled_back_write_offered_are_offered_again_on_sqlite() {
    let dir = Dir::new("steps-kept-again");
    let store = Arc::new(SqliteStore::in_memory().expect("opens"));
    kept_contents_contract(store, &dir).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contents_a_rolled_back_write_offered_are_offered_again_on_postgres() {
    let Some((_server, store)) = postgres().await else {
        return;
    };
    let dir = Dir::new("steps-kept-again-pg");
    kept_contents_contract(store, &dir).await;
}

#[tokio::test]
async fn a_replay_of_an_unchanged_agent_plays_the_recording_back() {
    let dir = Dir::new("replay-same");
    let (store, id) = recorded_session(&dir).await;
    let live = Arc::new(ScriptedModel::builder().build());
    let replay_dir = Dir::new("replay-same-effects");
    let report = markov_store::replay(
        &*store,
        &id,
        live.clone(),
        |model| {
            markov_executor::Agent::on_charter_with_executor(
                charter().0,
                Arc::new(executor(
                    model,
                    replay_dir.path("effects"),
                    replay_dir.path("marker"),
                )),
            )
            .state(json!({"notes": 0}))
            .build()
            .expect("builds")
        },
        markov_store::ReplayMode::RecordedWhereUnchanged,
    )
    .await
    .expect("replays");
    assert_eq!(report.error, None);
    assert_eq!(report.parted_at, None, "{report:#?}");
    assert_eq!(report.steps.len(), 5);
    assert!(
        report
            .steps
            .iter()
            .all(|s| s.answered_from == Some(markov_store::AnswerSource::Recorded))
    );
    assert!(live.requests().is_empty(), "the live model was never asked");
    // The recorded calls were answered from the recording: nothing paid.
    assert_eq!(lines(&replay_dir.path("effects")), 0, "pay never ran");
    assert_eq!(lines(&calls_file(&replay_dir.path("effects"))), 0);
    let sources: Vec<_> = report
        .tool_calls
        .iter()
        .map(|c| (c.tool.as_str(), c.answered_from, c.effect))
        .collect();
    use markov_store::{ToolCallSource as Source, ToolEffect as Effect};
    assert_eq!(
        sources,
        [
            // Not an action, but it wrote state: played back too.
            ("note", Source::Recorded, Some(Effect::WritesState)),
            ("pay", Source::Recorded, Some(Effect::Action)),
            ("note", Source::Recorded, Some(Effect::WritesState)),
        ]
    );
}

#[tokio::test]
async fn a_replay_of_a_changed_agent_says_where_the_runs_part() {
    let dir = Dir::new("replay-changed");
    let (store, id) = recorded_session(&dir).await;
    // The live model answers the second turn differently.
    let live = Arc::new(
        ScriptedModel::builder()
            .tool_call("note", json!({}))
            .response(calls(&[("pay-1", "pay", json!({"amount": 3}))]))
            .text("Paid 3.")
            .text("Nothing to note.")
            .build(),
    );
    let replay_dir = Dir::new("replay-changed-effects");
    let report = markov_store::replay(
        &*store,
        &id,
        live.clone(),
        |model| {
            // The agent now: a lower temperature.
            let settings = markov_core::model::ModelSettings {
                temperature: Some(0.0),
                ..Default::default()
            };
            markov_executor::Agent::on_charter_with_executor(
                charter().0,
                Arc::new(
                    executor(model, replay_dir.path("effects"), replay_dir.path("marker"))
                        .with_settings(settings),
                ),
            )
            .state(json!({"notes": 0}))
            .build()
            .expect("builds")
        },
        markov_store::ReplayMode::RecordedWhereUnchanged,
    )
    .await
    .expect("replays");
    assert_eq!(report.parted_at, Some(0), "the first request differs");
    assert!(report.steps[0].request_changed);
    assert!(!report.steps[0].answer_changed, "the same first answer");
    assert_eq!(
        report.steps[0].answered_from,
        Some(markov_store::AnswerSource::Live)
    );
    // The second turn's answers differ: four replayed steps, five recorded.
    assert_eq!(report.steps.len(), 5);
    assert!(report.steps[3].answer_changed);
    assert!(
        report.steps[4].replayed.is_none(),
        "the replay has no fifth step"
    );
    // The live answers' calls match recorded ones: answered from the
    // recording, nothing paid again.
    assert_eq!(lines(&replay_dir.path("effects")), 0, "pay never ran");
    let pay: Vec<_> = report
        .tool_calls
        .iter()
        .filter(|c| c.tool == "pay")
        .map(|c| (c.step, c.answered_from))
        .collect();
    assert_eq!(pay, [(1, markov_store::ToolCallSource::Recorded)]);
    // The diff is a serde type a page shows.
    let json = serde_json::to_value(&report).expect("serializes");
    assert_eq!(json["parted_at"], 0);
    assert_eq!(json["tool_calls"][1]["answered_from"], "recorded");
}

/// Replays the recorded session with a live model that pays another
/// amount (a call the recording does not have).
async fn replay_new_payment(
    name: &str,
    options: markov_store::ReplayOptions,
) -> (markov_store::ReplayReport, Dir, Arc<ScriptedModel>) {
    let dir = Dir::new(name);
    let (store, id) = recorded_session(&dir).await;
    let live = Arc::new(
        ScriptedModel::builder()
            .response(calls(&[("pay-5", "pay", json!({"amount": 5}))]))
            .text("Done.")
            .text("Nothing to note.")
            .build(),
    );
    let replay_dir = Dir::new(&format!("{name}-effects"));
    let report = markov_store::replay(
        &*store,
        &id,
        live.clone(),
        |model| {
            markov_executor::Agent::on_charter_with_executor(
                charter().0,
                Arc::new(executor(
                    model,
                    replay_dir.path("effects"),
                    replay_dir.path("marker"),
                )),
            )
            .state(json!({"notes": 0}))
            .build()
            .expect("builds")
        },
        markov_store::ReplayOptions {
            mode: markov_store::ReplayMode::Live,
            ..options
        },
    )
    .await
    .expect("replays");
    (report, replay_dir, live)
}

#[tokio::test]
async fn a_replay_refuses_a_new_call_with_side_effects() {
    let (report, replay_dir, live) =
        replay_new_payment("replay-refused", markov_store::ReplayOptions::default()).await;
    assert_eq!(report.error, None);
    assert_eq!(lines(&replay_dir.path("effects")), 0, "pay never ran");
    assert_eq!(lines(&calls_file(&replay_dir.path("effects"))), 0);
    assert_eq!(report.tool_calls.len(), 1);
    assert_eq!(report.tool_calls[0].tool, "pay");
    assert_eq!(report.tool_calls[0].args, json!({"amount": 5}));
    assert_eq!(
        report.tool_calls[0].answered_from,
        markov_store::ToolCallSource::Refused
    );
    // The model read why.
    let second = &live.requests()[1];
    let result = serde_json::to_string(&second.messages).expect("serializes");
    assert!(
        result.contains("not run during a replay") && result.contains("side effects"),
        "{result}"
    );
}

#[tokio::test]
async fn a_replay_asked_to_run_tools_live_runs_a_new_call() {
    let options = markov_store::ReplayOptions {
        run_tools_live: true,
        ..Default::default()
    };
    let (report, replay_dir, _) = replay_new_payment("replay-live-tools", options).await;
    assert_eq!(report.error, None);
    assert_eq!(lines(&replay_dir.path("effects")), 1, "pay ran once");
    assert_eq!(
        report.tool_calls[0].answered_from,
        markov_store::ToolCallSource::Live
    );
}

#[tokio::test]
async fn a_database_from_before_step_traces_opens_and_records_them() {
    let dir = Dir::new("steps-old-schema");
    let path = dir.path("sessions.db");
    let id = SessionId::new("old");
    {
        let store = Arc::new(SqliteStore::open(&path).expect("opens"));
        let session = DurableMachine::create(
            store.clone(),
            id.clone(),
            WorkerId::new("w"),
            agent(Arc::new(two_turns()), &dir).machine(),
        )
        .await
        .expect("created");
        session.release().await.expect("released");
    }
    // The database as an earlier version left it: no step tables.
    {
        let conn = rusqlite::Connection::open(&path).expect("opens");
        conn.execute_batch("DROP TABLE step_traces; DROP TABLE step_contents;")
            .expect("the old schema");
    }
    let store = Arc::new(SqliteStore::open(&path).expect("the old database opens"));
    assert!(store.steps(&id, 0, 10).await.expect("reads").is_empty());
    let mut session = DurableMachine::open(
        store.clone(),
        id.clone(),
        WorkerId::new("w"),
        &agent(Arc::new(two_turns()), &dir),
    )
    .await
    .expect("opens");
    session.machine().enqueue_user("pay 3");
    session.run().await.expect("runs");
    assert_eq!(store.steps(&id, 0, 10).await.expect("reads").len(), 3);
}

#[tokio::test]
async fn retention_drops_step_detail_and_keeps_the_sessions() {
    let dir = Dir::new("steps-retention");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("opens"));
    let mut ids = Vec::new();
    for name in ["older", "newer"] {
        let id = SessionId::new(name);
        let mut session = DurableMachine::create(
            store.clone(),
            id.clone(),
            WorkerId::new("w"),
            agent(Arc::new(two_turns()), &dir).machine(),
        )
        .await
        .expect("created");
        session.machine().enqueue_user("pay 3");
        session.run().await.expect("runs");
        session.release().await.expect("released");
        ids.push(id);
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let keep_one = markov_store::StepRetention {
        sessions: Some(1),
        ..Default::default()
    };
    assert_eq!(store.prune_steps(&keep_one).await.expect("prunes"), 3);
    assert!(store.steps(&ids[0], 0, 10).await.expect("reads").is_empty());
    assert_eq!(store.steps(&ids[1], 0, 10).await.expect("reads").len(), 3);
    assert!(
        store.load(&ids[0]).await.is_ok(),
        "the session itself stays"
    );
    let a_year = markov_store::StepRetention {
        days: Some(365),
        ..Default::default()
    };
    assert_eq!(
        store.prune_steps(&a_year).await.expect("prunes"),
        0,
        "recent steps stay"
    );
}
