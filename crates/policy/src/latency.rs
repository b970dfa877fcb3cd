//! The soft latency budget: a `tracing` warning when a tool takes longer than
//! its [`ToolMetadata::latency_budget`](crate::ToolMetadata::latency_budget).
//! The result is never changed.

use std::time::Instant;

use markov_core::async_trait;
use markov_core::tool::ToolExecutionResult;

use crate::service::{ToolLayer, ToolRequest, ToolService};

/// The latency stage's layer.
#[derive(Debug, Clone, Copy, Default)]
pub struct LatencyLayer;

impl LatencyLayer {
    /// The layer.
    pub fn new() -> Self {
        LatencyLayer
    }
}

impl<S> ToolLayer<S> for LatencyLayer {
    type Service = Latency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Latency { inner }
    }
}

/// A service whose duration is checked against the tool's latency budget.
#[derive(Debug, Clone)]
pub struct Latency<S> {
    inner: S,
}

#[async_trait]
impl<S: ToolService> ToolService for Latency<S> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        let Some(budget) = req.metadata.map(|m| m.latency_budget()) else {
            return self.inner.call(req).await;
        };
        let tool = req.name;
        let start = Instant::now();
        let result = self.inner.call(req).await;
        let elapsed = start.elapsed();
        if elapsed > budget {
            tracing::warn!(
                tool,
                duration_ms = elapsed.as_millis() as u64,
                budget_ms = budget.as_millis() as u64,
                "tool exceeded its latency budget"
            );
        }
        result
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("latency");
        self.inner.stages(out);
    }
}
