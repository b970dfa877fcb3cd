//! The Streamable HTTP transport's client: reqwest's, with each message
//! seen before rmcp parses it.
//!
//! rmcp's tool type drops a tool's `execution` field, so a tool the server
//! runs only as a task (`execution.taskSupport: "required"`) would be
//! offered and every call of it would fail. [`WatchedClient`] forwards every
//! request to reqwest's client unchanged (its redirect policy, headers and
//! errors stay as they are) and notes task-only tools from the answers to
//! `tools/list`, as the stdio transport's watch does:
//!
//! - an answer in an SSE stream is read from each event's data as it
//!   passes;
//! - an answer in a JSON body reaches this client already parsed, without
//!   the field, so when it lists tools the same `tools/list` request is
//!   sent once more and its body read here, bounded in size and time. A
//!   failure of that second request is a warning: the listing itself
//!   stands.

use std::collections::HashMap;
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use axum::http::{HeaderName, HeaderValue};
use futures::StreamExt;
use futures::stream::BoxStream;
use rmcp::model::{ClientJsonRpcMessage, ClientRequest, ServerJsonRpcMessage, ServerResult};
use rmcp::transport::common::http_header::{
    EVENT_STREAM_MIME_TYPE, HEADER_SESSION_ID, JSON_MIME_TYPE,
};
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
    StreamableHttpResponseLimits,
};

use crate::child::{Seen, note_task_only};

/// The server's events, as rmcp's transport takes them.
type SseStream = BoxStream<'static, Result<sse_stream::Sse, SseError>>;

/// reqwest's client, noting task-only tools in what the server answers.
#[derive(Clone)]
pub(crate) struct WatchedClient {
    inner: reqwest::Client,
    seen: Arc<SyncMutex<Seen>>,
    /// How long the second read of a JSON `tools/list` answer may take.
    reread_timeout: Duration,
}

impl WatchedClient {
    pub(crate) fn new(
        inner: reqwest::Client,
        seen: Arc<SyncMutex<Seen>>,
        reread_timeout: Duration,
    ) -> Self {
        WatchedClient {
            inner,
            seen,
            reread_timeout,
        }
    }

    /// An SSE stream whose events are looked at as they pass.
    fn watch(&self, stream: SseStream) -> SseStream {
        let seen = Arc::clone(&self.seen);
        stream
            .inspect(move |event| {
                if let Some(data) = event.as_ref().ok().and_then(|e| e.data.as_deref()) {
                    note_task_only(data.as_bytes(), &seen);
                }
            })
            .boxed()
    }

    /// Sends a `tools/list` request again and notes task-only tools from
    /// its JSON body; the answer itself is not used.
    async fn reread(&self, request: Reread<'_>, limit: usize) -> Result<(), String> {
        let mut builder = self
            .inner
            .post(request.uri)
            .header(
                reqwest::header::ACCEPT,
                format!("{EVENT_STREAM_MIME_TYPE}, {JSON_MIME_TYPE}"),
            )
            .headers(
                request
                    .headers
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            );
        if let Some(token) = request.auth {
            builder = builder.bearer_auth(token);
        }
        if let Some(session) = request.session {
            builder = builder.header(HEADER_SESSION_ID, session);
        }
        let mut response = builder
            .json(request.message)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let json = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.split(';')
                    .next()
                    .is_some_and(|t| t.trim().eq_ignore_ascii_case(JSON_MIME_TYPE))
            });
        if !status.is_success() || !json {
            return Err(format!("HTTP {status}, not a JSON body"));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| e.to_string())? {
            if body.len() + chunk.len() > limit {
                return Err(format!("a body over {limit} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        note_task_only(&body, &self.seen);
        Ok(())
    }
}

/// What the second read of a `tools/list` answer sends.
struct Reread<'a> {
    uri: &'a str,
    message: &'a ClientJsonRpcMessage,
    session: Option<&'a str>,
    auth: Option<&'a str>,
    headers: &'a HashMap<HeaderName, HeaderValue>,
}

/// Whether `message` asks for `tools/list`.
fn lists_tools(message: &ClientJsonRpcMessage) -> bool {
    matches!(
        message,
        ClientJsonRpcMessage::Request(request)
            if matches!(request.request, ClientRequest::ListToolsRequest(_))
    )
}

impl StreamableHttpClient for WatchedClient {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default(),
        )
        .await
    }

    async fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let mut limits = StreamableHttpResponseLimits::default();
        limits.max_sse_event_size = max_sse_event_size;
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            limits,
        )
        .await
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let lists = lists_tools(&message);
        // Kept only for a second read of a JSON answer.
        let again = lists.then(|| {
            (
                message.clone(),
                session_id.clone(),
                auth_header.clone(),
                custom_headers.clone(),
            )
        });
        let response = self
            .inner
            .post_message_with_response_limits(
                Arc::clone(&uri),
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            )
            .await?;
        match response {
            StreamableHttpPostResponse::Sse(stream, session) => {
                Ok(StreamableHttpPostResponse::Sse(self.watch(stream), session))
            }
            StreamableHttpPostResponse::Json(answer, session) => {
                // Only a listing with tools can hold a task-only one.
                let listed = matches!(
                    &answer,
                    ServerJsonRpcMessage::Response(response)
                        if matches!(&response.result, ServerResult::ListToolsResult(list) if !list.tools.is_empty())
                );
                if let (true, Some((message, sent_session, auth, headers))) = (listed, again) {
                    let request = Reread {
                        uri: &uri,
                        message: &message,
                        session: sent_session.as_deref(),
                        auth: auth.as_deref(),
                        headers: &headers,
                    };
                    let read = tokio::time::timeout(
                        self.reread_timeout,
                        self.reread(request, limits.max_json_response_size),
                    )
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer within {:?}", self.reread_timeout)));
                    if let Err(why) = read {
                        tracing::warn!(
                            why,
                            "an MCP server's tools/list answer was not inspected for task-only \
                             tools: such a tool, if listed, is offered and its calls fail"
                        );
                    }
                }
                Ok(StreamableHttpPostResponse::Json(answer, session))
            }
            other => Ok(other),
        }
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<Self::Error>> {
        self.inner
            .delete_session(uri, session_id, auth_header, custom_headers)
            .await
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<SseStream, StreamableHttpError<Self::Error>> {
        let stream = self
            .inner
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
            .await?;
        Ok(self.watch(stream))
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<SseStream, StreamableHttpError<Self::Error>> {
        let stream = self
            .inner
            .get_stream_with_max_sse_event_size(
                uri,
                session_id,
                last_event_id,
                auth_header,
                custom_headers,
                max_sse_event_size,
            )
            .await?;
        Ok(self.watch(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(value: serde_json::Value) -> ClientJsonRpcMessage {
        serde_json::from_value(value).expect("a client message")
    }

    #[test]
    fn only_a_tools_list_request_is_read_again() {
        assert!(lists_tools(&message(
            json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        )));
        assert!(lists_tools(&message(
            json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {"cursor": "c"}})
        )));
        assert!(!lists_tools(&message(
            json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "a"}})
        )));
        assert!(!lists_tools(&message(
            json!({"jsonrpc": "2.0", "method": "notifications/initialized"})
        )));
    }

    #[tokio::test]
    async fn sse_events_are_watched_as_they_pass_and_passed_on_unchanged() {
        crate::install_crypto_provider();
        let seen: Arc<SyncMutex<Seen>> = Arc::default();
        let client = WatchedClient::new(
            reqwest::Client::new(),
            Arc::clone(&seen),
            Duration::from_secs(1),
        );
        let listing = r#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"a","execution":{"taskSupport":"required"}},{"name":"b"}]}}"#;
        let events = vec![
            Ok(sse_stream::Sse {
                event: Some("message".into()),
                data: Some(listing.into()),
                ..Default::default()
            }),
            Err(SseError::InvalidLine),
        ];
        let passed: Vec<_> = client
            .watch(futures::stream::iter(events).boxed())
            .collect()
            .await;
        assert_eq!(passed.len(), 2);
        assert_eq!(
            passed[0].as_ref().ok().and_then(|e| e.data.as_deref()),
            Some(listing)
        );
        assert!(passed[1].is_err());
        let seen = crate::child::lock(&seen);
        assert_eq!(
            seen.task_only,
            std::collections::HashSet::from(["a".to_owned()])
        );
    }
}
