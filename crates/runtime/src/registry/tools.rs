//! [`ToolRegistry`]: registered tools with their metadata, frozen by
//! [`ToolRegistryBuilder::lock`], with the standard stack built once.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use markov_core::ids::{InstanceId, ToolCallId};
use markov_core::tool::{
    Erased, SharedTool, Tool, ToolContext, ToolDefinition, ToolExecutionResult,
};
use serde_json::{Value, json};

use super::audit::AuditSink;
use super::budget::{Budget, BudgetGate, TurnBudgetState, TurnBudgets};
use super::confirm::{CONFIRMATION_TOKEN, ConfirmationStore};
use super::error::ToolErrorKind;
use super::execute::{EnvelopeMode, ExecuteService};
use super::idempotency::IdempotencyStore;
use super::metadata::{Mode, ToolMetadata};
use super::service::{CallReport, ToolRequest, ToolService};
use super::stack::PolicyStack;

/// The result text of a `TerminateResponse` without a message, for
/// [`ToolRegistry::execute`].
const TERMINATE_MESSAGE: &str = "Finished";

/// The settings of the standard stack.
#[derive(Debug, Clone)]
pub struct PolicyConfig {
    budget: Budget,
    mode_budgets: Vec<(Mode, Budget)>,
    confirmations: Arc<ConfirmationStore>,
    idempotency: Arc<IdempotencyStore>,
    audit_sink: Option<Arc<dyn AuditSink>>,
    envelope: EnvelopeMode,
    registry_version: Arc<str>,
}

impl PolicyConfig {
    /// `budget` in every mode; envelopes on; confirmation tokens valid for
    /// 5 minutes; the last 1 024 results kept for replays; no audit sink.
    pub fn new(budget: Budget) -> Self {
        PolicyConfig {
            budget,
            mode_budgets: Vec::new(),
            confirmations: Arc::new(ConfirmationStore::default()),
            idempotency: Arc::new(IdempotencyStore::default()),
            audit_sink: None,
            envelope: EnvelopeMode::On,
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

    /// Uses `store` for confirmation tokens (e.g. one with another TTL).
    #[must_use]
    pub fn confirmation_store(mut self, store: Arc<ConfirmationStore>) -> Self {
        self.confirmations = store;
        self
    }

    /// Uses `store` for replays.
    #[must_use]
    pub fn idempotency_store(mut self, store: Arc<IdempotencyStore>) -> Self {
        self.idempotency = store;
        self
    }

    /// Sends an [`AuditRecord`](super::AuditRecord) per call to `sink`.
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

    /// The confirmation store.
    pub fn confirmations(&self) -> Arc<ConfirmationStore> {
        Arc::clone(&self.confirmations)
    }

    /// The idempotency store.
    pub fn idempotency(&self) -> Arc<IdempotencyStore> {
        Arc::clone(&self.idempotency)
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
            PolicyStack::standard(&config).service(ExecuteService::new(config.envelope_mode())),
        );
        Ok(ToolRegistry {
            entries: self.entries,
            index,
            version,
            config,
            service,
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
}

/// The frozen registry: tools, metadata, version and the standard stack.
#[derive(Debug, Clone)]
pub struct ToolRegistry {
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    version: Arc<str>,
    config: PolicyConfig,
    service: Arc<dyn ToolService>,
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

    /// The definitions to offer a model, in registration order. A tool that
    /// needs confirmation gets an optional `confirmationToken` string argument.
    /// A provider crate renders them in its vendor's format (e.g.
    /// `markov_providers::openai::tool_schemas`).
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        self.entries
            .iter()
            .map(|e| {
                let mut def = e.tool.definition().clone();
                if e.metadata.requires_confirmation()
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
                                "description": "The token of the user's confirmation, once given."
                            }),
                        );
                    }
                }
                def
            })
            .collect()
    }

    /// A session of this registry in `mode`, charging `turn`.
    pub fn session<'a>(&'a self, mode: &'a Mode, turn: &'a TurnBudgetState) -> RegistrySession<'a> {
        RegistrySession {
            registry: self,
            mode,
            turn,
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
            .run(self.tool(name), call_id, name, input, cx, TERMINATE_MESSAGE)
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
}

impl<'a> RegistrySession<'a> {
    /// Runs `tool` (as the caller resolved it) for `name` through the stack.
    pub async fn run(
        &self,
        tool: Option<&'a SharedTool>,
        call_id: &'a ToolCallId,
        name: &'a str,
        input: Value,
        cx: ToolContext<'a>,
        terminate_message: &'a str,
    ) -> Executed {
        let report = CallReport::new();
        let req = ToolRequest {
            call_id,
            name,
            input,
            tool,
            metadata: self.registry.metadata(name),
            mode: self.mode,
            turn: self.turn,
            report: &report,
            cx,
            terminate_message,
        };
        let result = self.registry.service.call(req).await;
        Executed {
            error: report.error_kind(),
            intents: report.take_intents(),
            result,
        }
    }
}

/// A registry bound to a mode, with per-leaf turn counters: what an executor
/// holds.
#[derive(Debug)]
pub struct RegistryBinding {
    registry: Arc<ToolRegistry>,
    mode: Mode,
    budgets: TurnBudgets,
}

impl RegistryBinding {
    /// `registry` in `mode`.
    pub fn new(registry: Arc<ToolRegistry>, mode: Mode) -> Self {
        RegistryBinding {
            registry,
            mode,
            budgets: TurnBudgets::new(),
        }
    }

    /// The registry.
    pub fn registry(&self) -> &ToolRegistry {
        &self.registry
    }

    /// The mode.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// The counters of `leaf`'s turn; `new_turn` starts them over.
    pub fn turn(&self, leaf: &InstanceId, new_turn: bool) -> Arc<TurnBudgetState> {
        self.budgets.for_leaf(leaf, new_turn)
    }

    /// A session charging `turn`.
    pub fn session<'a>(&'a self, turn: &'a TurnBudgetState) -> RegistrySession<'a> {
        self.registry.session(&self.mode, turn)
    }
}
