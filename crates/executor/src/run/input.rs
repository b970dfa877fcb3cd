//! The input guard at the drain: each user message the run takes from the
//! queue is checked before it enters the history, so that what the history
//! keeps (in memory and in a store) is what the guard let through — the
//! rewritten text, or markov's note in a blocked message's place.
//!
//! The run state never awaits: when the queue holds user text no verdict
//! covers yet, [`RunState::next`](super::RunState::next) hands the driver an
//! [`InputCheck`] ([`Action::CheckInput`](super::Action::CheckInput)), the
//! driver awaits [`InputCheck::run`] and hands the verdicts back through
//! [`RunState::on_input_checked`](super::RunState::on_input_checked). An
//! executor without input guards is never asked and nothing is checked.

use markov_core::message::{Item, Items, Message, Metadata, Role};
use markov_guard::{Blocked, Checked};
use markov_policy::{GuardAction, GuardPoint, GuardRecord};

use crate::effect::Entry;
use crate::executor::InputGuard;
use crate::step::BLOCKED_NOTE;

/// The user texts of a drain that the input guards must check before they
/// enter the history. Run it with [`InputCheck::run`].
#[derive(Debug, Clone)]
pub struct InputCheck {
    guard: InputGuard,
    texts: Vec<String>,
}

impl InputCheck {
    /// The texts to check, one per user message, in queue order.
    pub fn texts(&self) -> &[String] {
        &self.texts
    }

    /// Runs the guards on each text, one after the other; each rewrite
    /// and block is traced and audited.
    pub async fn run(self) -> InputChecked {
        let mut verdicts = Vec::with_capacity(self.texts.len());
        for text in self.texts {
            let checked = self.guard.guards().check(&text).await;
            let action = match &checked {
                Checked::Passed(None) => None,
                Checked::Passed(Some(_)) => Some(GuardAction::Rewrite),
                Checked::Blocked(blocked) => Some(GuardAction::Block {
                    guard: blocked.guard.clone(),
                    reason: blocked.reason.clone(),
                }),
            };
            if let Some(action) = action {
                let record = GuardRecord {
                    point: GuardPoint::Input,
                    action,
                    call_id: None,
                };
                record.trace();
                if let Some(sink) = self.guard.audit() {
                    sink.guard(&record);
                }
            }
            verdicts.push((text, checked));
        }
        InputChecked(verdicts)
    }
}

/// The input guards' verdicts of an [`InputCheck`], for
/// [`RunState::on_input_checked`](super::RunState::on_input_checked).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputChecked(pub(super) Vec<(String, Checked)>);

impl InputChecked {
    /// The verdict on `text`, if it was checked.
    pub(super) fn verdict(&self, text: &str) -> Option<&Checked> {
        self.0.iter().find(|(t, _)| t == text).map(|(_, c)| c)
    }

    pub(super) fn extend(&mut self, other: InputChecked) {
        self.0.extend(other.0);
    }
}

/// The text of an entry the input guards check: a user message's text,
/// `None` for anything else (tool results, markov's own messages, effects,
/// a message with no text).
pub(super) fn guarded_text(entry: &Entry) -> Option<String> {
    if entry.effect.is_some() || entry.message.role != Role::User {
        return None;
    }
    let text = entry.message.text();
    (!text.is_empty()).then_some(text)
}

/// What the verdicts did to a drained batch.
#[derive(Debug, Default)]
pub(super) struct Applied {
    /// The blocks, in queue order.
    pub blocked: Vec<Blocked>,
    /// How many messages were rewritten.
    pub rewritten: usize,
}

/// Applies `verdicts` to the user messages of `entries`: a rewritten
/// message keeps its place with the rewritten text; a blocked one is
/// replaced by markov's note (a system message naming the guard and its
/// reason, never the user's words), its tool results, if it carried any,
/// kept so that every call still has its result. Every user text of
/// `entries` must have a verdict (see [`unchecked`]).
pub(super) fn apply_verdicts(entries: &mut Vec<Entry>, verdicts: &InputChecked) -> Applied {
    let mut applied = Applied::default();
    let mut out = Vec::with_capacity(entries.len());
    for mut entry in std::mem::take(entries) {
        let Some(text) = guarded_text(&entry) else {
            out.push(entry);
            continue;
        };
        match verdicts.verdict(&text) {
            None | Some(Checked::Passed(None)) => out.push(entry),
            Some(Checked::Passed(Some(rewritten))) => {
                replace_text(&mut entry.message, rewritten.clone());
                applied.rewritten += 1;
                out.push(entry);
            }
            Some(Checked::Blocked(blocked)) => {
                let results: Vec<Item> = entry
                    .message
                    .item_list()
                    .iter()
                    .filter(|i| matches!(i, Item::ToolResult { .. }))
                    .cloned()
                    .collect();
                let source = entry
                    .message
                    .metadata
                    .as_ref()
                    .and_then(|m| m.source.clone());
                if !results.is_empty() {
                    let mut kept = Message::user_items(results);
                    kept.metadata = entry.message.metadata.take();
                    out.push(Entry::message(kept));
                }
                let mut note = Message::system(blocked_note(blocked));
                if let Some(source) = source {
                    note = note.with_metadata(Metadata::with_source(source));
                }
                out.push(Entry::message(note));
                applied.blocked.push(blocked.clone());
            }
        }
    }
    *entries = out;
    applied
}

/// The user texts of `entries` that `verdicts` does not cover, in order.
pub(super) fn unchecked(entries: &[Entry], verdicts: Option<&InputChecked>) -> Vec<String> {
    entries
        .iter()
        .filter_map(guarded_text)
        .filter(|text| verdicts.is_none_or(|v| v.verdict(text).is_none()))
        .collect()
}

/// The check of `texts` by `guard`.
pub(super) fn check(guard: InputGuard, texts: Vec<String>) -> InputCheck {
    InputCheck { guard, texts }
}

/// markov's note in a blocked message's place.
pub(crate) fn blocked_note(blocked: &Blocked) -> String {
    format!("{BLOCKED_NOTE} The message was {blocked}.")
}

/// Replaces a message's text by `text`: a plain string outright, else in
/// the first text item's place, the other text items removed (images and
/// other items kept).
fn replace_text(message: &mut Message, text: String) {
    match &mut message.items {
        Items::Text(s) => *s = text,
        Items::List(items) => {
            let mut text = Some(text);
            items.retain_mut(|item| match item {
                Item::Text { text: t } => match text.take() {
                    Some(new) => {
                        *t = new;
                        true
                    }
                    None => false,
                },
                _ => true,
            });
        }
        Items::Instance(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdicts(list: &[(&str, Checked)]) -> InputChecked {
        InputChecked(
            list.iter()
                .map(|(t, c)| ((*t).to_owned(), c.clone()))
                .collect(),
        )
    }

    #[test]
    fn a_rewrite_replaces_the_text_and_a_block_leaves_only_the_note() {
        let mut entries = vec![
            Entry::message(Message::user("mail ann@example.com")),
            Entry::message(Message::user("the secret plan")),
            Entry::message(Message::user("fine")),
        ];
        let applied = apply_verdicts(
            &mut entries,
            &verdicts(&[
                (
                    "mail ann@example.com",
                    Checked::Passed(Some("mail [EMAIL_1]".into())),
                ),
                (
                    "the secret plan",
                    Checked::Blocked(Blocked {
                        guard: "forbid".into(),
                        reason: "no".into(),
                    }),
                ),
                ("fine", Checked::Passed(None)),
            ]),
        );
        let shown: Vec<(Role, String)> = entries
            .iter()
            .map(|e| (e.message.role, e.message.text()))
            .collect();
        assert_eq!(
            shown,
            [
                (Role::User, "mail [EMAIL_1]".to_owned()),
                (
                    Role::System,
                    "[guard] The message was blocked by forbid: no.".to_owned()
                ),
                (Role::User, "fine".to_owned()),
            ]
        );
        assert_eq!(applied.rewritten, 1);
        assert_eq!(applied.blocked.len(), 1);
    }

    #[test]
    fn a_blocked_message_keeps_its_tool_results_and_loses_its_text() {
        let result = Item::tool_result("c1", "42", None);
        let mut entries = vec![Entry::message(Message::user_items(vec![
            result.clone(),
            Item::text("and the secret plan"),
        ]))];
        apply_verdicts(
            &mut entries,
            &verdicts(&[(
                "and the secret plan",
                Checked::Blocked(Blocked {
                    guard: "forbid".into(),
                    reason: "no".into(),
                }),
            )]),
        );
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].message.item_list(), [result]);
        assert_eq!(entries[1].message.role, Role::System);
    }

    #[test]
    fn only_user_text_is_checked_and_only_once() {
        let entries = vec![
            Entry::message(Message::user("a")),
            Entry::message(Message::system("markov's")),
            Entry::message(Message::user("b")),
        ];
        assert_eq!(unchecked(&entries, None), ["a", "b"]);
        let seen = verdicts(&[("a", Checked::Passed(None))]);
        assert_eq!(unchecked(&entries, Some(&seen)), ["b"]);
    }
}
