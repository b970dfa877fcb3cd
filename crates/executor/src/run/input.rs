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
/// [`RunState::on_input_checked`](super::RunState::on_input_checked): one
/// per checked text, in queue order, matched to the drained messages by
/// position (two equal messages can get different verdicts).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InputChecked(pub(super) Vec<(String, Checked)>);

impl InputChecked {
    /// The verdict on the `index`-th user text of the batch, if it was
    /// checked there as `text`.
    pub(super) fn verdict(&self, index: usize, text: &str) -> Option<&Checked> {
        self.0
            .get(index)
            .filter(|(checked, _)| checked == text)
            .map(|(_, c)| c)
    }

    /// How many of `texts` (a batch's user texts, in order) these verdicts
    /// cover: the leading ones, when they are what was checked, in order;
    /// `None` when they are not (the queue changed under the check).
    pub(super) fn covers(&self, texts: &[String]) -> Option<usize> {
        let covered = self.0.len();
        (covered <= texts.len() && self.0.iter().zip(texts).all(|((t, _), text)| t == text))
            .then_some(covered)
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
/// `entries` must have its verdict, at its position (see
/// [`InputChecked::covers`]).
pub(super) fn apply_verdicts(entries: &mut Vec<Entry>, verdicts: &InputChecked) -> Applied {
    let mut applied = Applied::default();
    let mut out = Vec::with_capacity(entries.len());
    let mut index = 0;
    for mut entry in std::mem::take(entries) {
        let Some(text) = guarded_text(&entry) else {
            out.push(entry);
            continue;
        };
        let verdict = verdicts.verdict(index, &text);
        index += 1;
        match verdict {
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
                    kept.make_mut().metadata = entry.message.metadata.clone();
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

/// The user texts of `entries`, in order.
pub(super) fn guarded_texts(entries: &[Entry]) -> Vec<String> {
    entries.iter().filter_map(guarded_text).collect()
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
    match &mut message.make_mut().items {
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
    fn only_user_text_is_checked_and_verdicts_cover_a_prefix() {
        let entries = vec![
            Entry::message(Message::user("a")),
            Entry::message(Message::system("markov's")),
            Entry::message(Message::user("b")),
        ];
        let texts = guarded_texts(&entries);
        assert_eq!(texts, ["a", "b"]);
        let seen = verdicts(&[("a", Checked::Passed(None))]);
        assert_eq!(seen.covers(&texts), Some(1));
        let other = verdicts(&[("b", Checked::Passed(None))]);
        assert_eq!(other.covers(&texts), None);
    }

    #[test]
    fn equal_messages_get_their_own_verdicts_by_position() {
        let mut entries = vec![
            Entry::message(Message::user("same")),
            Entry::message(Message::user("same")),
        ];
        apply_verdicts(
            &mut entries,
            &verdicts(&[
                ("same", Checked::Passed(None)),
                (
                    "same",
                    Checked::Blocked(Blocked {
                        guard: "once".into(),
                        reason: "said twice".into(),
                    }),
                ),
            ]),
        );
        let roles: Vec<Role> = entries.iter().map(|e| e.message.role).collect();
        assert_eq!(roles, [Role::User, Role::System]);
    }
}
