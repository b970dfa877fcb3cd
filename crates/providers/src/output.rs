//! Structured output alongside tools.
//!
//! A node with an output type asks every model call for an answer of its
//! schema. Sent as the vendor's schema field (`response_format`,
//! `output_format`, `text.format`, `responseSchema`), that constrains the
//! whole answer on some servers: llama.cpp's server and vLLM turn the
//! schema into a grammar that applies from the first token and has no
//! tool-call branch, so the model can never call a tool (or change its
//! state, or take a transition) and must make an answer up. Gemini refuses
//! a response schema next to function declarations.
//!
//! So a call that offers tools asks for the structured answer through one
//! more tool, the *output tool* (`final_answer`, whose parameters are the
//! output schema), unless the client talks to a vendor's own service,
//! which combines the schema field with tools ([`StructuredOutput`]).
//! A call that offers no tools, or forbids calling them, always uses the
//! schema field. Under the output tool, tool choice `auto` becomes `any`
//! (the answer *is* a tool call, so the server's tool-call grammar covers
//! it), except with thinking on, which forbids forcing tool use at
//! Anthropic. The answer's call of the output tool becomes a text item
//! holding its arguments' JSON, so the loop records the structured answer
//! as it records a schema-constrained text, and no call waits for a result.

use markov_core::{Item, ModelRequest, ModelResponse, StopReason, ToolChoice};
use serde_json::Value;

/// How a client asks for a structured answer when the call also offers
/// tools. A call without tools always sends the vendor's schema field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StructuredOutput {
    /// The schema field at the vendor's own address (which combines it
    /// with tools), the output tool anywhere else (llama.cpp, vLLM,
    /// Ollama, proxies). The default.
    #[default]
    Auto,
    /// Always the vendor's schema field, for a server known to keep tool
    /// calls possible under it.
    SchemaField,
    /// Always the output tool when tools are offered.
    OutputTool,
}

impl StructuredOutput {
    /// Whether the schema field is sent next to tools, for a client whose
    /// server is (`vendor`) or is not the vendor's own.
    pub(crate) fn schema_with_tools(self, vendor: bool) -> bool {
        match self {
            StructuredOutput::Auto => vendor,
            StructuredOutput::SchemaField => true,
            StructuredOutput::OutputTool => false,
        }
    }
}

/// The names the output tool may take, in order of preference: the first
/// no offered tool has.
const NAMES: [&str; 3] = ["final_answer", "final_answer_output", "markov_final_answer"];

/// What the model reads about the output tool.
pub(crate) const DESCRIPTION: &str = "Gives your final answer, in the required format. Call it once you are done, instead of answering in text; its arguments are your answer.";

/// How one call asks for its structured answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Plan<'a> {
    /// The node declares no output type.
    Plain,
    /// The vendor's schema field.
    Schema(&'a Value),
    /// The output tool, named so, whose parameters are the schema.
    Tool {
        /// The tool's name.
        name: &'static str,
        /// The output schema.
        schema: &'a Value,
    },
}

impl<'a> Plan<'a> {
    /// The plan of `request` for a client that does (`schema_with_tools`)
    /// or does not send the schema field next to tools.
    pub(crate) fn of(request: &ModelRequest<'a>, schema_with_tools: bool) -> Self {
        let Some(schema) = request.output_schema() else {
            return Plan::Plain;
        };
        if schema_with_tools
            || request.tools().is_empty()
            || *request.tool_choice() == ToolChoice::None
        {
            return Plan::Schema(schema);
        }
        let taken = |name: &str| request.tools().iter().any(|t| t.name.as_str() == name);
        match NAMES.into_iter().find(|name| !taken(name)) {
            Some(name) => Plan::Tool { name, schema },
            // Every name is someone's tool: the schema field it is.
            None => Plan::Schema(schema),
        }
    }

    /// The schema to send in the vendor's field, if any.
    pub(crate) fn schema_field(self) -> Option<&'a Value> {
        match self {
            Plan::Schema(schema) => Some(schema),
            Plan::Plain | Plan::Tool { .. } => None,
        }
    }

    /// The output tool's name and parameters, if it is offered.
    pub(crate) fn tool(self) -> Option<(&'static str, &'a Value)> {
        match self {
            Plan::Tool { name, schema } => Some((name, schema)),
            Plan::Plain | Plan::Schema(_) => None,
        }
    }

    /// The tool choice to send: `auto` becomes `any` under the output tool
    /// unless thinking is on (Anthropic refuses forced tool use then).
    pub(crate) fn tool_choice<'c>(self, request: &ModelRequest<'c>) -> &'c ToolChoice {
        const ANY: &ToolChoice = &ToolChoice::Any;
        let choice = request.tool_choice();
        match (self, choice) {
            (Plan::Tool { .. }, ToolChoice::Auto) if request.settings().thinking.is_none() => ANY,
            _ => choice,
        }
    }

    /// The answer as the loop reads it: each call of the output tool
    /// becomes a text item holding its arguments' JSON (the raw text when
    /// they did not parse), and an answer left without calls ends the turn.
    pub(crate) fn finish(self, mut response: ModelResponse) -> ModelResponse {
        let Plan::Tool { name, .. } = self else {
            return response;
        };
        let mut answered = false;
        for item in &mut response.content {
            if let Item::ToolUse {
                name: called,
                input,
                ..
            } = item
                && called.as_str() == name
            {
                let text = match input.get(markov_core::tool::MALFORMED_ARGUMENTS_KEY) {
                    Some(Value::String(raw)) => raw.clone(),
                    _ => input.to_string(),
                };
                *item = Item::Text { text };
                answered = true;
            }
        }
        if answered && response.stop_reason == StopReason::ToolUse && !response.has_tool_calls() {
            response.stop_reason = StopReason::EndTurn;
        }
        response
    }
}

/// The answer of `model.complete(request)` as a stream of events: for a
/// call under the output tool, whose deltas would show a call that the
/// answer does not have.
pub(crate) fn replayed<'a, M: markov_core::Model>(
    model: &'a M,
    request: ModelRequest<'a>,
) -> futures::stream::BoxStream<'a, Result<markov_core::StreamEvent, markov_core::ModelError>> {
    markov_core::model::replay_stream(model.complete(request))
}

#[cfg(test)]
mod tests {
    use markov_core::{Message, ModelSettings, ToolDefinition};
    use serde_json::json;

    use super::*;

    #[test]
    fn the_output_tool_is_used_only_when_tools_are_offered() {
        let schema = json!({"type": "object"});
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        let tools = [ToolDefinition::new("add", "", json!({"type": "object"})).unwrap()];
        let bare = ModelRequest::new("", &history, &settings).with_output_schema(Some(&schema));
        assert_eq!(Plan::of(&bare, false), Plan::Schema(&schema));
        let with_tools = bare.with_tools(&tools);
        assert_eq!(
            Plan::of(&with_tools, false),
            Plan::Tool {
                name: "final_answer",
                schema: &schema
            }
        );
        assert_eq!(Plan::of(&with_tools, true), Plan::Schema(&schema));
        assert_eq!(
            Plan::of(&with_tools, false).tool_choice(&with_tools),
            &ToolChoice::Any
        );
        let none = with_tools.with_tool_choice(&ToolChoice::None);
        assert_eq!(Plan::of(&none, false), Plan::Schema(&schema));
        let plain = ModelRequest::new("", &history, &settings).with_tools(&tools);
        assert_eq!(Plan::of(&plain, false), Plan::Plain);
    }

    #[test]
    fn a_taken_name_is_not_reused() {
        let schema = json!({"type": "object"});
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        let tools = [ToolDefinition::new("final_answer", "", json!({"type": "object"})).unwrap()];
        let request = ModelRequest::new("", &history, &settings)
            .with_tools(&tools)
            .with_output_schema(Some(&schema));
        assert_eq!(
            Plan::of(&request, false).tool().unwrap().0,
            "final_answer_output"
        );
    }

    #[test]
    fn the_output_call_becomes_the_answer_text() {
        let schema = json!({"type": "object"});
        let plan = Plan::Tool {
            name: "final_answer",
            schema: &schema,
        };
        let response = ModelResponse::new(
            vec![
                Item::text("thinking aloud"),
                Item::tool_use("c1", "final_answer", json!({"total": 5})),
            ],
            StopReason::ToolUse,
        );
        let done = plan.finish(response);
        assert_eq!(
            done.content,
            vec![Item::text("thinking aloud"), Item::text(r#"{"total":5}"#)]
        );
        assert_eq!(done.stop_reason, StopReason::EndTurn);
        let malformed = ModelResponse::new(
            vec![Item::tool_use(
                "c2",
                "final_answer",
                markov_core::tool::parse_tool_arguments("{\"total\": 5"),
            )],
            StopReason::ToolUse,
        );
        assert_eq!(
            plan.finish(malformed).content,
            vec![Item::text("{\"total\": 5")]
        );
        // Other calls stay, and so does the stop reason.
        let mixed = ModelResponse::new(
            vec![
                Item::tool_use("c3", "add", json!({})),
                Item::tool_use("c4", "final_answer", json!({})),
            ],
            StopReason::ToolUse,
        );
        let mixed = plan.finish(mixed);
        assert_eq!(mixed.stop_reason, StopReason::ToolUse);
        assert!(mixed.has_tool_calls());
    }
}
