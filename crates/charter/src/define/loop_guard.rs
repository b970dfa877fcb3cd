//! The loop guard: how many identical tool calls a leaf may make within one
//! user turn (a rule on a node, or the charter's default).
//!
//! After `max_repeats` identical calls in a user turn, the next one is not
//! run and gets an error result telling the model it is repeating itself;
//! after `stop_after` more such refusals the run ends. The executor applies
//! the rule with `markov-policy`'s repeat counts, which hold one
//! conversation's counts; the step limit still bounds everything.

/// How many identical calls a leaf may make in one user turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopGuard {
    max_repeats: Option<u32>,
    stop_after: Option<u32>,
}

impl Default for LoopGuard {
    /// Three identical calls; the run ends after two more refused ones.
    fn default() -> Self {
        LoopGuard {
            max_repeats: Some(3),
            stop_after: Some(2),
        }
    }
}

impl LoopGuard {
    /// No limit (the step limit still applies).
    pub const OFF: LoopGuard = LoopGuard {
        max_repeats: None,
        stop_after: None,
    };

    /// `n` identical calls per user turn (at least one); the run ends after
    /// two more refused ones.
    pub fn repeats(n: u32) -> Self {
        LoopGuard {
            max_repeats: Some(n.max(1)),
            stop_after: Some(2),
        }
    }

    /// The run ends after `m` refused repeats beyond the limit (`None`:
    /// refuse, never end).
    #[must_use]
    pub fn stop_after(mut self, m: Option<u32>) -> Self {
        self.stop_after = m;
        self
    }

    /// The identical calls allowed per user turn; `None` is no limit.
    pub fn max_repeats(&self) -> Option<u32> {
        self.max_repeats
    }

    /// The refused repeats after which the run ends; `None`: never.
    pub fn refusals_before_stop(&self) -> Option<u32> {
        self.stop_after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_allows_three_and_stops_after_two_refusals() {
        let guard = LoopGuard::default();
        assert_eq!(guard.max_repeats(), Some(3));
        assert_eq!(guard.refusals_before_stop(), Some(2));
        assert_eq!(LoopGuard::OFF.max_repeats(), None);
        assert_eq!(LoopGuard::OFF.refusals_before_stop(), None);
        let custom = LoopGuard::repeats(0).stop_after(None);
        assert_eq!(custom.max_repeats(), Some(1), "at least one call");
        assert_eq!(custom.refusals_before_stop(), None);
    }
}
