//! [`Rehearsal`]: the scripted model `markov-serve` runs without an API
//! key. It follows the demo's plan on every turn (look the cities up, add,
//! answer), reading only the conversation, so any number of sessions can
//! use it.
//!
//! In the demo team (`markov-serve --team`) it plays both agents, from the
//! tools each is offered: `cities`, with no `add`, hands the two counts to
//! `maths` (`transfer_to_maths`, the numbers in the reason); `maths` adds
//! the numbers its handoff's note names and hands the sum back; `cities`,
//! handed the conversation back, answers with what the hand-back says.
//! Asked with no tools at all (a handoff's summary), it restates the
//! conversation's last user text.

use async_trait::async_trait;
use markov_core::message::{Item, Message, Role};
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
use serde_json::json;

/// The cities the demo knows.
const CITIES: [&str; 2] = ["Lisbon", "Porto"];

/// The note a handoff adds to what the agent taking over is given, up to
/// the reason (see `markov_executor::team`).
const HANDED: &str = " agent handed the conversation to you: ";

/// The reason in a handoff's note in `text`, if it has one.
fn handoff_reason(text: &str) -> Option<&str> {
    let (_, rest) = text.rsplit_once(HANDED)?;
    rest.split_once(']').map(|(reason, _)| reason)
}

/// The integers in `text`, in order.
fn numbers(text: &str) -> Vec<i64> {
    text.split(|c: char| !c.is_ascii_digit())
        .filter_map(|part| part.parse().ok())
        .collect()
}

/// A scripted stand-in for a real model; its answers say so.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rehearsal;

fn answer(content: Vec<Item>, stop_reason: StopReason) -> ModelResponse {
    ModelResponse::new(content, stop_reason)
}

/// The messages of the current turn: after the last user message that is
/// not only tool results.
fn current_turn(messages: &[Message]) -> (&[Message], String) {
    for (i, m) in messages.iter().enumerate().rev() {
        if m.role != Role::User {
            continue;
        }
        let results_only = !m.item_list().is_empty()
            && m.item_list()
                .iter()
                .all(|item| matches!(item, Item::ToolResult { .. }));
        if !results_only {
            return (&messages[i + 1..], m.text());
        }
    }
    (messages, String::new())
}

#[async_trait]
impl Model for Rehearsal {
    fn provider_name(&self) -> &str {
        "scripted"
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let (turn, question) = current_turn(request.messages());
        let offered = |name: &str| request.tools().iter().any(|t| t.name.as_str() == name);
        if request.tools().is_empty() {
            return Ok(answer(
                vec![Item::text(format!(
                    "(scripted rehearsal summary) The user asked: {question}"
                ))],
                StopReason::EndTurn,
            ));
        }
        let results: Vec<i64> = turn
            .iter()
            .flat_map(|m| m.item_list().iter())
            .filter_map(|item| match item {
                // A plain number, or a registry's `{"ok":true,"data":N}`.
                Item::ToolResult { content, .. } => content.trim().parse().ok().or_else(|| {
                    serde_json::from_str::<serde_json::Value>(content)
                        .ok()
                        .and_then(|v| v["data"].as_i64())
                }),
                _ => None,
            })
            .collect();
        let calls: Vec<&str> = turn
            .iter()
            .flat_map(|m| m.item_list().iter())
            .filter_map(|item| match item {
                Item::ToolUse { name, .. } => Some(name.as_str()),
                _ => None,
            })
            .collect();
        // The demo team's parts.
        if offered("hand_back") && offered("add") {
            return Ok(maths(&question, &results, &calls));
        }
        if !calls.is_empty() || !offered("transfer_to_maths") {
            // Not the team's cities agent, or in the middle of its plan.
        } else if let Some(reason) = handoff_reason(&question) {
            // Handed back: the hand-back's reason is the answer.
            return Ok(answer(
                vec![Item::text(format!("(scripted rehearsal) {reason}"))],
                StopReason::EndTurn,
            ));
        }
        let cities: Vec<&str> = CITIES
            .into_iter()
            .filter(|c| question.to_lowercase().contains(&c.to_lowercase()))
            .collect();
        let reply = |text: String| Ok(answer(vec![Item::text(text)], StopReason::EndTurn));
        if cities.is_empty() {
            return reply(
                "(scripted rehearsal: no API key is set) I look up how many people live in \
                 Lisbon and Porto, and add them up. Ask me about them."
                    .into(),
            );
        }
        if calls.is_empty() {
            let content = cities
                .iter()
                .enumerate()
                .map(|(i, city)| {
                    Item::tool_use(
                        format!("rehearsal_{i}"),
                        "population",
                        json!({"city": city}),
                    )
                })
                .collect();
            return Ok(answer(content, StopReason::ToolUse));
        }
        if offered("transfer_to_maths")
            && !offered("add")
            && let (2, [a, b, ..]) = (cities.len(), results.as_slice())
        {
            return Ok(answer(
                vec![Item::tool_use(
                    "rehearsal_transfer",
                    "transfer_to_maths",
                    json!({"reason": format!("Add {a} and {b}: the people of {} and {}.", cities[0], cities[1])}),
                )],
                StopReason::ToolUse,
            ));
        }
        match (cities.len(), calls.contains(&"add"), results.as_slice()) {
            (2, false, [a, b, ..]) => Ok(answer(
                vec![Item::tool_use(
                    "rehearsal_add",
                    "add",
                    json!({"a": a, "b": b}),
                )],
                StopReason::ToolUse,
            )),
            (2, true, [.., sum]) => reply(format!(
                "(scripted rehearsal) Lisbon and Porto have {sum} inhabitants together."
            )),
            (_, _, [count, ..]) => reply(format!(
                "(scripted rehearsal) {} has {count} inhabitants.",
                cities[0]
            )),
            _ => reply("(scripted rehearsal) I could not look that up.".into()),
        }
    }
}

/// The demo team's `maths` agent: adds the two numbers its handoff's note
/// names, then hands the sum back.
fn maths(question: &str, results: &[i64], calls: &[&str]) -> ModelResponse {
    let reason = handoff_reason(question).unwrap_or(question);
    match (calls.contains(&"add"), results, numbers(reason).as_slice()) {
        (false, _, [a, b, ..]) => answer(
            vec![Item::tool_use(
                "rehearsal_add",
                "add",
                json!({"a": a, "b": b}),
            )],
            StopReason::ToolUse,
        ),
        (true, [.., sum], _) => {
            let what = reason
                .split_once(": ")
                .map_or("they", |(_, what)| what.trim_end_matches('.'));
            let what = what.strip_prefix("the people of ").unwrap_or(what);
            answer(
                vec![Item::tool_use(
                    "rehearsal_hand_back",
                    "hand_back",
                    json!({"reason": format!("{what} have {sum} inhabitants together.")}),
                )],
                StopReason::ToolUse,
            )
        }
        _ => answer(
            vec![Item::text(
                "(scripted rehearsal) I add two numbers I am handed; I was handed none.".to_owned(),
            )],
            StopReason::EndTurn,
        ),
    }
}
