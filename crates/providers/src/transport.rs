//! What both providers share: the HTTP client, retries with backoff, error
//! mapping, timeouts and the secret API key.
//!
//! Nothing here knows a vendor's JSON beyond the common error envelope
//! `{"error": {"type", "message"}}`, which both Anthropic and OpenAI use.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::Duration;

use markov_core::ModelError;
use reqwest::header::{HeaderMap, HeaderValue};
use reqwest::{Response, Url};
use serde::Deserialize;

use crate::error::ConfigError;

/// The longest `retry-after` we wait for; a provider asking for more gets its
/// error returned to the caller instead.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// The most bytes of an unparseable error body kept in an error message.
const MAX_ERROR_BODY: usize = 2_000;

/// The most of an error body that is read: the rest is never downloaded
/// (a huge or endless body costs nothing, on every retry).
pub(crate) const MAX_ERROR_BODY_READ: usize = 8 * 1024;

/// The most of a token count's answer read: a few numbers of JSON.
pub(crate) const MAX_COUNT_ANSWER: usize = 64 * 1024;

/// The default bound of a whole call, streamed or not.
pub(crate) const DEFAULT_DEADLINE: Duration = Duration::from_secs(600);

/// The default size cap of one server-sent event (what the parser may hold
/// of one event). Parsing is linear, so a generous cap costs nothing until
/// a server sends that much.
pub(crate) const DEFAULT_MAX_EVENT_BYTES: usize = 16 << 20;

/// An API key. Its `Debug` output never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct ApiKey(Arc<str>);

impl ApiKey {
    pub(crate) fn new(key: impl Into<String>) -> Self {
        ApiKey(Arc::from(key.into()))
    }

    /// A header value holding `prefix` + the key, marked sensitive so that
    /// hyper and reqwest never print it.
    pub(crate) fn header(&self, prefix: &str) -> Result<HeaderValue, ConfigError> {
        let mut value = HeaderValue::from_str(&format!("{prefix}{}", self.0))
            .map_err(|_| ConfigError::InvalidApiKey)?;
        value.set_sensitive(true);
        Ok(value)
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Reads an environment variable, treating an empty value as unset.
pub(crate) fn env_var(env: &dyn Fn(&str) -> Option<String>, var: &'static str) -> Option<String> {
    env(var).filter(|v| !v.trim().is_empty())
}

/// The process environment, as [`env_var`] wants it.
pub(crate) fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Retries, backoff and timeout of one client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TransportConfig {
    /// Retries after the first attempt.
    pub(crate) max_retries: u32,
    /// The backoff before the first retry; doubled for each further one.
    pub(crate) initial_backoff: Duration,
    /// The cap of the exponential backoff.
    pub(crate) max_backoff: Duration,
    /// The limit for one attempt: the whole exchange for a complete call, the
    /// wait for the response head and each pause between streamed chunks for a
    /// streaming call.
    pub(crate) timeout: Duration,
    /// The limit of a whole call, retries and the waits between them
    /// included: a streamed one from the request to its last event, whatever
    /// the server sends meanwhile (pings included); a complete one from the
    /// request to its last byte.
    pub(crate) deadline: Duration,
    /// The largest server-sent event accepted, in bytes.
    pub(crate) max_event_bytes: usize,
    /// The outgoing limits (all off by default).
    pub(crate) limits: crate::limits::Limits,
}

impl TransportConfig {
    pub(crate) const DEFAULT: TransportConfig = TransportConfig {
        max_retries: 2,
        initial_backoff: Duration::from_millis(500),
        max_backoff: Duration::from_secs(8),
        timeout: Duration::from_secs(600),
        deadline: DEFAULT_DEADLINE,
        max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
        limits: crate::limits::Limits::DEFAULT,
    };

    /// The wait before retry number `retry` (0-based): the provider's
    /// `retry-after` when it gave one, else exponential backoff with jitter
    /// (a random point in the upper half of the exponential step).
    fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(after) = retry_after {
            return after;
        }
        let factor = 2u32.saturating_pow(retry);
        let step = self
            .initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff);
        let half = step / 2;
        let jitter_nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        let jitter = match jitter_nanos.checked_add(1) {
            _ if jitter_nanos == 0 => 0,
            Some(bound) => random_u64() % bound,
            None => random_u64(),
        };
        half.saturating_add(Duration::from_nanos(jitter))
    }
}

/// A random number from the standard library's per-process hash keys: enough
/// for jitter, and no dependency.
pub(crate) fn random_u64() -> u64 {
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0x9e37_79b9_7f4a_7c15);
    hasher.finish()
}

/// An HTTP client with the crate's retry and error rules.
#[derive(Debug, Clone)]
pub(crate) struct Transport {
    client: reqwest::Client,
    config: TransportConfig,
    /// The outgoing limits, shared by the client's clones.
    limiter: Option<Arc<crate::limits::Limiter>>,
}

/// Parses and checks a base URL; `var` is the environment variable it
/// came from, named in the error.
pub(crate) fn parse_base_url(url: &str, var: Option<&'static str>) -> Result<Url, ConfigError> {
    let invalid = |reason: &str| ConfigError::InvalidBaseUrl {
        url: redact_loose(url),
        var,
        reason: reason.to_owned(),
    };
    let no_scheme = || {
        invalid(&format!(
            "it has no scheme: write it as \"http://{}\" (or https://)",
            redact_loose(url.trim())
        ))
    };
    let parsed = match Url::parse(url.trim()) {
        Ok(parsed) => parsed,
        Err(_) if !url.contains("://") => return Err(no_scheme()),
        Err(e) => return Err(invalid(&e.to_string())),
    };
    if !matches!(parsed.scheme(), "http" | "https") {
        // `localhost:8080` parses with the scheme `localhost`.
        if !url.contains("://") {
            return Err(no_scheme());
        }
        return Err(invalid("the scheme must be http or https"));
    }
    if parsed.cannot_be_a_base() {
        return Err(invalid("it cannot be a base url"));
    }
    Ok(parsed)
}

/// Joins `path` (no leading slash) under `base`, keeping the base's own path.
/// The longest a question about a server's context (`served_context`) may
/// take: it is asked once at start, and a server that does not answer
/// leaves the documented default in place.
pub(crate) const CONTEXT_QUERY_WAIT: Duration = Duration::from_secs(5);

/// What a local server says of itself (`EnvModel::served_facts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ServedFacts {
    /// The context window, in tokens, the server runs the model with
    /// (llama.cpp's `n_ctx`, vLLM's `max_model_len`).
    pub context_window: Option<u32>,
    /// Whether the server's chat template handles tools (llama.cpp's
    /// `chat_template_caps.supports_tools`, else whether its
    /// `chat_template` mentions them): `Some(false)` means the model never
    /// sees the tools it is offered.
    pub template_has_tools: Option<bool>,
}

/// Whether llama.cpp's chat template handles tools, from its `/props`:
/// `chat_template_caps.supports_tools` where the build says, else whether
/// the template's text mentions `tools`.
pub(crate) fn template_has_tools(props: &serde_json::Value) -> Option<bool> {
    props
        .get("chat_template_caps")
        .and_then(|caps| caps.get("supports_tools"))
        .and_then(serde_json::Value::as_bool)
        .or_else(|| {
            props
                .get("chat_template")
                .and_then(serde_json::Value::as_str)
                .filter(|t| !t.is_empty())
                .map(|t| t.contains("tools"))
        })
}

/// The context window vLLM reports for `model` in its model list
/// (`data[].max_model_len`): the entry named `model`, or the only entry.
pub(crate) fn context_from_models(list: &serde_json::Value, model: &str) -> Option<u32> {
    let entries = list.get("data")?.as_array()?;
    let entry = entries
        .iter()
        .find(|e| e.get("id").and_then(serde_json::Value::as_str) == Some(model))
        .or(match entries.as_slice() {
            [only] => Some(only),
            _ => None,
        })?;
    positive_u32(entry.get("max_model_len")?)
}

/// The context window llama.cpp's server reports at `GET /props`: `n_ctx`
/// at the top level (newer builds), else
/// `default_generation_settings.n_ctx`.
pub(crate) fn context_from_props(props: &serde_json::Value) -> Option<u32> {
    props.get("n_ctx").and_then(positive_u32).or_else(|| {
        props
            .get("default_generation_settings")?
            .get("n_ctx")
            .and_then(positive_u32)
    })
}

fn positive_u32(value: &serde_json::Value) -> Option<u32> {
    value
        .as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n > 0)
}

/// `{server}/props`, llama.cpp's server's own endpoint, from a base URL
/// with or without the `/v1` of the OpenAI-compatible API (the query, where
/// a key may ride, is kept).
pub(crate) fn props_endpoint(base: &Url) -> Url {
    let mut url = base.clone();
    let path = base.path().trim_end_matches('/');
    let path = path.strip_suffix("/v1").unwrap_or(path);
    url.set_path(&format!("{path}/props"));
    url
}

pub(crate) fn endpoint(base: &Url, path: &str) -> Url {
    let mut url = base.clone();
    let joined = format!("{}/{}", base.path().trim_end_matches('/'), path);
    url.set_path(&joined);
    url
}

impl Transport {
    /// A client whose TLS uses rustls with the `ring` provider and the
    /// platform's root certificates, set per client rather than process-wide.
    pub(crate) fn new(
        config: TransportConfig,
        base_url: &Url,
        default_headers: HeaderMap,
    ) -> Result<Self, ConfigError> {
        let tls = tls_config(base_url.scheme() == "https")?;
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .default_headers(default_headers)
            // A redirect is never followed: reqwest strips `Authorization` on
            // a redirect to another host but not `x-api-key` or other key
            // headers, and a key must never reach an address the user did
            // not configure. A 3xx becomes `ModelError::Redirect`.
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(config.timeout.min(Duration::from_secs(30)))
            .read_timeout(config.timeout)
            .build()
            .map_err(|e| ConfigError::HttpClient(e.to_string()))?;
        Ok(Transport {
            client,
            config,
            limiter: crate::limits::Limiter::new(config.limits),
        })
    }

    /// Waits for the call's place under the client's limits (see
    /// [`crate::limits`]); the place is held as long as the value is.
    pub(crate) async fn enter(
        &self,
        body_len: usize,
        max_tokens: u32,
    ) -> Result<Option<crate::limits::Place>, ModelError> {
        match &self.limiter {
            Some(limiter) => {
                let tokens = crate::limits::estimate_tokens(body_len, max_tokens);
                limiter.enter(tokens).await.map(Some)
            }
            None => Ok(None),
        }
    }

    /// `stream` run under the client's limits: it waits for its place
    /// before its first event and holds it until its last.
    pub(crate) fn limited<'a>(
        &'a self,
        body_len: usize,
        max_tokens: u32,
        stream: futures::stream::BoxStream<'a, Result<markov_core::StreamEvent, ModelError>>,
    ) -> futures::stream::BoxStream<'a, Result<markov_core::StreamEvent, ModelError>> {
        use futures::StreamExt;
        if self.limiter.is_none() {
            return stream;
        }
        let mut stream = Some(stream);
        futures::stream::once(self.enter(body_len, max_tokens))
            .flat_map(move |entered| match (entered, stream.take()) {
                (Ok(place), Some(stream)) => stream
                    .map(move |event| {
                        let _held = &place;
                        event
                    })
                    .boxed(),
                (Err(error), _) => futures::stream::once(async move { Err(error) }).boxed(),
                (Ok(_), None) => futures::stream::empty().boxed(),
            })
            .boxed()
    }

    pub(crate) fn client(&self) -> &reqwest::Client {
        &self.client
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.config.timeout
    }

    pub(crate) fn config(&self) -> &TransportConfig {
        &self.config
    }

    /// Runs `attempt` until it succeeds, fails with an error that is not
    /// retryable, or the retries are spent. Each attempt is bounded by the
    /// configured timeout and its number recorded on `span` as `attempt`.
    pub(crate) async fn with_retries<T, F, Fut>(
        &self,
        span: &tracing::Span,
        mut attempt: F,
    ) -> Result<T, ModelError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ModelError>>,
    {
        let mut retry = 0u32;
        loop {
            span.record("attempt", retry + 1);
            let result = match tokio::time::timeout(self.config.timeout, attempt()).await {
                Ok(result) => result,
                Err(_) => Err(ModelError::Timeout(self.config.timeout)),
            };
            let error = match result {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            if !error.is_retryable() || retry >= self.config.max_retries {
                return Err(error);
            }
            let retry_after = match &error {
                ModelError::Http { retry_after, .. } => *retry_after,
                _ => None,
            };
            if retry_after.is_some_and(|after| after > MAX_RETRY_AFTER)
                || is_quota_exhausted(&error)
            {
                return Err(error);
            }
            let delay = self.config.delay(retry, retry_after);
            tracing::warn!(parent: span, %error, ?delay, "model call failed; retrying");
            tokio::time::sleep(delay).await;
            if let Some(limiter) = &self.limiter {
                // A retry is a request like any other.
                limiter.take_request().await;
            }
            retry += 1;
        }
    }

    /// What a local server says of itself ([`ServedFacts`]): vLLM lists
    /// the context per model at `models_url` (`max_model_len`), llama.cpp's
    /// server answers `props_url` (`GET /props`: the context in
    /// `default_generation_settings.n_ctx`, or `n_ctx` at the top level in
    /// newer builds, and its chat template). Each request is one attempt
    /// bounded by the timeout (at most [`CONTEXT_QUERY_WAIT`]).
    ///
    /// # Errors
    /// The error of the last request when no request succeeded.
    pub(crate) async fn served_facts(
        &self,
        models_url: Url,
        props_url: Url,
        model: &str,
    ) -> Result<ServedFacts, ModelError> {
        let wait = self.config.timeout.min(CONTEXT_QUERY_WAIT);
        let models = self.get_json(models_url, wait).await;
        let listed = models
            .as_ref()
            .ok()
            .and_then(|list| context_from_models(list, model));
        match self.get_json(props_url, wait).await {
            Ok(props) => Ok(ServedFacts {
                context_window: listed.or_else(|| context_from_props(&props)),
                template_has_tools: template_has_tools(&props),
            }),
            // A server without `/props` (vLLM, Ollama) that answered the
            // model list has said what it knows.
            Err(_) if models.is_ok() => Ok(ServedFacts {
                context_window: listed,
                template_has_tools: None,
            }),
            Err(error) => Err(error),
        }
    }

    /// One GET of a JSON document of at most 1 MiB, bounded by `wait`.
    async fn get_json(&self, url: Url, wait: Duration) -> Result<serde_json::Value, ModelError> {
        let call = async {
            let response = self
                .client
                .get(url)
                .send()
                .await
                .map_err(|e| transport_error(e, wait))?;
            let response = check_status(response).await?;
            let (body, cut) = read_capped(response, 1 << 20).await;
            if cut {
                return Err(ModelError::InvalidResponse(
                    "the answer is larger than 1 MiB".into(),
                ));
            }
            serde_json::from_str(&body)
                .map_err(|e| ModelError::InvalidResponse(format!("cannot parse the answer: {e}")))
        };
        tokio::time::timeout(wait, call)
            .await
            .unwrap_or(Err(ModelError::Timeout(wait)))
    }

    /// The ids of the models a server lists at `url` (`{"data": [{"id"}]}`,
    /// as OpenAI, Anthropic, llama.cpp, vLLM and Ollama answer), each
    /// once, one attempt bounded by the timeout (at most 30 s).
    pub(crate) async fn list_models(&self, url: Url) -> Result<Vec<String>, ModelError> {
        // `data[].id` (OpenAI, Anthropic, llama.cpp, vLLM, Ollama), else
        // `models[].name` (Gemini). llama.cpp's server sends both, the
        // same models twice (`models` in Ollama's shape): one list is read.
        #[derive(Deserialize)]
        struct List {
            #[serde(default)]
            data: Vec<Entry>,
            #[serde(default)]
            models: Vec<Named>,
        }
        #[derive(Deserialize)]
        struct Entry {
            id: String,
        }
        #[derive(Deserialize)]
        struct Named {
            name: String,
        }
        let wait = self.config.timeout.min(Duration::from_secs(30));
        let list: List = serde_json::from_value(self.get_json(url, wait).await?).map_err(|e| {
            ModelError::InvalidResponse(format!("cannot parse the model list: {e}"))
        })?;
        let listed: Vec<String> = if list.data.is_empty() {
            list.models.into_iter().map(|m| m.name).collect()
        } else {
            list.data.into_iter().map(|m| m.id).collect()
        };
        let mut seen = std::collections::HashSet::with_capacity(listed.len());
        Ok(listed
            .into_iter()
            .filter(|model| seen.insert(model.clone()))
            .collect())
    }

    /// A token count: `post` (which sends the count request and checks its
    /// status) under the client's limits — a place among the calls in
    /// flight and one request of the request rate, no tokens (the vendors
    /// do not count a count against token rates) — retried like a call,
    /// each attempt bounded by the timeout and all of them by the
    /// deadline; the answer is read up to [`MAX_COUNT_ANSWER`] bytes (a
    /// larger one is an invalid response).
    pub(crate) async fn count<F, Fut>(
        &self,
        span: &tracing::Span,
        mut post: F,
    ) -> Result<String, ModelError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Response, ModelError>>,
    {
        let _place = self.enter(0, 0).await?;
        self.with_retries_by_deadline(span, || {
            let sent = post();
            async move {
                let (body, cut) = read_capped(sent.await?, MAX_COUNT_ANSWER).await;
                if cut {
                    return Err(ModelError::InvalidResponse(format!(
                        "a token count answer larger than {MAX_COUNT_ANSWER} bytes"
                    )));
                }
                Ok(body)
            }
        })
        .await
    }

    /// [`with_retries`](Self::with_retries) bounded as a whole by the
    /// configured deadline: a server that answers every attempt slowly with
    /// a retryable error, or never answers, ends the call with
    /// [`ModelError::Timeout`] carrying the deadline. Streams bound their
    /// retries by the same deadline in [`sse_stream`](crate::sse::sse_stream).
    pub(crate) async fn with_retries_by_deadline<T, F, Fut>(
        &self,
        span: &tracing::Span,
        attempt: F,
    ) -> Result<T, ModelError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ModelError>>,
    {
        // A deadline too far for the clock is no deadline: tokio's timeout
        // then waits without end instead of panicking.
        tokio::time::timeout(self.config.deadline, self.with_retries(span, attempt))
            .await
            .unwrap_or(Err(ModelError::Timeout(self.config.deadline)))
    }
}

fn tls_config(need_roots: bool) -> Result<rustls::ClientConfig, ConfigError> {
    use rustls_platform_verifier::BuilderVerifierExt;

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ConfigError::HttpClient(e.to_string()))?;
    let mut config = match builder.clone().with_platform_verifier() {
        Ok(builder) => builder.with_no_client_auth(),
        // A plain-http server (a local model server) needs no roots; without
        // them any https connection fails its handshake.
        Err(_) if !need_roots => builder
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
        Err(e) => {
            return Err(ConfigError::HttpClient(format!(
                "cannot load the system's root certificates: {e}"
            )));
        }
    };
    // reqwest offers HTTP/2 only in a TLS configuration it builds itself;
    // this one is ours, so it says so: a provider that speaks HTTP/2 then
    // carries many calls on one connection, one that does not keeps
    // HTTP/1.1 with keep-alive. Plain http (a local server) stays HTTP/1.1.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// A reqwest failure as a model error.
pub(crate) fn transport_error(error: reqwest::Error, timeout: Duration) -> ModelError {
    if error.is_timeout() {
        ModelError::Timeout(timeout)
    } else {
        // The URL goes at the end, redacted (a key may ride in its query).
        let url = error.url().map(|u| redact_url(u.as_str()));
        let error = error.without_url();
        let mut text = error.to_string();
        let mut source = std::error::Error::source(&error);
        while let Some(inner) = source {
            text.push_str(": ");
            text.push_str(&inner.to_string());
            source = inner.source();
        }
        if let Some(url) = url {
            text.push_str(&format!(" (from {url})"));
        }
        ModelError::Connection(text)
    }
}

/// The common error envelope: `{"error": {"type", "message"}}`, or
/// `{"error": "message"}` as some OpenAI-compatible servers send it.
#[derive(Deserialize)]
struct ErrorEnvelope {
    error: ErrorDetail,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ErrorDetail {
    Object {
        #[serde(default, rename = "type")]
        kind: Option<String>,
        #[serde(default)]
        message: Option<String>,
    },
    Text(String),
}

/// The type and message of an error body, if it has the common envelope.
pub(crate) fn parse_error_body(body: &str) -> Option<(Option<String>, String)> {
    let envelope: ErrorEnvelope = serde_json::from_str(body).ok()?;
    match envelope.error {
        ErrorDetail::Object { kind, message } => {
            Some((kind.clone(), message.or(kind).unwrap_or_default()))
        }
        ErrorDetail::Text(message) => Some((None, message)),
    }
}

/// Checks a response's status: success passes, anything else becomes a
/// [`ModelError`] carrying the provider's own message and `retry-after`.
/// An `overloaded_error` body becomes [`ModelError::Overloaded`].
pub(crate) async fn check_status(response: Response) -> Result<Response, ModelError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    if status.is_redirection() {
        return Err(redirect_error(&response));
    }
    let retry_after = retry_after(response.headers());
    let url = redact_url(response.url().as_str());
    let (body, cut) = read_capped(response, MAX_ERROR_BODY_READ).await;
    let (kind, message) = parse_error_body(&body).unwrap_or_else(|| {
        let mut text = body.trim().to_owned();
        let mut cut = cut;
        if text.len() > MAX_ERROR_BODY {
            let mut end = MAX_ERROR_BODY;
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            text.truncate(end);
            cut = true;
        }
        if cut {
            text.push_str("… (truncated)");
        }
        if text.is_empty() {
            text = status
                .canonical_reason()
                .unwrap_or("unknown error")
                .to_owned();
        }
        (None, text)
    });
    let error = if kind.as_deref() == Some("overloaded_error") {
        ModelError::Overloaded(message)
    } else if is_context_length(status.as_u16(), &message, &body) {
        ModelError::ContextLength(message)
    } else if status.as_u16() == 429 && kind.as_deref() == Some("insufficient_quota") {
        // Waiting does not refill a quota: the call ends at once.
        ModelError::Http {
            status: 429,
            message: format!("{QUOTA_EXHAUSTED}{message}"),
            retry_after: None,
        }
    } else {
        ModelError::Http {
            status: status.as_u16(),
            message,
            retry_after,
        }
    };
    Err(naming_url(error, &url))
}

/// Whether an error answer of `status` with `message` (and the whole
/// `body`, whose codes the message may not repeat) says that the request
/// does not fit the model's context window, as each vendor words it:
///
/// - Anthropic: `prompt is too long: 210000 tokens > 200000 maximum`, or
///   `input length and max_tokens exceed context limit`;
/// - OpenAI (and vLLM): the code `context_length_exceeded`, or `This
///   model's maximum context length is 8192 tokens`;
/// - llama.cpp's server: the type `exceed_context_size_error`, `the
///   request exceeds the available context size`;
/// - Gemini: `The input token count (…) exceeds the maximum number of
///   tokens allowed (…)`.
pub(crate) fn is_context_length(status: u16, message: &str, body: &str) -> bool {
    if !matches!(status, 400 | 413 | 422) {
        return false;
    }
    let message = message.to_ascii_lowercase();
    body.contains("context_length_exceeded")
        || body.contains("exceed_context_size_error")
        || message.contains("prompt is too long")
        || message.contains("exceed context limit")
        || message.contains("maximum context length")
        || message.contains("exceeds the available context size")
        || message.contains("context_length_exceeded")
        || (message.contains("input token count") && message.contains("exceeds the maximum"))
}

/// A `404` from under `base` when `base` does not end in `/v1`, with the
/// hint that OpenAI-compatible servers serve under `/v1`; other errors are
/// returned as they are.
pub(crate) fn hint_v1(error: ModelError, base: &Url) -> ModelError {
    let base = base.path();
    match error {
        ModelError::Http {
            status: 404,
            message,
            retry_after,
        } if !base.trim_end_matches('/').ends_with("/v1") => ModelError::Http {
            status: 404,
            message: format!(
                "{message}; OpenAI-compatible servers usually answer under /v1: the base URL (OPENAI_BASE_URL) should end in /v1, e.g. http://localhost:8080/v1"
            ),
            retry_after,
        },
        other => other,
    }
}

/// How the message of an answer that says the account's quota is
/// exhausted starts: such an answer is never retried (waiting does not
/// refill a quota), though a [`Fallback`](crate::Fallback) may ask another
/// model.
pub(crate) const QUOTA_EXHAUSTED: &str = "quota exhausted (not retried): ";

/// Whether `error` says the account's quota is exhausted.
fn is_quota_exhausted(error: &ModelError) -> bool {
    matches!(error, ModelError::Http { status: 429, message, .. } if message.starts_with(QUOTA_EXHAUSTED))
}

/// A redirect as an error naming its target: the `Location` header made
/// absolute against the response's URL, redacted (a key may ride in its
/// query).
fn redirect_error(response: &Response) -> ModelError {
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)
        .map(|value| String::from_utf8_lossy(value.as_bytes()).trim().to_owned())
        .map(|target| match response.url().join(&target) {
            Ok(absolute) => redact_url(absolute.as_str()),
            Err(_) => "<an unparseable url>".to_owned(),
        });
    ModelError::Redirect {
        status: response.status().as_u16(),
        location,
    }
}

/// `error` naming the `url` it came from (already redacted), when it is an
/// HTTP error, an overload or a connection failure that does not name it
/// yet; other errors are returned as they are.
pub(crate) fn naming_url(error: ModelError, url: &str) -> ModelError {
    let from = format!(" (from {url})");
    let named = |mut text: String| {
        if !text.ends_with(&from) {
            text.push_str(&from);
        }
        text
    };
    match error {
        ModelError::Http {
            status,
            message,
            retry_after,
        } => ModelError::Http {
            status,
            message: named(message),
            retry_after,
        },
        ModelError::Overloaded(message) => ModelError::Overloaded(named(message)),
        ModelError::Connection(text) => ModelError::Connection(named(text)),
        ModelError::ContextLength(text) => ModelError::ContextLength(named(text)),
        other => other,
    }
}

/// At most `cap` bytes of a body, as text, and whether reading stopped at
/// the cap (the body may go on); the rest is never read (the connection is
/// dropped with the response). A read error ends the body where it stands.
async fn read_capped(mut response: Response, cap: usize) -> (String, bool) {
    let mut bytes: Vec<u8> = Vec::new();
    while bytes.len() < cap {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = cap - bytes.len();
                bytes.extend_from_slice(chunk.get(..room).unwrap_or(&chunk));
            }
            Ok(None) | Err(_) => break,
        }
    }
    let cut = bytes.len() >= cap;
    (String::from_utf8_lossy(&bytes).into_owned(), cut)
}

/// The wait a response asks for: `retry-after-ms` (OpenAI) or `retry-after`
/// in seconds. The HTTP-date form of `retry-after` is not understood.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let number = |name: &str| -> Option<f64> {
        let value: f64 = headers.get(name)?.to_str().ok()?.trim().parse().ok()?;
        (value.is_finite() && value >= 0.0).then_some(value)
    };
    // A wait too long for a `Duration` is treated as the longest one: it is
    // over the retry cap either way, and a header must never panic the client.
    let duration = |secs: f64| Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX);
    if let Some(ms) = number("retry-after-ms") {
        return Some(duration(ms / 1000.0));
    }
    number("retry-after").map(duration)
}

/// `url` as [`redact_url`] shows it, or, when it does not parse, the text
/// as given with what could be a secret cut out: everything from a `?`
/// on, and a password before an `@`.
pub(crate) fn redact_loose(url: &str) -> String {
    // `host:8080` parses, with the scheme `host`: only a URL with an
    // authority has its parts where `redact_url` looks.
    if Url::parse(url).is_ok_and(|u| u.has_authority()) {
        return redact_url(url);
    }
    let (mut text, query) = match url.split_once('?') {
        Some((head, _)) => (head.to_owned(), true),
        None => (url.to_owned(), false),
    };
    if let Some(at) = text.find('@') {
        let (userinfo, rest) = text.split_at(at);
        if let Some(colon) = userinfo.rfind(':') {
            let scheme_end = userinfo.find("://").map_or(0, |i| i + 3);
            if colon >= scheme_end {
                text = format!("{}:redacted{rest}", &userinfo[..colon]);
            }
        }
    }
    if query {
        text.push_str("?redacted");
    }
    text
}

/// `url` as it may be shown in logs, `Debug` output and errors: a password in
/// the user-info part and the whole query string (where some proxies carry
/// keys) are replaced by `<redacted>`.
pub(crate) fn redact_url(url: &str) -> String {
    match Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("redacted"));
            }
            if parsed.query().is_some() {
                parsed.set_query(Some("redacted"));
            }
            parsed.to_string()
        }
        Err(_) => "<an unparseable url>".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_vendors_context_length_error_is_recognized() {
        let cases = [
            (
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#,
                "prompt is too long: 210000 tokens > 200000 maximum",
            ),
            (
                r#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#,
                "This model's maximum context length is 8192 tokens.",
            ),
            (
                r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}}"#,
                "the request exceeds the available context size, try increasing it",
            ),
            (
                r#"{"error":{"code":400,"message":"The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}"#,
                "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
            ),
        ];
        for (body, message) in cases {
            assert!(is_context_length(400, message, body), "{body}");
        }
        // Other refusals, and the same words on a server error, are not.
        assert!(!is_context_length(
            400,
            "max_tokens: must be positive",
            "{}"
        ));
        assert!(!is_context_length(500, "prompt is too long", "{}"));
    }

    #[test]
    fn huge_retry_after_values_do_not_panic() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from_static("1e30"));
        assert_eq!(retry_after(&headers), Some(Duration::MAX));
        let mut headers = HeaderMap::new();
        headers.insert("retry-after-ms", HeaderValue::from_static("1e300"));
        assert_eq!(retry_after(&headers), Some(Duration::MAX));
    }

    #[test]
    fn tls_offers_http2_before_http1() {
        let config = tls_config(false).expect("a TLS configuration");
        assert_eq!(
            config.alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
    }

    #[test]
    fn urls_are_redacted_for_display() {
        assert_eq!(
            redact_url("https://user:sk-secret@proxy.test/v1?api-key=sk-2"),
            "https://user:redacted@proxy.test/v1?redacted"
        );
        assert_eq!(
            redact_url("http://localhost:8080/v1"),
            "http://localhost:8080/v1"
        );
        assert_eq!(redact_url("not a url sk-3"), "<an unparseable url>");
    }

    #[test]
    fn backoff_grows_and_stays_in_its_window() {
        let config = TransportConfig {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(350),
            ..TransportConfig::DEFAULT
        };
        for _ in 0..50 {
            let first = config.delay(0, None);
            assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
            let second = config.delay(1, None);
            assert!(second >= Duration::from_millis(100) && second <= Duration::from_millis(200));
            let capped = config.delay(10, None);
            assert!(capped >= Duration::from_millis(175) && capped <= Duration::from_millis(350));
        }
        assert_eq!(
            config.delay(3, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn retry_after_reads_seconds_and_milliseconds() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers), None);
        headers.insert("retry-after", HeaderValue::from_static("3"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
        headers.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(250)));
        headers.remove("retry-after-ms");
        headers.insert("retry-after", HeaderValue::from_static("Wed, 21 Oct 2015"));
        assert_eq!(retry_after(&headers), None);
    }

    #[test]
    fn error_bodies_of_both_shapes_parse() {
        let anthropic =
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        assert_eq!(
            parse_error_body(anthropic),
            Some((Some("overloaded_error".into()), "Overloaded".into()))
        );
        let openai =
            r#"{"error":{"message":"bad key","type":"invalid_request_error","code":null}}"#;
        assert_eq!(
            parse_error_body(openai),
            Some((Some("invalid_request_error".into()), "bad key".into()))
        );
        assert_eq!(
            parse_error_body(r#"{"error":"model not found"}"#),
            Some((None, "model not found".into()))
        );
        assert_eq!(parse_error_body("<html>"), None);
    }

    #[test]
    fn the_context_is_read_as_vllm_and_llama_cpp_report_it() {
        use serde_json::json;
        // vLLM: per model in the model list.
        let vllm = json!({"object": "list", "data": [
            {"id": "a", "max_model_len": 8192},
            {"id": "Qwen/Qwen2.5-7B-Instruct", "max_model_len": 32768},
        ]});
        assert_eq!(
            context_from_models(&vllm, "Qwen/Qwen2.5-7B-Instruct"),
            Some(32_768)
        );
        assert_eq!(
            context_from_models(&vllm, "other"),
            None,
            "two models, neither named"
        );
        let one = json!({"data": [{"id": "m", "max_model_len": 4096}]});
        assert_eq!(context_from_models(&one, "alias"), Some(4096));
        // llama.cpp lists no context in its model list.
        let llama = json!({"data": [{"id": "m", "meta": {"n_ctx_train": 32768}}]});
        assert_eq!(context_from_models(&llama, "m"), None);
        // llama.cpp's /props, older and newer.
        let props = json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1});
        assert_eq!(context_from_props(&props), Some(4096));
        let props = json!({"n_ctx": 8192, "default_generation_settings": {"params": {}}});
        assert_eq!(context_from_props(&props), Some(8192));
        assert_eq!(context_from_props(&json!({"n_ctx": 0})), None);
        assert_eq!(context_from_props(&json!({"n_ctx": "4096"})), None);
        assert_eq!(context_from_props(&json!([])), None);
        // The chat template, with or without tools.
        assert_eq!(
            template_has_tools(&json!({"chat_template": "{% if tools %}…"})),
            Some(true)
        );
        assert_eq!(
            template_has_tools(&json!({"chat_template": "{{ messages }}"})),
            Some(false)
        );
        let caps =
            json!({"chat_template": "tools", "chat_template_caps": {"supports_tools": false}});
        assert_eq!(template_has_tools(&caps), Some(false));
        assert_eq!(template_has_tools(&json!({})), None);
    }

    #[test]
    fn props_sit_beside_v1() {
        let base = parse_base_url("http://localhost:8080/v1/", None).unwrap();
        assert_eq!(
            props_endpoint(&base).as_str(),
            "http://localhost:8080/props"
        );
        let base = parse_base_url("http://localhost:8080", None).unwrap();
        assert_eq!(
            props_endpoint(&base).as_str(),
            "http://localhost:8080/props"
        );
        let base = parse_base_url("http://h/proxy/v1?k=1", None).unwrap();
        assert_eq!(props_endpoint(&base).as_str(), "http://h/proxy/props?k=1");
    }

    #[test]
    fn endpoints_keep_the_base_path() {
        let base = parse_base_url("http://localhost:11434/v1/", None).unwrap();
        assert_eq!(
            endpoint(&base, "chat/completions").as_str(),
            "http://localhost:11434/v1/chat/completions"
        );
        let base = parse_base_url("https://api.anthropic.com", None).unwrap();
        assert_eq!(
            endpoint(&base, "v1/messages").as_str(),
            "https://api.anthropic.com/v1/messages"
        );
        assert!(parse_base_url("ftp://x", None).is_err());
        assert!(parse_base_url("not a url", None).is_err());
    }

    #[test]
    fn a_base_url_without_a_scheme_is_named_with_its_variable() {
        for url in ["localhost:8080/v1", "127.0.0.1:8080", "my-box/v1"] {
            let error = parse_base_url(url, Some("OPENAI_BASE_URL")).unwrap_err();
            let text = error.to_string();
            assert!(text.contains(&format!("{url:?}")), "{text}");
            assert!(text.contains("(from OPENAI_BASE_URL)"), "{text}");
            assert!(text.contains(&format!("http://{url}")), "{text}");
        }
        let error = parse_base_url("ftp://x", None).unwrap_err().to_string();
        assert_eq!(
            error,
            r#"invalid base url "ftp://x/": the scheme must be http or https"#
        );
        // What could be a secret never shows, parseable or not.
        let error = parse_base_url("user:sk-secret@host:1?key=sk-2", Some("X"))
            .unwrap_err()
            .to_string();
        assert!(!error.contains("sk-"), "{error}");
    }

    #[test]
    fn api_key_debug_is_redacted() {
        let key = ApiKey::new("sk-secret");
        assert!(!format!("{key:?}").contains("secret"));
        assert!(key.header("Bearer ").unwrap().is_sensitive());
    }
}
