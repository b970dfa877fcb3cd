//! Usage and cost: what a conversation's model calls used, the limits they
//! must stay within, and the prices they are charged at.
//!
//! - [`UsageTotals`]: the session's total and the current user turn's,
//!   kept by the machine and stored with its snapshot; a run's total is in
//!   each step the executor yields (its run's usage).
//! - [`UsageLimits`]: tokens, requests and money per run, per turn and per
//!   session, checked **before** each model call against a conservative
//!   estimate of that call ([`UsageMeter`]); a call that could pass a limit
//!   is not made, and the run ends with
//!   a usage-limit yield reason.
//! - [`Prices`]: a maintained table of model prices (the `genai-prices`
//!   crate's, bundled: no network), overridable per model with
//!   [`ModelPrice`]; every call's cost is summed in exact nano-dollars
//!   ([`Usd`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, PoisonError, RwLock};

use markov_core::model::{ModelRequest, ModelSettings, Usage};
use markov_core::usage::Usd;
use serde::{Deserialize, Serialize};

/// A conversation's usage: the session's total and the current user
/// turn's (which starts over with each user message that starts a run).
/// Part of the machine's snapshot and of a stored session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct UsageTotals {
    /// Every model call of the session.
    pub session: Usage,
    /// The model calls of the current user turn.
    pub turn: Usage,
}

impl UsageTotals {
    /// Whether nothing was used yet.
    pub fn is_empty(&self) -> bool {
        self.session.is_empty() && self.turn.is_empty()
    }

    /// Adds one step's usage to both totals.
    pub fn add(&mut self, usage: Usage) {
        self.session += usage;
        self.turn += usage;
    }
}

/// Which total a limit bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum LimitScope {
    /// One run (a machine's run, or a resume).
    Run,
    /// One user turn: from a user message to the end of its answer, over
    /// every run it takes (a pause for approval and its resume, say).
    Turn,
    /// The whole session, for its life.
    Session,
}

impl fmt::Display for LimitScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitScope::Run => "per-run",
            LimitScope::Turn => "per-turn",
            LimitScope::Session => "per-session",
        })
    }
}

/// What a limit counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum LimitKind {
    /// Tokens: input, cached input and output ([`Usage::total_tokens`]).
    Tokens,
    /// Model calls.
    Requests,
    /// Money, at the agent's [`Prices`].
    Cost,
}

impl fmt::Display for LimitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LimitKind::Tokens => "tokens",
            LimitKind::Requests => "requests",
            LimitKind::Cost => "cost",
        })
    }
}

/// The bounds of one scope: any of tokens, requests and cost (unset ones
/// do not bound). Given to [`UsageLimitsBuilder`], which checks them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limit {
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    requests: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cost: Option<Usd>,
}

impl Limit {
    /// No bound yet.
    pub fn new() -> Self {
        Limit::default()
    }

    /// At most `tokens` tokens ([`Usage::total_tokens`]).
    #[must_use]
    pub fn tokens(mut self, tokens: u64) -> Self {
        self.tokens = Some(tokens);
        self
    }

    /// At most `requests` model calls.
    #[must_use]
    pub fn requests(mut self, requests: u64) -> Self {
        self.requests = Some(requests);
        self
    }

    /// At most `cost`, at the agent's [`Prices`].
    #[must_use]
    pub fn cost(mut self, cost: Usd) -> Self {
        self.cost = Some(cost);
        self
    }

    /// The bound on tokens, if any.
    pub fn max_tokens(&self) -> Option<u64> {
        self.tokens
    }

    /// The bound on model calls, if any.
    pub fn max_requests(&self) -> Option<u64> {
        self.requests
    }

    /// The bound on money, if any.
    pub fn max_cost(&self) -> Option<Usd> {
        self.cost
    }

    fn is_unset(&self) -> bool {
        *self == Limit::default()
    }

    /// Each bound as (kind, amount) in comparable units: tokens, calls,
    /// nano-dollars.
    fn bounds(&self) -> impl Iterator<Item = (LimitKind, u64)> {
        [
            (LimitKind::Tokens, self.tokens),
            (LimitKind::Requests, self.requests),
            (LimitKind::Cost, self.cost.map(Usd::as_nanos)),
        ]
        .into_iter()
        .filter_map(|(kind, bound)| bound.map(|b| (kind, b)))
    }
}

/// Why limits were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UsageLimitsError {
    /// A bound of zero would refuse every call.
    #[error("the {scope} limit on {kind} is zero: it would refuse every model call")]
    Zero {
        /// The scope.
        scope: LimitScope,
        /// What it counts.
        kind: LimitKind,
    },
    /// An inner scope's bound above its outer scope's (a run's above its
    /// turn's, a turn's above its session's) could never be reached.
    #[error("the {inner} limit on {kind} is above the {outer} one, so it could never be reached")]
    Conflict {
        /// What the limits count.
        kind: LimitKind,
        /// The inner scope.
        inner: LimitScope,
        /// The outer scope.
        outer: LimitScope,
    },
}

/// Bounds on what model calls may use, per run, per user turn and per
/// session, built with [`UsageLimits::builder`] (which refuses zero and
/// unreachable bounds) and given to
/// the agent builder's `limits`.
///
/// They are checked right before each model call (a context policy's
/// summarizer's too, and a retry after a context-length refusal again),
/// against what the scope has used plus a conservative estimate of the
/// call (the input it sends, and its `max_tokens` of output, priced at
/// the higher of the input and cache write rates): a call that could
/// pass a bound is not made, and the run
/// ends with the usage-limit yield reason,
/// the history intact. A per-run or per-turn limit lets the next turn go
/// on; a per-session one stops every later call.
///
/// ```
/// use markov_core::Usd;
/// use markov_context::{Limit, UsageLimits};
///
/// let limits = UsageLimits::builder()
///     .per_turn(Limit::new().requests(10).tokens(200_000))
///     .per_session(Limit::new().cost(Usd::from_cents(50)))
///     .build()
///     .unwrap();
/// assert_eq!(limits.per_turn().max_requests(), Some(10));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, try_from = "RawLimits")]
pub struct UsageLimits {
    #[serde(skip_serializing_if = "Limit::is_unset")]
    run: Limit,
    #[serde(skip_serializing_if = "Limit::is_unset")]
    turn: Limit,
    #[serde(skip_serializing_if = "Limit::is_unset")]
    session: Limit,
}

/// Limits as read, before they are checked.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
#[derive(Default)]
struct RawLimits {
    run: Limit,
    turn: Limit,
    session: Limit,
}

impl TryFrom<RawLimits> for UsageLimits {
    type Error = UsageLimitsError;

    fn try_from(raw: RawLimits) -> Result<Self, Self::Error> {
        UsageLimitsBuilder {
            run: raw.run,
            turn: raw.turn,
            session: raw.session,
        }
        .build()
    }
}

impl UsageLimits {
    /// No limits (the default).
    pub fn none() -> Self {
        UsageLimits::default()
    }

    /// Describes limits; [`build`](UsageLimitsBuilder::build) checks them.
    pub fn builder() -> UsageLimitsBuilder {
        UsageLimitsBuilder::default()
    }

    /// The bounds of each run.
    pub fn per_run(&self) -> &Limit {
        &self.run
    }

    /// The bounds of each user turn.
    pub fn per_turn(&self) -> &Limit {
        &self.turn
    }

    /// The bounds of the session.
    pub fn per_session(&self) -> &Limit {
        &self.session
    }

    /// Whether any bound is set.
    pub fn is_set(&self) -> bool {
        !(self.run.is_unset() && self.turn.is_unset() && self.session.is_unset())
    }

    /// Whether a bound on tokens or money is set: only then is a call's
    /// input estimated.
    fn needs_estimate(&self) -> bool {
        [&self.run, &self.turn, &self.session]
            .iter()
            .any(|l| l.tokens.is_some() || l.cost.is_some())
    }

    /// Whether a bound on money is set.
    pub fn limits_cost(&self) -> bool {
        [&self.run, &self.turn, &self.session]
            .iter()
            .any(|l| l.cost.is_some())
    }

    fn scopes(&self) -> [(LimitScope, &Limit); 3] {
        [
            (LimitScope::Run, &self.run),
            (LimitScope::Turn, &self.turn),
            (LimitScope::Session, &self.session),
        ]
    }
}

/// Describes [`UsageLimits`]; see [`UsageLimits::builder`].
#[derive(Debug, Clone, Copy, Default)]
pub struct UsageLimitsBuilder {
    run: Limit,
    turn: Limit,
    session: Limit,
}

impl UsageLimitsBuilder {
    /// The bounds of each run.
    #[must_use]
    pub fn per_run(mut self, limit: Limit) -> Self {
        self.run = limit;
        self
    }

    /// The bounds of each user turn.
    #[must_use]
    pub fn per_turn(mut self, limit: Limit) -> Self {
        self.turn = limit;
        self
    }

    /// The bounds of the session.
    #[must_use]
    pub fn per_session(mut self, limit: Limit) -> Self {
        self.session = limit;
        self
    }

    /// Checks the bounds and freezes them.
    ///
    /// # Errors
    /// [`UsageLimitsError::Zero`] for a bound of zero;
    /// [`UsageLimitsError::Conflict`] for a run's bound above its turn's
    /// or session's, or a turn's above its session's, on the same count.
    pub fn build(self) -> Result<UsageLimits, UsageLimitsError> {
        let limits = UsageLimits {
            run: self.run,
            turn: self.turn,
            session: self.session,
        };
        let scopes = limits.scopes();
        for (scope, limit) in scopes {
            if let Some((kind, _)) = limit.bounds().find(|(_, bound)| *bound == 0) {
                return Err(UsageLimitsError::Zero { scope, kind });
            }
        }
        for (i, (inner, inner_limit)) in scopes.iter().enumerate() {
            for (outer, outer_limit) in &scopes[i + 1..] {
                for (kind, bound) in inner_limit.bounds() {
                    let above = outer_limit
                        .bounds()
                        .any(|(k, outer_bound)| k == kind && bound > outer_bound);
                    if above {
                        return Err(UsageLimitsError::Conflict {
                            kind,
                            inner: *inner,
                            outer: *outer,
                        });
                    }
                }
            }
        }
        Ok(limits)
    }
}

/// The limit a model call would have passed: it was not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LimitExceeded {
    /// Which total.
    pub scope: LimitScope,
    /// What it counts.
    pub kind: LimitKind,
    /// The bound (tokens, calls, or nano-dollars for a cost).
    pub limit: u64,
    /// What the scope had used (same unit).
    pub used: u64,
    /// What the call could have used at most, as estimated (same unit).
    pub estimate: u64,
}

impl fmt::Display for LimitExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |n: u64| match self.kind {
            LimitKind::Cost => Usd::from_nanos(n).to_string(),
            _ => n.to_string(),
        };
        write!(
            f,
            "the {} limit on {} ({}) would be passed: {} used, the next model call could use up to {}",
            self.scope,
            self.kind,
            show(self.limit),
            show(self.used),
            show(self.estimate)
        )
    }
}

/// What one step's model calls may still use: the limits, what the run,
/// the turn and the session have used, and what the step's calls in
/// flight have reserved. An executor asks it before each model call
/// ([`UsageMeter::admit`]).
#[derive(Debug)]
pub struct UsageMeter {
    limits: UsageLimits,
    run: Usage,
    totals: UsageTotals,
    /// The estimates of the calls admitted in this step: leaves run
    /// concurrently, and each must leave room for the others.
    reserved: Mutex<Usage>,
}

impl UsageMeter {
    /// A meter of `limits` over what was used so far.
    pub fn new(limits: UsageLimits, run: Usage, totals: UsageTotals) -> Self {
        UsageMeter {
            limits,
            run,
            totals,
            reserved: Mutex::new(Usage::default()),
        }
    }

    /// The limits.
    pub fn limits(&self) -> &UsageLimits {
        &self.limits
    }

    /// Whether a call's input must be estimated (a bound on tokens or
    /// money is set).
    pub fn needs_estimate(&self) -> bool {
        self.limits.needs_estimate()
    }

    /// Admits a call that could use up to `estimate` (one request, its
    /// tokens and cost), reserving it for the rest of the step; or names
    /// the first limit it could pass, and reserves nothing.
    ///
    /// # Errors
    /// The limit the call could pass.
    pub fn admit(&self, estimate: &Usage) -> Result<(), LimitExceeded> {
        let mut reserved = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
        let used_of = |scope| {
            let mut used = match scope {
                LimitScope::Run => self.run,
                LimitScope::Turn => self.totals.turn,
                LimitScope::Session => self.totals.session,
            };
            used += *reserved;
            used
        };
        for (scope, limit) in self.limits.scopes() {
            let used = used_of(scope);
            for (kind, bound) in limit.bounds() {
                let (used, needed) = match kind {
                    LimitKind::Tokens => (used.total_tokens(), estimate.total_tokens()),
                    LimitKind::Requests => (used.requests, estimate.requests),
                    LimitKind::Cost => (used.cost.as_nanos(), estimate.cost.as_nanos()),
                };
                if used.saturating_add(needed) > bound {
                    return Err(LimitExceeded {
                        scope,
                        kind,
                        limit: bound,
                        used,
                        estimate: needed,
                    });
                }
            }
        }
        *reserved += *estimate;
        Ok(())
    }
}

/// The input tokens a request could count at most: core's conservative
/// estimate ([`markov_core::tokens`], a token per three bytes of JSON,
/// which no tokenizer in use exceeds on text), plus the provider's
/// built-in tools. Always [`estimate_framing_tokens`] plus core's
/// estimate of the request's messages; the executor keeps the messages'
/// sum as the history and the context views grow, and adds the framing
/// alone.
pub fn estimate_input_tokens(request: &ModelRequest<'_>) -> u64 {
    estimate_framing_tokens(request)
        .saturating_add(markov_core::tokens::estimate_messages(request.messages()))
}

/// The input tokens of a request's parts other than its messages (core's
/// [`estimate_framing`](markov_core::tokens::estimate_framing): system
/// prompt, tools, output schema), plus the provider's built-in tools:
/// nothing that grows with the conversation.
pub fn estimate_framing_tokens(request: &ModelRequest<'_>) -> u64 {
    // The provider's built-in tools are the one part of a request core's
    // estimate leaves out (their definitions are the provider's).
    let provider_tools = request
        .provider_tools()
        .iter()
        .map(|tool| {
            serde_json::to_vec(tool)
                .map_or(0, |v| v.len() as u64)
                .div_ceil(3)
        })
        .sum::<u64>();
    markov_core::tokens::estimate_framing(request).saturating_add(provider_tools)
}

/// A limit on money is set and the model a call goes to has no price:
/// the call cannot be checked against it, so it is not made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no price for the model {}", model.as_deref().unwrap_or("(none named)"))]
pub struct NoPrice {
    /// The model the call goes to (asked for, else the client's own);
    /// `None` when neither names one.
    pub model: Option<String>,
}

/// A model call about to be made, as the usage limits see it.
#[derive(Debug, Clone, Copy)]
pub struct ModelCall<'a> {
    /// The client's [`Model::provider_name`](markov_core::Model::provider_name).
    pub provider: &'a str,
    /// The settings it is made with (the model asked for, `max_tokens`).
    pub settings: &'a ModelSettings,
    /// The client's own model, which a request that names none goes to
    /// ([`Model::model_name`](markov_core::Model::model_name)).
    pub configured: Option<&'a str>,
}

impl ModelCall<'_> {
    /// The model the call goes to: the one asked for, else the client's.
    fn model(&self) -> Option<&str> {
        self.settings.model.as_deref().or(self.configured)
    }
}

/// The meter's verdict on `call`, whose input tokens `input` estimates
/// (asked only when a bound on tokens or money is set): `Ok(Ok(()))` when
/// it may be made (its estimate is then reserved for the step), else the
/// limit it could pass. Its estimate is the input, its `max_tokens` of
/// output in full and one request, priced at `prices` by the model its
/// settings name.
///
/// # Errors
/// [`NoPrice`] when a limit on money
/// is set and the model has no price.
pub fn admit_call(
    meter: &UsageMeter,
    prices: &Prices,
    call: &ModelCall<'_>,
    input: impl FnOnce() -> u64,
) -> Result<Result<(), LimitExceeded>, NoPrice> {
    if !meter.limits().is_set() {
        return Ok(Ok(()));
    }
    let mut estimate = Usage {
        requests: 1,
        ..Usage::default()
    };
    if meter.needs_estimate() {
        let input = input();
        let output = u64::from(call.settings.max_tokens);
        estimate.input_tokens = input;
        estimate.output_tokens = output;
        if meter.limits().limits_cost() {
            let model = call.model();
            estimate.cost = model
                .and_then(|m| prices.estimate(call.provider, m, input, output))
                .ok_or_else(|| NoPrice {
                    model: model.map(str::to_owned),
                })?;
        }
    }
    Ok(meter.admit(&estimate))
}

/// What an answered call of `call` used: its token counts, one request,
/// and its cost at `prices` (by the model the answer names, else the one
/// asked for, else the client's own), or counted as unpriced.
pub fn metered(
    prices: &Prices,
    call: &ModelCall<'_>,
    response: &markov_core::model::ModelResponse,
) -> Usage {
    metered_usage(prices, call, response.usage, response.model.as_deref())
}

/// What a call of `call` that reported `usage` used, as [`metered`] counts
/// an answer's: one request, priced by the model `answered` names, else
/// the one asked for, else the client's own (a compaction names none).
pub fn metered_usage(
    prices: &Prices,
    call: &ModelCall<'_>,
    mut usage: Usage,
    answered: Option<&str>,
) -> Usage {
    usage.requests = 1;
    match prices.cost_of_answer(call.provider, answered, call.model(), &usage) {
        Some(cost) => {
            usage.cost = cost;
            usage.unpriced_requests = 0;
        }
        None => {
            usage.cost = Usd::ZERO;
            usage.unpriced_requests = 1;
        }
    }
    usage
}

/// A model's price, per million tokens of each kind, exact.
///
/// ```
/// use markov_core::Usd;
/// use markov_context::ModelPrice;
///
/// // $3 and $15 per million input and output tokens.
/// let price = ModelPrice::per_million_tokens(Usd::from_cents(300), Usd::from_cents(1500))
///     .cache_read(Usd::from_cents(30))
///     .cache_write(Usd::from_micros(3_750_000));
/// # let _ = price;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelPrice {
    input: Usd,
    output: Usd,
    cache_read: Usd,
    cache_write: Usd,
}

impl ModelPrice {
    /// `input` and `output` per million tokens; cached input at the input
    /// price until [`cache_read`](Self::cache_read) and
    /// [`cache_write`](Self::cache_write) say otherwise.
    pub fn per_million_tokens(input: Usd, output: Usd) -> Self {
        ModelPrice {
            input,
            output,
            cache_read: input,
            cache_write: input,
        }
    }

    /// Free (a model served locally, say).
    pub fn free() -> Self {
        ModelPrice::per_million_tokens(Usd::ZERO, Usd::ZERO)
    }

    /// The price of a million input tokens read from the prompt cache.
    #[must_use]
    pub fn cache_read(mut self, price: Usd) -> Self {
        self.cache_read = price;
        self
    }

    /// The price of a million input tokens written to the prompt cache.
    #[must_use]
    pub fn cache_write(mut self, price: Usd) -> Self {
        self.cache_write = price;
        self
    }

    /// What `usage` costs, rounded up to the nano-dollar.
    pub fn cost(&self, usage: &Usage) -> Usd {
        let part = |tokens: u64, per_million: Usd| -> u128 {
            u128::from(tokens) * u128::from(per_million.as_nanos())
        };
        let total = part(usage.input_tokens, self.input)
            + part(usage.output_tokens, self.output)
            + part(usage.cache_read_input_tokens, self.cache_read)
            + part(usage.cache_creation_input_tokens, self.cache_write);
        Usd::from_nanos(u64::try_from(total.div_ceil(1_000_000)).unwrap_or(u64::MAX))
    }
}

/// Where prices come from: the bundled table of the `genai-prices` crate
/// (maintained by its authors, read without network), and prices given
/// per model, which win.
///
/// A model is looked up by the name its answer gives, then by the name
/// asked for, then by the client's own model
/// ([`Model::model_name`](markov_core::Model::model_name): the one
/// `OpenAi::builder().model(..)` configures, say); a model found nowhere is unpriced (counted in
/// [`Usage::unpriced_requests`], and refused before the call when a limit
/// on money is set). A model served locally through an OpenAI-compatible
/// server is usually not in the table: give it [`ModelPrice::free`].
///
/// ```
/// use markov_core::Usd;
/// use markov_context::{ModelPrice, Prices};
///
/// let prices = Prices::table().model(
///     "my-fine-tune",
///     ModelPrice::per_million_tokens(Usd::from_cents(100), Usd::from_cents(400)),
/// );
/// # let _ = prices;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Prices {
    /// Whether the bundled table is consulted.
    no_table: bool,
    overrides: BTreeMap<String, ModelPrice>,
}

impl Prices {
    /// The bundled table (the default).
    pub fn table() -> Self {
        Prices::default()
    }

    /// No table: only the prices given with [`model`](Self::model).
    pub fn only_given() -> Self {
        Prices {
            no_table: true,
            overrides: BTreeMap::new(),
        }
    }

    /// Prices `model` (the exact name) at `price`, over the table's.
    #[must_use]
    pub fn model(mut self, model: impl Into<String>, price: ModelPrice) -> Self {
        self.overrides.insert(model.into(), price);
        self
    }

    /// What `usage` cost on `model` of `provider` (the client's
    /// [`Model::provider_name`](markov_core::Model::provider_name)), or
    /// `None` when the model has no price.
    pub fn cost(&self, provider: &str, model: &str, usage: &Usage) -> Option<Usd> {
        if let Some(price) = self.overrides.get(model) {
            return Some(price.cost(usage));
        }
        if self.no_table || model.is_empty() {
            return None;
        }
        table_cost(provider, model, usage)
    }

    /// What the answered call cost: by the model the answer names, else
    /// the one the call went to (asked for, else the client's own).
    pub fn cost_of_answer(
        &self,
        provider: &str,
        answered: Option<&str>,
        asked: Option<&str>,
        usage: &Usage,
    ) -> Option<Usd> {
        [answered, asked]
            .into_iter()
            .flatten()
            .find_map(|model| self.cost(provider, model, usage))
    }

    /// The most a call of `input` tokens and `output` tokens could cost on
    /// `model`: the input at the higher of the plain and cache write
    /// rates, as a cache breakpoint may write it all.
    pub fn estimate(&self, provider: &str, model: &str, input: u64, output: u64) -> Option<Usd> {
        let plain = Usage {
            input_tokens: input,
            output_tokens: output,
            ..Usage::default()
        };
        let written = Usage {
            cache_creation_input_tokens: input,
            output_tokens: output,
            ..Usage::default()
        };
        let plain = self.cost(provider, model, &plain)?;
        Some(
            self.cost(provider, model, &written)
                .map_or(plain, |w| w.max(plain)),
        )
    }
}

/// The table's id of a provider markov's clients name
/// ([`Model::provider_name`](markov_core::Model::provider_name)), and
/// the index of its cache of matched models in [`MATCHED`].
fn table_provider(provider: &str) -> Option<(&'static str, usize)> {
    match provider {
        "anthropic" => Some(("anthropic", 0)),
        "openai" => Some(("openai", 1)),
        "gcp.gemini" => Some(("google", 2)),
        _ => None,
    }
}

/// A model name as the bundled table matched it: the table's model, ready
/// to price (`None`: the table has no such model).
type Matched = Option<Arc<Mutex<genai_prices::ExtractedUsage>>>;

/// One provider's matched model names.
type MatchedNames = HashMap<Box<str>, Matched>;

/// The bundled table's answer to "which model is this name", per provider
/// of [`table_provider`] and model name. The table is compiled into the
/// process and never changes, so an entry cannot go stale; matching a name
/// runs the table's regular expressions over the provider's models, which
/// cost more than the price itself.
static MATCHED: LazyLock<[RwLock<MatchedNames>; 3]> =
    LazyLock::new(|| std::array::from_fn(|_| RwLock::new(HashMap::new())));

/// Names kept per provider: a model name comes from the provider's
/// answers, so the cache is bounded; a name beyond it is matched on each
/// call, as if there were no cache.
const MATCHED_PER_PROVIDER: usize = 256;

/// The bundled table's price of `usage` on `model`, rounded up to the
/// nano-dollar. The table works in floating point per call; the totals
/// are summed in whole nano-dollars, so they do not drift. The model is
/// matched once per name (see [`MATCHED`]); a provider the table's ids do
/// not name is matched by the model on each call.
fn table_cost(provider: &str, model: &str, usage: &Usage) -> Option<Usd> {
    let Some((id, slot)) = table_provider(provider) else {
        return table_cost_matching(None, model, usage);
    };
    let cache = &MATCHED[slot];
    let found = cache
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(model)
        .cloned();
    let matched = match found {
        Some(matched) => matched,
        None => match match_model(id, model) {
            Ok(matched) => {
                let mut cache = cache.write().unwrap_or_else(PoisonError::into_inner);
                if cache.len() < MATCHED_PER_PROVIDER {
                    cache.insert(model.into(), matched.clone());
                } else {
                    tracing::debug!(
                        provider = id,
                        model,
                        "the price table's cache of model names is full: this name is matched on each call"
                    );
                }
                matched
            }
            Err(error) => {
                tracing::debug!(
                    provider = id,
                    model,
                    %error,
                    "the price table could not match the model once: it is matched on each call"
                );
                return table_cost_matching(Some(id), model, usage);
            }
        },
    };
    let matched = matched?;
    let mut extracted = matched.lock().unwrap_or_else(PoisonError::into_inner);
    extracted.usage = table_usage(usage);
    let request = extracted.price_request()?;
    finite_price(genai_prices::calculate(&request).ok()?.total_price)
}

/// `model` as the bundled table matches it for provider `id`: the table's
/// model (`None` when it has none), as its usage extraction finds it from
/// an answer naming `model`, whose request then prices that model without
/// matching the name again. The answer is in the one shape every provider
/// of [`table_provider`] reads: a `model` and a `usage` of input and
/// output tokens (Gemini's in its Anthropic flavour).
fn match_model(id: &str, model: &str) -> Result<Matched, String> {
    use genai_prices::{ErrorKind, ExtractRequest};

    let answer = serde_json::json!({
        "model": model,
        "usage": { "input_tokens": 1, "output_tokens": 1 },
    });
    let flavor = match id {
        "openai" => "responses",
        "google" => "anthropic",
        _ => "default",
    };
    let request = ExtractRequest::from_value(&answer)
        .with_provider_id(id)
        .with_api_flavor(flavor);
    match genai_prices::extract_usage(&request) {
        Ok(extracted) if extracted.price_request().is_some() => {
            Ok(Some(Arc::new(Mutex::new(extracted))))
        }
        Ok(_) => Err("the table's extraction named no model".to_owned()),
        Err(error) if error.kind() == ErrorKind::ModelNotFound => Ok(None),
        Err(error) => Err(error.to_string()),
    }
}

/// The bundled table's price of `usage` on `model`, matching the model's
/// name on this call (of provider `id`, else of the provider whose models
/// the name matches).
fn table_cost_matching(id: Option<&str>, model: &str, usage: &Usage) -> Option<Usd> {
    use genai_prices::PriceRequest;

    let counted = table_usage(usage);
    let mut request = PriceRequest::new(model, &counted);
    if let Some(id) = id {
        request = request.with_provider_id(id);
    }
    finite_price(genai_prices::calculate(&request).ok()?.total_price)
}

/// `usage` in the table's terms.
fn table_usage(usage: &Usage) -> genai_prices::Usage {
    use genai_prices::{Usage as TableUsage, UsageKey};

    let as_f64 = |n: u64| n as f64;
    // The table's input counts the cached tokens too.
    let input = usage
        .input_tokens
        .saturating_add(usage.cache_read_input_tokens)
        .saturating_add(usage.cache_creation_input_tokens);
    TableUsage::from([
        (UsageKey::INPUT_TOKENS, as_f64(input)),
        (UsageKey::OUTPUT_TOKENS, as_f64(usage.output_tokens)),
        (
            UsageKey::CACHE_READ_TOKENS,
            as_f64(usage.cache_read_input_tokens),
        ),
        (
            UsageKey::CACHE_WRITE_TOKENS,
            as_f64(usage.cache_creation_input_tokens),
        ),
    ])
}

/// The table's price in dollars as an amount, rounded up to the
/// nano-dollar (`None` for one that is not a finite amount).
fn finite_price(price: f64) -> Option<Usd> {
    if !price.is_finite() || price < 0.0 {
        return None;
    }
    // Saturates at the largest amount for a price beyond it.
    let nanos = (price * 1e9).ceil() as u64;
    Some(Usd::from_nanos(nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn used(tokens: u64, requests: u64) -> Usage {
        Usage {
            input_tokens: tokens,
            requests,
            ..Usage::default()
        }
    }

    #[test]
    fn zero_and_unreachable_bounds_are_refused() {
        let zero = UsageLimits::builder()
            .per_turn(Limit::new().requests(0))
            .build();
        assert_eq!(
            zero,
            Err(UsageLimitsError::Zero {
                scope: LimitScope::Turn,
                kind: LimitKind::Requests
            })
        );
        let conflict = UsageLimits::builder()
            .per_run(Limit::new().tokens(1_000))
            .per_session(Limit::new().tokens(500))
            .build();
        assert_eq!(
            conflict,
            Err(UsageLimitsError::Conflict {
                kind: LimitKind::Tokens,
                inner: LimitScope::Run,
                outer: LimitScope::Session
            })
        );
        // Different counts never conflict.
        assert!(
            UsageLimits::builder()
                .per_run(Limit::new().tokens(1_000))
                .per_session(Limit::new().requests(5))
                .build()
                .is_ok()
        );
    }

    #[test]
    fn stored_limits_are_checked_as_built_ones_are() {
        let limits: Result<UsageLimits, _> = serde_json::from_str(r#"{"turn": {"tokens": 0}}"#);
        assert!(limits.is_err());
        let limits = UsageLimits::builder()
            .per_session(Limit::new().cost(Usd::from_cents(5)))
            .build()
            .unwrap();
        let json = serde_json::to_string(&limits).unwrap();
        assert_eq!(json, r#"{"session":{"cost":"0.05"}}"#);
        assert_eq!(serde_json::from_str::<UsageLimits>(&json).unwrap(), limits);
    }

    #[test]
    fn a_call_is_admitted_only_if_it_fits_every_scope() {
        let limits = UsageLimits::builder()
            .per_turn(Limit::new().requests(3))
            .per_session(Limit::new().tokens(1_000))
            .build()
            .unwrap();
        let totals = UsageTotals {
            session: used(700, 5),
            turn: used(100, 2),
        };
        let meter = UsageMeter::new(limits, Usage::default(), totals);
        assert_eq!(meter.admit(&used(200, 1)), Ok(()));
        // The first call's reservation counts: a third request is over
        // the turn's bound.
        let refused = meter.admit(&used(10, 1)).unwrap_err();
        assert_eq!(refused.scope, LimitScope::Turn);
        assert_eq!(refused.kind, LimitKind::Requests);
        assert_eq!((refused.limit, refused.used, refused.estimate), (3, 3, 1));
    }

    #[test]
    fn tokens_are_priced_exactly() {
        let price = ModelPrice::per_million_tokens(Usd::from_cents(300), Usd::from_cents(1500))
            .cache_read(Usd::from_cents(30));
        let usage = Usage {
            input_tokens: 1_000,
            output_tokens: 100,
            cache_read_input_tokens: 10_000,
            ..Usage::default()
        };
        // 1000 × $3/M + 100 × $15/M + 10000 × $0.30/M = $0.0075.
        assert_eq!(price.cost(&usage), Usd::from_micros(7_500));
        // A part of a nano-dollar is rounded up.
        let one = Usage {
            input_tokens: 1,
            ..Usage::default()
        };
        let tiny = ModelPrice::per_million_tokens(Usd::from_nanos(1), Usd::ZERO);
        assert_eq!(tiny.cost(&one), Usd::from_nanos(1));
    }

    #[test]
    fn given_prices_win_and_unknown_models_are_unpriced() {
        let usage = used(1_000_000, 1);
        let prices = Prices::table().model(
            "claude-sonnet-4-5",
            ModelPrice::per_million_tokens(Usd::from_cents(1), Usd::ZERO),
        );
        assert_eq!(
            prices.cost("anthropic", "claude-sonnet-4-5", &usage),
            Some(Usd::from_cents(1))
        );
        assert_eq!(
            prices.cost("openai", "no-such-model-anywhere", &usage),
            None
        );
        assert_eq!(Prices::only_given().cost("openai", "gpt-4o", &usage), None);
    }

    #[test]
    fn the_table_prices_a_known_model() {
        let usage = Usage {
            input_tokens: 1_000_000,
            output_tokens: 1_000_000,
            ..Usage::default()
        };
        let cost = Prices::table()
            .cost("openai", "gpt-4o", &usage)
            .expect("gpt-4o is in the table");
        // $2.50 in and $10 out per million, as long as the table has held it.
        assert_eq!(cost, "12.50".parse().unwrap());
        let cached = Usage {
            cache_read_input_tokens: 1_000_000,
            ..Usage::default()
        };
        let read = Prices::table().cost("openai", "gpt-4o", &cached).unwrap();
        assert!(
            read < "2.50".parse().unwrap(),
            "cached input is cheaper: {read}"
        );
    }

    /// Every model of the three providers' tables, by its own name and
    /// by names the table matches loosely, priced once matched and priced
    /// matching the name on the call: the same amount, or both unpriced.
    #[test]
    fn a_model_matched_once_is_priced_as_matching_it_on_every_call() {
        let usages = [
            Usage {
                input_tokens: 1_000,
                output_tokens: 500,
                ..Usage::default()
            },
            // Above the long-context tiers some models price differently.
            Usage {
                input_tokens: 300_000,
                output_tokens: 2_000,
                cache_read_input_tokens: 50_000,
                cache_creation_input_tokens: 20_000,
                ..Usage::default()
            },
        ];
        let calculator = genai_prices::Calculator::bundled();
        let mut compared = 0;
        for (provider, id) in [
            ("anthropic", "anthropic"),
            ("openai", "openai"),
            ("gcp.gemini", "google"),
        ] {
            let table = calculator
                .find_provider(Some(id), None)
                .unwrap()
                .unwrap_or_else(|| panic!("{id} is in the table"));
            let mut names: Vec<String> = Vec::new();
            for model in table.models() {
                let name = model.id();
                names.extend([
                    name.to_owned(),
                    name.to_uppercase(),
                    format!("{name}-20250514"),
                    format!("{name}-latest"),
                ]);
            }
            names.extend(["not-a-model".to_owned(), String::new()]);
            for name in &names {
                for usage in &usages {
                    // Twice: the first call matches and fills the cache,
                    // the second reads it.
                    for _ in 0..2 {
                        assert_eq!(
                            table_cost(provider, name, usage),
                            table_cost_matching(Some(id), name, usage),
                            "{provider} {name:?} {usage:?}"
                        );
                        compared += 1;
                    }
                }
            }
        }
        assert!(compared > 500, "{compared} comparisons");
        let priced = Usage {
            input_tokens: 1_000_000,
            ..Usage::default()
        };
        assert!(table_cost("anthropic", "claude-sonnet-4-5", &priced).is_some());
    }

    #[test]
    fn a_matched_name_is_kept_and_an_unknown_one_too() {
        let usage = used(1_000, 1);
        assert!(table_cost("openai", "gpt-4o-mini", &usage).is_some());
        assert_eq!(table_cost("openai", "no-such-model-here", &usage), None);
        let cache = MATCHED[1].read().unwrap();
        assert!(matches!(cache.get("gpt-4o-mini"), Some(Some(_))));
        assert!(matches!(cache.get("no-such-model-here"), Some(None)));
    }

    #[test]
    fn a_provider_the_table_does_not_name_is_matched_by_the_model() {
        let usage = used(1_000_000, 1);
        assert_eq!(
            table_cost("some.gateway", "gpt-4o", &usage),
            table_cost_matching(None, "gpt-4o", &usage)
        );
        assert!(table_cost("some.gateway", "gpt-4o", &usage).is_some());
    }
}
