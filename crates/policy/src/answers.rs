//! [`PendingAnswers`]: the model's answers whose tools may have started,
//! kept until the step that records them is written.
//!
//! A model gives new call ids every time it is asked, so a resumed step that
//! called the model again would make new calls, and a completed side effect
//! would run a second time. The answer is therefore recorded — durably,
//! through the conversation's [`Journal`](crate::Journal) —
//! before the first of its tools runs, and a leaf asked for the same answer
//! again (the same instance over the same history) gets the recorded one
//! instead of a new model call: the same calls, with the same ids, answered
//! from the ledger when they completed and run once when they did not.

use std::sync::Mutex;

use markov_core::ids::InstanceId;
use markov_core::model::ModelResponse;
use serde::{Deserialize, Serialize};

/// A model's answer to one leaf, recorded before its tools ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RecordedAnswer {
    /// The leaf instance that asked.
    pub instance: InstanceId,
    /// The length of the history the request was made over: with the
    /// instance, what identifies the request (the history only grows).
    pub history_len: u64,
    /// The answer as the model gave it.
    pub response: ModelResponse,
}

/// The recorded answers of the step in flight (one per leaf that called
/// tools).
#[derive(Debug, Default)]
pub struct PendingAnswers {
    answers: Mutex<Vec<RecordedAnswer>>,
    /// Serializes journal writes, so the last one written holds every
    /// answer (two leaves of one step record theirs concurrently).
    pub(crate) writing: futures::lock::Mutex<()>,
}

impl PendingAnswers {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RecordedAnswer>> {
        self.answers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The answer recorded for `instance` over a history of `history_len`
    /// messages, if any.
    pub fn find(&self, instance: &InstanceId, history_len: usize) -> Option<ModelResponse> {
        let len = u64::try_from(history_len).unwrap_or(u64::MAX);
        self.lock()
            .iter()
            .find(|a| a.instance == *instance && a.history_len == len)
            .map(|a| a.response.clone())
    }

    /// Adds `answer`, replacing one for the same instance.
    pub(crate) fn push(&self, answer: RecordedAnswer) {
        let mut answers = self.lock();
        answers.retain(|a| a.instance != answer.instance);
        answers.push(answer);
    }

    /// The recorded answers, in the order they were recorded.
    pub fn snapshot(&self) -> Vec<RecordedAnswer> {
        self.lock().clone()
    }

    /// Whether none is recorded.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Forgets every answer: their step is recorded.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// Replaces the answers (a restored conversation).
    pub fn restore(&self, answers: Vec<RecordedAnswer>) {
        *self.lock() = answers;
    }
}
