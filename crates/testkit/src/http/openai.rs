//! OpenAI Chat Completions answers: complete response bodies for
//! [`Reply::json`](super::Reply::json) and event streams for
//! [`Reply::sse`](super::Reply::sse) or
//! [`Reply::sse_split`](super::Reply::sse_split), in the shapes of OpenAI's
//! public API documentation. Streams end with a usage chunk and
//! `data: [DONE]`.
//!
//! ```
//! use markov_testkit::http::{Reply, openai};
//! use serde_json::json;
//!
//! let answer = openai::tool_call("call_1", "add", &json!({"a": 2, "b": 3}));
//! assert_eq!(answer["choices"][0]["finish_reason"], "tool_calls");
//! let call = &answer["choices"][0]["message"]["tool_calls"][0];
//! assert_eq!(call["function"]["arguments"], r#"{"a":2,"b":3}"#);
//! let _reply = Reply::json(200, answer);
//! let _streamed = Reply::sse_split(&openai::text_events("Hello."), 5);
//! ```

use serde_json::{Value, json};

use super::{FakeServer, MODEL, Reply, split_in_two, sse_data};

/// When every canned answer was created (seconds since the epoch).
const CREATED: u64 = 1_741_569_952;

/// The usage every canned answer reports.
fn usage() -> Value {
    json!({"prompt_tokens": 120, "completion_tokens": 30, "total_tokens": 150})
}

/// A complete Chat Completions response (`"object": "chat.completion"`)
/// with one choice holding `message` and `finish_reason`, its id
/// `chatcmpl-<id>`.
pub fn completion(id: &str, message: Value, finish_reason: &str) -> Value {
    json!({
        "id": format!("chatcmpl-{id}"),
        "object": "chat.completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason
        }],
        "usage": usage()
    })
}

/// A complete text answer, `finish_reason` `stop`.
pub fn text(text: &str) -> Value {
    completion(
        "text",
        json!({"role": "assistant", "content": text, "refusal": null}),
        "stop",
    )
}

/// A complete answer with one tool call `id` of function `name`, its
/// `arguments` serialized to a string as the API sends them,
/// `finish_reason` `tool_calls`.
pub fn tool_call(id: &str, name: &str, arguments: &Value) -> Value {
    completion(
        id,
        json!({
            "role": "assistant",
            "content": null,
            "refusal": null,
            "tool_calls": [{
                "id": id,
                "type": "function",
                "function": {"name": name, "arguments": arguments.to_string()}
            }]
        }),
        "tool_calls",
    )
}

/// An error body, such as
/// `{"error": {"message": ..., "type": "rate_limit_error", ...}}`.
pub fn error(kind: &str, message: &str) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": null}})
}

/// One `chat.completion.chunk` event with `delta` and `finish_reason`.
fn chunk(id: &str, delta: Value, finish_reason: Value) -> String {
    sse_data(
        &json!({
            "id": format!("chatcmpl-{id}"), "object": "chat.completion.chunk",
            "created": CREATED, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
            "usage": null
        })
        .to_string(),
    )
}

/// The last events of a stream: the usage chunk (no choices) and `[DONE]`.
fn stream_end(id: &str) -> [String; 2] {
    [
        sse_data(
            &json!({"id": format!("chatcmpl-{id}"), "object": "chat.completion.chunk",
                    "created": CREATED, "model": MODEL, "choices": [], "usage": usage()})
            .to_string(),
        ),
        sse_data("[DONE]"),
    ]
}

/// [`text`] as an event stream: the role, the text in two content deltas,
/// `finish_reason` `stop`, the usage chunk and `[DONE]`.
pub fn text_events(text: &str) -> String {
    let (head, tail) = split_in_two(text);
    let mut events = vec![
        chunk(
            "text",
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        ),
        chunk("text", json!({"content": head}), Value::Null),
        chunk("text", json!({"content": tail}), Value::Null),
        chunk("text", json!({}), json!("stop")),
    ];
    events.extend(stream_end("text"));
    events.concat()
}

/// [`tool_call`] as an event stream: id and name first, the arguments in
/// two fragments, `finish_reason` `tool_calls`, the usage chunk and
/// `[DONE]`.
pub fn tool_call_events(id: &str, name: &str, arguments: &Value) -> String {
    let json = arguments.to_string();
    let (head, tail) = split_in_two(&json);
    let fragment =
        |args: &str| json!({"tool_calls": [{"index": 0, "function": {"arguments": args}}]});
    let mut events = vec![
        chunk(
            id,
            json!({"role": "assistant", "content": null, "tool_calls": [{
                "index": 0, "id": id, "type": "function",
                "function": {"name": name, "arguments": ""}
            }]}),
            Value::Null,
        ),
        chunk(id, fragment(head), Value::Null),
        chunk(id, fragment(tail), Value::Null),
        chunk(id, json!({}), json!("tool_calls")),
    ];
    events.extend(stream_end(id));
    events.concat()
}

/// Makes `server` answer as llama.cpp's `llama-server` does about itself:
/// `GET /v1/models` lists `model` (with the training context in `meta`,
/// never the context it runs with) and `GET /props` reports the context
/// it runs with, `n_ctx`, in `default_generation_settings` (older builds)
/// or at the top level as well (`top_level`, newer builds).
pub fn serve_as_llama_cpp(server: &FakeServer, model: &str, n_ctx: u32, top_level: bool) {
    server.route(
        "GET",
        "/v1/models",
        Reply::json(
            200,
            json!({"object": "list", "data": [{
                "id": model, "object": "model", "owned_by": "llamacpp",
                "meta": {"n_ctx_train": 32_768, "n_params": 494_032_768}
            }]}),
        ),
    );
    let mut props = llama_cpp_props(model, n_ctx, TOOL_TEMPLATE);
    if top_level {
        props["n_ctx"] = json!(n_ctx);
    }
    server.route("GET", "/props", Reply::json(200, props));
}

/// A chat template that handles tools (the start of Qwen2.5's).
pub const TOOL_TEMPLATE: &str = "{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n<tools>{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}</tools>{%- endif %}";

/// llama.cpp's `GET /props` answer (older builds: the context only in
/// `default_generation_settings`) for `model` with a context of `n_ctx`
/// tokens and `chat_template` (a template without `tools` is one that
/// drops them).
pub fn llama_cpp_props(model: &str, n_ctx: u32, chat_template: &str) -> Value {
    json!({
        "default_generation_settings": {"n_ctx": n_ctx, "params": {"n_predict": -1}},
        "total_slots": 1,
        "model_path": format!("/models/{model}.gguf"),
        "chat_template": chat_template,
        "build_info": "b11434-0000000"
    })
}

/// Makes `server` answer as vLLM does about itself: `GET /v1/models` lists
/// `model` with the context it runs with (`max_model_len`), and `/props`
/// is unknown (404).
pub fn serve_as_vllm(server: &FakeServer, model: &str, max_model_len: u32) {
    server.route(
        "GET",
        "/v1/models",
        Reply::json(
            200,
            json!({"object": "list", "data": [{
                "id": model, "object": "model", "owned_by": "vllm",
                "root": model, "max_model_len": max_model_len
            }]}),
        ),
    );
    server.route(
        "GET",
        "/props",
        Reply::json(404, json!({"detail": "Not Found"})),
    );
}

/// Makes `server` answer as a server that does not report its context
/// (Ollama, a proxy): `GET /v1/models` lists `model` alone and `/props` is
/// unknown (404).
pub fn serve_without_context(server: &FakeServer, model: &str) {
    server.route(
        "GET",
        "/v1/models",
        Reply::json(
            200,
            json!({"object": "list", "data": [{"id": model, "object": "model"}]}),
        ),
    );
    server.route("GET", "/props", Reply::text(404, "404 page not found"));
}
