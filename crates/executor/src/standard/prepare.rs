//! Prepare: what the leaf's model call is made of besides the history
//! (system prompt, tools, tool choice, settings, output schema), and the
//! call's span.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::respond::prompt::system_prompt;
use markov_charter::ConfigError;
use markov_charter::charter::{AncestorView, PromptInput};
use markov_charter::tool_choice::check_thinking;
use markov_charter::toolgen::{generate_provider_tools, generate_tools_cached};
use markov_core::Role;
use markov_core::message::Message;
use markov_core::model::{Model, ModelRequest, ModelSettings, ToolChoice};
use markov_core::tool::{ProviderTool, ToolDefinition, ToolName};
use markov_policy::RegistryBinding;
use serde_json::Value;

use super::StandardExecutor;
use crate::error::RunError;
use crate::executor::LeafContext;

/// Everything a model call needs besides the history.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Prepared {
    /// The system prompt, written afresh for each call from the node, its
    /// state and the step (kept as written: a copy into an `Arc` would
    /// allocate again, and only a recorded call shares it).
    pub system: String,
    /// The tools offered, shared with every other step of the same node
    /// (see `generate_tools_cached`).
    pub tools: Arc<[ToolDefinition]>,
    /// The offered tools that are deferred, for a provider that searches
    /// tools itself (`None` otherwise: an empty list is not allocated).
    pub deferred_tools: Option<Arc<[ToolName]>>,
    /// The provider built-in tools offered (see
    /// [`generate_provider_tools`]); the provider runs them.
    pub provider_tools: Vec<ProviderTool>,
    /// The tool choice of this call.
    pub tool_choice: ToolChoice,
    /// The settings (executor defaults overridden by the node).
    pub settings: ModelSettings,
    /// The structured-output schema, if the node declares one.
    pub output_schema: Option<Value>,
}

impl Prepared {
    /// The request over `history`.
    pub(crate) fn request<'a>(&'a self, history: &'a [Message]) -> ModelRequest<'a> {
        ModelRequest::new(&self.system, history, &self.settings)
            .with_tools(&self.tools)
            .with_deferred_tools(self.deferred_tools.as_deref().unwrap_or_default())
            .with_provider_tools(&self.provider_tools)
            .with_tool_choice(&self.tool_choice)
            .with_output_schema(self.output_schema.as_ref())
    }
}

/// The names of the provider built-in tools offered to the leaf.
pub(super) fn provider_tool_names(cx: &LeafContext<'_>) -> Vec<ToolName> {
    let node = cx.instance().node();
    let declared = std::iter::once(node)
        .chain(cx.leaf.ancestors().iter().map(|a| a.node()))
        .any(|n| !n.provider_tools().is_empty());
    if !declared {
        return Vec::new();
    }
    generate_provider_tools(node, &ancestor_views(cx))
        .into_iter()
        .map(|t| t.name)
        .collect()
}

pub(super) fn ancestor_views<'a>(cx: &LeafContext<'a>) -> Vec<AncestorView<'a>> {
    cx.leaf
        .ancestors()
        .iter()
        .map(|a| AncestorView {
            node: a.node(),
            state: a.state(),
        })
        .collect()
}

/// Pack states as the leaf sees them: the root's, with the node's own packs
/// initialised for a non-worker. Borrowed unless an initial state fills a gap.
pub(super) fn pack_states<'a>(cx: &LeafContext<'a>) -> Cow<'a, BTreeMap<String, Value>> {
    let mut states = Cow::Borrowed(cx.root().pack_states());
    if !cx.is_worker() {
        for pack in cx.instance().node().packs() {
            let missing = states.get(pack.name()).is_none_or(Value::is_null);
            if missing && let Some(initial) = pack.initial_state() {
                states
                    .to_mut()
                    .insert(pack.name().to_owned(), initial.clone());
            }
        }
    }
    states
}

/// Builds the call: system prompt, tools, tool choice and settings.
///
/// When the final settings enable thinking, they are checked against the
/// node's tool choice rule under `model`'s
/// [`thinking_allowance`](Model::thinking_allowance) before any request is
/// made; a conflict is a [`ConfigError::ThinkingConflict`].
pub(super) fn prepare(
    cx: &LeafContext<'_>,
    defaults: &ModelSettings,
    defaults_given: bool,
    model: &dyn Model,
    registry: Option<&RegistryBinding>,
) -> Result<Prepared, RunError> {
    // From the end: a running turn's last messages are conversation, so this
    // stops at once however long the history (its start may hold thousands
    // of records that are not).
    let has_conversation = cx
        .history
        .iter()
        .rev()
        .any(|m| matches!(m.role, Role::User | Role::Assistant));
    if !has_conversation {
        return Err(RunError::EmptyMessages);
    }
    let node = cx.instance().node();
    let ancestors = ancestor_views(cx);
    let mut tools = generate_tools_cached(cx.charter, node, &ancestors, cx.is_worker())?;
    let mut deferred_tools = None;
    if let Some(binding) = registry {
        if binding.uses_native_search(model.native_tool_search()) {
            // The provider's own tool search: every tool, the deferred
            // ones marked, and no `search_tools`.
            tools = binding.all_tools(&tools);
            deferred_tools = Some(binding.deferred_names());
        } else {
            tools = binding.offered_tools(&tools, &cx.policy.found());
        }
    }
    let packs = if cx.root().packs().is_empty() {
        node.packs()
    } else {
        cx.root().packs()
    };
    let pack_states = pack_states(cx);
    let system = system_prompt(
        &PromptInput {
            charter: cx.charter,
            node,
            state: cx.instance().state(),
            ancestors: &ancestors,
            pack_states: &pack_states,
            packs,
            current_step: cx.current_step,
            max_steps: cx.max_steps,
        },
        &tools,
    );
    let mut settings = defaults.clone();
    let config = node.executor_config();
    if let Some(model) = &config.model {
        settings.model = Some(model.clone());
    }
    if let Some(max_tokens) = config.max_tokens {
        settings.max_tokens = max_tokens;
    } else if !defaults_given {
        settings.max_tokens = model.default_max_tokens(&settings);
    }
    if let Some(t) = config.temperature {
        settings.temperature = Some(t);
    }
    if let Some(thinking) = node.policy().thinking {
        settings.thinking = Some(thinking);
    }
    if let Some(thinking) = settings.thinking {
        check_thinking(
            thinking,
            model.thinking_allowance(&settings, thinking),
            cx.instance().tool_choice(),
            settings.temperature,
        )
        .map_err(|constraint| ConfigError::ThinkingConflict {
            node: node.name().unwrap_or("<unnamed>").to_owned(),
            constraint,
        })?;
    }
    Ok(Prepared {
        system,
        provider_tools: generate_provider_tools(node, &ancestors),
        tools,
        deferred_tools,
        // The recovery call asks for an answer without tools: forcing one
        // would contradict it (and a provider may then refuse the call).
        tool_choice: if cx.turn.recovering {
            ToolChoice::None
        } else {
            cx.instance().tool_choice().choice(cx.turn.tool_ran)
        },
        settings,
        output_schema: node.output().map(|o| o.schema().clone()),
    })
}

impl StandardExecutor {
    /// The leaf's call, prepared with the executor's defaults, its model
    /// and its registry (see [`prepare`]).
    pub(super) fn prepare(&self, cx: &LeafContext<'_>) -> Result<Prepared, RunError> {
        prepare(
            cx,
            &self.settings,
            self.settings_given,
            self.model.as_ref(),
            self.registry.as_deref(),
        )
    }

    /// The span of the leaf's model call, after OpenTelemetry's GenAI
    /// conventions for a chat call (`otel.name` is the span name an
    /// OpenTelemetry exporter shows); with content capture on, it records
    /// the system prompt and the history sent.
    pub(super) fn chat_span(&self, cx: &LeafContext<'_>, prepared: &Prepared) -> tracing::Span {
        let model_name = prepared.settings.model.as_deref().unwrap_or("");
        let span = tracing::info_span!(
            "chat",
            otel.name = %format_args!("chat {model_name}"),
            gen_ai.operation.name = "chat",
            gen_ai.provider.name = self.model.provider_name(),
            gen_ai.request.model = model_name,
            gen_ai.request.max_tokens = prepared.settings.max_tokens,
            // The model the answer names, recorded once it is in; a
            // model that knows which model answered before (a `Fallback`
            // of markov-providers) records it too.
            gen_ai.response.model = tracing::field::Empty,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
            gen_ai.system_instructions = tracing::field::Empty,
            gen_ai.input.messages = tracing::field::Empty,
            gen_ai.output.messages = tracing::field::Empty,
            error.type = tracing::field::Empty,
            step = cx.current_step,
            instance_id = %cx.instance().id(),
            node = cx.instance().node().name().unwrap_or(""),
            tool_choice = ?prepared.tool_choice,
            messages = cx.history.len(),
            streamed = self.streaming.is_some(),
        );
        if self.capture_content && !span.is_disabled() {
            span.record("gen_ai.system_instructions", &*prepared.system);
            if let Ok(json) = serde_json::to_string(cx.history) {
                span.record("gen_ai.input.messages", json.as_str());
            }
        }
        span
    }
}
