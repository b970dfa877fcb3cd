//! Structured audit logging: one `tracing` event per call (rejections
//! included) with `event = "tool_execution"`, and an optional [`AuditSink`]
//! receiving an [`AuditRecord`].

use std::sync::Arc;
use std::time::Instant;

use markov_core::async_trait;
use markov_core::tool::ToolExecutionResult;

use crate::kind::ToolErrorKind;
use crate::report::{AuditRecord, AuditSink};
use crate::service::{ToolLayer, ToolRequest, ToolService};

/// The audit stage's layer.
#[derive(Debug, Clone)]
pub struct AuditLayer {
    registry_version: Arc<str>,
    sink: Option<Arc<dyn AuditSink>>,
}

impl AuditLayer {
    /// A layer reporting `registry_version`, and to `sink` if there is one.
    pub fn new(registry_version: impl Into<Arc<str>>, sink: Option<Arc<dyn AuditSink>>) -> Self {
        AuditLayer {
            registry_version: registry_version.into(),
            sink,
        }
    }
}

impl<S> ToolLayer<S> for AuditLayer {
    type Service = Audit<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Audit {
            inner,
            layer: self.clone(),
        }
    }
}

/// A service whose calls are audited.
#[derive(Debug, Clone)]
pub struct Audit<S> {
    inner: S,
    layer: AuditLayer,
}

#[async_trait]
impl<S: ToolService> ToolService for Audit<S> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        let (call_id, tool, metadata, mode, report) =
            (req.call_id, req.name, req.metadata, req.mode, req.report);
        let start = Instant::now();
        let result = self.inner.call(req).await;
        let duration = start.elapsed();
        let error_type = if result.is_error {
            Some(
                report
                    .error_kind()
                    .unwrap_or(ToolErrorKind::ExecutionFailed),
            )
        } else {
            None
        };
        tracing::info!(
            event = "tool_execution",
            tool,
            call_id = %call_id,
            tool_version = metadata.map(|m| m.version()),
            registry_version = &*self.layer.registry_version,
            duration_ms = duration.as_secs_f64() * 1e3,
            ok = !result.is_error,
            category = metadata.map(|m| m.category().as_str()),
            mode = mode.as_str(),
            error_type = error_type.map(ToolErrorKind::as_str),
            "tool execution"
        );
        if let Some(sink) = &self.layer.sink {
            sink.record(&AuditRecord {
                call_id: call_id.clone(),
                tool: tool.to_owned(),
                tool_version: metadata.map(|m| m.version().to_owned()),
                registry_version: Arc::clone(&self.layer.registry_version),
                duration,
                ok: !result.is_error,
                category: metadata.map(|m| m.category()),
                mode: mode.clone(),
                error_type,
            });
        }
        result
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("audit");
        self.inner.stages(out);
    }
}
