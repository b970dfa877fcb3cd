//! Handoffs across agents: a team's agent hands the conversation to
//! another, which continues with its own instructions and tools, shown the
//! conversation as the team says, until it hands back explicitly.

use std::sync::Arc;

use markov_executor::{Agent, Handoff, HistoryFilter, Team, TeamError};
use markov_testkit::ScriptedModel;
use serde_json::json;

fn triage(model: &Arc<ScriptedModel>) -> Agent {
    Agent::builder("triage")
        .instructions("You are triage.")
        .tools([Handoff::tool("billing", "For refunds and invoices.").expect("valid")])
        .shared_model(model.clone())
        .build()
        .expect("builds")
}

#[markov_core::tool]
/// Refunds an order.
async fn refund(
    /// The order.
    order: String,
) -> String {
    format!("refunded {order}")
}

fn billing(model: &Arc<ScriptedModel>) -> Agent {
    Agent::builder("billing")
        .instructions("You are billing.")
        .tool(Refund)
        .tools([Handoff::back().expect("valid")])
        .shared_model(model.clone())
        .build()
        .expect("builds")
}

fn team(
    triage_model: &Arc<ScriptedModel>,
    billing_model: &Arc<ScriptedModel>,
    filter: HistoryFilter,
) -> Team {
    Team::builder()
        .agent("triage", triage(triage_model))
        .agent("billing", billing(billing_model))
        .history("billing", filter)
        .build()
        .expect("team builds")
}

fn texts(messages: &[markov_core::Message]) -> Vec<String> {
    messages.iter().map(markov_core::Message::text).collect()
}

#[tokio::test]
async fn a_handoff_continues_the_turn_with_the_other_agents_instructions_and_tools() {
    let t = Arc::new(
        ScriptedModel::builder()
            .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
            .build(),
    );
    let b = Arc::new(
        ScriptedModel::builder()
            .tool_call("refund", json!({"order": "A-1"}))
            .text("Refunded A-1.")
            .build(),
    );
    let mut session = team(&t, &b, HistoryFilter::Everything).session();
    let turn = session
        .send("Refund order A-1, please.")
        .await
        .expect("runs");
    assert_eq!(turn.agent, "billing");
    assert_eq!(session.current(), "billing");
    assert_eq!(turn.step.output().as_deref(), Some("Refunded A-1."));
    assert_eq!(turn.handoffs.len(), 1);
    assert_eq!(
        (turn.handoffs[0].from.as_str(), turn.handoffs[0].to.as_str()),
        ("triage", "billing")
    );
    assert_eq!(turn.handoffs[0].reason, "a refund");
    let first = &b.requests()[0];
    assert!(
        first.system.contains("You are billing."),
        "{}",
        first.system
    );
    assert!(!first.system.contains("You are triage."));
    let tools = first.tool_names();
    assert!(
        tools.contains(&"refund") && tools.contains(&"hand_back"),
        "{tools:?}"
    );
    assert!(!tools.contains(&"transfer_to_billing"));
    let seen = texts(&first.messages).join("\n");
    assert!(seen.contains("Refund order A-1, please."), "{seen}");
    assert!(
        seen.contains("handed the conversation to you: a refund"),
        "{seen}"
    );
    // Triage's tool call stays in triage's history.
    assert!(!seen.contains("transfer_to_billing"));
    assert_eq!(t.calls(), 1);
}

/// Turn one is answered by triage; in turn two it hands over. What billing
/// is shown depends on the team's filter.
async fn billing_sees(filter: HistoryFilter) -> String {
    let t = Arc::new(
        ScriptedModel::builder()
            .text("We ship in two days.")
            .tool_call("transfer_to_billing", json!({"reason": "invoice"}))
            .build(),
    );
    let b = Arc::new(
        ScriptedModel::builder()
            .text("Here is your invoice.")
            .build(),
    );
    let mut session = team(&t, &b, filter).session();
    session.send("When do you ship?").await.expect("runs");
    let turn = session.send("Send me the invoice.").await.expect("runs");
    assert_eq!(turn.agent, "billing");
    texts(&b.requests()[0].messages).join("\n")
}

#[tokio::test]
async fn the_history_the_next_agent_sees_is_everything_the_last_turns_or_a_summary() {
    let everything = billing_sees(HistoryFilter::Everything).await;
    assert!(everything.contains("When do you ship?"), "{everything}");
    assert!(everything.contains("We ship in two days."), "{everything}");
    assert!(everything.contains("Send me the invoice."), "{everything}");

    let last = billing_sees(HistoryFilter::LastTurns(1)).await;
    assert!(!last.contains("When do you ship?"), "{last}");
    assert!(last.contains("Send me the invoice."), "{last}");

    let summarizer = Arc::new(
        ScriptedModel::builder()
            .text("The user asked about shipping, now wants an invoice.")
            .build(),
    );
    let summary = billing_sees(HistoryFilter::Summary(summarizer.clone())).await;
    assert!(
        summary.contains("The user asked about shipping, now wants an invoice."),
        "{summary}"
    );
    assert!(!summary.contains("We ship in two days."), "{summary}");
    let asked = texts(&summarizer.requests()[0].messages).join("\n");
    assert!(
        asked.contains("User: When do you ship?") && asked.contains("Agent: We ship in two days."),
        "{asked}"
    );
}

#[tokio::test]
async fn the_hand_back_is_explicit_and_returns_to_the_agent_that_handed_over() {
    let t = Arc::new(
        ScriptedModel::builder()
            .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
            .text("Anything else about your order?")
            .build(),
    );
    let b = Arc::new(
        ScriptedModel::builder()
            .text("Refunded.")
            .tool_call("hand_back", json!({"reason": "not a billing question"}))
            .build(),
    );
    let mut session = team(&t, &b, HistoryFilter::Everything).session();
    session.send("Refund, please.").await.expect("runs");
    // Billing keeps the conversation until it hands back.
    let turn = session
        .send("Also, where is my parcel?")
        .await
        .expect("runs");
    assert_eq!(turn.agent, "triage");
    assert_eq!(turn.handoffs[0].to, "triage");
    assert_eq!(
        turn.step.output().as_deref(),
        Some("Anything else about your order?")
    );
    // Triage is shown what it has not seen: billing's answer and the new
    // question.
    let seen = texts(&t.requests()[1].messages).join("\n");
    assert!(
        seen.contains("Refunded.") && seen.contains("where is my parcel?"),
        "{seen}"
    );
    assert_eq!(b.calls(), 2);
}

#[tokio::test]
async fn handoffs_back_and_forth_stop_within_the_turns_bound() {
    let t = Arc::new(
        ScriptedModel::builder()
            .tool_call("transfer_to_billing", json!({"reason": "1"}))
            .tool_call("transfer_to_billing", json!({"reason": "3"}))
            .tool_call("transfer_to_billing", json!({"reason": "5"}))
            .build(),
    );
    let b = Arc::new(
        ScriptedModel::builder()
            .tool_call("hand_back", json!({"reason": "2"}))
            .tool_call("hand_back", json!({"reason": "4"}))
            .build(),
    );
    let mut session = team(&t, &b, HistoryFilter::Everything).session();
    let turn = session.send("Ping-pong.").await.expect("runs");
    assert_eq!(
        turn.handoffs.len(),
        markov_executor::team::MAX_HANDOFFS_PER_TURN
    );
    assert_eq!(
        t.calls() + b.calls(),
        5,
        "the fifth handoff is not followed"
    );
}

#[tokio::test]
async fn a_team_whose_handoff_names_an_agent_it_lacks_is_refused() {
    let t = Arc::new(ScriptedModel::builder().text("hi").build());
    let err = Team::builder()
        .agent("triage", triage(&t))
        .build()
        .expect_err("no billing agent");
    assert_eq!(
        err,
        TeamError::UnknownAgent {
            from: "triage".into(),
            to: "billing".into()
        }
    );
}

#[tokio::test]
async fn the_state_says_who_wrote_each_answer_and_where_each_handoff_was_and_reads_back() {
    let t = Arc::new(
        ScriptedModel::builder()
            .text("We ship in two days.")
            .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
            .text("Anything else?")
            .build(),
    );
    let b = Arc::new(
        ScriptedModel::builder()
            .text("Refunded.")
            .tool_call("hand_back", json!({"reason": "done"}))
            .build(),
    );
    let mut session = team(&t, &b, HistoryFilter::Everything).session();
    session.send("When do you ship?").await.expect("runs");
    session.send("Refund me.").await.expect("runs");
    session.send("Thanks.").await.expect("runs");
    let state = session.state();
    assert_eq!(
        state.speakers(),
        [
            None,
            Some("triage"),
            None,
            Some("billing"),
            None,
            Some("triage")
        ]
    );
    let at: Vec<(usize, &str, &str)> = state
        .handoffs_at()
        .map(|(at, h)| (at, h.from.as_str(), h.to.as_str()))
        .collect();
    assert_eq!(at, [(3, "triage", "billing"), (5, "billing", "triage")]);
    // A store keeps it as JSON: it reads back the same.
    let json = serde_json::to_string(state).expect("writes");
    let back: markov_executor::TeamState = serde_json::from_str(&json).expect("reads");
    assert_eq!(&back, state);
    assert_eq!(back.current(), "triage");
}
