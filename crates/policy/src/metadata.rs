//! What the registry knows about each tool: [`ToolMetadata`], [`Mode`] and
//! [`Category`].

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use markov_core::tool::Delivery;
use serde::Serialize;

/// The kind of session a call runs in (`text`, `voice`, or an application's
/// own). An open newtype: any name is a mode.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct Mode(Cow<'static, str>);

impl Mode {
    /// A text chat.
    pub const TEXT: Mode = Mode(Cow::Borrowed("text"));
    /// A voice session.
    pub const VOICE: Mode = Mode(Cow::Borrowed("voice"));

    /// A mode by name.
    pub fn new(name: impl Into<String>) -> Self {
        Mode(Cow::Owned(name.into()))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a tool does, for budgets and audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Reads information (search, lookup).
    Retrieval,
    /// Changes something in the world.
    Action,
    /// Anything else.
    Other,
}

impl Category {
    /// The wire name (`"retrieval"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Category::Retrieval => "retrieval",
            Category::Action => "action",
            Category::Other => "other",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Category::Retrieval => 0,
            Category::Action => 1,
            Category::Other => 2,
        }
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The registry's facts about one tool.
///
/// Defaults: every mode allowed, no confirmation, a 2 s latency budget,
/// version `"1.0.0"`, no timeout, the [`Delivery`] the tool's definition
/// states (or its default), offered up front (not deferred).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolMetadata {
    allowed_modes: Option<Vec<Mode>>,
    category: Category,
    requires_confirmation: bool,
    latency_budget: Duration,
    version: String,
    timeout: Option<Duration>,
    delivery: Option<Delivery>,
    deferred: bool,
}

impl ToolMetadata {
    /// Metadata of a tool of `category`, with the defaults above.
    pub fn new(category: Category) -> Self {
        ToolMetadata {
            allowed_modes: None,
            category,
            requires_confirmation: false,
            latency_budget: Duration::from_secs(2),
            version: "1.0.0".to_owned(),
            timeout: None,
            delivery: None,
            deferred: false,
        }
    }

    /// Defers the tool: it is registered but not offered up front; the
    /// built-in `search_tools` tool (added to the registry when a tool is
    /// deferred) finds it, and it is offered from then on (see
    /// [`ToolSearch`](crate::ToolSearch)). A deferred tool runs through the
    /// same policies as any other; a call of it before it is found is run
    /// too (a provider's own tool search may have found it).
    #[must_use]
    pub fn deferred(mut self) -> Self {
        self.deferred = true;
        self
    }

    /// Whether the tool is deferred (see [`deferred`](Self::deferred)).
    pub fn is_deferred(&self) -> bool {
        self.deferred
    }

    /// Restricts the tool to these modes.
    #[must_use]
    pub fn with_modes(mut self, modes: impl IntoIterator<Item = Mode>) -> Self {
        self.allowed_modes = Some(modes.into_iter().collect());
        self
    }

    /// Requires the user's confirmation before each execution.
    #[must_use]
    pub fn with_confirmation(mut self) -> Self {
        self.requires_confirmation = true;
        self
    }

    /// Sets the soft latency budget (a warning when exceeded).
    #[must_use]
    pub fn with_latency_budget(mut self, budget: Duration) -> Self {
        self.latency_budget = budget;
        self
    }

    /// Sets the tool's version.
    #[must_use]
    pub fn with_version(mut self, version: impl Into<String>) -> Self {
        self.version = version.into();
        self
    }

    /// Sets a hard timeout (needs a tokio runtime with time enabled).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// States the tool's [`Delivery`] contract, over what its definition
    /// says: what a resumed conversation does with a call interrupted
    /// before its result was recorded.
    #[must_use]
    pub fn with_delivery(mut self, delivery: Delivery) -> Self {
        self.delivery = Some(delivery);
        self
    }

    /// The [`Delivery`] contract set by [`with_delivery`](Self::with_delivery),
    /// if any.
    pub fn delivery(&self) -> Option<Delivery> {
        self.delivery
    }

    /// The allowed modes; `None` allows every mode.
    pub fn allowed_modes(&self) -> Option<&[Mode]> {
        self.allowed_modes.as_deref()
    }

    /// Whether the tool may run in `mode`.
    pub fn allows(&self, mode: &Mode) -> bool {
        self.allowed_modes
            .as_ref()
            .is_none_or(|modes| modes.contains(mode))
    }

    /// The category.
    pub fn category(&self) -> Category {
        self.category
    }

    /// Whether each execution needs a confirmation token.
    pub fn requires_confirmation(&self) -> bool {
        self.requires_confirmation
    }

    /// The soft latency budget.
    pub fn latency_budget(&self) -> Duration {
        self.latency_budget
    }

    /// The tool's version.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The hard timeout, if any.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }
}
