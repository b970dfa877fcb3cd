//! What a leaf's model call was made of, kept for a store that records
//! every step (see [`Machine::set_record_calls`](crate::Machine::set_record_calls)).

use std::sync::Arc;

use markov_core::message::Message;
use markov_core::model::{ModelRequest, ModelSettings, ToolChoice};
use markov_core::tool::{ProviderTool, ToolDefinition};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One leaf's model call of a step: everything its request held besides
/// the history, which it names by length (the request was sent the first
/// `history_len` messages of the machine's history), and how long the model
/// and the tools took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCall {
    /// The leaf instance that called.
    pub instance: String,
    /// The leaf's node, by name (or id when unnamed).
    pub node: String,
    /// The system prompt sent.
    pub system: Arc<str>,
    /// The tools offered.
    pub tools: Arc<[ToolDefinition]>,
    /// The provider built-in tools offered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub provider_tools: Vec<ProviderTool>,
    /// The tool choice.
    pub tool_choice: ToolChoice,
    /// The settings.
    pub settings: ModelSettings,
    /// The structured-output schema, if the node declares one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<Value>,
    /// How many messages of the history the request was sent (the first
    /// ones, in order).
    pub history_len: u64,
    /// Whether a context policy chose what the request showed of the
    /// history: then the request's messages were a view of the first
    /// `history_len` messages, not those messages as they are.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub context_view: bool,
    /// The leaf's turn bookkeeping when it called (what the tool choice
    /// rules saw), so that a fork continues the turn as it stood.
    #[serde(default)]
    pub turn: crate::TurnState,
    /// Whether the answer was a recorded one replayed (no model call).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
    /// Milliseconds the model call took (its retries and summaries
    /// included).
    pub model_ms: u64,
    /// Milliseconds the tools took, from the answer to the step's end.
    pub tools_ms: u64,
}

impl ModelCall {
    /// The request as it was sent, over `history` (the machine's history
    /// of which the request was sent the first
    /// [`history_len`](Self::history_len) messages).
    ///
    /// `None` when `history` is shorter than that.
    pub fn request<'a>(&'a self, history: &'a [Message]) -> Option<ModelRequest<'a>> {
        let len = usize::try_from(self.history_len).ok()?;
        let messages = history.get(..len)?;
        Some(
            ModelRequest::new(&self.system, messages, &self.settings)
                .with_tools(&self.tools)
                .with_provider_tools(&self.provider_tools)
                .with_tool_choice(&self.tool_choice)
                .with_output_schema(self.output_schema.as_ref()),
        )
    }
}
