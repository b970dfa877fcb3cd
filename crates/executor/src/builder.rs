//! [`MachineBuilder`]: a machine in one expression — the charter, its root
//! node (named once), the model, and optionally a tool registry.

use std::sync::Arc;

use markov_core::model::{Model, ModelSettings};
use markov_policy::{Mode, ToolRegistry};
use markov_runtime::charter::{Charter, CharterBuilder};
use markov_runtime::node::Node;
use serde_json::Value;

use crate::error::RunError;
use crate::executor::Executor;
use crate::instance::Instance;
use crate::machine::Machine;
use crate::run::{RunOptions, run_to_completion};
use crate::standard::StandardExecutor;
use crate::step::MachineStep;

/// Builds a [`Machine`]: see [`Machine::builder`].
pub struct MachineBuilder {
    charter: CharterBuilder,
    root: Option<(String, Node)>,
    start: Option<String>,
    state: Option<Value>,
    model: Option<Arc<dyn Model>>,
    executor: Option<Arc<dyn Executor>>,
    settings: Option<ModelSettings>,
    registry: Option<(Arc<ToolRegistry>, Mode)>,
}

impl std::fmt::Debug for MachineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MachineBuilder")
            .field("root", &self.root.as_ref().map(|(n, _)| n))
            .field("start", &self.start)
            .field("model", &self.model.is_some())
            .field("executor", &self.executor.is_some())
            .finish_non_exhaustive()
    }
}

impl Machine {
    /// A machine on a charter named `name`.
    ///
    /// The first node added is the root unless [`start`](MachineBuilder::start)
    /// names another; its state is [`state`](MachineBuilder::state), else
    /// the node's initial state, else `{}`. A model makes the standard
    /// executor ([`model`](MachineBuilder::model)); any executor will do
    /// ([`executor`](MachineBuilder::executor)).
    ///
    /// ```
    /// use markov_executor::{Machine, RunOptions};
    /// use markov_runtime::node::Node;
    /// use markov_testkit::ScriptedModel;
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let mut machine = Machine::builder("greeter")
    ///     .node("greet", Node::builder("Greet the user.").build().unwrap())
    ///     .model(ScriptedModel::builder().text("Hello!").build())
    ///     .build()
    ///     .unwrap();
    /// machine.enqueue_user("hi");
    /// let last = machine.run(RunOptions::default()).await.unwrap();
    /// assert!(last.done);
    /// # });
    /// ```
    pub fn builder(name: impl Into<String>) -> MachineBuilder {
        MachineBuilder {
            charter: Charter::builder(name),
            root: None,
            start: None,
            state: None,
            model: None,
            executor: None,
            settings: None,
            registry: None,
        }
    }

    /// Runs the machine to the end of the turn and returns the last step
    /// (`run_to_completion`). Input must be enqueued first.
    ///
    /// A run ends with a step whose yield reason is
    /// [`AwaitingApproval`](crate::YieldReason::AwaitingApproval) when calls
    /// need the application's approval; while it waits, new input is
    /// refused with [`RunError::AwaitingApproval`] (it stays queued).
    pub async fn run(&mut self, options: RunOptions) -> Result<MachineStep, RunError> {
        run_to_completion(self, options).await
    }

    /// Resumes the step that waits for approval, once the application has
    /// decided its calls ([`Machine::approvals`]), and runs to the end of
    /// the turn; returns the last step.
    ///
    /// No model is called before the calls are answered: the paused
    /// answers are replayed, the calls that ran before the pause are
    /// answered from the ledger, each approved call runs once with the
    /// arguments approved, and the denied, answered and expired ones get
    /// their results; then the model reads them all. A call still undecided
    /// pauses the run again. Input queued while the step waited stays
    /// queued for the next run. [`RunError::NotAwaitingApproval`] when no
    /// step waits.
    pub async fn resume(&mut self, options: RunOptions) -> Result<MachineStep, RunError> {
        crate::run::resume_to_completion(self, options).await
    }

    /// Whether a step waits for the application's approval of its calls
    /// (and for [`resume`](Self::resume)).
    pub fn is_awaiting_approval(&self) -> bool {
        if !self.policy.is_paused() {
            return false;
        }
        let paused = self.policy.answers().paused();
        let mut waiting = false;
        self.root.for_each_active_leaf(&mut |leaf| {
            waiting |= paused.contains(leaf.leaf().id());
        });
        waiting
    }

    /// The active leaves whose answer is paused. A paused answer whose leaf
    /// left the tree (a command, say) can never be resumed: it is dropped
    /// here, with the requests of its calls (none of them is recorded).
    pub(crate) fn paused_leaves(&self) -> Vec<markov_core::InstanceId> {
        let paused = self.policy.answers().paused();
        if paused.is_empty() {
            return paused;
        }
        let mut active = Vec::new();
        self.root
            .for_each_active_leaf(&mut |leaf| active.push(leaf.leaf().id().clone()));
        for gone in paused.iter().filter(|i| !active.contains(i)) {
            tracing::warn!(instance = %gone, "a paused answer's leaf is gone: it is dropped");
            self.policy.abandon_paused(gone);
        }
        paused.into_iter().filter(|i| active.contains(i)).collect()
    }
}

impl MachineBuilder {
    /// Registers `node` as `name`; the first node is the root.
    #[must_use]
    pub fn node(mut self, name: impl Into<String>, node: Node) -> Self {
        let name = name.into();
        if self.root.is_none() {
            self.root = Some((name.clone(), node.clone()));
        }
        self.charter = self.charter.node(name, node);
        self
    }

    /// Starts at the node registered as `name` instead of the first.
    #[must_use]
    pub fn start(mut self, name: impl Into<String>) -> Self {
        self.start = Some(name.into());
        self
    }

    /// The root's state (else its node's initial state, else `{}`).
    #[must_use]
    pub fn state(mut self, state: Value) -> Self {
        self.state = Some(state);
        self
    }

    /// More of the charter: packs, charter tools, transitions by reference.
    #[must_use]
    pub fn charter(mut self, f: impl FnOnce(CharterBuilder) -> CharterBuilder) -> Self {
        self.charter = f(self.charter);
        self
    }

    /// Runs the standard executor over `model`.
    #[must_use]
    pub fn model(self, model: impl Model + 'static) -> Self {
        self.shared_model(Arc::new(model))
    }

    /// Runs the standard executor over a shared model.
    #[must_use]
    pub fn shared_model(mut self, model: Arc<dyn Model>) -> Self {
        self.model = Some(model);
        self
    }

    /// Default model settings of the standard executor.
    #[must_use]
    pub fn settings(mut self, settings: ModelSettings) -> Self {
        self.settings = Some(settings);
        self
    }

    /// Sends tool calls through `registry` in `mode` (standard executor).
    #[must_use]
    pub fn registry(mut self, registry: Arc<ToolRegistry>, mode: Mode) -> Self {
        self.registry = Some((registry, mode));
        self
    }

    /// Uses `executor` instead of the standard one.
    #[must_use]
    pub fn executor(mut self, executor: impl Executor + 'static) -> Self {
        self.executor = Some(Arc::new(executor));
        self
    }

    /// Builds the charter and the machine.
    pub fn build(self) -> Result<Machine, RunError> {
        let charter = self.charter.build()?;
        let (name, node) = match (&self.start, self.root) {
            (Some(start), _) => {
                let node = charter.node(start).cloned().ok_or_else(|| {
                    RunError::Executor(format!("no node named {start:?} to start at"))
                })?;
                (start.clone(), node)
            }
            (None, Some(root)) => root,
            (None, None) => {
                return Err(RunError::Executor(
                    "a machine needs a node: call `node` on the builder".into(),
                ));
            }
        };
        let executor = match (self.executor, self.model) {
            (Some(executor), _) => executor,
            (None, Some(model)) => {
                let mut standard = StandardExecutor::shared(model);
                if let Some(settings) = self.settings {
                    standard = standard.with_settings(settings);
                }
                if let Some((registry, mode)) = self.registry {
                    standard = standard.with_registry(registry, mode);
                }
                Arc::new(standard)
            }
            (None, None) => {
                return Err(RunError::Executor(format!(
                    "machine {name:?} has no model: call `model` (or `executor`) on the builder"
                )));
            }
        };
        let state = self
            .state
            .or_else(|| node.initial_state().cloned())
            .unwrap_or_else(|| Value::Object(serde_json::Map::new()));
        Machine::with_options(
            charter,
            executor,
            Instance::new(node, state),
            crate::machine::MachineOptions::default(),
        )
    }
}
