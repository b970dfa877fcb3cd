//! [`ToolRegistry`]: registered tools with their metadata, frozen by
//! [`ToolRegistryBuilder::lock`], with the standard stack built once.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use markov_core::ids::ToolCallId;
use markov_core::tool::{
    Erased, SharedTool, Tool, ToolContext, ToolDefinition, ToolExecutionResult,
};
use serde_json::{Value, json};

use crate::audit::AuditSink;
use crate::budget::{Budget, BudgetGate, TurnBudgetState};
use crate::confirm::{
    ApprovalFlow, CONFIRMATION_TOKEN, ConfirmLayer, ConfirmationRequest, DEFAULT_CONFIRMATION_TTL,
};
use crate::error::ToolErrorKind;
use crate::execute::{EnvelopeMode, ExecuteService};
use crate::idempotency::{IdempotencyLayer, IdempotencyLimits};
use crate::metadata::{Mode, ToolMetadata};
use crate::service::{CallReport, ToolOrigin, ToolRequest, ToolService};
use crate::stack::PolicyStack;
use crate::state::PolicyState;

/// The result text of a `TerminateResponse` without a message, for
/// [`ToolRegistry::execute`].
const TERMINATE_MESSAGE: &str = "Finished";

/// The settings of the standard stack.
#[derive(Debug, Clone)]
pub struct PolicyConfig {
    budget: Budget,
    mode_budgets: Vec<(Mode, Budget)>,
    confirmation_ttl: Duration,
    approval_flow: ApprovalFlow,
    idempotency: IdempotencyLimits,
    audit_sink: Option<Arc<dyn AuditSink>>,
    envelope: EnvelopeMode,
    errors: crate::ErrorFormat,
    registry_version: Arc<str>,
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
            errors: crate::ErrorFormat::Envelope,
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

    /// How a call that needs approval waits for it.
    pub fn flow(&self) -> ApprovalFlow {
        self.approval_flow
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

    /// Sets how the execute stage words its own errors (envelopes by
    /// default; [`ErrorFormat::PlainText`](crate::ErrorFormat) for
    /// upstream's texts). Rejections of the other stages are envelopes.
    #[must_use]
    pub fn errors(mut self, errors: crate::ErrorFormat) -> Self {
        self.errors = errors;
        self
    }

    /// Sets the registry version audit reports ([`ToolRegistryBuilder::lock`]
    /// sets it).
    #[must_use]
    pub fn registry_version(mut self, version: impl Into<Arc<str>>) -> Self {
        self.registry_version = version.into();
        self
    }

    /// The registry version audit reports.
    pub fn version(&self) -> Arc<str> {
        Arc::clone(&self.registry_version)
    }

    /// The budget gate of these settings.
    pub fn budget_gate(&self) -> BudgetGate {
        BudgetGate::new(self.budget, self.mode_budgets.iter().cloned())
    }

    /// How long a confirmation request lives.
    pub fn confirmation_lifetime(&self) -> Duration {
        self.confirmation_ttl
    }

    /// The limits of the idempotency ledger.
    pub fn idempotency_limits(&self) -> IdempotencyLimits {
        self.idempotency
    }

    /// The audit sink, if any.
    pub fn sink(&self) -> Option<&Arc<dyn AuditSink>> {
        self.audit_sink.as_ref()
    }

    /// The envelope mode.
    pub fn envelope_mode(&self) -> EnvelopeMode {
        self.envelope
    }
}

/// A registry that could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Two tools share a name.
    #[error("tool {0:?} is registered twice")]
    Duplicate(String),
    /// A tool's name is not a valid tool name.
    #[error("{0}")]
    InvalidName(#[from] markov_core::tool::InvalidToolName),
}

#[derive(Debug, Clone)]
struct Entry {
    tool: SharedTool,
    metadata: ToolMetadata,
}

/// Collects tools and their metadata; [`lock`](Self::lock) freezes them.
#[derive(Debug)]
pub struct ToolRegistryBuilder {
    entries: Vec<Entry>,
    errors: Vec<RegistryError>,
    config: PolicyConfig,
}

impl ToolRegistryBuilder {
    /// Registers a typed tool.
    #[must_use]
    pub fn register<T: Tool>(mut self, tool: T, metadata: ToolMetadata) -> Self {
        match Erased::shared(tool) {
            Ok(tool) => self.entries.push(Entry { tool, metadata }),
            Err(e) => self.errors.push(e.into()),
        }
        self
    }

    /// Registers an erased tool (e.g. one a node also holds).
    #[must_use]
    pub fn register_shared(mut self, tool: SharedTool, metadata: ToolMetadata) -> Self {
        self.entries.push(Entry { tool, metadata });
        self
    }

    /// Sets the stack's settings.
    #[must_use]
    pub fn policies(mut self, config: PolicyConfig) -> Self {
        self.config = config;
        self
    }

    /// Freezes the registry: checks the names, computes the version and
    /// builds the standard stack.
    pub fn lock(self) -> Result<ToolRegistry, RegistryError> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        let mut index = HashMap::with_capacity(self.entries.len());
        for (i, e) in self.entries.iter().enumerate() {
            let name = e.tool.definition().name.as_str().to_owned();
            if index.insert(name.clone(), i).is_some() {
                return Err(RegistryError::Duplicate(name));
            }
        }
        let mut keys: Vec<(&str, &str)> = self
            .entries
            .iter()
            .map(|e| (e.tool.definition().name.as_str(), e.metadata.version()))
            .collect();
        keys.sort_unstable();
        let mut h = DefaultHasher::new();
        keys.hash(&mut h);
        let version: Arc<str> = Arc::from(format!("{}.{:016x}", keys.len(), h.finish()));
        let config = self.config.registry_version(Arc::clone(&version));
        let service: Arc<dyn ToolService> = Arc::new(
            PolicyStack::standard(&config)
                .service(ExecuteService::new(config.envelope_mode()).errors(config.errors)),
        );
        Ok(ToolRegistry {
            entries: self.entries,
            index,
            version,
            config,
            service,
            own_state: Arc::new(PolicyState::new()),
        })
    }
}

/// A call that went through the stack.
#[derive(Debug, Clone, PartialEq)]
pub struct Executed {
    /// The result (an envelope on failure).
    pub result: ToolExecutionResult,
    /// Why it failed.
    pub error: Option<ToolErrorKind>,
    /// The intents of a success.
    pub intents: Vec<Value>,
    /// Set when the call did not run and waits for the application's
    /// decision on this request ([`ApprovalFlow::Pause`]): once decided, the
    /// same call (same id, same arguments) gets the decision's outcome.
    pub awaiting: Option<ConfirmationRequest>,
}

/// The registry of a machine that has none: no tools, no policies but the
/// pause of a tool whose definition needs approval and the ledger, and the
/// execute stage, in [`ErrorFormat::PlainText`](crate::ErrorFormat). Every
/// tool call takes the same path through a [`ToolService`]; this is that
/// path's plainest form.
pub fn plain_registry() -> &'static ToolRegistry {
    static PLAIN: std::sync::OnceLock<ToolRegistry> = std::sync::OnceLock::new();
    PLAIN.get_or_init(|| {
        let config = PolicyConfig::new(Budget::UNLIMITED).envelope(EnvelopeMode::Off);
        ToolRegistry {
            entries: Vec::new(),
            index: HashMap::new(),
            version: Arc::from("0.plain"),
            // The ledger even here: a resumed step answers a completed call
            // from it instead of running the tool again.
            service: Arc::new(
                PolicyStack::new()
                    .layer(
                        ConfirmLayer::new(config.confirmation_lifetime())
                            .format(EnvelopeMode::Off, crate::ErrorFormat::PlainText),
                    )
                    .layer(IdempotencyLayer::new(config.idempotency_limits()))
                    .service(ExecuteService::plain()),
            ),
            config,
            own_state: Arc::new(PolicyState::new()),
        }
    })
}

/// The registry of a machine that has none, for the calls of an answer
/// nothing can replay (no journal keeps it, no call of it can pause the
/// step, it is not itself a replay): only the execute stage, in
/// [`ErrorFormat::PlainText`](crate::ErrorFormat). A ledger entry is kept
/// so that a replayed answer does not run a completed call again; an
/// answer that is never replayed needs none, and its calls cost no more
/// than the tool.
pub fn unrecorded_registry() -> &'static ToolRegistry {
    static UNRECORDED: std::sync::OnceLock<ToolRegistry> = std::sync::OnceLock::new();
    UNRECORDED.get_or_init(|| {
        let config = PolicyConfig::new(Budget::UNLIMITED).envelope(EnvelopeMode::Off);
        ToolRegistry {
            entries: Vec::new(),
            index: HashMap::new(),
            version: Arc::from("0.unrecorded"),
            service: Arc::new(ExecuteService::plain()),
            config,
            own_state: Arc::new(PolicyState::new()),
        }
    })
}

/// The frozen registry: tools, metadata, version and the standard stack.
#[derive(Debug, Clone)]
pub struct ToolRegistry {
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    version: Arc<str>,
    config: PolicyConfig,
    service: Arc<dyn ToolService>,
    /// The conversation state of calls made through [`ToolRegistry::execute`]
    /// (a machine brings its own).
    own_state: Arc<PolicyState>,
}

impl ToolRegistry {
    /// A builder with `config`.
    pub fn builder(config: PolicyConfig) -> ToolRegistryBuilder {
        ToolRegistryBuilder {
            entries: Vec::new(),
            errors: Vec::new(),
            config,
        }
    }

    /// `<tool count>.<hash of the sorted names and versions>`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The metadata of `name`.
    pub fn metadata(&self, name: &str) -> Option<&ToolMetadata> {
        self.index.get(name).map(|&i| &self.entries[i].metadata)
    }

    /// The tool `name`.
    pub fn tool(&self, name: &str) -> Option<&SharedTool> {
        self.index.get(name).map(|&i| &self.entries[i].tool)
    }

    /// The names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries
            .iter()
            .map(|e| e.tool.definition().name.as_str())
    }

    /// The stack's settings.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// The standard stack over the execution.
    pub fn service(&self) -> &dyn ToolService {
        &*self.service
    }

    /// Whether `name` is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The state of the conversation that [`execute`](Self::execute) runs
    /// calls in: its approvals ([`PolicyState::approvals`]) and ledger. A
    /// machine has its own (`Machine::policy_state`).
    pub fn policy_state(&self) -> &PolicyState {
        &self.own_state
    }

    /// The definition to offer a model for `name`, as [`definitions`](Self::definitions) writes it.
    pub fn definition(&self, name: &str) -> Option<ToolDefinition> {
        self.index
            .get(name)
            .map(|&i| offered(&self.entries[i], self.config.flow()))
    }

    /// The definitions to offer a model, in registration order: exactly the
    /// schemas the stack enforces. In the token flow
    /// ([`ApprovalFlow::Token`]) a tool that needs confirmation gets an
    /// optional `confirmationToken` string argument; a paused call needs
    /// none, so the model is offered nothing to approve with.
    /// A provider crate renders them in its vendor's format (e.g.
    /// `markov_providers::openai::tool_schemas`).
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        let flow = self.config.flow();
        self.entries.iter().map(|e| offered(e, flow)).collect()
    }

    /// A session of this registry in `mode`, charging `turn`, in the
    /// registry's own conversation state.
    pub fn session<'a>(&'a self, mode: &'a Mode, turn: &'a TurnBudgetState) -> RegistrySession<'a> {
        self.session_in(mode, turn, &self.own_state)
    }

    /// A session of this registry in `mode`, charging `turn`, in the
    /// conversation `policy`.
    pub fn session_in<'a>(
        &'a self,
        mode: &'a Mode,
        turn: &'a TurnBudgetState,
        policy: &'a PolicyState,
    ) -> RegistrySession<'a> {
        RegistrySession {
            registry: self,
            mode,
            turn,
            policy,
        }
    }

    /// Runs one call of a registered tool through the stack.
    pub async fn execute(
        &self,
        session: (&Mode, &TurnBudgetState),
        call_id: &ToolCallId,
        name: &str,
        input: Value,
        cx: ToolContext<'_>,
    ) -> Executed {
        let (mode, turn) = session;
        self.session(mode, turn)
            .run(
                self.tool(name),
                call_id,
                name,
                std::borrow::Cow::Owned(input),
                cx,
                TERMINATE_MESSAGE,
            )
            .await
    }
}

/// A registry, the session's mode and the turn's counters: what a caller
/// needs to send calls through the stack.
#[derive(Debug, Clone, Copy)]
pub struct RegistrySession<'a> {
    /// The registry.
    pub registry: &'a ToolRegistry,
    /// The mode.
    pub mode: &'a Mode,
    /// The turn's counters.
    pub turn: &'a TurnBudgetState,
    /// The conversation's approvals and ledger.
    pub policy: &'a PolicyState,
}

impl<'a> RegistrySession<'a> {
    /// Runs `tool` (as the caller resolved it) for `name` through the stack.
    pub async fn run(
        &self,
        tool: Option<&'a SharedTool>,
        call_id: &'a ToolCallId,
        name: &'a str,
        input: std::borrow::Cow<'a, Value>,
        cx: ToolContext<'a>,
        terminate_message: &'a str,
    ) -> Executed {
        self.run_from(
            ToolOrigin::Node,
            tool,
            call_id,
            name,
            input,
            cx,
            terminate_message,
        )
        .await
    }

    /// [`run`](Self::run) for a tool found at `origin`.
    #[allow(clippy::too_many_arguments)]
    pub async fn run_from(
        &self,
        origin: ToolOrigin,
        tool: Option<&'a SharedTool>,
        call_id: &'a ToolCallId,
        name: &'a str,
        input: std::borrow::Cow<'a, Value>,
        cx: ToolContext<'a>,
        terminate_message: &'a str,
    ) -> Executed {
        let report = CallReport::new();
        if let Err(error) = markov_core::tool::check_tool_arguments(&input) {
            // No stage and no tool sees arguments that are not an object.
            let result = crate::error::Rejection::new(ToolErrorKind::InvalidInput)
                .with_detail(error.to_string())
                .into_result(call_id, &report);
            return Executed {
                error: report.error_kind(),
                intents: Vec::new(),
                result,
                awaiting: None,
            };
        }
        let req = ToolRequest {
            call_id,
            name,
            input,
            tool,
            metadata: self.registry.metadata(name),
            mode: self.mode,
            turn: self.turn,
            policy: self.policy,
            report: &report,
            cx,
            terminate_message,
            origin,
        };
        let result = self.registry.service.call(req).await;
        Executed {
            error: report.error_kind(),
            intents: report.take_intents(),
            awaiting: report.awaiting(),
            result,
        }
    }
}

/// A registry bound to a mode: what an executor holds. The conversation
/// state (approvals, ledger, budget counters) is the machine's.
#[derive(Debug)]
pub struct RegistryBinding {
    registry: Arc<ToolRegistry>,
    mode: Mode,
    /// Offered tool lists by the address of the list they extend (which is
    /// kept alive here, so the address is not reused).
    offered: std::sync::Mutex<Vec<OfferedList>>,
}

type OfferedList = (Arc<[ToolDefinition]>, Arc<[ToolDefinition]>);

/// Tool lists remembered at most by [`RegistryBinding::offered_tools`].
const MAX_OFFERED_LISTS: usize = 256;

impl RegistryBinding {
    /// `registry` in `mode`.
    pub fn new(registry: Arc<ToolRegistry>, mode: Mode) -> Self {
        RegistryBinding {
            registry,
            mode,
            offered: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// The tools to offer a leaf whose own tool list is `base`: a tool of
    /// `base` that is registered is offered with the registry's definition
    /// (the schema the stack enforces, with `confirmationToken` where
    /// needed), and the registered tools the mode allows that `base` lacks
    /// are added after it. Computed once per `base` list.
    pub fn offered_tools(&self, base: &Arc<[ToolDefinition]>) -> Arc<[ToolDefinition]> {
        let mut lists = self.offered.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, merged)) = lists.iter().find(|(b, _)| Arc::ptr_eq(b, base)) {
            return Arc::clone(merged);
        }
        let mut merged: Vec<ToolDefinition> = base
            .iter()
            .map(|d| {
                self.registry
                    .definition(d.name.as_str())
                    .unwrap_or_else(|| d.clone())
            })
            .collect();
        for entry in &self.registry.entries {
            let name = entry.tool.definition().name.as_str();
            if entry.metadata.allows(&self.mode) && !base.iter().any(|d| d.name.as_str() == name) {
                merged.push(offered(entry, self.registry.config.flow()));
            }
        }
        let merged: Arc<[ToolDefinition]> = merged.into();
        if lists.len() >= MAX_OFFERED_LISTS {
            lists.clear();
        }
        lists.push((Arc::clone(base), Arc::clone(&merged)));
        merged
    }

    /// The registry.
    pub fn registry(&self) -> &ToolRegistry {
        &self.registry
    }

    /// The mode.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// A session charging `turn`, in the conversation `policy`.
    pub fn session<'a>(
        &'a self,
        turn: &'a TurnBudgetState,
        policy: &'a PolicyState,
    ) -> RegistrySession<'a> {
        self.registry.session_in(&self.mode, turn, policy)
    }
}

/// A registered tool's definition as offered: with the `confirmationToken`
/// argument when the tool needs confirmation in the token flow.
fn offered(e: &Entry, flow: ApprovalFlow) -> ToolDefinition {
    let mut def = e.tool.definition().clone();
    let needs = e.metadata.requires_confirmation() || def.needs_approval;
    if needs
        && flow == ApprovalFlow::Token
        && let Some(obj) = def.input_schema.as_object_mut()
    {
        let props = obj
            .entry("properties")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if let Some(props) = props.as_object_mut() {
            props.insert(
                CONFIRMATION_TOKEN.to_owned(),
                json!({
                    "type": "string",
                    "description": "The request_id of a confirmation request the user has approved. Leave it out until then."
                }),
            );
        }
    }
    def
}
