//! Guardrails: checks on what goes into an agent and what comes out of it.
//!
//! A [`Guard`] looks at one text and returns a [`Verdict`]: pass it,
//! rewrite it (a redaction), or block it with a reason. Guards are
//! composed into a [`GuardStack`], run in order (a rewrite feeds the next
//! guard, the first block ends the check), and [`Guards`] says where each
//! stack runs:
//!
//! - **input**: each user message, before it enters the history and
//!   before any model call (a rewrite is what the history keeps, a block
//!   replaces the message by a note); the executor can instead run it
//!   concurrently with the model call, holding the answer back until it
//!   passed;
//! - **output**: the answer's text, and streamed text, which is held back
//!   until the output stack passed it (per sentence, per N tokens or the
//!   whole answer: the guards' [`Hold`] says which);
//! - **tool calls**: each call's arguments, as JSON text, before it runs
//!   (a rewrite must stay JSON; a block answers the call with an error the
//!   model reads, without running it);
//! - **tool results**: what a tool returned, before the model reads it
//!   (the place for [`InjectionHeuristic`]).
//!
//! Ready-made guards: [`PiiRedactor`] (with a reversible mapping,
//! [`PiiRedactor::restorer`]), [`ClassifierGuard`] (asks any model with a
//! rubric, its usage counted), [`MaxLength`] and [`Script`] (examples of
//! writing one's own) and [`InjectionHeuristic`].
//!
//! ```
//! use markov_guard::{Guards, MaxLength, PiiRedactor};
//!
//! let pii = PiiRedactor::new();
//! let guards = Guards::new()
//!     .output(MaxLength::new(2_000))
//!     .output(pii.clone())
//!     .tool_call(pii.restorer());
//! assert!(!guards.is_empty());
//! ```

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

mod checks;
mod classifier;
mod injection;
mod pii;

pub use checks::{MaxLength, Script};
pub use classifier::ClassifierGuard;
pub use injection::InjectionHeuristic;
pub use pii::{PiiRedactor, PiiRestorer};

/// What a guard decided about a text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The text may go on as it is.
    Pass,
    /// The text goes on as this one instead (a redaction).
    Rewrite(String),
    /// The text must not go on.
    Block {
        /// Why, in words a user may read (it is shown and recorded).
        reason: String,
    },
}

impl Verdict {
    /// A block with `reason`.
    pub fn block(reason: impl Into<String>) -> Self {
        Verdict::Block {
            reason: reason.into(),
        }
    }
}

/// How much streamed text an output guard needs to see at once: text is
/// held back until the guard has passed it, in pieces of this size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Up to the end of each sentence (`.`, `!`, `?` or a line break
    /// followed by white space).
    Sentence,
    /// At least this many tokens (estimated), cut at white space.
    Tokens(u32),
    /// The whole answer: nothing is streamed before the answer is complete.
    Whole,
}

impl Hold {
    /// The hold two guards of one stack need together: the coarser of the
    /// two (different kinds need the whole answer).
    pub fn and(self, other: Hold) -> Hold {
        match (self, other) {
            (Hold::Sentence, Hold::Sentence) => Hold::Sentence,
            (Hold::Tokens(a), Hold::Tokens(b)) => Hold::Tokens(a.max(b)),
            _ => Hold::Whole,
        }
    }

    /// The length of the prefix of `held` that may be checked and released
    /// now, `None` when more text is needed. At the end of the stream the
    /// caller checks whatever is left.
    pub fn ready(self, held: &str) -> Option<usize> {
        match self {
            Hold::Whole => None,
            Hold::Sentence => {
                let bytes = held.as_bytes();
                let mut end = None;
                for (i, b) in bytes.iter().enumerate() {
                    let next = bytes.get(i + 1);
                    let ends = matches!(b, b'.' | b'!' | b'?')
                        && next.is_some_and(u8::is_ascii_whitespace)
                        || *b == b'\n';
                    if ends {
                        end = Some(i + 1);
                    }
                }
                end
            }
            Hold::Tokens(n) => {
                let tokens = markov_core::tokens::estimate_text(held);
                if tokens < u64::from(n) {
                    return None;
                }
                // Cut after the last white space, so no word is split.
                held.rfind(char::is_whitespace)
                    .map(|i| i + held[i..].chars().next().map_or(1, char::len_utf8))
            }
        }
    }
}

/// A check on one text. Implement it for a guard of one's own; compose
/// guards with [`GuardStack`] and place them with [`Guards`].
///
/// `check` must not panic on any text: a guard that cannot decide (a
/// classifier whose model fails) decides as its documentation says, and
/// logs why.
#[async_trait]
pub trait Guard: Send + Sync + fmt::Debug {
    /// The guard's name, shown with its blocks.
    fn name(&self) -> &str;

    /// How much streamed text the guard needs at once; the whole answer
    /// unless it says otherwise.
    fn hold(&self) -> Hold {
        Hold::Whole
    }

    /// The verdict on `text`.
    async fn check(&self, text: &str) -> Verdict;
}

/// A block, with the guard that blocked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// The guard's [`Guard::name`].
    pub guard: String,
    /// Its reason.
    pub reason: String,
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "blocked by {}: {}", self.guard, self.reason)
    }
}

/// What a stack decided: the text to go on with (rewritten or not), or a
/// block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// Every guard passed; `Some` when one rewrote the text.
    Passed(Option<String>),
    /// A guard blocked.
    Blocked(Blocked),
}

/// Guards run one after the other on the same text: a rewrite is what the
/// next guard sees, the first block ends the check.
#[derive(Debug, Clone, Default)]
pub struct GuardStack {
    guards: Vec<Arc<dyn Guard>>,
}

impl GuardStack {
    /// Adds `guard` after the others.
    pub fn push(&mut self, guard: Arc<dyn Guard>) {
        self.guards.push(guard);
    }

    /// Whether the stack has no guard.
    pub fn is_empty(&self) -> bool {
        self.guards.is_empty()
    }

    /// Adds `other`'s guards after these.
    pub fn extend(&mut self, other: &GuardStack) {
        self.guards.extend(other.guards.iter().cloned());
    }

    /// The hold the stack's guards need together ([`Hold::and`]).
    pub fn hold(&self) -> Hold {
        self.guards
            .iter()
            .map(|g| g.hold())
            .reduce(Hold::and)
            .unwrap_or(Hold::Whole)
    }

    /// Runs the guards on `text`.
    pub async fn check(&self, text: &str) -> Checked {
        let mut current: Option<String> = None;
        for guard in &self.guards {
            let seen = current.as_deref().unwrap_or(text);
            match guard.check(seen).await {
                Verdict::Pass => {}
                Verdict::Rewrite(rewritten) => {
                    tracing::debug!(guard = guard.name(), "a guard rewrote a text");
                    current = Some(rewritten);
                }
                Verdict::Block { reason } => {
                    tracing::warn!(guard = guard.name(), %reason, "a guard blocked a text");
                    return Checked::Blocked(Blocked {
                        guard: guard.name().to_owned(),
                        reason,
                    });
                }
            }
        }
        Checked::Passed(current)
    }
}

/// Where guards run, as set on an agent (`AgentBuilder::guards`) or an
/// executor. Each method adds a guard to the end of its stack.
#[derive(Debug, Clone, Default)]
pub struct Guards {
    /// Checks the user's message of a turn.
    pub input: GuardStack,
    /// Checks the answer's text, streamed text included.
    pub output: GuardStack,
    /// Checks each tool call's arguments (JSON text) before it runs.
    pub tool_calls: GuardStack,
    /// Checks each tool result before the model reads it.
    pub tool_results: GuardStack,
    /// The input stack runs beside the turn's first model call rather than
    /// before the message enters the history ([`Guards::concurrent_input`]).
    concurrent_input: bool,
}

impl Guards {
    /// No guard anywhere.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an input guard.
    #[must_use]
    pub fn input(mut self, guard: impl Guard + 'static) -> Self {
        self.input.push(Arc::new(guard));
        self
    }

    /// Adds an output guard.
    #[must_use]
    pub fn output(mut self, guard: impl Guard + 'static) -> Self {
        self.output.push(Arc::new(guard));
        self
    }

    /// Adds a tool-call guard.
    #[must_use]
    pub fn tool_call(mut self, guard: impl Guard + 'static) -> Self {
        self.tool_calls.push(Arc::new(guard));
        self
    }

    /// Adds a tool-result guard.
    #[must_use]
    pub fn tool_result(mut self, guard: impl Guard + 'static) -> Self {
        self.tool_results.push(Arc::new(guard));
        self
    }

    /// Runs the input guards beside the turn's first model call instead of
    /// before the message enters the history: a guard that passes adds no
    /// latency. No streamed text is released and no tool call of the
    /// answer runs before they passed, and a block drops the model call;
    /// but the model was called with the message, so it is in the history
    /// when they decide: a rewrite is not applied (it is logged) and a
    /// blocked message stays beside markov's note. Off by default.
    #[must_use]
    pub fn concurrent_input(mut self) -> Self {
        self.concurrent_input = true;
        self
    }

    /// Whether the input guards run beside the model call
    /// ([`Guards::concurrent_input`]).
    pub fn is_input_concurrent(&self) -> bool {
        self.concurrent_input
    }

    /// These guards followed, in each stack, by `other`'s: how a node's
    /// own guards join the agent's. The input guards run beside the model
    /// call if either says so.
    #[must_use]
    pub fn then(mut self, other: &Guards) -> Guards {
        self.input.extend(&other.input);
        self.output.extend(&other.output);
        self.tool_calls.extend(&other.tool_calls);
        self.tool_results.extend(&other.tool_results);
        self.concurrent_input |= other.concurrent_input;
        self
    }

    /// Whether no stack has a guard.
    pub fn is_empty(&self) -> bool {
        self.input.is_empty()
            && self.output.is_empty()
            && self.tool_calls.is_empty()
            && self.tool_results.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Upper;
    #[async_trait]
    impl Guard for Upper {
        fn name(&self) -> &str {
            "upper"
        }
        async fn check(&self, text: &str) -> Verdict {
            Verdict::Rewrite(text.to_uppercase())
        }
    }

    #[derive(Debug)]
    struct NoShouting;
    #[async_trait]
    impl Guard for NoShouting {
        fn name(&self) -> &str {
            "no-shouting"
        }
        async fn check(&self, text: &str) -> Verdict {
            if text.chars().any(char::is_lowercase) {
                Verdict::Pass
            } else {
                Verdict::block("shouting")
            }
        }
    }

    #[tokio::test]
    async fn a_rewrite_feeds_the_next_guard_and_the_first_block_wins() {
        let guards = Guards::new().output(Upper).output(NoShouting);
        assert_eq!(
            guards.output.check("hi").await,
            Checked::Blocked(Blocked {
                guard: "no-shouting".into(),
                reason: "shouting".into()
            })
        );
        let guards = Guards::new().output(Upper);
        assert_eq!(
            guards.output.check("hi").await,
            Checked::Passed(Some("HI".into()))
        );
        assert_eq!(
            GuardStack::default().check("x").await,
            Checked::Passed(None)
        );
    }

    #[tokio::test]
    async fn a_nodes_guards_run_after_the_agents() {
        let joined = Guards::new()
            .output(Upper)
            .then(&Guards::new().output(NoShouting).concurrent_input());
        assert!(matches!(
            joined.output.check("hi").await,
            Checked::Blocked(Blocked { guard, .. }) if guard == "no-shouting"
        ));
        assert!(joined.is_input_concurrent());
        assert!(joined.input.is_empty());
    }

    #[test]
    fn sentences_are_released_at_their_end_only() {
        assert_eq!(Hold::Sentence.ready("Hello wor"), None);
        assert_eq!(Hold::Sentence.ready("Pi is 3.14 and"), None);
        assert_eq!(Hold::Sentence.ready("Hi. Then x"), Some(3));
        assert_eq!(Hold::Sentence.ready("One!\nTwo"), Some(5));
        assert_eq!(Hold::Whole.ready("Done. And more. "), None);
    }

    #[test]
    fn tokens_are_released_at_white_space_once_enough() {
        assert_eq!(Hold::Tokens(100).ready("short text"), None);
        let long = "word ".repeat(40) + "tail";
        let cut = Hold::Tokens(10).ready(&long).unwrap();
        assert!(long[..cut].ends_with(' '));
        assert!(!long[..cut].contains("tail"));
    }

    #[test]
    fn holds_combine_to_the_coarser() {
        assert_eq!(Hold::Sentence.and(Hold::Sentence), Hold::Sentence);
        assert_eq!(Hold::Tokens(5).and(Hold::Tokens(9)), Hold::Tokens(9));
        assert_eq!(Hold::Sentence.and(Hold::Tokens(9)), Hold::Whole);
        assert_eq!(Hold::Sentence.and(Hold::Whole), Hold::Whole);
    }
}
