//! Exact token counts of context views, for policies that ask for them
//! ([`TokenCount::Provider`](markov_charter::context::TokenCount)).
//!
//! The cheap estimate runs on every step; the model's own count only
//! where the estimate says a view passed its summary threshold. A count is
//! remembered with the view it was of (its [`HistoryId`] and length): the
//! view is only appended to while its id stays, so the count plus the
//! estimates of the messages appended since bounds the view's tokens, and
//! the model is asked again only when that sum passes the threshold —
//! near a crossing, not on every step. A compaction gives the view a new
//! id, which forgets the count.

use std::collections::HashMap;
use std::sync::Mutex;

use markov_core::message::Message;
use markov_core::model::HistoryId;
use markov_core::tokens;

/// The exact counts of one machine's views, per policy; never serialized
/// (a restored machine's views have new ids, so nothing would apply).
#[derive(Debug, Default)]
pub(crate) struct ExactCounts {
    by_policy: Mutex<HashMap<u64, PolicyCounts>>,
}

/// What is known of one policy's view.
#[derive(Debug, Default)]
struct PolicyCounts {
    /// The last count, and the view it was of.
    last: Option<Counted>,
    /// The model offers no count: it is not asked again.
    not_offered: bool,
    /// A warning that the estimate decides was logged: the next falls to
    /// debug, so a machine's trace warns once per policy, not per step.
    warned: bool,
}

/// One count of a view.
#[derive(Debug, Clone, Copy)]
struct Counted {
    id: HistoryId,
    /// The view's length when counted.
    len: usize,
    tokens: u64,
}

/// What the counts know of a view whose estimate passed its threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Known {
    /// The last count plus the estimates since is within the threshold:
    /// the view is sent as it is, without asking.
    Within,
    /// The last count of this view passed the threshold, or the model
    /// offers no count: the estimate decides.
    Estimate,
    /// Nothing is known that decides: ask the model.
    Ask,
}

/// Why a count could not decide, for the warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unavailable {
    /// The model offers no count.
    NotOffered,
    /// The count failed.
    Failed,
}

impl ExactCounts {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, PolicyCounts>> {
        self.by_policy.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What is known of `policy`'s view `messages` (the view `id`),
    /// against `threshold`.
    pub(crate) fn known(
        &self,
        policy: u64,
        id: HistoryId,
        messages: &[Message],
        threshold: u64,
    ) -> Known {
        let by_policy = self.lock();
        let Some(counts) = by_policy.get(&policy) else {
            return Known::Ask;
        };
        if counts.not_offered {
            return Known::Estimate;
        }
        match counts.last {
            Some(last) if last.id == id && last.len <= messages.len() => {
                if last.tokens > threshold {
                    return Known::Estimate;
                }
                let since = tokens::estimate_messages(&messages[last.len..]);
                if last.tokens.saturating_add(since) <= threshold {
                    Known::Within
                } else {
                    Known::Ask
                }
            }
            _ => Known::Ask,
        }
    }

    /// Remembers that `policy`'s view `id`, `len` messages long, counted
    /// `tokens`.
    pub(crate) fn remember(&self, policy: u64, id: HistoryId, len: usize, tokens: u64) {
        self.lock().entry(policy).or_default().last = Some(Counted { id, len, tokens });
    }

    /// Notes that `policy`'s count could not be had; whether this is the
    /// first time for the policy (the one to warn about).
    pub(crate) fn unavailable(&self, policy: u64, why: Unavailable) -> bool {
        let mut by_policy = self.lock();
        let counts = by_policy.entry(policy).or_default();
        if why == Unavailable::NotOffered {
            counts.not_offered = true;
        }
        !std::mem::replace(&mut counts.warned, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(n: usize, bytes: usize) -> Vec<Message> {
        (0..n).map(|_| Message::user("x".repeat(bytes))).collect()
    }

    #[test]
    fn a_count_plus_the_estimates_since_decides_until_it_passes() {
        let counts = ExactCounts::default();
        let id = HistoryId::fresh();
        let view = messages(4, 300);
        assert_eq!(counts.known(1, id, &view, 1_000), Known::Ask);
        counts.remember(1, id, 4, 600);
        assert_eq!(counts.known(1, id, &view, 1_000), Known::Within);
        // One more message of about 100 tokens: still within.
        let longer = messages(5, 300);
        let one = tokens::estimate_messages(&longer[4..]);
        assert!(600 + one <= 1_000);
        assert_eq!(counts.known(1, id, &longer, 1_000), Known::Within);
        // Enough appended to pass: ask again.
        let long = messages(9, 300);
        assert_eq!(counts.known(1, id, &long, 1_000), Known::Ask);
        // A count past the threshold leaves it to the estimate.
        counts.remember(1, id, 9, 1_200);
        assert_eq!(counts.known(1, id, &long, 1_000), Known::Estimate);
        // Another view (a compaction's new id) knows nothing.
        assert_eq!(
            counts.known(1, HistoryId::fresh(), &long, 1_000),
            Known::Ask
        );
        // Nor does another policy.
        assert_eq!(counts.known(2, id, &long, 1_000), Known::Ask);
    }

    #[test]
    fn a_model_without_counts_is_asked_once_and_warned_about_once() {
        let counts = ExactCounts::default();
        let id = HistoryId::fresh();
        assert!(counts.unavailable(1, Unavailable::Failed));
        assert!(!counts.unavailable(1, Unavailable::Failed));
        // A failure is not final: the next crossing asks again.
        assert_eq!(counts.known(1, id, &messages(1, 3), 10), Known::Ask);
        assert!(!counts.unavailable(1, Unavailable::NotOffered));
        assert_eq!(counts.known(1, id, &messages(1, 3), 10), Known::Estimate);
        assert!(counts.unavailable(2, Unavailable::NotOffered));
    }
}
