//! Model clients for markov: the Anthropic Messages API, OpenAI-compatible
//! Chat Completions, OpenAI's Responses API and Gemini, each implementing
//! [`markov_core::Model`], with and without streaming.
//!
//! - [`Anthropic`] (feature `anthropic`) speaks the Messages API.
//! - [`OpenAi`] (feature `openai`) speaks Chat Completions at a configurable
//!   base URL, so it also serves vLLM, Ollama, llama.cpp's server and LM Studio.
//! - [`Responses`] (feature `responses`) speaks OpenAI's Responses API
//!   (`store: false`, reasoning items carried across steps, prompt cache
//!   keys), also served by vLLM and llama.cpp's server.
//! - [`Gemini`] (feature `gemini`) speaks the Gemini API
//!   (`generateContent`, `streamGenerateContent`), tools converted to its
//!   schema dialect, thought signatures sent back.
//! - [`Fallback`] tries a list of models in order when one cannot answer;
//!   its answer names the model that gave it.
//! - [`from_env`] picks the client the environment configures.
//! - [`ConfigError`] says why a client could not be built.
//!
//! Every client is configured from the environment (`from_env`:
//! `ANTHROPIC_API_KEY` and `ANTHROPIC_BASE_URL`, `GEMINI_API_KEY` and
//! `GEMINI_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_BASE_URL`, with
//! `MARKOV_OPENAI_API=responses` for the Responses API and `MARKOV_MODEL`
//! for the model; a base URL other than the vendor's needs no key, as for a
//! local server such as llama.cpp's) or by a builder. A base URL includes
//! `/v1` for the OpenAI clients and not for Anthropic or Gemini; a value
//! without a scheme is refused naming the value and its variable. They
//! retry 408, 409, 429, 5xx, overload, timeouts and connection failures
//! with exponential backoff and jitter, honouring a `retry-after` of up
//! to 60 s (a longer one, and a 429 that says the quota is exhausted, end
//! the call at once), under the client's [`Limits`];
//! they never retry 400, 401 or 403, whose [`ModelError::Http`] carries the
//! provider's own message. A streamed call is retried only until its
//! response head arrives; once events have been delivered, a failure (such as
//! Anthropic's mid-stream `overloaded_error`, [`ModelError::Overloaded`])
//! ends the stream with that error. Dropping a call's future (or stream)
//! cancels it.
//! Every answer names the model that gave it as the provider reported it
//! ([`ModelResponse::model`](markov_core::ModelResponse::model)), and the
//! Gemini client refuses, through
//! [`Model::check_tools`](markov_core::Model::check_tools), the tools and
//! output types its schema dialect cannot express before any call.
//! Every call runs in a `provider_request` tracing span with the fields
//! `gen_ai.provider.name`, `gen_ai.request.model` and `attempt` (distinct
//! from the loop's `chat` span around it). API keys never appear in `Debug`
//! output or logs.
//!
//! ```no_run
//! # #[cfg(feature = "anthropic")]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use markov_core::{Message, Model, ModelRequest, ModelSettings, ToolChoice};
//! use markov_providers::Anthropic;
//!
//! let model = Anthropic::from_env()?; // reads ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL
//! let history = [Message::user("What is 2 + 3?")];
//! let settings = ModelSettings::default();
//! let answer = model
//!     .complete(ModelRequest::new("You are terse.", &history, &settings))
//!     .await?;
//! println!("{:?}", answer.content);
//! # Ok(())
//! # }
//! ```
//!
//! # Servers that misbehave
//!
//! - A call is bounded as a whole, retries and the waits between them
//!   included (`stream_deadline` on either builder, 10 minutes by default,
//!   for `complete` as for `stream`): a server that keeps a stream alive
//!   with pings or keep-alive comments and never answers, or answers each
//!   attempt of `complete` slowly with a retryable error, ends the call with
//!   [`ModelError::Timeout`] carrying that deadline. The per-attempt
//!   `timeout` still bounds the wait for the response head and each pause
//!   between chunks.
//! - Server-sent events are parsed in one pass over the bytes, however an
//!   event is split into chunks. One event larger than `max_event_bytes`
//!   (16 MiB by default) ends the stream with
//!   [`ModelError::InvalidResponse`] ("a server-sent event exceeded …
//!   bytes"); the parser never holds more of one event.
//! - Of an error body, at most 8 KiB are read, chunk by chunk, whatever its
//!   size, on every attempt (retries included); the rest is never
//!   downloaded. A message cut short ends with `… (truncated)`.
//! - Redirects are never followed, so the API key never reaches an address
//!   the base URL does not name: a `3xx` answer ends the call with
//!   [`ModelError::Redirect`], which names the target (redacted) and is not
//!   retried.
//! - HTTP errors, overloads and connection failures ([`ModelError::Http`],
//!   [`ModelError::Overloaded`], [`ModelError::Connection`]), before or
//!   during a stream, end with `(from <url>)`: the URL they came from, with
//!   any password or query in it redacted. `endpoint()` on either client
//!   shows it the same way.
//!
//! # Malformed tool arguments
//!
//! A tool call whose arguments are not valid JSON (a stream cut short, a
//! server's bad JSON) does not fail the call. Its `tool_use` item keeps the
//! text as `{"__invalid_arguments": "<the raw text>", "__error": "<the parse
//! error>"}` (see `markov_core::tool::parse_tool_arguments`), and the loop
//! answers it with an invalid-input error result before any tool or policy
//! stage sees it. Empty arguments are `{}`.
//!
//! # Structured output with tools
//!
//! A request with an output schema (a node with an output type) that also
//! offers tools asks for its structured answer through an *output tool*,
//! `final_answer`, whose parameters are the schema, instead of the
//! vendor's schema field (`response_format`, `output_format`): llama.cpp's
//! server and vLLM turn that field into a grammar with no tool-call
//! branch, so under it a model can never call a tool. Tool choice `auto`
//! becomes `any` (`required`) then, so the answer is always a call, and
//! the answer's call of `final_answer` comes back as a text item with its
//! arguments' JSON, which the loop records as the structured answer; no
//! call of it waits for a result. A call without tools (or under tool
//! choice `none`) sends the schema field. At the vendor's own address
//! (`api.openai.com`, `api.anthropic.com`), which combines the two, the
//! schema field is sent with tools too; [`StructuredOutput`] overrides
//! the choice on either builder. A call under the output tool is not
//! streamed: its stream replays the whole answer.
//!
//! # Architecture invariant
//!
//! Only this crate knows vendor JSON. The wire structs are private to each
//! provider module and converted by hand from and to markov-core's types;
//! none of them is public.
//!
//! [`ModelError::Http`]: markov_core::ModelError::Http
//! [`ModelError::Overloaded`]: markov_core::ModelError::Overloaded
//! [`ModelError::Timeout`]: markov_core::ModelError::Timeout
//! [`ModelError::InvalidResponse`]: markov_core::ModelError::InvalidResponse
//! [`ModelError::Connection`]: markov_core::ModelError::Connection
//! [`ModelError::Redirect`]: markov_core::ModelError::Redirect
#![deny(missing_docs)]

#[cfg(feature = "anthropic")]
pub mod anthropic;
#[cfg(feature = "gemini")]
pub mod gemini;
#[cfg(feature = "openai")]
pub mod openai;
#[cfg(feature = "responses")]
pub mod responses;

#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
mod body;
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
mod client;
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
mod convert;
mod env;
mod error;
mod fallback;
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
mod limits;
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
mod output;
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
mod sse;
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
mod transport;

#[cfg(feature = "anthropic")]
pub use anthropic::{Anthropic, AnthropicBuilder, ClearToolUses, PromptCaching};
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
pub use body::DEFAULT_BODY_CACHE_BYTES;
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
pub use client::{Client, ClientBuilder};
pub use convert::{TEXT_INSTEAD_OF_TOOL_CALL, TOOL_CALL_AS_TEXT};
pub use env::{EnvModel, MODEL_ENV, OPENAI_API_ENV, from_env};
pub use error::ConfigError;
pub use fallback::{Fallback, falls_back};
#[cfg(feature = "gemini")]
pub use gemini::{Gemini, GeminiBuilder};
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
pub use limits::Limits;
#[cfg(feature = "openai")]
pub use openai::{MaxTokensField, OpenAi, OpenAiBuilder, SchemaStrictness};
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
pub use output::StructuredOutput;
#[cfg(feature = "responses")]
pub use responses::{PromptCacheKey, Responses, ResponsesBuilder};
pub use transport::ServedFacts;
