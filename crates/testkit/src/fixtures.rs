//! Tools for tests, written with `#[tool]`: the ones scenario tests keep
//! needing (arithmetic, a payment with a side effect you can count, one
//! that needs approval, one that panics, one that never finishes), and
//! [`Counted`], which counts the calls of any tool.
//!
//! ```
//! use markov_core::tool::{DynTool, Erased, NoState, ToolContext, ToolOutcome};
//! use markov_core::ToolCallId;
//! use markov_testkit::fixtures::{Add, Counted, Pay};
//! use serde_json::json;
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let pay = Pay::default();
//! let add = Counted::new(Add);
//! let (id, state) = (ToolCallId::new("c1"), NoState::default());
//! let cx = ToolContext::new(&id, &[], &state);
//! let tool = Erased::new(pay.clone()).unwrap();
//! let out = tool.call_json(&json!({"amount": 5}), cx).await.unwrap();
//! assert_eq!(out, ToolOutcome::Value(json!("paid 5")));
//! assert_eq!(pay.paid(), [5]); // clones share the record
//! let out = Erased::new(add.clone()).unwrap().call_json(&json!({"a": 2, "b": 3}), cx).await;
//! assert_eq!(out.unwrap(), ToolOutcome::Value(json!(5)));
//! assert_eq!(add.calls(), 1);
//! # });
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext};

/// Adds two integers.
#[markov_core::tool]
pub async fn add(
    /// The first summand.
    a: i64,
    /// The second summand.
    b: i64,
) -> i64 {
    a + b
}

/// The amounts a [`Pay`] or [`Wire`] paid, in order; clones share it.
#[derive(Debug, Clone, Default)]
pub struct Payments(Arc<Mutex<Vec<u32>>>);

impl Payments {
    /// Every amount paid so far, in order.
    pub fn paid(&self) -> Vec<u32> {
        self.lock().clone()
    }

    /// How many payments were made: how often the tool really ran.
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    fn record(&self, amount: u32) {
        self.lock().push(amount);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        // A test that panicked while holding the lock has failed already;
        // the record is still readable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// `pay`: pays an amount, a side effect recorded in its [`Payments`] so a
/// test can count how often it really ran. Answers `paid <amount>`.
#[derive(Debug, Clone, Default)]
pub struct Pay {
    /// Where its payments are recorded.
    pub payments: Payments,
}

#[markov_core::tool]
impl Pay {
    /// Pays an amount.
    pub async fn pay(
        &self,
        /// The amount to pay.
        amount: u32,
    ) -> String {
        self.payments.record(amount);
        format!("paid {amount}")
    }
}

impl Pay {
    /// Every amount paid so far, in order.
    pub fn paid(&self) -> Vec<u32> {
        self.payments.paid()
    }

    /// A [`Wire`] that records its payments with this one's.
    pub fn wire(&self) -> Wire {
        Wire {
            payments: self.payments.clone(),
        }
    }
}

/// `wire`: [`Pay`] that needs the application's approval for every call,
/// by its own definition (no registry needed). Answers `wired <amount>`.
#[derive(Debug, Clone, Default)]
pub struct Wire {
    /// Where its payments are recorded.
    pub payments: Payments,
}

#[markov_core::tool(needs_approval)]
impl Wire {
    /// Wires an amount.
    pub async fn wire(
        &self,
        /// The amount to wire.
        amount: u32,
    ) -> String {
        self.payments.record(amount);
        format!("wired {amount}")
    }
}

impl Wire {
    /// Every amount wired so far, in order.
    pub fn paid(&self) -> Vec<u32> {
        self.payments.paid()
    }
}

/// `explode`: a tool with a bug, it panics (an index out of bounds).
#[markov_core::tool]
pub async fn explode() -> String {
    let none: Vec<String> = Vec::new();
    // Out of bounds whatever the input: the kind of bug that panics.
    none[none.len()].clone()
}

/// `hang`: never finishes (for timeouts and cancellation).
#[markov_core::tool]
pub async fn hang() -> String {
    std::future::pending::<String>().await
}

/// Any tool, counting its calls (the runs of its `call`, whatever they
/// return); clones share the count.
#[derive(Debug, Clone, Default)]
pub struct Counted<T> {
    tool: T,
    calls: Arc<AtomicUsize>,
}

impl<T> Counted<T> {
    /// Counts the calls of `tool`.
    pub fn new(tool: T) -> Self {
        Counted {
            tool,
            calls: Arc::default(),
        }
    }

    /// How often the tool was called.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

// Written by hand: `#[tool]` makes tools of concrete types, and this
// forwards every part of any tool's definition.
#[async_trait]
impl<T: Tool> Tool for Counted<T> {
    const NAME: &'static str = T::NAME;
    const TERMINAL: bool = T::TERMINAL;
    const NEEDS_APPROVAL: bool = T::NEEDS_APPROVAL;
    type Args = T::Args;
    type Output = T::Output;
    type Error = T::Error;

    fn description(&self) -> String {
        self.tool.description()
    }

    async fn call(&self, args: T::Args, cx: &ToolContext<'_>) -> Result<T::Output, T::Error> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.tool.call(args, cx).await
    }
}
