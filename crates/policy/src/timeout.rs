//! `TIMEOUT`: a per-tool hard limit ([`ToolMetadata::timeout`](crate::ToolMetadata::timeout)),
//! enforced with `tokio::time::timeout`. The tool's future is dropped at the
//! deadline. A tool without a timeout does not touch tokio; one with a
//! timeout needs a tokio runtime with its time driver enabled.

use markov_core::async_trait;
use markov_core::tool::ToolExecutionResult;

use crate::error::Rejection;
use crate::kind::ToolErrorKind;
use crate::service::{ToolLayer, ToolRequest, ToolService};

/// The kind this stage fails with.
pub const REJECTION: ToolErrorKind = ToolErrorKind::Timeout;

/// The timeout stage's layer.
#[derive(Debug, Clone, Copy, Default)]
pub struct TimeoutLayer;

impl TimeoutLayer {
    /// The layer.
    pub fn new() -> Self {
        TimeoutLayer
    }
}

impl<S> ToolLayer<S> for TimeoutLayer {
    type Service = Timeout<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Timeout { inner }
    }
}

/// A service cut off at its tool's timeout.
#[derive(Debug, Clone)]
pub struct Timeout<S> {
    inner: S,
}

#[async_trait]
impl<S: ToolService> ToolService for Timeout<S> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        let Some(limit) = req.metadata.and_then(|m| m.timeout()) else {
            return self.inner.call(req).await;
        };
        let (call_id, report, tool) = (req.call_id, req.report, req.name);
        match tokio::time::timeout(limit, self.inner.call(req)).await {
            Ok(result) => result,
            Err(_elapsed) => {
                tracing::warn!(
                    tool,
                    timeout_ms = limit.as_millis() as u64,
                    "tool timed out"
                );
                Rejection::new(REJECTION)
                    .with_detail(format!(
                        "{tool} did not finish within {} ms",
                        limit.as_millis()
                    ))
                    .into_result(call_id, report)
            }
        }
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("timeout");
        self.inner.stages(out);
    }
}
