//! [`StandardExecutor`]: one model call per leaf per step, over any [`Model`].
//!
//! [`StandardExecutor::run_leaf`] is the step as five named phases, one
//! file each:
//!
//! 1. `prepare`: system prompt, tools, tool choice, settings ([`prepare`]);
//! 2. `call`: the recorded answer of an unfinished step replayed, else the
//!    model called over what the context policy shows, each call admitted
//!    by the usage limits first (the compaction it may need is
//!    `markov_context::call_in_view`'s);
//! 3. `record`: an answer with calls made durable before any tool runs,
//!    its usage metered, the answer interpreted ([`interpret`]);
//! 4. `tools`: the calls through the tool pipeline, a pause for approvals,
//!    every call answered even when the run is cancelled;
//! 5. `settle`: the pipeline's outcome in emission order and a queued
//!    transition ([`after_tools`], [`after_transition`]).
//!
//! The rules (terminal tools, termination, restriction, tool choice) are
//! pure functions over plain values, testable without a runtime; the
//! phases are the async glue around them.
//!
//! With streaming configured ([`StandardExecutor::with_streaming`]) the model
//! call follows the vessel protocol of [`crate::stream`]: the (empty) vessel
//! is enqueued while the leaf runs, through [`LeafContext::queue`]; its final
//! version replaces it as the first entry of the outcome ([`finalize_vessel`]),
//! so it reaches the queue in one batch with its tool results. A run dropped
//! while tools run therefore leaves only the empty vessel behind, never a tool
//! call without its result.

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use markov_charter::ConfigError;
use markov_charter::context::ContextPolicy;
use markov_charter::toolgen::generate_tools_cached;
use markov_context::Prices;
use markov_core::message::{Message, Metadata, Source};
use markov_core::model::{Model, ModelSettings};
use markov_policy::{Mode, RegistryBinding, ToolRegistry};

use crate::error::RunError;
use crate::executor::{Executor, LeafContext, LeafOutcome};
use crate::stream::{MessageStreamEvent, StreamOptions};
use call::Reply;
use record::Recorded;
use settle::{Settled, settled};
use tools::ToolsRan;

mod call;
pub(crate) mod guard;
mod prepare;
mod record;
mod settle;
mod tools;

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
    /// The guards; `None` (the default) costs a step nothing.
    guards: Option<Arc<markov_guard::Guards>>,
    /// Nodes' own guards, each with the agent's followed by the node's;
    /// `None` (the default) costs a step nothing.
    node_guards: Option<Arc<NodeGuards>>,
    /// Set on a guarded leaf's own copy only: its streamed text held back.
    hold: Option<Arc<guard::HoldBack>>,
    /// Where the guards' rewrites and blocks are audited, when set
    /// ([`Self::with_guard_audit`]); else the registry's audit sink.
    guard_audit: Option<Arc<dyn markov_policy::AuditSink>>,
}

/// Nodes' own guards: for each node, its own and the stack its leaves run
/// (the agent's guards, then its own).
type NodeGuards = std::collections::HashMap<
    markov_core::NodeId,
    (markov_guard::Guards, Arc<markov_guard::Guards>),
>;

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
            guards: None,
            node_guards: None,
            hold: None,
            guard_audit: None,
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
    /// [`YieldReason::ContextExhausted`](crate::YieldReason::ContextExhausted).
    #[must_use]
    pub fn with_context_policy(mut self, policy: ContextPolicy) -> Self {
        self.context_policy = Some(policy);
        self
    }

    /// Checks what goes in and what comes out with `guards` (see
    /// [`markov_guard`]): each user message, before it enters the history
    /// (or beside the turn's first model call:
    /// [`Guards::concurrent_input`](markov_guard::Guards::concurrent_input));
    /// the answer, streamed text held back until the output guards passed
    /// it; each call's arguments; each tool result. A block ends the run
    /// with [`YieldReason::Blocked`](crate::YieldReason::Blocked). Guards
    /// with no guard in them are the same as none.
    #[must_use]
    pub fn with_guards(mut self, guards: markov_guard::Guards) -> Self {
        self.guards = (!guards.is_empty()).then(|| Arc::new(guards));
        if let Some(nodes) = self.node_guards.take() {
            let own = Arc::unwrap_or_clone(nodes)
                .into_iter()
                .map(|(id, (own, _))| (id, own));
            self.node_guards = Some(Arc::new(self.joined(own)));
        }
        self
    }

    /// Hands every rewrite and block of the guards to `sink`
    /// ([`AuditSink::guard`](markov_policy::AuditSink::guard)), whether or
    /// not the executor runs tools under the policy pipeline. Without it,
    /// they go to the audit sink of the registry's policies, if any (and
    /// are traced either way).
    #[must_use]
    pub fn with_guard_audit(mut self, sink: Arc<dyn markov_policy::AuditSink>) -> Self {
        self.guard_audit = Some(sink);
        self
    }

    /// Guards of `node`'s own: its leaves run the agent's guards
    /// ([`Self::with_guards`]) and then these, in each stack (a node
    /// cannot turn the agent's guards off). The node's input guards check
    /// a user message when the message goes to a leaf of the node. Given
    /// twice for a node, the second replaces the first.
    #[must_use]
    pub fn with_node_guards(
        mut self,
        node: &markov_charter::node::Node,
        guards: markov_guard::Guards,
    ) -> Self {
        let mut own: Vec<_> = self
            .node_guards
            .take()
            .map(|nodes| {
                Arc::unwrap_or_clone(nodes)
                    .into_iter()
                    .map(|(id, (own, _))| (id, own))
                    .collect()
            })
            .unwrap_or_default();
        own.retain(|(id, _)| id != node.id());
        own.push((node.id().clone(), guards));
        self.node_guards = Some(Arc::new(self.joined(own)));
        self
    }

    /// Each node's own guards with the stacks its leaves run.
    fn joined(
        &self,
        own: impl IntoIterator<Item = (markov_core::NodeId, markov_guard::Guards)>,
    ) -> NodeGuards {
        own.into_iter()
            .map(|(id, own)| {
                let agent = self.guards.as_deref().cloned().unwrap_or_default();
                let joined = Arc::new(agent.then(&own));
                (id, (own, joined))
            })
            .collect()
    }

    /// The guards a leaf of `node` runs: the node's joined with the
    /// agent's, else the agent's.
    fn guards_of(&self, node: &markov_charter::node::Node) -> Option<&Arc<markov_guard::Guards>> {
        if let Some(nodes) = &self.node_guards
            && let Some((_, joined)) = nodes.get(node.id())
        {
            return (!joined.is_empty()).then_some(joined);
        }
        self.guards.as_ref()
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
                // The deferred tools too: any may be found and offered.
                tools = binding.all_tools(&tools);
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

fn with_source(message: Message, source: &Source) -> Message {
    message.with_metadata(Metadata::with_source(source.clone()))
}

#[async_trait]
impl Executor for StandardExecutor {
    /// The input guards, unless they run beside the model call
    /// ([`Guards::concurrent_input`](markov_guard::Guards::concurrent_input)).
    fn input_guard(
        &self,
        node: &markov_charter::node::Node,
    ) -> Option<crate::executor::InputGuard> {
        let guards = self.guards_of(node)?;
        (!guards.is_input_concurrent() && !guards.input.is_empty()).then(|| {
            crate::executor::InputGuard::new(guards.input.clone())
                .audited(self.audit_sink().cloned())
        })
    }

    /// `false` when any output guard runs (the agent's or a node's): the
    /// guards check streamed thinking, never the thinking the history
    /// keeps as the provider signed it.
    fn shows_stored_thinking(&self) -> bool {
        let checked = |guards: &markov_guard::Guards| !guards.output.is_empty();
        !(self.guards.as_deref().is_some_and(checked)
            || self
                .node_guards
                .as_deref()
                .is_some_and(|nodes| nodes.values().any(|(_, joined)| checked(joined))))
    }

    /// One leaf's step, phase by phase. The order is behaviour: a replayed
    /// answer is never asked of the model again, an answer with calls is
    /// durable before the first tool runs, its usage is counted before the
    /// tools (so a step that pauses for approvals reports it), and every
    /// call gets exactly one result, a cancelled run's included.
    async fn run_leaf(&self, cx: LeafContext<'_>) -> Result<LeafOutcome, RunError> {
        if let Some(guards) = self.guards_of(cx.instance().node()) {
            // Boxed: the guarded step does not enlarge the plain one.
            return Box::pin(self.run_guarded(cx, guards)).await;
        }
        if cx.record_calls {
            // Boxed: a machine that does not record its calls carries
            // neither the clock nor the call's description.
            return Box::pin(self.run_recorded(cx)).await;
        }
        let prepared = self.prepare(&cx)?;
        let span = self.chat_span(&cx, &prepared);
        let answer = match self.call_or_replay(&cx, &prepared, &span).await? {
            Reply::Answer(answer) => answer,
            Reply::Stopped(outcome) => return Ok(outcome),
        };
        self.finish_leaf(&cx, &prepared, answer, &span, None).await
    }
}

impl StandardExecutor {
    /// [`run_leaf`](Executor::run_leaf) of a machine that records its
    /// calls: the same phases, timed, the outcome saying what the model
    /// call was made of ([`LeafOutcome::call`]).
    async fn run_recorded(&self, cx: LeafContext<'_>) -> Result<LeafOutcome, RunError> {
        let prepared = self.prepare(&cx)?;
        let span = self.chat_span(&cx, &prepared);
        let started = std::time::Instant::now();
        let history_len = cx.history.len();
        let answer = match self.call_or_replay(&cx, &prepared, &span).await? {
            Reply::Answer(answer) => answer,
            Reply::Stopped(outcome) => return Ok(outcome),
        };
        let answered = std::time::Instant::now();
        let replayed = answer.replayed;
        let traces = crate::respond::pipeline::CallTraces::default();
        let mut outcome = self
            .finish_leaf(&cx, &prepared, answer, &span, Some(&traces))
            .await?;
        let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let node = cx.instance().node();
        // A call under a context policy whose view altered nothing was
        // sent the history as it is; else the view's shape says what it
        // was sent, to rebuild its request.
        let (context_view, view) = match node.context_policy().or(self.context_policy.as_ref()) {
            Some(policy) if !cx.views.shows_history_as_is(policy) => {
                (true, cx.views.view_shape(policy))
            }
            _ => (false, None),
        };
        outcome.call = Some(Box::new(crate::step::ModelCall {
            instance: cx.instance().id().to_string(),
            node: node
                .name()
                .map_or_else(|| node.id().to_string(), str::to_owned),
            system: Arc::from(prepared.system.as_str()),
            tools: Arc::clone(&prepared.tools),
            provider_tools: prepared.provider_tools.clone(),
            tool_choice: prepared.tool_choice.clone(),
            settings: prepared.settings.clone(),
            output_schema: prepared.output_schema.clone(),
            history_len: history_len as u64,
            context_view,
            view,
            turn: cx.turn,
            replayed,
            model_ms: millis(answered.duration_since(started)),
            tools_ms: millis(answered.elapsed()),
            tool_calls: traces.take(),
        }));
        Ok(outcome)
    }

    /// The step after the answer: record it, run its tools, settle.
    async fn finish_leaf(
        &self,
        cx: &LeafContext<'_>,
        prepared: &prepare::Prepared,
        answer: call::Answer,
        span: &tracing::Span,
        traces: Option<&crate::respond::pipeline::CallTraces>,
    ) -> Result<LeafOutcome, RunError> {
        let calls = match self.record(cx, prepared, answer, span).await? {
            Recorded::Finished(outcome) => return Ok(outcome),
            Recorded::Calls(calls) => calls,
        };
        let ran = match self.run_tools(cx, calls, span, traces).await {
            ToolsRan::Paused(outcome) => return Ok(outcome),
            ToolsRan::Done(ran) => ran,
        };
        Ok(match settled(cx, ran) {
            Settled::Done(outcome) => outcome,
            // Boxed: a transition is rare, and its future would enlarge
            // every step's.
            Settled::Transition(pending, metered) => {
                Box::pin(settle::transition(cx, pending, metered)).await
            }
        })
    }
}
