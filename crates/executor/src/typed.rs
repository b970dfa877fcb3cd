//! Typed answers: [`Machine::run_typed`] runs the machine and parses its
//! final answer into a Rust type, asking the model again — a bounded number
//! of times — when the answer does not parse. An answer cut by the token
//! limit is an error ([`TypedRunError::Cut`]), never a guess.

use markov_core::{Item, Role};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::RunError;
use crate::machine::Machine;
use crate::run::{RunOptions, run_to_completion};
use crate::step::{MachineStep, YieldReason};

/// How many times [`Machine::run_typed`] asks again after an answer that
/// does not parse.
pub const DEFAULT_TYPED_RETRIES: usize = 2;

/// A parsed answer.
#[derive(Debug, Clone)]
pub struct Typed<T> {
    /// The answer.
    pub value: T,
    /// The run's last step.
    pub step: MachineStep,
    /// Runs it took (1 when the first answer parsed).
    pub attempts: usize,
}

/// Why no typed answer came back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TypedRunError {
    /// A run failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The answer was cut by the token limit before it was complete: it
    /// is not guessed at, nor asked for again under the output schema
    /// (which would make the model shape a guess like an answer). Give
    /// the node more answer tokens (`NodeBuilder::max_tokens` or the
    /// agent's settings) and run it again.
    #[error(
        "the answer was cut by the token limit before it was complete (run {attempts}): give the node more answer tokens"
    )]
    Cut {
        /// Runs made.
        attempts: usize,
        /// The cut answer, as the model gave it.
        answer: Value,
    },
    /// No answer parsed, after every retry.
    #[error("the answer did not parse after {attempts} attempts: {error}")]
    Invalid {
        /// Runs made.
        attempts: usize,
        /// Why the last answer did not parse.
        error: String,
        /// The last answer, as the model gave it.
        answer: Value,
    },
}

/// The text of the message that asks the model again.
pub fn retry_prompt(error: &str) -> String {
    format!(
        "Your answer did not match the required format: {error}. Answer again with only the answer in that format."
    )
}

/// The answer of the last assistant message: its structured output, else its
/// text.
fn last_answer(machine: &Machine) -> Value {
    let Some(message) = machine
        .history()
        .iter()
        .rev()
        .find(|m| m.role == Role::Assistant)
    else {
        return Value::Null;
    };
    let output = message
        .item_list()
        .iter()
        .rev()
        .find_map(|item| match item {
            Item::Output { data } => Some(data.clone()),
            _ => None,
        });
    output.unwrap_or_else(|| {
        let text = message.text();
        serde_json::from_str(text.trim()).unwrap_or(Value::String(text))
    })
}

impl Machine {
    /// Runs the machine and parses its answer into `T` (the node's
    /// structured output when it declares one, else the answer's JSON
    /// text), asking again up to [`DEFAULT_TYPED_RETRIES`] times when it
    /// does not parse. Input must be enqueued first. markov asks again with
    /// [`retry_prompt`] as its own instruction
    /// ([`Machine::enqueue_instruction`]): a system message in the history,
    /// never the user's words.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// use markov_executor::Agent;
    /// use markov_testkit::ScriptedModel;
    /// use serde::Deserialize;
    ///
    /// #[derive(Deserialize, schemars::JsonSchema)]
    /// struct Answer { value: i64 }
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let agent = Agent::builder("typed")
    ///     .instructions("Answer in JSON.")
    ///     .output::<Answer>()
    ///     .model(ScriptedModel::builder().text("forty-two").text(r#"{"value": 42}"#).build())
    ///     .build()
    ///     .unwrap();
    /// let mut machine = agent.machine();
    /// machine.enqueue_user("What is six times seven?");
    /// let answer = machine.run_typed::<Answer>().await.unwrap();
    /// assert_eq!(answer.value.value, 42);
    /// assert_eq!(answer.attempts, 2);
    /// # });
    /// ```
    pub async fn run_typed<T: DeserializeOwned>(&mut self) -> Result<Typed<T>, TypedRunError> {
        let options = self.run_options().clone();
        self.run_typed_with(options, DEFAULT_TYPED_RETRIES).await
    }

    /// [`run_typed`](Self::run_typed) with at most `retries` re-asks.
    pub async fn run_typed_with<T: DeserializeOwned>(
        &mut self,
        options: RunOptions,
        retries: usize,
    ) -> Result<Typed<T>, TypedRunError> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            let step = run_to_completion(self, options.clone()).await?;
            let answer = last_answer(self);
            if step.yield_reason == YieldReason::MaxTokens {
                return Err(TypedRunError::Cut { attempts, answer });
            }
            match serde_json::from_value::<T>(answer.clone()) {
                Ok(value) => {
                    return Ok(Typed {
                        value,
                        step,
                        attempts,
                    });
                }
                Err(error) if attempts <= retries => {
                    tracing::debug!(attempts, %error, "the answer did not parse: asking again");
                    // markov's words, not the user's: a system message
                    // that runs the model again within the user's turn.
                    self.enqueue_instruction(retry_prompt(&error.to_string()));
                }
                Err(error) => {
                    return Err(TypedRunError::Invalid {
                        attempts,
                        error: error.to_string(),
                        answer,
                    });
                }
            }
        }
    }
}
