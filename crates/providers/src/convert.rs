//! Conversions both providers share: stored items that no provider has a
//! block for, the marking of mid-conversation system instructions, and the
//! parsing of tool arguments (whose rule lives in core).

use std::borrow::Cow;

use markov_core::message::ImageData;
use markov_core::{Item, Items, Message};
use serde_json::Value;

/// A message's content as a plain string, or as its item list.
pub(crate) enum Content<'a> {
    Text(&'a str),
    Items(&'a [Item]),
}

/// The content of a message. Instance payloads have none.
pub(crate) fn content(message: &Message) -> Content<'_> {
    match &message.items {
        Items::Text(text) => Content::Text(text),
        Items::List(items) => Content::Items(items),
        Items::Instance(_) => Content::Items(&[]),
    }
}

/// A file reference as the text line the model sees:
/// `[file: <filename> (<mediaType>)] <url>`, or `[file: <mediaType>] <url>`.
pub(crate) fn file_reference(url: &str, media_type: &str, filename: Option<&str>) -> String {
    match filename {
        Some(name) => format!("[file: {name} ({media_type})] {url}"),
        None => format!("[file: {media_type}] {url}"),
    }
}

/// A tool result's text for a provider that takes no images in a tool
/// result: the text, then one note per image (its type and size, never
/// its data), one per line. Said in a debug log, since the model reads
/// less than the tool returned.
pub(crate) fn tool_result_text<'a>(
    provider: &'static str,
    content: &'a str,
    images: &[ImageData],
) -> Cow<'a, str> {
    if images.is_empty() {
        return Cow::Borrowed(content);
    }
    tracing::debug!(
        provider,
        images = images.len(),
        "this API takes no images in a tool result: the model reads a note for each"
    );
    let mut text = content.to_owned();
    for image in images {
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&image.note());
    }
    Cow::Owned(text)
}

/// The text a user-side item stands for in a vendor's text part: a text
/// as it is (none when empty), a file reference's line, an `output` item's
/// JSON; `None` for the items a vendor encodes otherwise (images, tool
/// calls and results).
pub(crate) fn item_text(item: &Item) -> Option<Cow<'_, str>> {
    match item {
        Item::Text { text } if !text.is_empty() => Some(Cow::Borrowed(text)),
        Item::File {
            url,
            media_type,
            filename,
            ..
        } => Some(Cow::Owned(file_reference(
            url,
            media_type,
            filename.as_deref(),
        ))),
        Item::Output { data } => Some(Cow::Owned(output_text(data))),
        _ => None,
    }
}

/// An `output` item's data as the model sees it: JSON with a 2-space indent.
pub(crate) fn output_text(data: &Value) -> String {
    serde_json::to_string_pretty(data).unwrap_or_else(|_| data.to_string())
}

/// The prefix of a mid-conversation system message sent as user text, by
/// the clients whose vendor has no system role there (Anthropic, Gemini):
/// markov's words are never passed off as the user's.
pub(crate) const SYSTEM_PREFIX: &str = "[System instruction] ";

/// The text of a `system` message as one instruction for providers without a
/// mid-conversation system role, or `None` when it holds no text.
pub(crate) fn system_text(message: &Message) -> Option<String> {
    let texts: Vec<&str> = match content(message) {
        Content::Text(text) => vec![text],
        Content::Items(items) => items
            .iter()
            .filter_map(|item| match item {
                Item::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect(),
    };
    let texts: Vec<&str> = texts.into_iter().filter(|t| !t.is_empty()).collect();
    (!texts.is_empty()).then(|| texts.join("\n"))
}

/// The longest model name kept from an answer (in bytes); a longer one is
/// cut, since the name travels on to steps, spans and a service's events.
pub(crate) const MAX_MODEL_NAME: usize = 256;

/// The model name an answer gives, as
/// [`ModelResponse::model`](markov_core::ModelResponse::model) keeps it:
/// `None` for an empty one, cut to [`MAX_MODEL_NAME`] bytes at a character
/// boundary.
pub(crate) fn model_name(name: Option<String>) -> Option<String> {
    let mut name = name.filter(|n| !n.is_empty())?;
    if name.len() > MAX_MODEL_NAME {
        let mut end = MAX_MODEL_NAME;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
    }
    Some(name)
}

/// The stop reason when the provider gives none (or one this crate does not
/// know): tool use if the answer calls tools, else the end of the turn.
pub(crate) fn implied_stop_reason(has_tool_calls: bool) -> markov_core::StopReason {
    if has_tool_calls {
        markov_core::StopReason::ToolUse
    } else {
        markov_core::StopReason::EndTurn
    }
}

/// The start of the error of a forced call answered by a tool call the
/// server left in the text: the server does not parse tool calls.
pub const TOOL_CALL_AS_TEXT: &str = "returned a tool call as text";

/// The start of the error of a forced call answered in plain text: the
/// model chose text, which a server that does not enforce the tool choice
/// (llama.cpp's) lets through.
pub const TEXT_INSTEAD_OF_TOOL_CALL: &str =
    "answered in text although the call required a tool call";

/// Whether `text` holds a tool call written out as text: a chat template's
/// call markers (Qwen's and Hermes' `<tool_call>`, Mistral's
/// `[TOOL_CALLS]`, Llama's `<|python_tag|>` and `<function=`), or a JSON
/// object with a `name` and its `arguments` or `parameters`.
fn looks_like_a_tool_call(text: &str) -> bool {
    const MARKERS: [&str; 7] = [
        "<tool_call>",
        "</tool_call>",
        "[TOOL_CALLS]",
        "<|python_tag|>",
        "<function=",
        "<|tool_call",
        "<tool_use>",
    ];
    MARKERS.iter().any(|marker| text.contains(marker))
        || (text.contains("\"name\"")
            && (text.contains("\"arguments\"") || text.contains("\"parameters\"")))
}

/// Refuses an answer that calls no tool although the call offered tools
/// and forced their use (`choice`, as sent): the answer would be made up.
/// The error tells two causes apart: a tool call the server left in the
/// text ([`TOOL_CALL_AS_TEXT`]: its chat template or parser does not
/// handle tools, as llama.cpp without a tool-capable template, vLLM
/// without `--enable-auto-tool-choice`), and a plain text answer
/// ([`TEXT_INSTEAD_OF_TOOL_CALL`]: the model chose text, which llama.cpp's
/// server does not prevent, as it does not enforce `tool_choice:
/// "required"`). An answer cut by the token limit, refused or filtered
/// passes.
pub(crate) fn check_forced_call(
    offered_tools: bool,
    choice: &markov_core::ToolChoice,
    response: &markov_core::ModelResponse,
    endpoint: impl FnOnce() -> String,
) -> Result<(), markov_core::ModelError> {
    use markov_core::StopReason;
    let ignored = offered_tools
        && choice.forces_tool_use()
        && !response.has_tool_calls()
        && response.provider_tool_calls().next().is_none()
        && !matches!(
            response.stop_reason,
            StopReason::MaxTokens
                | StopReason::Refusal
                | StopReason::ContentFilter
                | StopReason::PauseTurn
        );
    if !ignored {
        return Ok(());
    }
    // Named only here: redacting the URL costs a parse on every call.
    let endpoint = endpoint();
    let text: String = response
        .content
        .iter()
        .filter_map(|item| match item {
            markov_core::Item::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let message = if looks_like_a_tool_call(&text) {
        format!(
            "the server at {endpoint} {TOOL_CALL_AS_TEXT} instead of a call: it does not parse tool calls out of the model's output. \
             A local server needs a chat template and parser that support tools: start llama.cpp's llama-server with --jinja \
             (and --chat-template-file <a template with tools> for a model whose own template has none), \
             vLLM with --enable-auto-tool-choice --tool-call-parser <the model's parser>, \
             and use an Ollama model whose template supports tools (docs/guide/local-models.md)"
        )
    } else {
        format!(
            "the model at {endpoint} {TEXT_INSTEAD_OF_TOOL_CALL} (tool_choice \"required\"). \
             llama.cpp's llama-server does not enforce a required tool choice, so a model that prefers text answers in text: \
             a model trained for tool calls calls them. If the model never saw the tools, the server's chat template has none \
             (llama-server --jinja, and --chat-template-file <a template with tools> for a model whose own template has none; \
             vLLM --enable-auto-tool-choice) (docs/guide/local-models.md)"
        )
    };
    Err(markov_core::ModelError::InvalidResponse(message))
}

/// A call id for servers that send none. Random, so that ids stay unique
/// across responses (a positional `call_0` would repeat in every response
/// and make idempotency keys collide).
pub(crate) fn fallback_call_id(index: usize) -> String {
    format!(
        "call_{:012x}_{index}",
        crate::transport::random_u64() & 0xffff_ffff_ffff
    )
}

/// `stream` with its final answer checked as [`check_forced_call`] checks
/// a complete one: the answer is replaced by the error.
pub(crate) fn checked_stream<'a>(
    stream: futures::stream::BoxStream<
        'a,
        Result<markov_core::StreamEvent, markov_core::ModelError>,
    >,
    offered_tools: bool,
    choice: &'a markov_core::ToolChoice,
    endpoint: impl Fn() -> String + Send + 'a,
) -> futures::stream::BoxStream<'a, Result<markov_core::StreamEvent, markov_core::ModelError>> {
    use futures::StreamExt;
    if !offered_tools || !choice.forces_tool_use() {
        return stream;
    }
    stream
        .map(move |event| match event {
            Ok(markov_core::StreamEvent::Done(response)) => {
                check_forced_call(offered_tools, choice, &response, &endpoint)
                    .map(|()| markov_core::StreamEvent::Done(response))
            }
            other => other,
        })
        .boxed()
}

/// Tool arguments from their JSON text (see
/// [`markov_core::tool::parse_tool_arguments`]: malformed text is kept, and
/// refused before any tool runs).
pub(crate) use markov_core::tool::parse_tool_arguments;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn files_and_outputs_become_text() {
        assert_eq!(
            file_reference("https://x/a.pdf", "application/pdf", Some("a.pdf")),
            "[file: a.pdf (application/pdf)] https://x/a.pdf"
        );
        assert_eq!(
            file_reference("https://x/a", "text/plain", None),
            "[file: text/plain] https://x/a"
        );
        assert_eq!(
            output_text(&json!({"a":[1]})),
            "{\n  \"a\": [\n    1\n  ]\n}"
        );
    }

    #[test]
    fn model_names_are_kept_short_and_whole() {
        assert_eq!(model_name(None), None);
        assert_eq!(model_name(Some(String::new())), None);
        assert_eq!(
            model_name(Some("gpt-4.1".into())).as_deref(),
            Some("gpt-4.1")
        );
        let long = "é".repeat(MAX_MODEL_NAME);
        let kept = model_name(Some(long)).unwrap();
        assert!(kept.len() <= MAX_MODEL_NAME && kept.len() >= MAX_MODEL_NAME - 1);
        assert!(kept.chars().all(|c| c == 'é'));
    }
}
