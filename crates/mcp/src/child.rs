//! The stdio transport: a child process whose stdout is read through a
//! [`Watch`] that sees each message before rmcp parses it.
//!
//! The watch does two things rmcp cannot:
//!
//! - a message nested deeper than [`MAX_DEPTH`] would be dropped by the
//!   JSON parser without a word, and the request it answers would wait
//!   out its whole timeout; the watch ends the connection at once instead,
//!   and leaves the reason for the client's error to say;
//! - a tool the server marks task-only (`execution.taskSupport:
//!   "required"`) cannot be called without the tasks extension, which this
//!   client does not speak, and rmcp's tool type drops the field: the
//!   watch notes such tools' names from each `tools/list` answer so that
//!   they are not offered.

use std::collections::HashSet;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex as SyncMutex};
use std::task::{Context, Poll};
use std::time::Duration;

use rmcp::RoleClient;
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use rmcp::transport::async_rw::AsyncRwTransport;
use serde_json::Value;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// How deep a server's message may nest (objects and arrays). serde_json
/// refuses more than 128 levels; a little less leaves room for the
/// envelope.
pub(crate) const MAX_DEPTH: usize = 120;

/// The largest message the watch inspects for task-only tools; a larger
/// `tools/list` page is passed on uninspected, with a warning.
const MAX_INSPECTED: usize = 16 * 1024 * 1024;

/// Why a message nested too deep ended the connection.
pub(crate) fn too_deep() -> String {
    format!(
        "the server sent a message nested deeper than {MAX_DEPTH} levels, which this client \
         does not read (a tool schema or result that deep is a bug in the server)"
    )
}

/// What the watch learned, shared with the client.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// Why the connection was ended, when the watch ended it.
    pub(crate) refused: Option<String>,
    /// Tools the server marks task-only.
    pub(crate) task_only: HashSet<String>,
}

/// Reads the child's stdout, tracking each line's nesting depth.
pub(crate) struct Watch<R> {
    inner: R,
    seen: Arc<SyncMutex<Seen>>,
    depth: usize,
    in_string: bool,
    escaped: bool,
    line: Vec<u8>,
    oversized: bool,
}

impl<R> Watch<R> {
    pub(crate) fn new(inner: R, seen: Arc<SyncMutex<Seen>>) -> Self {
        Watch {
            inner,
            seen,
            depth: 0,
            in_string: false,
            escaped: false,
            line: Vec::new(),
            oversized: false,
        }
    }

    /// Scans `bytes`; an error when a message nests too deep.
    fn scan(&mut self, bytes: &[u8]) -> io::Result<()> {
        for &b in bytes {
            if !self.oversized {
                if self.line.len() < MAX_INSPECTED {
                    self.line.push(b);
                } else {
                    self.oversized = true;
                    self.line = Vec::new();
                }
            }
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => {
                    self.depth += 1;
                    if self.depth > MAX_DEPTH {
                        let reason = too_deep();
                        lock(&self.seen).refused = Some(reason.clone());
                        return Err(io::Error::new(io::ErrorKind::InvalidData, reason));
                    }
                }
                b'}' | b']' => self.depth = self.depth.saturating_sub(1),
                b'\n' => {
                    self.depth = 0;
                    self.end_line();
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A whole line read: a `tools/list` answer is looked at for task-only
    /// tools.
    fn end_line(&mut self) {
        let line = std::mem::take(&mut self.line);
        if std::mem::take(&mut self.oversized) {
            tracing::warn!(
                "an MCP message over {MAX_INSPECTED} bytes was not inspected for task-only tools"
            );
            return;
        }
        note_task_only(&line, &self.seen);
    }
}

/// Notes the tools a message marks task-only (`execution.taskSupport:
/// "required"`) when it is an answer to `tools/list`; any other message,
/// or one that is no JSON, is left alone. Both transports call it on each
/// message before rmcp parses it, since rmcp's tool type drops the field.
pub(crate) fn note_task_only(message: &[u8], seen: &SyncMutex<Seen>) {
    if !contains(message, b"taskSupport") {
        return;
    }
    let Ok(message) = serde_json::from_slice::<Value>(message) else {
        return;
    };
    let Some(tools) = message.pointer("/result/tools").and_then(Value::as_array) else {
        return;
    };
    let mut seen = lock(seen);
    for tool in tools {
        let required = tool
            .pointer("/execution/taskSupport")
            .and_then(Value::as_str)
            == Some("required");
        if let (true, Some(name)) = (required, tool.get("name").and_then(Value::as_str)) {
            seen.task_only.insert(name.to_owned());
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

impl<R: AsyncRead + Unpin> AsyncRead for Watch<R> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => Poll::Ready(this.scan(&buf.filled()[before..])),
            other => other,
        }
    }
}

/// A child process speaking MCP on its stdio, read through a [`Watch`].
pub(crate) struct ChildTransport {
    child: Option<Child>,
    transport: AsyncRwTransport<RoleClient, Watch<ChildStdout>, ChildStdin>,
    close_timeout: Duration,
}

impl ChildTransport {
    /// The transport over `child`, whose stdin and stdout are piped.
    pub(crate) fn new(
        mut child: Child,
        seen: Arc<SyncMutex<Seen>>,
        close_timeout: Duration,
    ) -> io::Result<Self> {
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("the child's stdout is not piped"))?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| io::Error::other("the child's stdin is not piped"))?;
        Ok(ChildTransport {
            child: Some(child),
            transport: AsyncRwTransport::new(Watch::new(stdout, seen), stdin),
            close_timeout,
        })
    }

    /// Closes stdin, waits for the child, then kills it.
    async fn shutdown(&mut self) -> io::Result<()> {
        let close = self.transport.close().await;
        if let Some(mut child) = self.child.take() {
            match tokio::time::timeout(self.close_timeout, child.wait()).await {
                Ok(Ok(_)) => {}
                Ok(Err(err)) => tracing::warn!(%err, "waiting for the MCP server's process"),
                Err(_) => {
                    tracing::info!("the MCP server did not exit when its stdin closed; killing it");
                    child.kill().await?;
                }
            }
        }
        close
    }
}

impl Transport<RoleClient> for ChildTransport {
    type Error = io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.transport.send(item)
    }

    fn receive(&mut self) -> impl Future<Output = Option<RxJsonRpcMessage<RoleClient>>> + Send {
        self.transport.receive()
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.shutdown()
    }
}

pub(crate) fn lock<T>(mutex: &SyncMutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch() -> Watch<&'static [u8]> {
        Watch::new(&[][..], Arc::default())
    }

    #[test]
    fn depth_counts_brackets_outside_strings_only() {
        let mut w = watch();
        let deep_string = format!("{{\"a\":\"{}\"}}\n", "[".repeat(500));
        assert!(w.scan(deep_string.as_bytes()).is_ok());
        let ok = format!("{}{}\n", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(w.scan(ok.as_bytes()).is_ok());
        let deep = "[".repeat(MAX_DEPTH + 1);
        let err = w.scan(deep.as_bytes()).expect_err("too deep");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(lock(&w.seen).refused.is_some());
    }

    #[test]
    fn escaped_quotes_do_not_end_a_string() {
        let mut w = watch();
        let line = format!("{{\"a\":\"\\\"{}\"}}\n", "{".repeat(300));
        assert!(w.scan(line.as_bytes()).is_ok());
    }

    #[test]
    fn task_only_tools_are_noted_from_a_listing() {
        let mut w = watch();
        let line = r#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"a","execution":{"taskSupport":"required"}},{"name":"b","execution":{"taskSupport":"optional"}},{"name":"c"}]}}"#;
        // Split across reads, as a pipe may deliver it.
        let (first, second) = line.split_at(40);
        w.scan(first.as_bytes()).expect("ok");
        w.scan(second.as_bytes()).expect("ok");
        w.scan(b"\n").expect("ok");
        let seen = lock(&w.seen);
        assert_eq!(seen.task_only, HashSet::from(["a".to_owned()]));
    }
}
