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
//!
//! An answer whose calls wait for the application's approval stays
//! recorded, marked paused, after its step: resuming replays it over the
//! history as it is then, and the step that records it is the one that
//! answers every call.

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
    /// Whether some of its calls wait for the application's approval: its
    /// step ended without recording it, and resuming replays it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
}

/// The recorded answers of the step in flight (one per leaf that called
/// tools).
#[derive(Debug, Default)]
pub struct PendingAnswers {
    answers: Mutex<Vec<RecordedAnswer>>,
    /// Answers recorded by an earlier run that nothing else keeps (see
    /// [`seed`](PendingAnswers::seed)), each taken by the step that asks
    /// for it.
    seeded: Mutex<Vec<RecordedAnswer>>,
    /// Whether `seeded` may hold any: a step of a conversation without
    /// seeds does not lock it.
    has_seeds: std::sync::atomic::AtomicBool,
    /// Serializes journal writes, so the last one written holds every
    /// answer (two leaves of one step record theirs concurrently).
    pub(crate) writing: futures::lock::Mutex<()>,
}

impl PendingAnswers {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<RecordedAnswer>> {
        self.answers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The answer recorded for `instance` over a history of `history_len`
    /// messages, or its paused answer (over whatever history), if any; else
    /// a seeded answer of `instance` over that history, which becomes the
    /// step's recorded answer (see [`seed`](Self::seed)).
    pub fn find(&self, instance: &InstanceId, history_len: usize) -> Option<ModelResponse> {
        let len = u64::try_from(history_len).unwrap_or(u64::MAX);
        let mut answers = self.lock();
        if let Some(found) = answers
            .iter()
            .find(|a| a.instance == *instance && (a.paused || a.history_len == len))
        {
            return Some(found.response.clone());
        }
        if !self.has_seeds.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let mut seeded = self.seeded.lock().unwrap_or_else(|p| p.into_inner());
        let at = seeded
            .iter()
            .position(|a| a.instance == *instance && a.history_len == len)?;
        let mut answer = seeded.remove(at);
        answer.paused = false;
        let response = answer.response.clone();
        answers.retain(|a| a.instance != answer.instance);
        answers.push(answer);
        Some(response)
    }

    /// Seeds `answers`, recorded by an earlier run of this conversation
    /// that nothing else keeps (a sub-agent run again after a crash, its
    /// history built again step by step): each is replayed, instead of a
    /// model call, by the step of its instance over a history of its
    /// length, and is then that step's recorded answer.
    pub fn seed(&self, answers: impl IntoIterator<Item = RecordedAnswer>) {
        let mut seeded = self.seeded.lock().unwrap_or_else(|p| p.into_inner());
        seeded.extend(answers);
        self.has_seeds
            .store(!seeded.is_empty(), std::sync::atomic::Ordering::Release);
    }

    /// The seeded answers no step has taken yet.
    pub fn unused_seeds(&self) -> Vec<RecordedAnswer> {
        self.seeded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The length of the history the answer of `instance` was asked over,
    /// if one is recorded.
    pub fn history_len_of(&self, instance: &InstanceId) -> Option<u64> {
        self.lock()
            .iter()
            .find(|a| a.instance == *instance)
            .map(|a| a.history_len)
    }

    /// Marks the answer of `instance` paused (its calls wait for the
    /// application) or not.
    pub fn set_paused(&self, instance: &InstanceId, paused: bool) {
        for answer in self.lock().iter_mut() {
            if answer.instance == *instance {
                answer.paused = paused;
            }
        }
    }

    /// Whether the answer of `instance` is paused.
    pub fn is_paused(&self, instance: &InstanceId) -> bool {
        self.lock()
            .iter()
            .any(|a| a.paused && a.instance == *instance)
    }

    /// The instances whose answer is paused, in the order they were
    /// recorded.
    pub fn paused(&self) -> Vec<InstanceId> {
        self.lock()
            .iter()
            .filter(|a| a.paused)
            .map(|a| a.instance.clone())
            .collect()
    }

    /// Forgets every answer but the paused ones: their step is recorded.
    pub fn settle(&self) {
        self.lock().retain(|a| a.paused);
    }

    /// Forgets the paused answer of `instance` (a leaf that is gone).
    pub fn forget(&self, instance: &InstanceId) {
        self.lock().retain(|a| a.instance != *instance);
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

    /// Forgets every answer, paused ones included.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// Replaces the answers (a restored conversation).
    pub fn restore(&self, answers: Vec<RecordedAnswer>) {
        *self.lock() = answers;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use markov_core::model::StopReason;

    fn answer(instance: &str, history_len: u64, text: &str) -> RecordedAnswer {
        RecordedAnswer {
            instance: InstanceId::from(instance),
            history_len,
            response: ModelResponse::new(
                vec![
                    markov_core::Item::text(text),
                    markov_core::Item::tool_use("c1", "pay", serde_json::json!({})),
                ],
                StopReason::ToolUse,
            ),
            paused: false,
        }
    }

    #[test]
    fn a_seeded_answer_is_replayed_by_its_step_and_becomes_its_recorded_answer() {
        let answers = PendingAnswers::default();
        let root = InstanceId::from("root");
        assert_eq!(
            answers.find(&root, 1),
            None,
            "nothing seeded, nothing found"
        );
        answers.seed([answer("root", 1, "first"), answer("root", 3, "second")]);
        assert_eq!(answers.find(&root, 2), None, "no answer over that history");
        assert_eq!(
            answers.find(&root, 1),
            Some(answer("root", 1, "first").response)
        );
        assert_eq!(
            answers.history_len_of(&root),
            Some(1),
            "the step's recorded answer"
        );
        answers.settle();
        assert!(answers.is_empty());
        assert_eq!(
            answers.find(&root, 3),
            Some(answer("root", 3, "second").response)
        );
        assert!(answers.unused_seeds().is_empty(), "both taken");
    }
}
