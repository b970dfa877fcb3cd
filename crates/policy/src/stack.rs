//! [`PolicyStack`]: composing layers (tower's `ServiceBuilder`).

use markov_core::async_trait;
use markov_core::tool::ToolExecutionResult;

use crate::audit::AuditLayer;
use crate::budget::BudgetLayer;
use crate::config::PolicyConfig;
use crate::confirm::ConfirmLayer;
use crate::error::ErrorFormat;
use crate::gate::GateLayer;
use crate::idempotency::IdempotencyLayer;
use crate::latency::LatencyLayer;
use crate::mode::ModeLayer;
use crate::service::{ToolLayer, ToolRequest, ToolService};
use crate::timeout::TimeoutLayer;
use crate::unknown_tool::UnknownToolLayer;
use crate::validate::ValidateLayer;

/// The layer that does nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Identity;

impl<S> ToolLayer<S> for Identity {
    type Service = S;
    fn layer(&self, inner: S) -> S {
        inner
    }
}

/// Two layers: `outer` wraps what `inner` made.
#[derive(Debug, Clone)]
pub struct Stack<Inner, Outer> {
    inner: Inner,
    outer: Outer,
}

impl<S, Inner: ToolLayer<S>, Outer: ToolLayer<Inner::Service>> ToolLayer<S>
    for Stack<Inner, Outer>
{
    type Service = Outer::Service;
    fn layer(&self, service: S) -> Self::Service {
        self.outer.layer(self.inner.layer(service))
    }
}

/// One of two services (what an [`OptionLayer`] makes).
#[derive(Debug, Clone)]
pub enum Either<A, B> {
    /// The layer was present.
    Left(A),
    /// The layer was absent: the inner service itself.
    Right(B),
}

#[async_trait]
impl<A: ToolService, B: ToolService> ToolService for Either<A, B> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        match self {
            Either::Left(a) => a.call(req).await,
            Either::Right(b) => b.call(req).await,
        }
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        match self {
            Either::Left(a) => a.stages(out),
            Either::Right(b) => b.stages(out),
        }
    }
}

/// A layer that may be absent.
#[derive(Debug, Clone)]
pub struct OptionLayer<L>(Option<L>);

impl<S, L: ToolLayer<S>> ToolLayer<S> for OptionLayer<L> {
    type Service = Either<L::Service, S>;
    fn layer(&self, inner: S) -> Self::Service {
        match &self.0 {
            Some(l) => Either::Left(l.layer(inner)),
            None => Either::Right(inner),
        }
    }
}

/// Builds a service from layers; the first layer added is the outermost (it
/// sees the request first and the result last).
///
/// ```
/// use markov_policy::{EnvelopeMode, ExecuteService, LatencyLayer, PolicyStack, TimeoutLayer, ToolService};
///
/// let service = PolicyStack::new()
///     .layer(LatencyLayer::new())
///     .option_layer(Some(TimeoutLayer::new()))
///     .service(ExecuteService::new(EnvelopeMode::On));
/// let mut stages = Vec::new();
/// service.stages(&mut stages);
/// assert_eq!(stages, ["latency", "timeout", "execute"]);
/// ```
#[derive(Debug, Clone)]
pub struct PolicyStack<L> {
    layers: L,
}

impl Default for PolicyStack<Identity> {
    fn default() -> Self {
        Self::new()
    }
}

impl PolicyStack<Identity> {
    /// No layer yet.
    pub fn new() -> Self {
        PolicyStack { layers: Identity }
    }

    /// The standard stack, outermost first: audit → unknown tool → mode →
    /// budget → validate → confirm → idempotency → latency → timeout (see the
    /// crate documentation for why).
    pub fn standard(config: &PolicyConfig) -> PolicyStack<StandardLayers> {
        PolicyStack::new()
            .layer(AuditLayer::new(
                config.registry_version.clone(),
                config.audit_sink.clone(),
            ))
            .layer(UnknownToolLayer::unknown_tool())
            .layer(ModeLayer::mode())
            .layer(GateLayer::new(config.budget_gate()))
            .layer(ValidateLayer::validate())
            .layer(
                ConfirmLayer::new(config.confirmation_ttl)
                    .flow(config.approval_flow)
                    .format(config.envelope, ErrorFormat::Envelope),
            )
            .layer(IdempotencyLayer::new(config.idempotency))
            .layer(LatencyLayer::new())
            .layer(TimeoutLayer::new())
    }
}

/// The layers of [`PolicyStack::standard`].
pub type StandardLayers = Stack<
    TimeoutLayer,
    Stack<
        LatencyLayer,
        Stack<
            IdempotencyLayer,
            Stack<
                ConfirmLayer,
                Stack<
                    ValidateLayer,
                    Stack<
                        BudgetLayer,
                        Stack<ModeLayer, Stack<UnknownToolLayer, Stack<AuditLayer, Identity>>>,
                    >,
                >,
            >,
        >,
    >,
>;

impl<L> PolicyStack<L> {
    /// Adds `layer` inside the ones added before.
    pub fn layer<T>(self, layer: T) -> PolicyStack<Stack<T, L>> {
        PolicyStack {
            layers: Stack {
                inner: layer,
                outer: self.layers,
            },
        }
    }

    /// Adds `layer` if it is `Some`.
    pub fn option_layer<T>(self, layer: Option<T>) -> PolicyStack<Stack<OptionLayer<T>, L>> {
        self.layer(OptionLayer(layer))
    }

    /// Wraps `service` in the layers.
    pub fn service<S>(&self, service: S) -> L::Service
    where
        L: ToolLayer<S>,
    {
        self.layers.layer(service)
    }

    /// The layers.
    pub fn into_inner(self) -> L {
        self.layers
    }
}
