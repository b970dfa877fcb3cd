//! Externalized state: a node or pack hands ownership of its
//! state to application code — a store, a sync engine, a UI.
//!
//! A node or pack declares a [`StateHandler`] with
//! [`NodeBuilder::externalize`](crate::node::NodeBuilder::externalize) or
//! [`PackBuilder::externalize`](crate::pack::PackBuilder::externalize). The
//! machine calls it once per *scope* — `pack:<name>` for a pack,
//! `node:<instanceId>` for each instance of a node — when the scope appears,
//! with an [`ExternalContext`]. From then on, a `state` / `packState` message
//! for that scope is **not applied**: the machine hands it, as a
//! [`MutationEvent`], to the mutation callbacks, and only
//! [`ExternalContext::set_state`] changes the state.
//!
//! # Ownership
//!
//! [`ExternalContext`] is a cheap, cloneable handle (`Send + Sync`); clone it
//! into callbacks or hand it to a task. It holds a copy of the scope's state
//! that the machine refreshes before every callback. `set_state` validates
//! against the node's or pack's schema, updates that copy at once (a
//! following [`ExternalContext::state`] sees it) and records the write; the
//! machine copies recorded writes into its tree (copy-on-write) as soon as the
//! callback returns — or, for writes made elsewhere, at its next
//! synchronisation point (the start and each apply phase of a run, around a
//! command, or `Machine::sync_externalized`).
//!
//! Callbacks are plain synchronous `Fn`s called inside the machine; one that
//! needs I/O spawns it and later calls `set_state` from there. A callback
//! error is logged (`tracing::warn!`) and ignored; a handler error drops the
//! registration.
//!
//! ```
//! use markov_core::Message;
//! use markov_charter::externalize::{ExternalContext, MutationEvent, Scope, SetStateOptions};
//! use markov_charter::node::Node;
//! use serde_json::{Value, json};
//!
//! // A handler that accepts every patch the model or a tool writes.
//! let node = Node::builder("Count.")
//!     .externalize(|cx: &ExternalContext| {
//!         let handle = cx.clone();
//!         cx.on_mutation(move |_state: &Value, event: &MutationEvent| {
//!             handle.set_state(event.patch.clone(), SetStateOptions::patch())?;
//!             Ok(())
//!         });
//!         Ok(None)
//!     })
//!     .build()
//!     .unwrap();
//!
//! // What the machine does when an instance of the node appears, and when
//! // it meets a `state` message for it (normally you never write this).
//! let scope = Scope::node("i-1".into(), node.id().clone(), "i-1".into());
//! let registration = node
//!     .externalize_handler()
//!     .unwrap()
//!     .register(scope.clone(), node.shared_schema(), json!({ "count": 1 }))
//!     .unwrap();
//! let message = Message::user("a state message");
//! let event = MutationEvent::new(scope, json!({ "count": 1 }), json!({ "count": 2 }), message, 0, 1);
//! registration.dispatch_mutation(&event);
//! assert_eq!(registration.context().state(), json!({ "count": 2 }));
//! // The machine copies this write into its tree.
//! assert_eq!(registration.take_write(), Some(json!({ "count": 2 })));
//! ```

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use markov_core::message::Message;
use markov_core::{InstanceId, NodeId};
use serde_json::Value;

use crate::state::{StateSchema, merge_patch};

/// What an externalized state belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Scope {
    /// A pack's state (one per machine).
    Pack {
        /// `pack:<pack_name>`.
        id: String,
        /// The pack.
        pack_name: String,
        /// The root instance when the scope was registered.
        root_instance_id: InstanceId,
    },
    /// One instance's state.
    Node {
        /// `node:<instance_id>`.
        id: String,
        /// The instance.
        instance_id: InstanceId,
        /// Its node.
        node_id: NodeId,
        /// The root instance when the scope was registered.
        root_instance_id: InstanceId,
    },
}

impl Scope {
    /// The scope of the pack `pack_name`.
    pub fn pack(pack_name: impl Into<String>, root_instance_id: InstanceId) -> Self {
        let pack_name = pack_name.into();
        Scope::Pack {
            id: Self::pack_id(&pack_name),
            pack_name,
            root_instance_id,
        }
    }

    /// The scope of the instance `instance_id` of node `node_id`.
    pub fn node(instance_id: InstanceId, node_id: NodeId, root_instance_id: InstanceId) -> Self {
        Scope::Node {
            id: Self::node_id_of(&instance_id),
            instance_id,
            node_id,
            root_instance_id,
        }
    }

    /// `pack:<name>`.
    pub fn pack_id(pack_name: &str) -> String {
        format!("pack:{pack_name}")
    }

    /// `node:<instanceId>`.
    pub fn node_id_of(instance_id: &InstanceId) -> String {
        format!("node:{instance_id}")
    }

    /// The scope id, the key of its registration.
    pub fn id(&self) -> &str {
        match self {
            Scope::Pack { id, .. } | Scope::Node { id, .. } => id,
        }
    }
}

/// How [`ExternalContext::set_state`] combines `next` with the current state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SetStateMode {
    /// Shallow-merge `next` into the current state, then validate.
    #[default]
    Patch,
    /// Validate `next` and make it the state.
    Replace,
}

/// Where a state written with [`ExternalContext::set_state`] comes from
/// (informational; the machine treats both alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StateSource {
    /// The authoritative external store.
    External,
    /// A local guess, to be confirmed by the store.
    Optimistic,
}

/// Options of [`ExternalContext::set_state`].
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct SetStateOptions {
    /// Patch (default) or replace.
    pub mode: SetStateMode,
    /// The external store's revision of this state, if it has one.
    pub revision: Option<Value>,
    /// Where the state comes from.
    pub source: Option<StateSource>,
}

impl SetStateOptions {
    /// Shallow-merge into the current state.
    pub fn patch() -> Self {
        SetStateOptions::default()
    }

    /// Replace the state.
    pub fn replace() -> Self {
        SetStateOptions {
            mode: SetStateMode::Replace,
            ..SetStateOptions::default()
        }
    }

    /// Records the store's revision.
    #[must_use]
    pub fn revision(mut self, revision: impl Into<Value>) -> Self {
        self.revision = Some(revision.into());
        self
    }

    /// Records where the state comes from.
    #[must_use]
    pub fn source(mut self, source: StateSource) -> Self {
        self.source = Some(source);
        self
    }
}

/// A `state` / `packState` message the machine handed to a registration
/// instead of applying it.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct MutationEvent {
    /// The scope.
    pub scope: Scope,
    /// The scope's state when the message was met (before any callback).
    pub state: Value,
    /// The patch the message carries.
    pub patch: Value,
    /// The message itself (its items hold the instance payload).
    pub message: Message,
    /// The step whose apply phase met it (0 for the initial drain of a run).
    pub step_number: usize,
    /// Per machine, from 1.
    pub sequence: u64,
}

impl MutationEvent {
    /// An event (the machine builds these).
    pub fn new(
        scope: Scope,
        state: Value,
        patch: Value,
        message: Message,
        step_number: usize,
        sequence: u64,
    ) -> Self {
        MutationEvent {
            scope,
            state,
            patch,
            message,
            step_number,
            sequence,
        }
    }
}

/// The step about to be yielded, as [`ExternalContext::on_step`] callbacks see it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct StepInfo<'a> {
    /// The step's number (0 for a step made of the initial drain only).
    pub step_number: usize,
    /// Its yield reason, as on the wire (`"end_turn"`, …).
    pub yield_reason: &'a str,
    /// Whether the run ends with it.
    pub done: bool,
    /// The messages the step reports.
    pub history: &'a [Message],
}

impl<'a> StepInfo<'a> {
    /// A step (the machine builds these).
    pub fn new(
        step_number: usize,
        yield_reason: &'a str,
        done: bool,
        history: &'a [Message],
    ) -> Self {
        StepInfo {
            step_number,
            yield_reason,
            done,
            history,
        }
    }
}

/// Why an externalized state could not be written, or a handler failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExternalizeError {
    /// `set_state` on a pack scope: the state does not fit the pack's schema.
    #[error("Externalized pack state validation failed ({pack}): {message}")]
    PackValidation {
        /// The pack.
        pack: String,
        /// The validator's message.
        message: String,
    },
    /// `set_state` on a node scope: the state does not fit the node's schema.
    #[error("Externalized node state validation failed ({instance}): {message}")]
    NodeValidation {
        /// The instance.
        instance: InstanceId,
        /// The validator's message.
        message: String,
    },
    /// The pack scope is no longer registered.
    #[error("Externalized pack not found: {0}")]
    PackNotFound(String),
    /// The instance is no longer in the tree (or its registration was dropped).
    #[error("Externalized node instance not found: {0}")]
    NodeNotFound(InstanceId),
    /// A handler or callback failed for a reason of its own.
    #[error("{0}")]
    Handler(String),
}

impl ExternalizeError {
    /// A handler's or callback's own failure.
    pub fn handler(message: impl fmt::Display) -> Self {
        ExternalizeError::Handler(message.to_string())
    }
}

/// What a handler may return: run when the registration is removed.
pub type Cleanup = Box<dyn FnOnce() + Send>;

type MutationCallback = Arc<dyn Fn(&Value, &MutationEvent) -> CallbackResult + Send + Sync>;
type StepCallback = Arc<dyn Fn(&StepInfo<'_>, &[MutationEvent]) -> CallbackResult + Send + Sync>;
type HydrateCallback = Arc<dyn Fn(&Value) -> CallbackResult + Send + Sync>;
type HandlerFn =
    dyn Fn(&ExternalContext) -> Result<Option<Cleanup>, ExternalizeError> + Send + Sync;

/// What a callback returns; an error is logged and otherwise ignored.
pub type CallbackResult = Result<(), ExternalizeError>;

/// The `externalize.state` handler of a node or pack: called once per scope
/// when the scope is registered. Cheap to clone; two handlers are the same
/// when they are clones of one another.
#[derive(Clone)]
pub struct StateHandler(Arc<HandlerFn>);

impl fmt::Debug for StateHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StateHandler(..)")
    }
}

impl StateHandler {
    /// Wraps a handler.
    pub fn new(
        handler: impl Fn(&ExternalContext) -> Result<Option<Cleanup>, ExternalizeError>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        StateHandler(Arc::new(handler))
    }

    /// Whether both are the same handler.
    pub fn same(&self, other: &StateHandler) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Registers `scope`: builds its context over `state`, calls the handler,
    /// then the `on_hydrate` callbacks it installed. A handler error is
    /// returned (the caller drops the scope); hydrate errors are logged.
    pub fn register(
        &self,
        scope: Scope,
        schema: Arc<dyn StateSchema>,
        state: Value,
    ) -> Result<Registration, ExternalizeError> {
        let context = ExternalContext::new(scope, schema, state);
        let cleanup = match (self.0)(&context) {
            Ok(cleanup) => cleanup,
            Err(e) => {
                context.lock().detached = true;
                return Err(e);
            }
        };
        let registration = Registration {
            handler: self.clone(),
            context,
            cleanup: Mutex::new(cleanup),
        };
        let (callbacks, state) = {
            let inner = registration.context.lock();
            (inner.on_hydrate.clone(), inner.state.clone())
        };
        for cb in callbacks {
            log_failure(registration.context.scope_id(), "hydrate", cb(&state));
        }
        Ok(registration)
    }
}

fn log_failure(scope: &str, what: &str, result: CallbackResult) {
    if let Err(e) = result {
        tracing::warn!(scope, callback = what, error = %e, "externalized state callback failed");
    }
}

struct ContextInner {
    state: Value,
    /// The last accepted write not yet copied into the machine's tree.
    pending: Option<Value>,
    detached: bool,
    on_mutation: Vec<MutationCallback>,
    on_step: Vec<StepCallback>,
    on_hydrate: Vec<HydrateCallback>,
}

struct Shared {
    scope: Scope,
    schema: Arc<dyn StateSchema>,
    inner: Mutex<ContextInner>,
}

/// A handler's view of one scope: its state, a way to write it, and the
/// callbacks it installs. Clone it freely (it is a handle).
#[derive(Clone)]
pub struct ExternalContext(Arc<Shared>);

impl fmt::Debug for ExternalContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExternalContext")
            .field("scope", &self.0.scope)
            .finish_non_exhaustive()
    }
}

impl ExternalContext {
    fn new(scope: Scope, schema: Arc<dyn StateSchema>, state: Value) -> Self {
        ExternalContext(Arc::new(Shared {
            scope,
            schema,
            inner: Mutex::new(ContextInner {
                state,
                pending: None,
                detached: false,
                on_mutation: Vec::new(),
                on_step: Vec::new(),
                on_hydrate: Vec::new(),
            }),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, ContextInner> {
        self.0.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn scope_id(&self) -> &str {
        self.0.scope.id()
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.0.scope
    }

    /// The scope's current state (including writes not yet copied into the tree).
    pub fn state(&self) -> Value {
        self.lock().state.clone()
    }

    /// Writes the scope's state: patch mode shallow-merges `next` into the
    /// current state, replace mode takes `next`; the result is validated
    /// against the node's or pack's schema and the *parsed* value becomes the
    /// state, which is returned.
    ///
    /// Fails with a validation error, or with a not-found error once the
    /// scope is gone (instance removed, registration dropped).
    pub fn set_state(
        &self,
        next: Value,
        options: SetStateOptions,
    ) -> Result<Value, ExternalizeError> {
        let mut inner = self.lock();
        if inner.detached {
            return Err(self.not_found());
        }
        let candidate = match options.mode {
            SetStateMode::Replace => next,
            SetStateMode::Patch => {
                merge_patch(&inner.state, &next).map_err(|e| self.invalid(e.to_string()))?
            }
        };
        let parsed = self
            .0
            .schema
            .parse(&candidate)
            .map_err(|m| self.invalid(m))?;
        inner.state = parsed.clone();
        inner.pending = Some(parsed.clone());
        Ok(parsed)
    }

    fn invalid(&self, message: String) -> ExternalizeError {
        match &self.0.scope {
            Scope::Pack { pack_name, .. } => ExternalizeError::PackValidation {
                pack: pack_name.clone(),
                message,
            },
            Scope::Node { instance_id, .. } => ExternalizeError::NodeValidation {
                instance: instance_id.clone(),
                message,
            },
        }
    }

    fn not_found(&self) -> ExternalizeError {
        match &self.0.scope {
            Scope::Pack { pack_name, .. } => ExternalizeError::PackNotFound(pack_name.clone()),
            Scope::Node { instance_id, .. } => ExternalizeError::NodeNotFound(instance_id.clone()),
        }
    }

    /// Called with `(current state, event)` for every `state` / `packState`
    /// message of this scope the machine meets.
    pub fn on_mutation(
        &self,
        callback: impl Fn(&Value, &MutationEvent) -> CallbackResult + Send + Sync + 'static,
    ) {
        self.lock().on_mutation.push(Arc::new(callback));
    }

    /// Upstream's alias of [`ExternalContext::on_mutation`].
    pub fn on_instance_message(
        &self,
        callback: impl Fn(&Value, &MutationEvent) -> CallbackResult + Send + Sync + 'static,
    ) {
        self.on_mutation(callback);
    }

    /// Called before each yielded step with the step and this scope's events
    /// since the previous yielded step (empty when there were none).
    pub fn on_step(
        &self,
        callback: impl Fn(&StepInfo<'_>, &[MutationEvent]) -> CallbackResult + Send + Sync + 'static,
    ) {
        self.lock().on_step.push(Arc::new(callback));
    }

    /// Called with the state once the handler has returned.
    pub fn on_hydrate(&self, callback: impl Fn(&Value) -> CallbackResult + Send + Sync + 'static) {
        self.lock().on_hydrate.push(Arc::new(callback));
    }
}

/// The machine's side of a registered scope. Dropping it detaches the
/// context (later `set_state` calls fail with not-found) and runs the
/// handler's cleanup.
pub struct Registration {
    handler: StateHandler,
    context: ExternalContext,
    /// Behind a mutex only so that a registration is `Sync` (the machine is
    /// shared across the awaits of a step) while cleanups need only be `Send`.
    cleanup: Mutex<Option<Cleanup>>,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("scope", self.scope())
            .finish_non_exhaustive()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.context.lock().detached = true;
        let cleanup = self
            .cleanup
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(cleanup) = cleanup {
            cleanup();
        }
    }
}

impl Registration {
    /// The scope.
    pub fn scope(&self) -> &Scope {
        self.context.scope()
    }

    /// The handler that registered it.
    pub fn handler(&self) -> &StateHandler {
        &self.handler
    }

    /// The context handed to the handler.
    pub fn context(&self) -> &ExternalContext {
        &self.context
    }

    /// Sets the context's copy of the state to the tree's (before callbacks run).
    pub fn refresh(&self, state: &Value) {
        let mut inner = self.context.lock();
        if inner.pending.is_none() {
            inner.state = state.clone();
        }
    }

    /// Takes the last write not yet copied into the tree.
    pub fn take_write(&self) -> Option<Value> {
        self.context.lock().pending.take()
    }

    /// Calls every mutation callback with `(state, event)`; errors are logged.
    pub fn dispatch_mutation(&self, event: &MutationEvent) {
        let callbacks = self.context.lock().on_mutation.clone();
        for cb in callbacks {
            let state = self.context.state();
            log_failure(self.context.scope_id(), "mutation", cb(&state, event));
        }
    }

    /// Calls every step callback with `(step, events)`; errors are logged.
    pub fn notify_step(&self, step: &StepInfo<'_>, events: &[MutationEvent]) {
        let callbacks = self.context.lock().on_step.clone();
        for cb in callbacks {
            log_failure(self.context.scope_id(), "step", cb(step, events));
        }
    }
}
