//! [`StandardExecutor`]: one model call per leaf per step, over any [`Model`].
//!
//! The logic is a sequence of pure functions over plain values — [`prepare`]
//! (system prompt, tools, tool choice, settings), [`interpret`] (the model's
//! answer), [`after_tools`] (the pipeline's outcome) and [`after_transition`]
//! — and [`StandardExecutor::run_leaf`] is the thin async glue that performs
//! the model call, the tool calls and a code transition between them. Each
//! rule (terminal tools, termination, restriction, tool choice) is therefore
//! testable without a runtime.
//!
//! With streaming configured ([`StandardExecutor::with_streaming`]) the model
//! call follows the vessel protocol of [`crate::stream`]: the (empty) vessel
//! is enqueued while the leaf runs, through [`LeafContext::queue`]; its final
//! version replaces it as the first entry of the outcome ([`finalize_vessel`]),
//! so it reaches the queue in one batch with its tool results. A run dropped
//! while tools run therefore leaves only the empty vessel behind, never a tool
//! call without its result.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use crate::respond::pipeline::{
    CallLog, LeafView, PipelineOutcome, ToolCall, run_tool_calls_logged,
};
use crate::respond::prompt::system_prompt;
use crate::respond::take_transition;
use crate::usage::{
    Call, LimitExceeded, Prices, admit_call, estimate_framing_tokens, estimate_input_tokens,
    metered, metered_usage,
};
use async_trait::async_trait;
use futures::StreamExt;
use markov_charter::ConfigError;
use markov_charter::charter::{AncestorView, PromptInput};
use markov_charter::context::{ContextPolicy, TokenCount};
use markov_charter::tool_choice::check_thinking;
use markov_charter::toolgen::{generate_provider_tools, generate_tools_cached};
use markov_charter::transition::{TransitionError, TransitionOutcome};
use markov_core::Role;
use markov_core::ids::ToolCallId;
use markov_core::message::{Item, MAX_ARGUMENT_DEPTH, Message, Metadata, Source, nesting_exceeds};
use markov_core::model::{
    Compaction, HistoryId, InputTokenCount, Model, ModelError, ModelRequest, ModelResponse,
    ModelSettings, StopReason, StreamEvent, ToolChoice,
};
use markov_core::tool::{
    InvalidArguments, ProviderTool, ToolCallError, ToolDefinition, ToolExecutionResult, ToolName,
};
use markov_policy::{
    ErrorFormat, Mode, RecordedAnswer, RegistryBinding, Rejection, ToolErrorKind, ToolRegistry,
};
use serde_json::Value;
use tracing::Instrument;

use crate::context::{Forced, SummaryJob, native_reads};
use crate::effect::{Effect, Entry};
use crate::error::RunError;
use crate::executor::{Executor, Intent, LeafContext, LeafOutcome};
use crate::instance::SuspendInfo;
use crate::queue::Queue;
use crate::step::{TurnState, YieldReason};
use crate::stream::{MessageStreamEvent, StreamOptions, VesselState};

/// The result text of a tool call cut off by the token limit.
pub const CUT_OFF_TOOL_CALL: &str =
    "Tool call not run: the response was cut off by the token limit.";

/// The result text of a tool call that had not finished when its run was
/// cancelled.
pub const CANCELLED_TOOL_CALL: &str = "Tool call not completed: the run was cancelled before it finished. It may or may not have taken effect.";

/// The result text of a call whose id repeats an earlier call's in the same
/// response (its id is made unique in the history; it is not run).
pub const DUPLICATE_TOOL_CALL: &str = "Tool call not run: its id repeats an earlier call of this response. Call the tool again if it is really needed.";

/// Calls a model once per leaf per step and runs the tools it asks for.
#[derive(Debug, Clone)]
pub struct StandardExecutor {
    model: Arc<dyn Model>,
    settings: ModelSettings,
    registry: Option<Arc<RegistryBinding>>,
    streaming: Option<StreamOptions>,
    capture_content: bool,
    prices: Prices,
    context_policy: Option<ContextPolicy>,
    /// Whether the application set the settings: if not, the answer
    /// tokens follow the model ([`Model::default_max_tokens`]).
    settings_given: bool,
}

impl StandardExecutor {
    /// An executor over `model` with default settings: the answer tokens
    /// asked for follow the model ([`Model::default_max_tokens`]: a known
    /// model's most, up to 8 192; 2 048 for a model it does not know)
    /// until [`Self::with_settings`] or a node says otherwise.
    pub fn new(model: impl Model + 'static) -> Self {
        Self::shared(Arc::new(model))
    }

    /// An executor over a shared model.
    pub fn shared(model: Arc<dyn Model>) -> Self {
        StandardExecutor {
            model,
            settings: ModelSettings::default(),
            registry: None,
            streaming: None,
            capture_content: false,
            prices: Prices::table(),
            context_policy: None,
            settings_given: false,
        }
    }

    /// Prices the model calls at `prices` (the bundled table by default):
    /// each step's [`usage`](crate::MachineStep::usage) has their cost,
    /// and limits on money are checked with them.
    #[must_use]
    pub fn with_prices(mut self, prices: Prices) -> Self {
        self.prices = prices;
        self
    }

    /// Records prompts, messages, tool arguments and tool results in the
    /// trace (`gen_ai.input.messages`, `gen_ai.tool.call.arguments`, ...).
    /// Off by default: they may hold personal data, and writing them costs
    /// a serialization of the history per model call.
    #[must_use]
    pub fn with_content_capture(mut self, capture: bool) -> Self {
        self.capture_content = capture;
        self
    }

    /// What every leaf's model call is shown of a long history (see
    /// [`markov_charter::context`]); a node's own policy overrides it.
    /// Without one, every call is sent the whole history, and a model that
    /// refuses it as too long ends the run with
    /// [`YieldReason::ContextExhausted`].
    #[must_use]
    pub fn with_context_policy(mut self, policy: ContextPolicy) -> Self {
        self.context_policy = Some(policy);
        self
    }

    /// Sets the default settings; a node's executor config overrides them.
    #[must_use]
    pub fn with_settings(mut self, settings: ModelSettings) -> Self {
        self.settings = settings;
        self.settings_given = true;
        self
    }

    /// Sends calls of `registry`'s tools through its policy stack in `mode`
    /// (see [`markov_policy`]), and offers the registry's tools
    /// to every leaf with the schemas the stack enforces (a tool is
    /// registered once, in the registry). Budgets count per user turn of
    /// each leaf: they start over when a user message starts a run, never
    /// on a transition. Approvals and answered calls are the machine's
    /// ([`Machine::policy_state`](crate::Machine::policy_state)).
    ///
    /// A leaf's own tools stay offered and callable beside the registry's:
    /// a node, ancestor, charter or pack tool the registry does not register
    /// (such as `respond` and `finish` from `markov-tools-std`) runs on the
    /// plain path, exactly as without a registry — no mode or budget stage,
    /// the conversation's ledger, a pause when its own definition needs
    /// approval, its plain result text — and still gets exactly one result
    /// per call. A tool of the same name in the
    /// registry takes the registry's stack. Names that nobody declares are
    /// refused by the registry's unknown-tool stage (`NOT_FOUND`).
    #[must_use]
    pub fn with_registry(mut self, registry: Arc<ToolRegistry>, mode: Mode) -> Self {
        self.registry = Some(Arc::new(RegistryBinding::new(registry, mode)));
        self
    }

    /// Streams every model call into the queue as a vessel message and
    /// reports each step of it to `callback` (see [`crate::stream`]).
    /// A node with structured output gets a plain call, still wrapped in the
    /// vessel protocol.
    #[must_use]
    pub fn with_streaming(
        self,
        callback: impl Fn(&MessageStreamEvent) + Send + Sync + 'static,
    ) -> Self {
        self.with_stream_options(StreamOptions::new(callback))
    }

    /// Sets (or replaces) the streaming options; see [`Self::with_streaming`].
    #[must_use]
    pub fn with_stream_options(mut self, options: StreamOptions) -> Self {
        self.streaming = Some(options);
        self
    }
}

/// Why the model cannot serve a node of a charter (see
/// [`StandardExecutor::check_nodes`]).
#[derive(Debug)]
pub(crate) enum Unservable {
    /// The node's tool list cannot be made.
    Tools(ConfigError),
    /// The model refuses a tool or the output type.
    Refused(markov_core::Unsupported),
    /// The node's context policy compacts natively with a model that
    /// makes no items, or items of a vendor the model does not read.
    Native {
        /// The vendor the policy's model makes items of.
        makes: Option<String>,
        /// The vendor the executor's model reads.
        reads: Option<String>,
    },
}

impl StandardExecutor {
    /// Checks, through [`Model::check_tools`], that the model can be
    /// offered what each node offers it: the nodes `charter` registers and
    /// the nodes their transitions hold inline. Each is checked with the
    /// tools of a leaf that is not a worker (the built-in ones, its own,
    /// the charter's, its packs', the registry's) and its output type.
    /// Tools a node only gets as a child of another (its ancestors') are
    /// checked with the nodes that declare them; a node a model writes
    /// (a general transition's) is known only when it is taken.
    ///
    /// # Errors
    /// The first node the model cannot serve (its registered name, else
    /// its own, else the transition's), and why.
    pub(crate) fn check_nodes(
        &self,
        charter: &markov_charter::charter::Charter,
    ) -> Result<(), (String, Unservable)> {
        use markov_charter::transition::{NodeTarget, Transition};

        // The registered nodes first, then the ones held inline.
        let mut waiting: std::collections::VecDeque<(String, &markov_charter::node::Node)> =
            charter
                .nodes()
                .map(|(name, node)| (name.to_owned(), node))
                .collect();
        let mut seen = HashSet::new();
        while let Some((name, node)) = waiting.pop_front() {
            if !seen.insert(node.id().clone()) {
                continue;
            }
            let mut tools = generate_tools_cached(charter, node, &[], false)
                .map_err(|e| (name.clone(), Unservable::Tools(e)))?;
            if let Some(binding) = &self.registry {
                tools = binding.offered_tools(&tools);
            }
            self.model
                .check_tools(&tools, node.output().map(|o| o.schema()))
                .map_err(|e| (name.clone(), Unservable::Refused(e)))?;
            // A native compaction must make items the model reads: else
            // every crossing would compact for nothing.
            if let Some(summarize) = node
                .context_policy()
                .or(self.context_policy.as_ref())
                .and_then(ContextPolicy::summarize)
                .filter(|s| s.is_native())
            {
                let makes = summarize.model().native_summaries();
                let reads = self.model.native_summaries();
                if makes.is_none() || makes != reads {
                    return Err((
                        name.clone(),
                        Unservable::Native {
                            makes: makes.map(str::to_owned),
                            reads: reads.map(str::to_owned),
                        },
                    ));
                }
            }
            for (transition_name, transition) in node.transitions() {
                if let Ok(Transition::Serial {
                    target: NodeTarget::Inline(inline),
                    ..
                }) = charter.resolve_transition(transition)
                {
                    let name = inline.name().unwrap_or(transition_name).to_owned();
                    waiting.push_back((name, inline));
                }
            }
        }
        Ok(())
    }
}

/// Everything a model call needs besides the history.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Prepared {
    /// The system prompt, written afresh for each call from the node, its
    /// state and the step.
    pub system: Arc<str>,
    /// The tools offered, shared with every other step of the same node
    /// (see `generate_tools_cached`).
    pub tools: Arc<[ToolDefinition]>,
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
            .with_provider_tools(&self.provider_tools)
            .with_tool_choice(&self.tool_choice)
            .with_output_schema(self.output_schema.as_ref())
    }
}

/// The names of the provider built-in tools offered to the leaf.
fn provider_tool_names(cx: &LeafContext<'_>) -> Vec<ToolName> {
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

fn ancestor_views<'a>(cx: &LeafContext<'a>) -> Vec<AncestorView<'a>> {
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
fn pack_states<'a>(cx: &LeafContext<'a>) -> Cow<'a, BTreeMap<String, Value>> {
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
pub(crate) fn prepare(
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
    if let Some(binding) = registry {
        tools = binding.offered_tools(&tools);
    }
    let packs = if cx.root().packs().is_empty() {
        node.packs()
    } else {
        cx.root().packs()
    };
    let pack_states = pack_states(cx);
    let system: Arc<str> = system_prompt(
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
    )
    .into();
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

/// What to do after the model answered.
#[derive(Debug)]
pub(crate) enum AfterModel {
    /// The leaf is done for this step.
    Finish(LeafOutcome),
    /// Run the calls of the assistant message (see [`tool_calls`]), then
    /// call [`after_tools`] with `entries` so far.
    RunTools {
        /// Entries so far (the assistant message).
        entries: Vec<Entry>,
        /// The results of calls answered without running (a repeated id),
        /// to record after the pipeline's.
        refused: Vec<ToolExecutionResult>,
    },
}

fn with_source(message: Message, source: &Source) -> Message {
    message.with_metadata(Metadata::with_source(source.clone()))
}

/// Interprets the model's answer. The assistant message is always the first
/// of the returned entries.
///
/// Calls of provider built-in tools are not run and get no result: the
/// provider answered them in the same response
/// ([`Item::ProviderToolUse`]/[`Item::ProviderToolResult`], kept as they
/// are). A plain `tool_use` naming a provider tool offered to this leaf (a
/// client that reports server calls as ordinary calls) is recorded as an
/// [`Item::ProviderToolUse`], so the history keeps one result per client
/// call. An answer whose only calls are provider calls ends the turn like a
/// text answer.
///
/// Arguments nested deeper than [`MAX_ARGUMENT_DEPTH`] could be recorded but
/// never read back: they are recorded as `{}`, and such a regular call is
/// answered as invalid input, worded as `errors` says (the error envelope
/// under a registry, the plain text without), without running.
pub(crate) fn interpret(
    cx: &LeafContext<'_>,
    response: ModelResponse,
    errors: ErrorFormat,
) -> AfterModel {
    let source = cx.source();
    let output = cx.instance().node().output();
    let provider_tools = provider_tool_names(cx);
    let mut items: Vec<Item> = response
        .content
        .into_iter()
        .map(|item| match item {
            Item::Text { text } if output.is_some() => Item::Output {
                data: output
                    .map(|o| o.map_text_block(&text))
                    .unwrap_or(Value::Null),
            },
            other => other,
        })
        .collect();
    let refused = screen_calls(&mut items, &provider_tools, errors);
    let has_calls = items.iter().any(|i| matches!(i, Item::ToolUse { .. }));
    // Room for the results or the reminder that usually follow.
    let mut entries = Vec::with_capacity(2);
    entries.push(Entry::message(with_source(
        Message::assistant_items(items),
        &source,
    )));
    let mut turn = cx.turn;

    if response.stop_reason == StopReason::MaxTokens {
        // The calls may be cut mid-argument: answer each without running it, so
        // the history keeps one result per call.
        if has_calls {
            let results = tool_calls(&entries, &refused)
                .iter()
                .map(|c| ToolExecutionResult::error(c.id.clone(), CUT_OFF_TOOL_CALL).to_item(true))
                .chain(refused.iter().map(|r| r.to_item(true)))
                .collect();
            entries.push(Entry::message(with_source(
                Message::user_items(results),
                &source,
            )));
        }
        return AfterModel::Finish(LeafOutcome::new(entries, YieldReason::MaxTokens, turn));
    }
    if has_calls {
        return AfterModel::RunTools { entries, refused };
    }
    let restriction = &cx.instance().node().policy().restriction;
    if restriction.may_inject(turn.injections) {
        turn.injections += 1;
        entries.push(Entry::message(with_source(
            Message::system(restriction.restriction_message.clone()),
            &source,
        )));
        return AfterModel::Finish(LeafOutcome::new(entries, YieldReason::Restricted, turn));
    }
    AfterModel::Finish(LeafOutcome::new(entries, YieldReason::EndTurn, turn))
}

/// Screens the calls of a response before anything runs, returning the
/// results of those answered without running:
///
/// - arguments nested deeper than [`MAX_ARGUMENT_DEPTH`] are replaced by
///   `{}` (vendors want an object), and such a regular call gets an
///   invalid-input error result;
/// - a call that repeats an earlier call's id gets a unique id (`id_2`,
///   `id_3`, ...) and an error result;
/// - a plain `tool_use` naming one of `provider_tools` becomes an
///   [`Item::ProviderToolUse`].
///
/// In place, in order: the calls are read from the message itself later
/// (borrowed, never copied).
fn screen_calls(
    items: &mut [Item],
    provider_tools: &[ToolName],
    errors: ErrorFormat,
) -> Vec<ToolExecutionResult> {
    let mut refused = Vec::new();
    let mut taken = CallIds::default();
    for item in items.iter_mut() {
        if let Item::ProviderToolUse { id, input, .. } = item
            && nesting_exceeds(input, MAX_ARGUMENT_DEPTH)
        {
            // Answered by the provider already: only the record must be
            // readable.
            tracing::warn!(call_id = %id, "provider tool call arguments nested too deep; recorded as {{}}");
            *input = Value::Object(serde_json::Map::new());
        }
        let Item::ToolUse { id, name, input } = item else {
            continue;
        };
        // What is recorded must read back: serde_json reads a bounded depth.
        let too_deep = nesting_exceeds(input, MAX_ARGUMENT_DEPTH);
        if too_deep {
            *input = Value::Object(serde_json::Map::new());
        }
        if taken.contains(id) {
            // Providers reject a history with two calls of one id (Anthropic
            // does), and running both could repeat a side effect: the repeat
            // gets a unique id and an error result, and does not run.
            let unique = taken.unique(id);
            refused.push(ToolExecutionResult::error(
                unique.clone(),
                DUPLICATE_TOOL_CALL,
            ));
            *id = unique.clone();
            taken.insert(unique);
        } else if provider_tools.iter().any(|p| *p == **name) {
            *item = Item::ProviderToolUse {
                id: id.clone(),
                name: std::mem::take(name),
                input: std::mem::take(input),
            };
        } else {
            if too_deep {
                refused.push(too_deep_result(id.clone(), errors));
            }
            taken.insert(id.clone());
        }
    }
    refused
}

/// The error result of a call whose arguments were nested too deep to keep.
fn too_deep_result(id: ToolCallId, errors: ErrorFormat) -> ToolExecutionResult {
    let detail = format!(
        "{}; the call was not run, and its arguments are recorded as {{}}",
        InvalidArguments::TooDeep {
            limit: MAX_ARGUMENT_DEPTH
        }
    );
    tracing::debug!(call_id = %id, "tool call refused: {detail}");
    let content = match errors {
        ErrorFormat::PlainText => ToolCallError::InvalidInput(detail).to_string(),
        _ => Rejection::new(ToolErrorKind::InvalidInput)
            .with_detail(detail)
            .to_envelope(),
    };
    ToolExecutionResult::error(id, content)
}

/// Completes a streamed message: the answer's assistant message (always the
/// first entry, see [`interpret`]) is replaced by its completed version under
/// the vessel's id, which takes the vessel's place when the outcome is
/// enqueued. Returns the `message_end` event; `None` if there is no entry.
pub(crate) fn finalize_vessel(
    vessel: &mut VesselState,
    after: &mut AfterModel,
) -> Option<MessageStreamEvent> {
    let entries = match after {
        AfterModel::Finish(outcome) => &mut outcome.entries,
        AfterModel::RunTools { entries, .. } => entries,
    };
    let first = entries.first_mut()?;
    let assistant = std::mem::replace(&mut first.message, Message::assistant_items(Vec::new()));
    let (completed, event) = vessel.complete(assistant);
    first.message = completed;
    Some(event)
}

/// What to do after the tools ran.
#[derive(Debug)]
// Made once per leaf per step and matched at once: boxing the outcome
// would add an allocation per step to save a few bytes of a short-lived
// value.
#[allow(clippy::large_enum_variant)]
pub(crate) enum AfterTools {
    /// The leaf is done for this step.
    Finish(LeafOutcome),
    /// Take the queued transition, then call [`after_transition`].
    Transition(Box<PendingTransition>),
}

/// A step waiting for its transition.
#[derive(Debug)]
pub(crate) struct PendingTransition {
    entries: Vec<Entry>,
    outcome: PipelineOutcome,
    turn: TurnState,
    /// The transition's name.
    pub name: String,
    /// Why the model took it.
    pub reason: String,
    /// Its arguments.
    pub args: Value,
    /// The running state after this turn's updates.
    pub state: Value,
}

/// Records the pipeline's outcome and decides the step's result.
pub(crate) fn after_tools(
    cx: &LeafContext<'_>,
    entries: Vec<Entry>,
    outcome: PipelineOutcome,
) -> AfterTools {
    // A tool ran: tool choice relaxes and restriction counters start over.
    let turn = TurnState {
        tool_ran: true,
        injections: 0,
        recovering: false,
    };
    match &outcome.transition {
        Some(queued) => AfterTools::Transition(Box::new(PendingTransition {
            name: queued.name.clone(),
            reason: queued.reason.clone(),
            args: queued.args.clone(),
            state: outcome
                .state
                .as_ref()
                .map(|(s, _)| s.clone())
                .unwrap_or_else(|| cx.instance().state().clone()),
            entries,
            outcome,
            turn,
        })),
        None => AfterTools::Finish(finish(cx, entries, outcome, turn, None)),
    }
}

/// Completes a step whose transition was attempted.
pub(crate) fn after_transition(
    cx: &LeafContext<'_>,
    pending: PendingTransition,
    result: Result<TransitionOutcome, TransitionError>,
) -> LeafOutcome {
    let PendingTransition {
        entries,
        mut outcome,
        turn,
        name,
        ..
    } = pending;
    match result {
        Err(error) => {
            // The transition tool already said "complete"; correct the claim.
            if let Some(queued) = &outcome.transition
                && let Some(slot) = outcome.results.get_mut(queued.result_index)
            {
                *slot = ToolExecutionResult::error(
                    slot.call_id.clone(),
                    format!("Transition to \"{name}\" failed: {error}"),
                );
            }
            outcome.transition = None;
            finish(cx, entries, outcome, turn, None)
        }
        Ok(transition) => finish(cx, entries, outcome, turn, Some(transition)),
    }
}

fn finish(
    cx: &LeafContext<'_>,
    mut entries: Vec<Entry>,
    mut outcome: PipelineOutcome,
    mut turn: TurnState,
    transition: Option<TransitionOutcome>,
) -> LeafOutcome {
    let source = cx.source();
    let leaf_id = cx.instance().id().clone();
    if let Some((_, patch)) = &outcome.state {
        entries.push(Entry::effect(
            cx.charter,
            Effect::State {
                instance: leaf_id.clone(),
                patch: patch.clone(),
            },
            Some(source.clone()),
        ));
    }
    for (pack, patch) in &outcome.pack_patches {
        entries.push(Entry::effect(
            cx.charter,
            Effect::PackState {
                pack: pack.clone(),
                patch: patch.clone(),
            },
            Some(source.clone()),
        ));
    }
    entries.push(Entry::message(with_source(
        Message::user_items(outcome.take_result_items()),
        &source,
    )));
    // A transition wins over a terminal response and over termination.
    let terminal = outcome.terminal.as_ref().filter(|_| transition.is_none());
    let mut replies = outcome.replies.clone();
    if let Some(t) = terminal
        && !t.in_replies
    {
        replies.push(Item::text(t.text.clone()));
    }
    if !replies.is_empty() {
        entries.push(Entry::message(with_source(
            Message::assistant_items(replies),
            &source,
        )));
    }
    let loop_stop = outcome.loop_stop.clone();
    let mut result = LeafOutcome::new(entries, YieldReason::ToolUse, turn);
    result.intents = outcome
        .intents
        .iter()
        .map(|(call_id, value)| Intent {
            instance_id: leaf_id.clone(),
            call_id: call_id.clone(),
            value: value.clone(),
        })
        .collect();
    match transition {
        Some(t) => {
            let (effect, reason) = match t {
                TransitionOutcome::To { node, state } => {
                    // Entering a node starts its turn over (tool choice forces again).
                    turn = TurnState::default();
                    (
                        Some(Effect::Transition {
                            instance: leaf_id,
                            node,
                            state,
                        }),
                        YieldReason::ToolUse,
                    )
                }
                TransitionOutcome::Spawn(children) if !children.is_empty() => (
                    Some(Effect::Spawn {
                        parent: leaf_id,
                        children,
                    }),
                    YieldReason::ToolUse,
                ),
                TransitionOutcome::Cede(content) => (
                    Some(Effect::Cede {
                        instance: leaf_id,
                        content,
                    }),
                    YieldReason::Cede,
                ),
                TransitionOutcome::Suspend {
                    suspend_id,
                    reason,
                    metadata,
                } => (
                    Some(Effect::Suspend {
                        instance: leaf_id,
                        info: SuspendInfo {
                            suspend_id,
                            reason,
                            suspended_at: std::time::SystemTime::now(),
                            metadata,
                        },
                    }),
                    YieldReason::Suspend,
                ),
                _ => (None, YieldReason::ToolUse),
            };
            if let Some(effect) = effect {
                result
                    .entries
                    .push(Entry::effect(cx.charter, effect, Some(source)));
            }
            result.yield_reason = reason;
            result.turn = turn;
        }
        None => {
            if let Some(t) = terminal {
                result.yield_reason = YieldReason::EndTurn;
                result.response = Some(t.text.clone());
            }
            if let Some(t) = &outcome.terminate {
                result.yield_reason = YieldReason::EndTurn;
                result.termination = Some(t.clone());
            }
        }
    }
    if let Some((tool, times)) = loop_stop {
        tracing::warn!(tool, times, "the loop guard ends the run");
        result.yield_reason = YieldReason::LoopDetected;
    }
    result
}

impl StandardExecutor {
    /// The usage limits' verdict on the leaf's model call over `messages`,
    /// whose estimated tokens `message_tokens` gives (kept incrementally:
    /// never a walk of the history): `Ok(None)` when it may be made (its
    /// estimate is then reserved for the step), else the limit it could
    /// pass.
    fn admit(
        &self,
        cx: &LeafContext<'_>,
        prepared: &Prepared,
        messages: &[Message],
        message_tokens: impl FnOnce() -> u64,
    ) -> Result<Option<LimitExceeded>, RunError> {
        let call = self.call(prepared);
        let verdict = admit_call(cx.usage, &self.prices, &call, || {
            // The framing (system prompt, tools) does not grow with the
            // conversation; the messages' sum is kept as they are appended.
            let framing = estimate_framing_tokens(&prepared.request(&[]));
            let input = framing.saturating_add(message_tokens());
            // Debug and test builds check the sum kept against the one
            // estimate, walked afresh.
            debug_assert_eq!(
                input,
                estimate_input_tokens(&prepared.request(messages)),
                "the incremental estimate of the request"
            );
            input
        })?;
        Ok(verdict.err())
    }

    /// The leaf's model call, as the usage limits and prices see it.
    fn call<'a>(&'a self, prepared: &'a Prepared) -> Call<'a> {
        Call {
            provider: self.model.provider_name(),
            settings: &prepared.settings,
            configured: self.model.model_name(),
        }
    }

    /// Reads the model's stream into `vessel`, reporting each delta, until
    /// the final answer.
    async fn read_stream(
        &self,
        request: ModelRequest<'_>,
        vessel: &mut VesselState,
        options: &StreamOptions,
    ) -> Result<ModelResponse, ModelError> {
        let mut events = self.model.stream(request);
        while let Some(event) = events.next().await {
            match event? {
                StreamEvent::Done(response) => return Ok(response),
                event => {
                    if let Some(update) = vessel.on_event(&event) {
                        (options.on_message_stream)(&update);
                    }
                }
            }
        }
        Err(ModelError::InvalidResponse(
            "the stream ended without a final message".into(),
        ))
    }

    /// The model call over `messages` (the history `id`, or a context
    /// view of it), streamed into a vessel when streaming is configured.
    async fn call_model(
        &self,
        cx: &LeafContext<'_>,
        prepared: &Prepared,
        messages: &[Message],
        id: HistoryId,
    ) -> Result<(ModelResponse, Option<VesselState>), RunError> {
        let request = prepared.request(messages).with_history_id(id);
        let model_error = |source| RunError::Model {
            step: cx.current_step,
            source,
        };
        let Some(options) = &self.streaming else {
            let response = self.model.complete(request).await.map_err(model_error)?;
            return Ok((response, None));
        };
        let mut vessel = VesselState::new(cx.source());
        let (message, event) = vessel.start();
        cx.queue.enqueue([message]);
        (options.on_message_stream)(&event);
        // Structured output is never streamed.
        let result = if prepared.output_schema.is_none() {
            self.read_stream(request, &mut vessel, options).await
        } else {
            self.model.complete(request).await
        };
        match result {
            Ok(response) => Ok((response, Some(vessel))),
            Err(error) => {
                let (message, event) = vessel.fail(error.to_string());
                cx.queue.enqueue([message]);
                (options.on_message_stream)(&event);
                Err(model_error(error))
            }
        }
    }
}

/// What [`StandardExecutor::call_in_context`] got.
enum Called {
    /// The model's answer (and the vessel it was streamed into).
    Answer(ModelResponse, Option<VesselState>),
    /// The model refused the request as too long for its context window,
    /// and no compaction could make it fit: the provider's message.
    Exhausted(String),
    /// A usage limit refused the next call (the summarizer's or the
    /// model's), which was not made.
    Limited(LimitExceeded),
}

/// What [`StandardExecutor::summarize`] did.
enum Summarized {
    /// The summary is in the view, and queued for the history.
    Done,
    /// The summarizer failed or wrote nothing: the view is as it was.
    Failed,
    /// Another leaf compacted the view while the summarizer ran: its
    /// summary is not used.
    Stale,
    /// A usage limit refused the summarizer's call, which was not made.
    Limited(LimitExceeded),
}

/// Whether `result` failed because the request does not fit the model's
/// context window; its message if so.
fn context_length<T>(result: &Result<T, RunError>) -> Option<String> {
    match result {
        Err(RunError::Model {
            source: ModelError::ContextLength(message),
            ..
        }) => Some(message.clone()),
        _ => None,
    }
}

impl StandardExecutor {
    /// The model call over what the leaf's context policy shows of the
    /// history (the node's policy, else the executor's), or over the whole
    /// history without one. A view past its summary threshold is
    /// summarized first. A request the model refuses as too long is
    /// compacted at once — everything before the current turn summarized
    /// or left out — and sent once more; without a policy, or when the
    /// current turn alone is too long, the answer is [`Called::Exhausted`].
    ///
    /// Every call — the summarizer's, the model's, the retry — is admitted
    /// by the usage limits right before it is made, with the estimate of
    /// what it sends (the view under a policy). A refused request's
    /// reservation stays for the rest of the step: providers do not bill
    /// a request refused as too long, so this errs on the side of
    /// spending less (a retry must fit beside it). What the summarizer's
    /// answered calls used is added to `spent`.
    async fn call_in_context(
        &self,
        cx: &LeafContext<'_>,
        prepared: &Prepared,
        spent: &mut markov_core::model::Usage,
    ) -> Result<Called, RunError> {
        let policy = cx
            .instance()
            .node()
            .context_policy()
            .or(self.context_policy.as_ref());
        let Some(policy) = policy else {
            let tokens = || cx.views.history_tokens(cx.history, cx.history_id);
            if let Some(limit) = self.admit(cx, prepared, cx.history, tokens)? {
                return Ok(Called::Limited(limit));
            }
            let result = self
                .call_model(cx, prepared, cx.history, cx.history_id)
                .await;
            if let Some(message) = context_length(&result) {
                return Ok(Called::Exhausted(message));
            }
            return result.map(|(response, vessel)| Called::Answer(response, vessel));
        };
        // The native summaries the model may be shown: its own vendor's,
        // under a policy that compacts natively.
        let reads = native_reads(policy, &*self.model);
        // A view the model counts within its threshold is sent as it is.
        let counted = self.within_by_count(cx, policy, prepared, reads).await;
        let view = match counted.map_or_else(
            || cx.views.prepare(policy, cx.history, reads),
            crate::context::Prepared::Ready,
        ) {
            crate::context::Prepared::Ready(view) => view,
            crate::context::Prepared::Summarize(job) => {
                match self.summarize(cx, policy, prepared, job, spent).await? {
                    Summarized::Limited(limit) => return Ok(Called::Limited(limit)),
                    Summarized::Failed => cx.views.summary_failed(policy),
                    Summarized::Done | Summarized::Stale => {}
                }
                cx.views.current(policy, cx.history, reads)
            }
        };
        if let Some(limit) = self.admit(cx, prepared, &view.messages, || view.tokens)? {
            return Ok(Called::Limited(limit));
        }
        let result = self.call_model(cx, prepared, &view.messages, view.id).await;
        let Some(message) = context_length(&result) else {
            return result.map(|(response, vessel)| Called::Answer(response, vessel));
        };
        drop(view);
        tracing::warn!(%message, "the model refused the context as too long: it is compacted and the call made again");
        match cx.views.force(policy, cx.history, reads) {
            Forced::Nothing => return Ok(Called::Exhausted(message)),
            Forced::Done => {}
            Forced::Summarize(job) => match self.summarize(cx, policy, prepared, job, spent).await?
            {
                Summarized::Limited(limit) => return Ok(Called::Limited(limit)),
                Summarized::Failed | Summarized::Stale => cx.views.drop_before_current(policy),
                Summarized::Done => {}
            },
        }
        let view = cx.views.current(policy, cx.history, reads);
        // A second request, admitted on its own estimate.
        if let Some(limit) = self.admit(cx, prepared, &view.messages, || view.tokens)? {
            return Ok(Called::Limited(limit));
        }
        let result = self.call_model(cx, prepared, &view.messages, view.id).await;
        if let Some(message) = context_length(&result) {
            return Ok(Called::Exhausted(message));
        }
        result.map(|(response, vessel)| Called::Answer(response, vessel))
    }

    /// Summarizes `job` with the policy's summarizer and puts the summary
    /// in the view; the summary message goes to the queue, so the step
    /// records it in the history. The summarizer's call passes the usage
    /// limits first, like any model call (its transcript and instructions
    /// estimated, its `max_tokens` counted in full, priced at its own
    /// model and provider), and what it used is added to `spent`. A failed
    /// summarizer is logged, and the view stays as it was.
    async fn summarize(
        &self,
        cx: &LeafContext<'_>,
        policy: &ContextPolicy,
        prepared: &Prepared,
        mut job: SummaryJob,
        spent: &mut markov_core::model::Usage,
    ) -> Result<Summarized, RunError> {
        let Some(summarize) = policy.summarize() else {
            return Ok(Summarized::Failed);
        };
        if summarize.is_native() {
            return self.compact(cx, policy, prepared, job, spent).await;
        }
        let model = summarize.model();
        let call = Call {
            provider: model.provider_name(),
            settings: summarize.model_settings(),
            configured: model.model_name(),
        };
        let messages = [Message::user(std::mem::take(&mut job.transcript))];
        let request = ModelRequest::new(
            summarize.instructions(),
            &messages,
            summarize.model_settings(),
        );
        if let Err(limit) = admit_call(cx.usage, &self.prices, &call, || {
            estimate_input_tokens(&request)
        })? {
            tracing::info!(%limit, "a usage limit refuses the summarizer's call: the leaf stops before it");
            return Ok(Summarized::Limited(limit));
        }
        let span = tracing::info_span!(
            "summarize",
            gen_ai.provider.name = call.provider,
            gen_ai.request.model = call.settings.model.as_deref().unwrap_or(""),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let answer = model.complete(request).instrument(span.clone()).await;
        let text = match answer {
            Ok(response) => {
                let used = metered(&self.prices, &call, &response);
                span.record("gen_ai.usage.input_tokens", used.input_tokens);
                span.record("gen_ai.usage.output_tokens", used.output_tokens);
                *spent += used;
                response
                    .content
                    .iter()
                    .filter_map(|item| match item {
                        Item::Text { text } => Some(text.as_str()),
                        _ => None,
                    })
                    .collect::<String>()
            }
            Err(error) => {
                span.record("error.type", "model_error");
                tracing::warn!(parent: &span, %error, "the summarizer failed: the context is not summarized");
                return Ok(Summarized::Failed);
            }
        };
        if text.trim().is_empty() {
            tracing::warn!(parent: &span, "the summarizer wrote nothing: the context is not summarized");
            return Ok(Summarized::Failed);
        }
        match cx.views.apply_summary(policy, job, text) {
            Some(message) => {
                cx.queue.enqueue([message]);
                Ok(Summarized::Done)
            }
            None => Ok(Summarized::Stale),
        }
    }
}

impl StandardExecutor {
    /// Compacts `job` with the vendor's own compaction
    /// ([`Model::compact`](markov_core::Model::compact) of the policy's
    /// model): the view's messages before the kept turns, as they are
    /// shown, with the leaf's instructions. The vendor's items go into the
    /// view in their place and, as a summary message, to the queue, so the
    /// step records them. The call passes the usage limits first, its
    /// input estimated and the settings' `max_tokens` counted for its
    /// answer, and what it used is added to `spent`.
    ///
    /// A model that offers no compaction, items of a vendor the leaf's
    /// model does not read (an executor configured by hand; an agent's
    /// builder refuses both) and a failed call are warned about and end
    /// as a failed summarizer does: the view stays as it was, and the
    /// policy backs off.
    async fn compact(
        &self,
        cx: &LeafContext<'_>,
        policy: &ContextPolicy,
        prepared: &Prepared,
        mut job: SummaryJob,
        spent: &mut markov_core::model::Usage,
    ) -> Result<Summarized, RunError> {
        let Some(summarize) = policy.summarize() else {
            return Ok(Summarized::Failed);
        };
        let model = summarize.model();
        // The leaf's own model name unless the policy names one: the
        // items are read by the leaf's model.
        let settings = ModelSettings {
            model: summarize
                .model_settings()
                .model
                .clone()
                .or_else(|| prepared.settings.model.clone()),
            ..summarize.model_settings().clone()
        };
        let call = Call {
            provider: model.provider_name(),
            settings: &settings,
            configured: model.model_name(),
        };
        let messages = std::mem::take(&mut job.messages);
        let request = ModelRequest::new(&prepared.system, &messages, &settings);
        if let Err(limit) = admit_call(cx.usage, &self.prices, &call, || {
            estimate_input_tokens(&request)
        })? {
            tracing::info!(%limit, "a usage limit refuses the compaction call: the leaf stops before it");
            return Ok(Summarized::Limited(limit));
        }
        let span = tracing::info_span!(
            "compact",
            gen_ai.provider.name = call.provider,
            gen_ai.request.model = call.settings.model.as_deref().unwrap_or(""),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        let compacted = match model.compact(request).instrument(span.clone()).await {
            Ok(Compaction::Compacted(compacted)) => compacted,
            Ok(_) => {
                span.record("error.type", "not_offered");
                if cx.views.native_unavailable(policy.id()) {
                    tracing::warn!(parent: &span, "the context policy's model offers no compaction of its own: the context is not compacted (warned once)");
                }
                return Ok(Summarized::Failed);
            }
            Err(error) => {
                span.record("error.type", "model_error");
                tracing::warn!(parent: &span, %error, "the compaction failed: the context is not compacted");
                return Ok(Summarized::Failed);
            }
        };
        let used = metered_usage(&self.prices, &call, compacted.usage, None);
        span.record("gen_ai.usage.input_tokens", used.input_tokens);
        span.record("gen_ai.usage.output_tokens", used.output_tokens);
        *spent += used;
        let vendor = compacted.native.vendor.clone();
        if self.model.native_summaries() != Some(vendor.as_str()) {
            span.record("error.type", "unreadable");
            if cx.views.native_unavailable(policy.id()) {
                tracing::warn!(parent: &span, vendor, "the compaction's items cannot be read by the leaf's model: the context is not compacted (warned once)");
            }
            return Ok(Summarized::Failed);
        }
        if compacted.native.items.is_empty() {
            tracing::warn!(parent: &span, "the compaction answered no items: the context is not compacted");
            return Ok(Summarized::Failed);
        }
        match cx.views.apply_native(policy, job, compacted.native) {
            Some(message) => {
                cx.queue.enqueue([message]);
                Ok(Summarized::Done)
            }
            None => Ok(Summarized::Stale),
        }
    }
}

impl StandardExecutor {
    /// Under a policy that counts with the provider
    /// ([`TokenCount::Provider`]): the leaf's view, to send as it is, when
    /// its estimate passes the summary threshold but the model's count of
    /// the request (remembered, plus the estimates since) does not. `None`
    /// when the estimate decides: it is within the threshold, the count
    /// passes it too, or no count could be had (a model that offers none,
    /// a failed count: warned about once per machine and policy).
    ///
    /// The count is not a billed call (see [`TokenCount::Provider`]): it
    /// is not checked against the usage limits nor accounted.
    async fn within_by_count(
        &self,
        cx: &LeafContext<'_>,
        policy: &ContextPolicy,
        prepared: &Prepared,
        reads: Option<&str>,
    ) -> Option<crate::context::ViewRef> {
        use crate::count::{Known, Unavailable};
        if policy.token_count() != TokenCount::Provider {
            return None;
        }
        let threshold = policy.summarize()?.threshold_tokens();
        let view = cx.views.summary_due(policy, cx.history, reads)?;
        let counts = &cx.views.counts;
        match counts.known(policy.id(), view.id, &view.messages, threshold) {
            Known::Within => return Some(view),
            Known::Estimate => return None,
            Known::Ask => {}
        }
        let span = tracing::info_span!(
            "count_view",
            gen_ai.provider.name = self.model.provider_name(),
            gen_ai.usage.input_tokens = tracing::field::Empty,
            threshold,
        );
        let request = prepared.request(&view.messages).with_history_id(view.id);
        let counted = self
            .model
            .count_tokens(request)
            .instrument(span.clone())
            .await;
        let (why, error) = match counted {
            Ok(InputTokenCount::Counted(tokens)) => {
                span.record("gen_ai.usage.input_tokens", tokens);
                counts.remember(policy.id(), view.id, view.messages.len(), tokens);
                return (tokens <= threshold).then_some(view);
            }
            Ok(_) => (Unavailable::NotOffered, None),
            Err(error) => (Unavailable::Failed, Some(error)),
        };
        let error = error.map(|e| e.to_string()).unwrap_or_default();
        if counts.unavailable(policy.id(), why) {
            tracing::warn!(parent: &span, ?why, %error, "no exact token count: the context policy's estimate decides when to summarize (warned once)");
        } else {
            tracing::debug!(parent: &span, ?why, %error, "no exact token count: the estimate decides");
        }
        None
    }
}

#[async_trait]
impl Executor for StandardExecutor {
    async fn run_leaf(&self, cx: LeafContext<'_>) -> Result<LeafOutcome, RunError> {
        let prepared = prepare(
            &cx,
            &self.settings,
            self.settings_given,
            self.model.as_ref(),
            self.registry.as_deref(),
        )?;
        // OpenTelemetry's GenAI conventions for a chat call; `otel.name` is
        // the span name an OpenTelemetry exporter shows.
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
        // An answer recorded before its tools ran, by a step that did not
        // finish (a crash, a failed write): the same calls with the same ids,
        // never a new model call that would make new ones.
        let recorded = cx
            .policy
            .answers()
            .find(cx.instance().id(), cx.history.len());
        let replayed = recorded.is_some();
        // A paused answer was counted by the step that asked for it.
        let resumed = replayed && cx.policy.answers().is_paused(cx.instance().id());
        let recorded = recorded.map(|mut response| {
            if resumed {
                apply_edits(&cx, &mut response);
            }
            response
        });
        // What the leaf's summarizer calls used, beside its model call.
        let mut spent = markov_core::model::Usage::default();
        let called = match recorded {
            Some(response) => {
                tracing::info!(parent: &span, "the recorded answer of an unfinished step is replayed");
                Ok((response, None))
            }
            None => {
                match self
                    .call_in_context(&cx, &prepared, &mut spent)
                    .instrument(span.clone())
                    .await
                {
                    Ok(Called::Answer(response, vessel)) => Ok((response, vessel)),
                    Ok(Called::Limited(limit)) => {
                        // The summary a summarizer made before is queued:
                        // the step records it; nothing else happened.
                        let mut stopped =
                            LeafOutcome::new(Vec::new(), YieldReason::UsageLimit, cx.turn);
                        stopped.usage_limit = Some(limit);
                        stopped.usage = spent;
                        return Ok(stopped);
                    }
                    Ok(Called::Exhausted(message)) => {
                        span.record("error.type", "context_length");
                        tracing::warn!(
                            parent: &span,
                            %message,
                            "the conversation does not fit the model's context window: the run ends"
                        );
                        let mut exhausted =
                            LeafOutcome::new(Vec::new(), YieldReason::ContextExhausted, cx.turn);
                        exhausted.usage = spent;
                        return Ok(exhausted);
                    }
                    Err(error) => Err(error),
                }
            }
        };
        let (response, vessel) = match called {
            Ok(answer) => answer,
            Err(error) => {
                span.record("error.type", "model_error");
                return Err(error);
            }
        };
        if !replayed && response.tool_calls().next().is_some() {
            // Durable before the first tool runs: a resumed step must answer
            // these calls, not ask the model for new ones.
            let answer = RecordedAnswer {
                instance: cx.instance().id().clone(),
                history_len: u64::try_from(cx.history.len()).unwrap_or(u64::MAX),
                response: response.clone(),
                paused: false,
            };
            if let Err(reason) = cx.policy.record_answer(answer).await {
                span.record("error.type", "journal_error");
                return Err(RunError::AnswerNotRecorded {
                    step: cx.current_step,
                    reason,
                });
            }
        }
        let mut usage = if resumed {
            markov_core::model::Usage::default()
        } else {
            metered(&self.prices, &self.call(&prepared), &response)
        };
        usage += spent;
        span.record("gen_ai.usage.input_tokens", usage.input_tokens);
        span.record("gen_ai.usage.output_tokens", usage.output_tokens);
        let model = response.model.clone();
        if let Some(model) = &model {
            span.record("gen_ai.response.model", model.as_str());
        }
        span.record(
            "gen_ai.response.finish_reasons",
            tracing::field::debug([&response.stop_reason]),
        );
        if self.capture_content
            && !span.is_disabled()
            && let Ok(json) = serde_json::to_string(&response.content)
        {
            span.record("gen_ai.output.messages", json.as_str());
        }
        let errors = match self.registry {
            Some(_) => ErrorFormat::Envelope,
            None => ErrorFormat::PlainText,
        };
        let mut after = interpret(&cx, response, errors);
        let vessel_id = vessel.as_ref().map(|v| v.message_id().clone());
        if let Some(mut vessel) = vessel
            && let Some(event) = finalize_vessel(&mut vessel, &mut after)
            && let Some(options) = &self.streaming
        {
            (options.on_message_stream)(&event);
        }
        let (entries, refused) = match after {
            AfterModel::Finish(mut outcome) => {
                outcome.usage = usage;
                outcome.model = model;
                return Ok(outcome);
            }
            AfterModel::RunTools { entries, refused } => (entries, refused),
        };
        let calls = Calls::of(&entries, &refused);
        let ancestors = ancestor_views(&cx);
        let packs = pack_states(&cx);
        let turn = cx.policy.budgets().for_leaf(cx.instance().id());
        let view = LeafView {
            charter: cx.charter,
            node: cx.instance().node(),
            instance_id: cx.instance().id(),
            root_id: cx.root().id(),
            state: cx.instance().state(),
            ancestors: &ancestors,
            pack_states: &packs,
            is_worker: cx.is_worker(),
            history: cx.history,
            terminate_message: cx.terminate_message,
            policies: self
                .registry
                .as_deref()
                .map(|binding| binding.session(&turn, cx.policy)),
            // Without a registry, the plain path still keeps this
            // conversation's ledger, so a resumed step never runs a
            // completed call again.
            conversation: Some(cx.policy),
            repeats: Some(cx.policy.repeats()),
            loop_guard: cx
                .instance()
                .node()
                .loop_guard()
                .unwrap_or_else(|| cx.charter.loop_guard()),
            capture_content: self.capture_content,
        };
        // Taken before any call counts: a step that pauses puts the counters
        // back, since resuming replays its calls.
        let mark = cx.policy.mark_leaf(cx.instance().id());
        let log = CallLog::new();
        let in_flight = ToolsInFlight {
            queue: cx.queue,
            calls: &calls,
            log: &log,
            recorded: Some((&entries, &refused)),
            source: cx.source(),
            resumed: resumed.then(|| (cx.policy, cx.instance().id())),
        };
        let mut outcome = run_tool_calls_logged(&view, &calls, &log).await;
        in_flight.disarm();
        drop(calls);
        if !outcome.awaiting.is_empty() {
            // Nothing of the step is recorded: the answer waits, paused,
            // with the calls that ran in the ledger, until the application
            // has decided and the step is resumed.
            tracing::info!(
                parent: &span,
                waiting = outcome.awaiting.len(),
                "calls wait for the application's approval: the step pauses"
            );
            cx.policy.rewind_leaf(mark);
            cx.policy.answers().set_paused(cx.instance().id(), true);
            if let Some(id) = &vessel_id {
                cx.queue.remove_message(id);
            }
            let mut paused = LeafOutcome::new(Vec::new(), YieldReason::AwaitingApproval, cx.turn);
            paused.usage = usage;
            paused.model = model;
            return Ok(paused);
        }
        cx.policy.answers().set_paused(cx.instance().id(), false);
        outcome
            .result_states_known
            .extend(refused.iter().map(|_| true));
        outcome.results.extend(refused);
        let mut outcome = match after_tools(&cx, entries, outcome) {
            AfterTools::Finish(outcome) => outcome,
            AfterTools::Transition(pending) => {
                let span = tracing::info_span!("transition", name = %pending.name);
                let result = take_transition(
                    cx.charter,
                    cx.instance().node(),
                    &pending.state,
                    &pending.name,
                    &pending.reason,
                    &pending.args,
                )
                .instrument(span)
                .await;
                after_transition(&cx, *pending, result)
            }
        };
        outcome.usage = usage;
        outcome.model = model;
        Ok(outcome)
    }
}

/// Rewrites the calls of a resumed answer whose arguments the application
/// edited: the history records each call with the arguments it ran with.
/// The answer was never recorded in the history, so nothing recorded is
/// rewritten.
fn apply_edits(cx: &LeafContext<'_>, response: &mut ModelResponse) {
    for item in &mut response.content {
        if let Item::ToolUse { id, name, input } = item
            && let Some(args) = cx.policy.edited_args(cx.instance().id(), id, name)
        {
            *input = args;
        }
    }
}

/// A response whose tools are running. Dropped armed — the run was
/// cancelled (dropped, an outer timeout) while a tool ran — it enqueues the
/// assistant message with one result per call: the result of each call that
/// completed, [`CANCELLED_TOOL_CALL`] for the others. The next run records
/// them, so a call that ran is never missing from the history.
struct ToolsInFlight<'a> {
    queue: &'a Queue,
    calls: &'a [ToolCall<'a>],
    log: &'a CallLog,
    /// The entries so far and the refused calls' results, until disarmed.
    recorded: Option<(&'a [Entry], &'a [ToolExecutionResult])>,
    source: Source,
    /// Set when the response is a paused answer being resumed: its record
    /// goes once the cancelled step's entries are queued, since they
    /// record the answer (replaying it again would record it twice).
    resumed: Option<(&'a markov_policy::PolicyState, &'a markov_core::InstanceId)>,
}

impl ToolsInFlight<'_> {
    fn disarm(mut self) {
        self.recorded = None;
    }
}

impl Drop for ToolsInFlight<'_> {
    fn drop(&mut self) {
        let Some((entries, refused)) = self.recorded.take() else {
            return;
        };
        // Copied only here, on cancellation: the step itself never copies
        // its messages.
        let mut entries = entries.to_vec();
        let results: Vec<Item> = self
            .calls
            .iter()
            .map(|call| {
                self.log
                    .result_of(call.id)
                    .unwrap_or_else(|| {
                        ToolExecutionResult::error(call.id.clone(), CANCELLED_TOOL_CALL)
                    })
                    .to_item(true)
            })
            .chain(refused.iter().map(|r| r.to_item(true)))
            .collect();
        tracing::warn!(
            calls = self.calls.len(),
            "run cancelled while tools ran: the calls are recorded with the results they had"
        );
        entries.push(Entry::message(with_source(
            Message::user_items(results),
            &self.source,
        )));
        self.queue.enqueue_entries(entries);
        if let Some((policy, instance)) = self.resumed {
            policy.abandon_paused(instance);
        }
    }
}

/// The ids of the calls of one response so far, to make a repeated one
/// unique. A model can repeat one id thousands of times in one response:
/// a set, and a counter per repeated id that resumes where the last
/// search stopped, keep the renaming linear in the number of calls.
#[derive(Default)]
struct CallIds {
    taken: HashSet<ToolCallId>,
    /// Per repeated id, the first suffix not yet tried.
    next: HashMap<ToolCallId, u64>,
}

impl CallIds {
    fn contains(&self, id: &ToolCallId) -> bool {
        self.taken.contains(id)
    }

    fn insert(&mut self, id: ToolCallId) {
        self.taken.insert(id);
    }

    /// `id` with the first numeric suffix from 2 (`id_2`, `id_3`, ...) that
    /// no earlier call has. A suffix tried stays taken (ids are only ever
    /// added), so the next search for `id` starts after it.
    fn unique(&mut self, id: &ToolCallId) -> ToolCallId {
        let n = self.next.entry(id.clone()).or_insert(2);
        loop {
            let candidate = ToolCallId::new(format!("{id}_{n}"));
            *n = n.saturating_add(1);
            if !self.taken.contains(&candidate) {
                return candidate;
            }
        }
    }
}

/// The calls to run of a response [`interpret`] returned as
/// [`AfterModel::RunTools`]: the assistant message's `tool_use` items
/// (the first entry), but those answered without running (`refused`),
/// borrowed from the message.
pub(crate) fn tool_calls<'a>(
    entries: &'a [Entry],
    refused: &[ToolExecutionResult],
) -> Vec<ToolCall<'a>> {
    calls_iter(entries, refused).collect()
}

fn calls_iter<'a>(
    entries: &'a [Entry],
    refused: &[ToolExecutionResult],
) -> impl Iterator<Item = ToolCall<'a>> {
    // A set, not a scan per call: a response can repeat one id thousands
    // of times, and every repeat is refused.
    let refused: HashSet<ToolCallId> = refused.iter().map(|r| r.call_id.clone()).collect();
    entries
        .first()
        .into_iter()
        .flat_map(|first| ToolCall::all_in(&first.message))
        .filter(move |c| !refused.contains(c.id))
}

/// A response's calls: most responses make one, which needs no list.
enum Calls<'a> {
    One([ToolCall<'a>; 1]),
    Many(Vec<ToolCall<'a>>),
}

impl<'a> Calls<'a> {
    fn of(entries: &'a [Entry], refused: &[ToolExecutionResult]) -> Self {
        let mut calls = calls_iter(entries, refused);
        match (calls.next(), calls.next()) {
            (Some(only), None) => Calls::One([only]),
            (first, second) => Calls::Many(first.into_iter().chain(second).chain(calls).collect()),
        }
    }
}

impl<'a> std::ops::Deref for Calls<'a> {
    type Target = [ToolCall<'a>];

    fn deref(&self) -> &Self::Target {
        match self {
            Calls::One(one) => one,
            Calls::Many(many) => many,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The renaming as it was first written (a scan of the earlier calls per
    /// candidate): the names the linear one must reproduce.
    fn reference(ids: &[(&str, bool)]) -> Vec<String> {
        let mut out: Vec<(String, bool)> = Vec::new();
        for (id, provider) in ids {
            let taken = |c: &str| out.iter().any(|(o, call)| *call && o == c);
            if taken(id) {
                let unique = (2..)
                    .map(|n| format!("{id}_{n}"))
                    .find(|c| !taken(c))
                    .unwrap_or_default();
                out.push((unique, true));
            } else {
                out.push(((*id).to_owned(), !provider));
            }
        }
        out.into_iter().map(|(id, _)| id).collect()
    }

    fn renamed(ids: &[(&str, bool)]) -> (Vec<Item>, Vec<ToolExecutionResult>) {
        let mut items: Vec<Item> = ids
            .iter()
            .map(|(id, provider)| {
                let name = if *provider { "web_search" } else { "pay" };
                Item::tool_use(*id, name, serde_json::json!({}))
            })
            .collect();
        let refused = screen_calls(
            &mut items,
            &[ToolName::new("web_search").expect("a tool name")],
            ErrorFormat::PlainText,
        );
        (items, refused)
    }

    fn id_of(item: &Item) -> String {
        match item {
            Item::ToolUse { id, .. } | Item::ProviderToolUse { id, .. } => id.to_string(),
            other => panic!("not a call: {other:?}"),
        }
    }

    proptest! {
        #[test]
        fn repeated_ids_get_the_same_unique_names_as_before(
            picks in proptest::collection::vec((0usize..6, proptest::bool::weighted(0.1)), 0..40)
        ) {
            const IDS: [&str; 6] = ["a", "a_2", "a_3", "a_2_2", "b", "b_2"];
            let ids: Vec<(&str, bool)> = picks.iter().map(|(i, p)| (IDS[*i], *p)).collect();
            let (items, refused) = renamed(&ids);
            let names: Vec<String> = items.iter().map(id_of).collect();
            prop_assert_eq!(&names, &reference(&ids));
            let calls: Vec<&String> = items
                .iter()
                .zip(&names)
                .filter(|(i, _)| matches!(i, Item::ToolUse { .. }))
                .map(|(_, n)| n)
                .collect();
            let unique: HashSet<&String> = calls.iter().copied().collect();
            prop_assert_eq!(unique.len(), calls.len(), "call ids are unique");
            // Each refused result answers one renamed call; the others run.
            let refused_ids: HashSet<String> =
                refused.iter().map(|r| r.call_id.to_string()).collect();
            prop_assert_eq!(refused_ids.len(), refused.len());
            prop_assert!(refused_ids.iter().all(|r| unique.contains(r)));
        }
    }

    #[test]
    fn arguments_too_deep_are_recorded_as_an_empty_object_and_refused() {
        let mut deep = Value::Object(serde_json::Map::new());
        for _ in 0..MAX_ARGUMENT_DEPTH {
            let mut outer = serde_json::Map::new();
            outer.insert("a".to_owned(), deep);
            deep = Value::Object(outer);
        }
        let mut items = vec![
            Item::tool_use("c1", "pay", deep.clone()),
            Item::tool_use("c1", "pay", deep.clone()),
            Item::tool_use("c2", "web_search", deep.clone()),
            Item::tool_use("c3", "pay", serde_json::json!({"a": 1})),
        ];
        let refused = screen_calls(
            &mut items,
            &[ToolName::new("web_search").expect("a tool name")],
            ErrorFormat::Envelope,
        );
        let empty = serde_json::json!({});
        for item in &items[..3] {
            match item {
                Item::ToolUse { input, .. } | Item::ProviderToolUse { input, .. } => {
                    assert_eq!(*input, empty);
                }
                other => panic!("not a call: {other:?}"),
            }
        }
        assert!(matches!(&items[2], Item::ProviderToolUse { .. }));
        let ids: Vec<&str> = refused.iter().map(|r| r.call_id.as_str()).collect();
        assert_eq!(ids, ["c1", "c1_2"], "c3 runs; the provider answered c2");
        assert!(
            refused[0].content.contains("INVALID_INPUT"),
            "{}",
            refused[0].content
        );
        assert_eq!(refused[1].content, DUPLICATE_TOOL_CALL);
    }

    #[test]
    fn twenty_thousand_repeats_of_one_id_are_numbered_in_order() {
        let ids = vec![("dup", false); 20_000];
        let (items, refused) = renamed(&ids);
        assert_eq!(id_of(&items[0]), "dup");
        assert_eq!(id_of(&items[1]), "dup_2");
        assert_eq!(id_of(&items[19_999]), "dup_20000");
        assert_eq!(refused.len(), 19_999);
    }
}
