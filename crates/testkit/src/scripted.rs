//! [`ScriptedModel`]: answers from a script and records what it was asked.

use std::collections::VecDeque;
use std::sync::Mutex;

use async_trait::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::message::{Item, Items, Message, Role};
use markov_core::model::{
    HistoryId, Model, ModelError, ModelRequest, ModelResponse, ModelSettings, StopReason,
    ToolChoice,
};
use markov_core::tool::{ProviderTool, ToolDefinition};
use serde_json::Value;

/// An owned copy of one request a [`ScriptedModel`] received.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    /// The system prompt.
    pub system: String,
    /// The conversation as sent.
    pub messages: Vec<Message>,
    /// The tools offered.
    pub tools: Vec<ToolDefinition>,
    /// The provider built-in tools offered.
    pub provider_tools: Vec<ProviderTool>,
    /// The tool choice.
    pub tool_choice: ToolChoice,
    /// The settings.
    pub settings: ModelSettings,
    /// The structured-output schema, if any.
    pub output_schema: Option<Value>,
    /// The history the request says its messages come from (see
    /// [`HistoryId`]): the same for every request of one machine's
    /// history, so a test can tell a machine kept in memory from one
    /// restored again.
    pub history_id: Option<HistoryId>,
}

impl RecordedRequest {
    /// The names of the tools offered, in order.
    pub fn tool_names(&self) -> Vec<&str> {
        self.tools.iter().map(|t| t.name.as_str()).collect()
    }
}

/// Whether a [`ScriptedModel`] keeps a copy of every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recording {
    /// Keep a copy (the default; what tests assert on).
    On,
    /// Keep nothing, so the model costs nothing per call (for benchmarks).
    Off,
}

/// One scripted answer.
#[derive(Debug, Clone)]
enum Scripted {
    Response(ModelResponse),
    Error(ModelError),
}

/// A model that answers from a fixed script, in order.
///
/// It behaves like a strict provider: a scripted text-only answer to a request
/// whose tool choice forces a tool (`Any`, or a named tool the answer does not
/// call), or a tool call under `ToolChoice::None`, is refused with a clear
/// error instead of being returned. When the script runs out it returns an
/// error, not a panic.
///
/// ```
/// use markov_testkit::ScriptedModel;
/// use serde_json::json;
///
/// let model = ScriptedModel::builder()
///     .tool_call("add", json!({"a": 2, "b": 3}))
///     .text("5")
///     .build();
/// assert_eq!(model.remaining(), 2);
/// ```
#[derive(Debug)]
pub struct ScriptedModel {
    script: Mutex<VecDeque<Scripted>>,
    served: Mutex<usize>,
    recording: Recording,
    requests: Mutex<Vec<RecordedRequest>>,
    fresh_call_ids: bool,
    per_turn: bool,
}

impl ScriptedModel {
    /// A model answering with `responses`, in order.
    pub fn new(responses: impl IntoIterator<Item = ModelResponse>) -> Self {
        Self::from_script(responses.into_iter().map(Scripted::Response).collect())
    }

    /// A builder that numbers tool call ids `call_1`, `call_2`, ... across the script.
    pub fn builder() -> ScriptBuilder {
        ScriptBuilder::default()
    }

    fn from_script(script: VecDeque<Scripted>) -> Self {
        ScriptedModel {
            script: Mutex::new(script),
            served: Mutex::new(0),
            recording: Recording::On,
            requests: Mutex::new(Vec::new()),
            fresh_call_ids: false,
            per_turn: false,
        }
    }

    /// Gives every tool call of every answer a new, random id (the
    /// scripted id with a random suffix), as real providers do: asked the
    /// same question twice — a resumed session calling the model again, or
    /// another process — they never answer with the same call ids.
    ///
    /// ```
    /// use markov_testkit::ScriptedModel;
    /// use serde_json::json;
    ///
    /// // Answers `pay` with an id such as `call_1-5f0c…`, new on every run.
    /// let model = ScriptedModel::builder().tool_call("pay", json!({})).build().fresh_call_ids();
    /// # let _ = model;
    /// ```
    #[must_use]
    pub fn fresh_call_ids(mut self) -> Self {
        self.fresh_call_ids = true;
        self
    }

    /// Serves every user turn of every conversation from the start of the
    /// script: the answer to a request is the script's `n`-th, `n` being
    /// how many answers the model has given in the request's current turn
    /// (the messages after the last user message that holds more than tool
    /// results). Read from the conversation alone, so one model serves any
    /// number of sessions, each the same way; the script is never used up
    /// ([`remaining`](Self::remaining) stays its length). A rehearsal of a
    /// service without a real model, say; a test of one conversation's
    /// order wants the default.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// use markov_core::{Message, Model, ModelRequest, ModelSettings};
    /// use markov_testkit::ScriptedModel;
    ///
    /// let model = ScriptedModel::builder().text("Hello.").build().per_turn();
    /// let settings = ModelSettings::default();
    /// for conversation in ["Hi", "Hey"] {
    ///     let history = [Message::user(conversation)];
    ///     let answer = model.complete(ModelRequest::new("", &history, &settings)).await;
    ///     assert_eq!(answer.unwrap().content, vec![markov_core::Item::text("Hello.")]);
    /// }
    /// # });
    /// ```
    #[must_use]
    pub fn per_turn(mut self) -> Self {
        self.per_turn = true;
        self
    }

    /// Sets whether requests are recorded.
    #[must_use]
    pub fn recording(mut self, recording: Recording) -> Self {
        self.recording = recording;
        self
    }

    /// Copies of the requests received so far, in order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.requests).clone()
    }

    /// How many requests were received.
    pub fn calls(&self) -> usize {
        *lock(&self.served)
    }

    /// How many scripted answers are left.
    pub fn remaining(&self) -> usize {
        lock(&self.script).len()
    }
}

/// 64 random bits as hex: `RandomState` is seeded from the OS per process
/// and varies per instance, which is all an id suffix needs.
fn random_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0);
    format!("{:016x}", hasher.finish())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A test that panicked while holding the lock already failed; keep going.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn check_tool_choice(
    choice: &ToolChoice,
    response: &ModelResponse,
    index: usize,
) -> Result<(), ModelError> {
    let mut called = response.tool_calls().map(|(_, name, _)| name);
    let refusal = match choice {
        ToolChoice::Any if called.next().is_none() => Some(
            "answers without a tool call, but the request's tool choice is Any (a provider would never return that)"
                .to_owned(),
        ),
        ToolChoice::Tool(name) if !called.any(|c| c == name.as_str()) => Some(format!(
            "does not call {name}, but the request's tool choice forces it"
        )),
        ToolChoice::None if called.next().is_some() => {
            Some("calls a tool, but the request's tool choice is None".to_owned())
        }
        _ => None,
    };
    match refusal {
        Some(why) => Err(ModelError::InvalidRequest(format!(
            "scripted response {} {why}",
            index + 1
        ))),
        None => Ok(()),
    }
}

/// How many answers the model gave in the current turn of `messages`:
/// the assistant messages after the last user message that holds more
/// than tool results.
fn answers_this_turn(messages: &[Message]) -> usize {
    let mut answers = 0;
    for message in messages.iter().rev() {
        match (&message.role, &message.items) {
            (Role::Assistant, _) => answers += 1,
            (Role::User, Items::Text(text)) if !text.is_empty() => break,
            (Role::User, Items::List(items))
                if items
                    .iter()
                    .any(|item| !matches!(item, Item::ToolResult { .. })) =>
            {
                break;
            }
            _ => {}
        }
    }
    answers
}

#[async_trait]
impl Model for ScriptedModel {
    fn provider_name(&self) -> &str {
        "scripted"
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        if self.recording == Recording::On {
            lock(&self.requests).push(RecordedRequest {
                system: request.system().to_owned(),
                messages: request.messages().to_vec(),
                tools: request.tools().to_vec(),
                provider_tools: request.provider_tools().to_vec(),
                tool_choice: request.tool_choice().clone(),
                settings: request.settings().clone(),
                output_schema: request.output_schema().cloned(),
                history_id: request.history_id(),
            });
        }
        let served = {
            let mut served = lock(&self.served);
            *served += 1;
            *served - 1
        };
        let (index, next) = if self.per_turn {
            let index = answers_this_turn(request.messages());
            (index, lock(&self.script).get(index).cloned())
        } else {
            (served, lock(&self.script).pop_front())
        };
        match next {
            Some(Scripted::Response(mut response)) => {
                check_tool_choice(request.tool_choice(), &response, index)?;
                if self.fresh_call_ids {
                    let suffix = random_suffix();
                    for item in &mut response.content {
                        if let Item::ToolUse { id, .. } = item {
                            *id = ToolCallId::new(format!("{id}-{suffix}"));
                        }
                    }
                }
                Ok(response)
            }
            Some(Scripted::Error(error)) => Err(error),
            None if self.per_turn => Err(ModelError::InvalidRequest(format!(
                "the scripted model's script has no answer {} for this turn ({} are scripted per turn)",
                index + 1,
                lock(&self.script).len()
            ))),
            None => Err(ModelError::InvalidRequest(format!(
                "the scripted model's script is exhausted: request {} has no scripted answer ({index} were scripted)",
                index + 1
            ))),
        }
    }
}

/// Builds a [`ScriptedModel`]'s script.
#[derive(Debug, Default)]
pub struct ScriptBuilder {
    script: VecDeque<Scripted>,
    next_id: u64,
}

impl ScriptBuilder {
    fn next_call_id(&mut self) -> String {
        self.next_id += 1;
        format!("call_{}", self.next_id)
    }

    /// An answer of plain text (`end_turn`).
    #[must_use]
    pub fn text(mut self, text: impl Into<String>) -> Self {
        self.script
            .push_back(Scripted::Response(text_response(text)));
        self
    }

    /// An answer with one tool call (`tool_use`).
    #[must_use]
    pub fn tool_call(self, name: &str, input: Value) -> Self {
        self.tool_calls([(name, input)])
    }

    /// An answer with several tool calls in one response (`tool_use`).
    #[must_use]
    pub fn tool_calls<'n>(mut self, calls: impl IntoIterator<Item = (&'n str, Value)>) -> Self {
        let content = calls
            .into_iter()
            .map(|(name, input)| Item::tool_use(self.next_call_id(), name, input))
            .collect();
        self.script.push_back(Scripted::Response(ModelResponse::new(
            content,
            StopReason::ToolUse,
        )));
        self
    }

    /// An answer with leading text and tool calls (`tool_use`).
    #[must_use]
    pub fn text_and_tool_calls<'n>(
        mut self,
        text: &str,
        calls: impl IntoIterator<Item = (&'n str, Value)>,
    ) -> Self {
        let mut content = vec![Item::text(text)];
        content.extend(
            calls
                .into_iter()
                .map(|(name, input)| Item::tool_use(self.next_call_id(), name, input)),
        );
        self.script.push_back(Scripted::Response(ModelResponse::new(
            content,
            StopReason::ToolUse,
        )));
        self
    }

    /// An answer cut off by the token limit (`max_tokens`).
    #[must_use]
    pub fn max_tokens(mut self, partial_text: impl Into<String>) -> Self {
        self.script.push_back(Scripted::Response(ModelResponse::new(
            vec![Item::text(partial_text)],
            StopReason::MaxTokens,
        )));
        self
    }

    /// A raw response.
    #[must_use]
    pub fn response(mut self, response: ModelResponse) -> Self {
        self.script.push_back(Scripted::Response(response));
        self
    }

    /// A failed call.
    #[must_use]
    pub fn error(mut self, error: ModelError) -> Self {
        self.script.push_back(Scripted::Error(error));
        self
    }

    /// The model.
    pub fn build(self) -> ScriptedModel {
        ScriptedModel::from_script(self.script)
    }
}

/// A plain text response (`end_turn`).
pub fn text_response(text: impl Into<String>) -> ModelResponse {
    ModelResponse::new(vec![Item::text(text)], StopReason::EndTurn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request<'a>(
        messages: &'a [Message],
        choice: &'a ToolChoice,
        settings: &'a ModelSettings,
    ) -> ModelRequest<'a> {
        ModelRequest::new("sys", messages, settings).with_tool_choice(choice)
    }

    #[tokio::test]
    async fn a_per_turn_script_serves_every_turn_of_every_conversation_from_its_start() {
        let model = ScriptedModel::builder()
            .tool_call("look", json!({}))
            .text("found")
            .build()
            .per_turn();
        let settings = ModelSettings::default();
        let ask = |history: Vec<Message>| {
            let model = &model;
            let settings = &settings;
            async move {
                model
                    .complete(request(&history, &ToolChoice::Auto, settings))
                    .await
            }
        };
        for conversation in 0..10 {
            let mut history = vec![Message::user(format!("question {conversation}"))];
            for turn in 0..2 {
                let first = ask(history.clone()).await.unwrap();
                assert!(
                    first.has_tool_calls(),
                    "conversation {conversation}, turn {turn}"
                );
                history.push(Message::assistant_items(first.content));
                history.push(Message::user_items(vec![Item::tool_result(
                    "call_1", "it", None,
                )]));
                let second = ask(history.clone()).await.unwrap();
                assert_eq!(second.content, vec![Item::text("found")]);
                history.push(Message::assistant_items(second.content));
                // The turn has no third answer.
                let error = ask(history.clone()).await.unwrap_err();
                assert!(
                    error.to_string().contains("no answer 3 for this turn"),
                    "{error}"
                );
                history.push(Message::user("and again"));
            }
        }
        assert_eq!(model.remaining(), 2);
    }

    #[tokio::test]
    async fn records_every_request_and_answers_in_order() {
        let model = ScriptedModel::builder()
            .tool_call("add", json!({"a": 1}))
            .text("done")
            .build();
        let settings = ModelSettings::default();
        let history = vec![Message::user("hi")];
        let first = model
            .complete(request(&history, &ToolChoice::Auto, &settings))
            .await
            .unwrap();
        assert_eq!(first.stop_reason, StopReason::ToolUse);
        let (id, name, _) = first.tool_calls().next().unwrap();
        assert_eq!((id.as_str(), name), ("call_1", "add"));
        let second = model
            .complete(request(&history, &ToolChoice::Auto, &settings))
            .await
            .unwrap();
        assert_eq!(second.content, vec![Item::text("done")]);
        let recorded = model.requests();
        assert_eq!(recorded.len(), 2);
        assert_eq!(recorded[0].system, "sys");
        assert_eq!(recorded[0].messages, history);
        assert_eq!(model.calls(), 2);
    }

    #[tokio::test]
    async fn an_exhausted_script_is_an_error_not_a_panic() {
        let model = ScriptedModel::builder().text("only").build();
        let settings = ModelSettings::default();
        let _ = model
            .complete(request(&[], &ToolChoice::Auto, &settings))
            .await
            .unwrap();
        let err = model
            .complete(request(&[], &ToolChoice::Auto, &settings))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("script is exhausted"), "{err}");
        assert!(!err.is_retryable());
    }

    #[tokio::test]
    async fn refuses_text_when_a_tool_is_forced() {
        let model = ScriptedModel::builder().text("no tools").build();
        let settings = ModelSettings::default();
        let err = model
            .complete(request(&[], &ToolChoice::Any, &settings))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("tool choice is Any"), "{err}");
    }

    #[tokio::test]
    async fn recording_off_keeps_nothing() {
        let model = ScriptedModel::builder()
            .text("x")
            .build()
            .recording(Recording::Off);
        let settings = ModelSettings::default();
        let _ = model
            .complete(request(&[], &ToolChoice::Auto, &settings))
            .await
            .unwrap();
        assert!(model.requests().is_empty());
        assert_eq!(model.calls(), 1);
    }
}
