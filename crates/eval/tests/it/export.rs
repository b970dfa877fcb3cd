//! A stored session exported as a case replays offline.

use std::sync::Arc;

use markov_eval::{Dataset, Expect, Runner, export_session};
use markov_store::{DurableMachine, SessionId, SqliteStore, Store, WorkerId};
use markov_testkit::ScriptedModel;
use serde_json::json;

use crate::fixtures::{INSTRUCTIONS, calculator};

#[tokio::test]
async fn a_case_exported_from_a_stored_session_replays_offline() {
    let store = Arc::new(SqliteStore::in_memory().expect("store"));
    // A recorded conversation of two turns (the model's answers stand in
    // for a real model's).
    let recorded = ScriptedModel::builder()
        .tool_call("add", json!({"a": 1, "b": 2}))
        .text("{\"sum\": 3}")
        .tool_call("add", json!({"a": 3, "b": 4}))
        .text("{\"sum\": 7}")
        .build()
        .fresh_call_ids();
    let agent = calculator(Arc::new(recorded), INSTRUCTIONS).expect("builds");
    let id = SessionId::new("recorded");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("app"),
        agent.machine(),
    )
    .await
    .expect("created");
    for turn in ["What is 1 + 2?", "And 3 + 4?"] {
        session.machine().enqueue_user(turn);
        session.run().await.expect("runs");
    }
    session.release().await.expect("released");

    let case = export_session(store.as_ref() as &dyn Store, &id)
        .await
        .expect("exports");
    assert_eq!(case.input, ["What is 1 + 2?", "And 3 + 4?"]);
    assert_eq!(case.script.len(), 4);
    assert!(
        matches!(&case.expect[..], [Expect::Trajectory { calls, .. }, Expect::OutputEquals { value }]
        if calls.len() == 2 && value == "{\"sum\":7}")
    );
    // As TOML, as the command line writes it, and back.
    let dataset = Dataset {
        name: "exported".into(),
        description: None,
        repeat: None,
        cases: vec![case],
    };
    let dataset = Dataset::from_toml(&dataset.to_toml().expect("writes")).expect("reads");
    let report = Runner::new(|model| calculator(model, INSTRUCTIONS))
        .run(&dataset)
        .await
        .expect("runs");
    assert_eq!(report.summary.passed, 1, "{}", report.table());
    assert_eq!(report.cases[0].runs[0].steps, 4);
}

#[tokio::test]
async fn a_session_that_is_not_there_is_an_error() {
    let store = SqliteStore::in_memory().expect("store");
    let err = export_session(&store, &SessionId::new("nope"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");
}

#[tokio::test]
async fn only_the_users_words_are_exported_as_input() {
    use markov_core::message::{Message, Metadata, Source};
    let store = Arc::new(SqliteStore::in_memory().expect("store"));
    let recorded = ScriptedModel::builder()
        .text("{\"sum\": 3}")
        .text("{\"sum\": 3}")
        .build();
    let agent = calculator(Arc::new(recorded), INSTRUCTIONS).expect("builds");
    let id = SessionId::new("noted");
    let machine = agent.machine();
    let instance = machine.instance().id().clone();
    let mut session =
        DurableMachine::create(store.clone(), id.clone(), WorkerId::new("app"), machine)
            .await
            .expect("created");
    session.machine().enqueue_user("What is 1 + 2?");
    session.run().await.expect("runs");
    // markov's own follow-up, and text an agent instance handed back.
    session.machine().enqueue_instruction("Answer again.");
    session
        .machine()
        .enqueue([
            Message::user("the child's findings").with_metadata(Metadata::with_source(Source {
                instance_id: Some(instance),
                ..Source::default()
            })),
        ]);
    session.run().await.expect("runs");
    session.release().await.expect("released");

    let case = export_session(store.as_ref() as &dyn Store, &id)
        .await
        .expect("exports");
    assert_eq!(case.input, ["What is 1 + 2?"]);
}

#[tokio::test]
async fn a_range_of_recorded_steps_exports_as_a_case_that_replays_offline() {
    let store = Arc::new(SqliteStore::in_memory().expect("store"));
    let recorded = ScriptedModel::builder()
        .tool_call("add", json!({"a": 1, "b": 2}))
        .text("{\"sum\": 3}")
        .tool_call("add", json!({"a": 3, "b": 4}))
        .text("{\"sum\": 7}")
        .build()
        .fresh_call_ids();
    let agent = calculator(Arc::new(recorded), INSTRUCTIONS).expect("builds");
    let id = SessionId::new("recorded");
    let mut session = DurableMachine::create(
        store.clone(),
        id.clone(),
        WorkerId::new("app"),
        agent.machine(),
    )
    .await
    .expect("created");
    for turn in ["What is 1 + 2?", "And 3 + 4?"] {
        session.machine().enqueue_user(turn);
        session.run().await.expect("runs");
    }
    session.release().await.expect("released");
    // The second turn's two steps.
    let case = markov_eval::export_steps(store.as_ref() as &dyn Store, &id, 2..4)
        .await
        .expect("exports");
    assert_eq!(case.input, ["And 3 + 4?"], "only the turn of those steps");
    assert_eq!(case.script.len(), 2, "their two recorded answers");
    let dataset = Dataset {
        name: "exported".into(),
        description: None,
        repeat: None,
        cases: vec![case],
    };
    let dataset = Dataset::from_toml(&dataset.to_toml().expect("writes")).expect("reads");
    let report = Runner::new(|model| calculator(model, INSTRUCTIONS))
        .run(&dataset)
        .await
        .expect("runs");
    assert_eq!(report.summary.passed, 1, "{}", report.table());
    assert_eq!(report.cases[0].runs[0].steps, 2);
    // An open range ends at the last step, and its case says so; the
    // case file of it is the one of those steps.
    let open = markov_eval::export_dataset(store.as_ref() as &dyn Store, &id, Some(2..u64::MAX))
        .await
        .expect("exports");
    assert_eq!(open.cases[0].id, "recorded-steps-2-4");
    assert_eq!(open.cases[0].input, dataset.cases[0].input);
    assert_eq!(open.cases[0].script, dataset.cases[0].script);
    let whole = markov_eval::export_dataset(store.as_ref() as &dyn Store, &id, None)
        .await
        .expect("exports");
    assert_eq!(whole.cases[0].input, ["What is 1 + 2?", "And 3 + 4?"]);
    // Steps that were not recorded are an error, not an empty case.
    let err = markov_eval::export_steps(store.as_ref() as &dyn Store, &id, 9..12)
        .await
        .expect_err("nothing recorded there");
    assert!(matches!(err, markov_eval::ExportError::NoSteps { .. }));
}
