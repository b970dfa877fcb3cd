//! A team's chat in the browser: the handoff is shown as an event between
//! the messages, each answer with the agent that wrote it, and what the
//! handoff gives the next agent as markov's note, never as the user's
//! words; the same after a reload. A call that waits for approval in a
//! team conversation shows as an agent's does, and approving it on the
//! page resumes the turn with the agent that made it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use markov_policy::{Category, ToolMetadata};
use markov_server::Server;
use markov_store::SqliteStore;
use markov_testkit::ScriptedModel;
use serde_json::json;

use super::{Browser, conversation};
use crate::http::start;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_chat_shows_the_handoffs_as_events_and_which_agent_answered() {
    let refunds = Arc::new(AtomicUsize::new(0));
    let team = crate::team::team(
        ScriptedModel::builder()
            .tool_call(
                "transfer_to_billing",
                json!({"reason": "the user wants a refund"}),
            )
            .text("Glad it is sorted. Anything else?")
            .build(),
        ScriptedModel::builder()
            .tool_call("refund", json!({"amount": 5}))
            .text("I refunded **5 €** to your card.")
            .tool_call("hand_back", json!({"reason": "the refund is done"}))
            .build(),
        &refunds,
    );
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(Server::builder().team("support", team), store, refunds).await;
    let Some(browser) = Browser::start(1000, 860).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;

    browser.say("Refund my 5, please.").await;
    browser
        .wait(
            "billing's answer",
            "document.querySelector('#log .msg.assistant.by-agent') \
             && !document.body.classList.contains('running')",
        )
        .await;
    shows_the_handoff(&browser).await;
    // What the handoff gave billing is markov's note to billing.
    let notes = browser
        .run("return [...document.querySelectorAll('#log .msg.markov')].map(e => e.innerText)")
        .await;
    let notes: Vec<String> = serde_json::from_value(notes).expect("the notes' texts");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("handed the conversation to you")
                && n.to_lowercase().contains("markov to billing")),
        "{notes:?}"
    );
    browser.screenshot("team-handoff.png").await;

    // After a reload: the conversation's texts, the handoff where it was,
    // the answer with its agent.
    browser.reload().await;
    browser
        .wait(
            "the conversation again",
            "document.querySelector('#log .msg.assistant.by-agent')",
        )
        .await;
    shows_the_handoff(&browser).await;
    let text = conversation(&browser).await;
    let handoff = text.find("triage handed the conversation to billing");
    let asked = text.find("Refund my 5, please.");
    let answered = text.find("I refunded");
    assert!(
        asked < handoff && handoff < answered && asked.is_some(),
        "in order: {text}"
    );

    // Billing hands back: triage answers, after a second handoff event.
    browser.say("Thanks, that is all.").await;
    browser
        .wait(
            "triage's answer",
            "document.querySelectorAll('#log .note.handoff').length === 2 \
             && [...document.querySelectorAll('#log .msg.assistant.by-agent .who')] \
                  .some(e => e.innerText.toLowerCase() === 'triage') \
             && !document.body.classList.contains('running')",
        )
        .await;
    let text = conversation(&browser).await;
    assert!(
        text.contains("billing handed the conversation to triage: the refund is done"),
        "{text}"
    );
    assert!(text.contains("Glad it is sorted."), "{text}");
    // What triage was given (billing's answer among it) is markov's note,
    // never triage's answer.
    let answers = browser
        .run(
            "return [...document.querySelectorAll('#log .msg.assistant.by-agent')] \
             .map(e => e.innerText)",
        )
        .await;
    let answers: Vec<String> = serde_json::from_value(answers).expect("the answers");
    assert_eq!(answers.len(), 2, "{answers:?}");
    assert!(answers[1].contains("Glad it is sorted."), "{answers:?}");
    assert!(
        answers[1].to_lowercase().starts_with("triage"),
        "{answers:?}"
    );
    browser.screenshot("team-hand-back.png").await;
    browser.close().await;
}

/// The first turn as the page shows it: the handoff, billing's answer
/// with its name, the user's one message.
async fn shows_the_handoff(browser: &Browser) {
    assert_eq!(
        browser.text("#log .note.handoff").await.trim(),
        "triage handed the conversation to billing: the user wants a refund"
    );
    assert_eq!(
        browser
            .text("#log .msg.assistant.by-agent .who")
            .await
            .trim()
            .to_lowercase(),
        "billing"
    );
    assert_eq!(
        browser.count("#log .msg.user").await,
        1,
        "only the user's words"
    );
    assert_eq!(
        browser.text("#log .msg.user").await.trim(),
        "Refund my 5, please."
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_chat_shows_a_paused_approval_and_approving_it_resumes_the_agent() {
    let refunds = Arc::new(AtomicUsize::new(0));
    let team = crate::team::team_with(
        ScriptedModel::builder()
            .tool_call(
                "transfer_to_billing",
                json!({"reason": "the user wants a refund"}),
            )
            .build(),
        ScriptedModel::builder()
            .tool_call("refund", json!({"amount": 5}))
            .text("I refunded **5 €** to your card.")
            .build(),
        &refunds,
        ToolMetadata::new(Category::Action).with_confirmation(),
    );
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(
        Server::builder().team("support", team),
        store,
        refunds.clone(),
    )
    .await;
    let Some(browser) = Browser::start(1000, 860).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;

    browser.say("Refund my 5, please.").await;
    let shown = browser
        .wait(
            "billing's call waiting",
            "document.querySelectorAll('#approvals .approval').length === 1 \
             && document.getElementById('approvals').innerText",
        )
        .await;
    let shown = shown.as_str().unwrap_or_default().to_owned();
    assert!(shown.contains("Approve refund?"), "{shown}");
    assert!(shown.contains("\"amount\": 5"), "{shown}");
    browser
        .wait(
            "the composer waiting for the decision",
            "document.getElementById('send').disabled \
             && document.getElementById('status').innerText.includes('decision')",
        )
        .await;
    assert_eq!(
        browser.text("#log .note.handoff").await.trim(),
        "triage handed the conversation to billing: the user wants a refund"
    );
    assert_eq!(refunds.load(Ordering::SeqCst), 0, "not before the decision");
    browser.screenshot("team-approval-waiting.png").await;

    // Reloaded: the call still waits, once.
    browser.reload().await;
    browser
        .wait(
            "the waiting call again",
            "document.querySelectorAll('#approvals .approval').length === 1",
        )
        .await;

    browser.click("#approvals button.approve").await;
    let log = browser
        .wait(
            "billing's answer after the approval",
            "document.querySelector('#log .msg.assistant.by-agent') \
             && !document.body.classList.contains('running') \
             && document.getElementById('log').innerText",
        )
        .await;
    let log = log.as_str().unwrap_or_default().to_owned();
    assert!(log.contains("You approved the call of refund."), "{log}");
    assert!(log.contains("I refunded"), "{log}");
    assert_eq!(
        browser
            .text("#log .msg.assistant.by-agent .who")
            .await
            .trim()
            .to_lowercase(),
        "billing"
    );
    assert_eq!(browser.count("#approvals .approval").await, 0);
    assert_eq!(refunds.load(Ordering::SeqCst), 1, "refunded once");
    browser.screenshot("team-approval-approved.png").await;
    browser.close().await;
}
