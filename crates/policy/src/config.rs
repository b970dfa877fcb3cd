//! [`PolicyConfig`]: the settings of the standard stack, one name per
//! option (the builder method that sets it).

use std::sync::Arc;
use std::time::Duration;

use crate::approvals::{ApprovalFlow, DEFAULT_CONFIRMATION_TTL};
use crate::error::{EnvelopeMode, ErrorFormat};
use crate::ledger::IdempotencyLimits;
use crate::metadata::Mode;
use crate::report::AuditSink;
use crate::search::ToolSearch;
use crate::turn::Budget;

/// The settings of the standard stack.
#[derive(Debug, Clone)]
pub struct PolicyConfig {
    pub(crate) budget: Budget,
    pub(crate) mode_budgets: Vec<(Mode, Budget)>,
    pub(crate) confirmation_ttl: Duration,
    pub(crate) approval_flow: ApprovalFlow,
    pub(crate) idempotency: IdempotencyLimits,
    pub(crate) audit_sink: Option<Arc<dyn AuditSink>>,
    pub(crate) envelope: EnvelopeMode,
    pub(crate) errors: ErrorFormat,
    pub(crate) tool_search: ToolSearch,
    /// The version audit reports; [`ToolRegistryBuilder::lock`](crate::ToolRegistryBuilder::lock)
    /// sets it.
    pub(crate) registry_version: Arc<str>,
}

impl PolicyConfig {
    /// `budget` in every mode; envelopes on; calls that need approval
    /// pause the run ([`ApprovalFlow::Pause`]) and their requests are valid
    /// for 5 minutes; answers kept for replays within
    /// [`IdempotencyLimits::default`]; no audit sink.
    pub fn new(budget: Budget) -> Self {
        PolicyConfig {
            budget,
            mode_budgets: Vec::new(),
            confirmation_ttl: DEFAULT_CONFIRMATION_TTL,
            approval_flow: ApprovalFlow::Pause,
            idempotency: IdempotencyLimits::default(),
            audit_sink: None,
            envelope: EnvelopeMode::On,
            errors: ErrorFormat::Envelope,
            tool_search: ToolSearch::default(),
            registry_version: Arc::from(""),
        }
    }

    /// A budget for one mode, instead of the default one.
    #[must_use]
    pub fn mode_budget(mut self, mode: Mode, budget: Budget) -> Self {
        self.mode_budgets.retain(|(m, _)| *m != mode);
        self.mode_budgets.push((mode, budget));
        self
    }

    /// How long a confirmation request may wait for its approval and use.
    #[must_use]
    pub fn confirmation_ttl(mut self, ttl: Duration) -> Self {
        self.confirmation_ttl = ttl;
        self
    }

    /// How a call that needs approval waits for it: the run pauses
    /// ([`ApprovalFlow::Pause`], the default), or the model is told to call
    /// again with the approved request's id ([`ApprovalFlow::Token`]). It
    /// applies to the calls through this registry; a tool outside every
    /// registry that needs approval by its own definition always pauses.
    #[must_use]
    pub fn approval_flow(mut self, flow: ApprovalFlow) -> Self {
        self.approval_flow = flow;
        self
    }

    /// How long, and how many, answered calls are kept for replays.
    #[must_use]
    pub fn idempotency(mut self, limits: IdempotencyLimits) -> Self {
        self.idempotency = limits;
        self
    }

    /// Sends an [`AuditRecord`](crate::AuditRecord) per call to `sink`.
    #[must_use]
    pub fn audit_sink(mut self, sink: Arc<dyn AuditSink>) -> Self {
        self.audit_sink = Some(sink);
        self
    }

    /// Sets whether successes are wrapped in the envelope.
    #[must_use]
    pub fn envelope(mut self, envelope: EnvelopeMode) -> Self {
        self.envelope = envelope;
        self
    }

    /// How deferred tools are searched for and how long what is found
    /// stays offered ([`ToolSearch::default`] unless set). It matters only
    /// when a tool is deferred ([`ToolMetadata::deferred`](crate::ToolMetadata::deferred)).
    #[must_use]
    pub fn tool_search(mut self, search: ToolSearch) -> Self {
        self.tool_search = search;
        self
    }

    /// The tool-search setting.
    pub fn tool_search_setting(&self) -> ToolSearch {
        self.tool_search
    }

    /// Sets how the execute stage words its own errors (envelopes by
    /// default; [`ErrorFormat::PlainText`] for plain texts). Rejections of
    /// the other stages are envelopes.
    #[must_use]
    pub fn errors(mut self, errors: ErrorFormat) -> Self {
        self.errors = errors;
        self
    }
}
