//! A guard that asks a model.

use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use markov_core::message::Message;
use markov_core::model::{Model, ModelRequest, ModelSettings, Usage};

use crate::{Guard, Hold, Verdict};

/// What the classifier's model is told after the rubric.
const ANSWER_FORMAT: &str = "\n\nAnswer with one line: PASS if the text meets the rubric, \
or BLOCK: followed by a short reason if it does not.";

/// Asks any [`Model`] (a small local one is fine) whether a text meets a
/// rubric: the model answers `PASS` or `BLOCK: reason`. What its calls
/// used is counted ([`Self::usage`]). An answer it cannot read, or a
/// failed call, blocks: a guard that cannot decide does not let the text
/// through (logged as a warning).
#[derive(Debug, Clone)]
pub struct ClassifierGuard {
    model: Arc<dyn Model>,
    system: String,
    settings: ModelSettings,
    hold: Hold,
    usage: Arc<Mutex<Usage>>,
}

impl ClassifierGuard {
    /// A classifier asking `model` with `rubric`, holding streamed text
    /// for the whole answer.
    pub fn new(model: Arc<dyn Model>, rubric: impl Into<String>) -> Self {
        let settings = ModelSettings {
            max_tokens: 64,
            ..ModelSettings::default()
        };
        ClassifierGuard {
            model,
            system: rubric.into() + ANSWER_FORMAT,
            settings,
            hold: Hold::Whole,
            usage: Arc::new(Mutex::new(Usage::default())),
        }
    }

    /// Checks streamed text in pieces of `hold` instead (each piece is one
    /// model call).
    #[must_use]
    pub fn with_hold(mut self, hold: Hold) -> Self {
        self.hold = hold;
        self
    }

    /// What the classifier's calls have used so far (clones share it).
    pub fn usage(&self) -> Usage {
        *self.usage.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait]
impl Guard for ClassifierGuard {
    fn name(&self) -> &str {
        "classifier"
    }

    fn hold(&self) -> Hold {
        self.hold
    }

    async fn check(&self, text: &str) -> Verdict {
        let messages = [Message::user(text)];
        let request = ModelRequest::new(&self.system, &messages, &self.settings);
        let response = match self.model.complete(request).await {
            Ok(response) => response,
            Err(error) => {
                tracing::warn!(%error, "the classifier's model failed: the text is blocked");
                return Verdict::block("the classifier could not be asked");
            }
        };
        {
            let mut usage = self.usage.lock().unwrap_or_else(PoisonError::into_inner);
            *usage += response.usage;
            usage.requests += 1;
        }
        let answer = Message::assistant_items(response.content).text();
        let answer = answer.trim();
        let head: String = answer.chars().take(5).collect::<String>().to_uppercase();
        if head.starts_with("PASS") {
            Verdict::Pass
        } else if head.starts_with("BLOCK") {
            let reason = answer[5..].trim_start_matches([':', ' ']).trim();
            Verdict::block(if reason.is_empty() {
                "the classifier blocked the text"
            } else {
                reason
            })
        } else {
            tracing::warn!(
                answer,
                "the classifier's answer is neither PASS nor BLOCK: the text is blocked"
            );
            Verdict::block("the classifier's answer could not be read")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use markov_core::message::Item;
    use markov_core::model::{ModelResponse, StopReason};
    use markov_testkit::ScriptedModel;

    fn answer(text: &str, tokens: u64) -> ModelResponse {
        ModelResponse::new(vec![Item::text(text)], StopReason::EndTurn).with_usage(Usage {
            input_tokens: tokens,
            output_tokens: 2,
            ..Usage::default()
        })
    }

    #[tokio::test]
    async fn the_model_decides_with_the_rubric_and_its_usage_is_counted() {
        let model = Arc::new(ScriptedModel::new([
            answer("PASS", 10),
            answer("BLOCK: medical advice", 12),
            answer("I think it is fine", 9),
        ]));
        let g = ClassifierGuard::new(model.clone(), "No medical advice.");
        assert_eq!(g.check("Hello").await, Verdict::Pass);
        assert_eq!(
            g.check("Take 5 pills").await,
            Verdict::block("medical advice")
        );
        assert_eq!(
            g.check("Hm").await,
            Verdict::block("the classifier's answer could not be read")
        );
        let usage = g.usage();
        assert_eq!(
            (usage.input_tokens, usage.output_tokens, usage.requests),
            (31, 6, 3)
        );
        let asked = model.requests();
        assert!(asked[0].system.starts_with("No medical advice."));
    }
}
