//! [`Rehearsal`]: the scripted model `markov-serve` runs without an API
//! key. It follows the demo's plan on every turn (look the cities up, add,
//! answer), reading only the conversation, so any number of sessions can
//! use it.

use async_trait::async_trait;
use markov_core::message::{Item, Message, Role};
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
use serde_json::json;

/// The cities the demo knows.
const CITIES: [&str; 2] = ["Lisbon", "Porto"];

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
