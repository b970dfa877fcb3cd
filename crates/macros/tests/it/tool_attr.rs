//! `#[tool]` on plain async functions and on a struct's method: names,
//! descriptions, parameter docs in the schema, the options, the context
//! parameter, fallible and infallible functions, and a call through the
//! erased tool the loop uses.

use markov_core::ToolCallId;
use markov_core::tool::{DynTool, Erased, NoState, Tool, ToolCallError, ToolContext, ToolOutcome};
use markov_macros::tool;
use serde_json::json;

/// Adds two integers.
///
/// Both may be negative.
#[tool]
async fn add(
    /// The first summand.
    a: i64,
    /// The second summand,
    /// on two lines.
    b: i64,
) -> i64 {
    a + b
}

/// Greets whoever the call is for.
#[tool(name = "greet_caller")]
async fn greet(cx: &ToolContext<'_>, greeting: String) -> String {
    format!("{greeting}, {}", cx.call_id())
}

/// The tenant a tool works for: what an application would hand a tool
/// (a database pool, an HTTP client) when it builds the agent.
struct Tenant {
    name: String,
}

#[tool(name = "greet_tenant")]
impl Tenant {
    /// Greets the tenant.
    async fn greet(
        &self,
        cx: &ToolContext<'_>,
        /// How to greet.
        greeting: String,
    ) -> Result<String, DivideByZero> {
        Ok(format!("{greeting}, {} ({})", self.name, cx.call_id()))
    }
}

/// A tool with dependencies and no parameters.
#[derive(Clone)]
struct Clock {
    now: u64,
}

#[tool]
impl Clock {
    /// The time.
    pub(crate) async fn time(&self) -> u64 {
        self.now
    }
}

/// Answers the user, and ends the turn with the answer.
#[tool(terminal)]
async fn answer(text: String) -> String {
    text
}

#[derive(Debug, thiserror::Error)]
#[error("cannot divide by zero")]
struct DivideByZero;

/// Divides.
#[tool(description = "Divide a by b")]
async fn divide(a: f64, b: f64) -> Result<f64, DivideByZero> {
    if b == 0.0 {
        Err(DivideByZero)
    } else {
        Ok(a / b)
    }
}

/// Transfers money.
#[tool(name = "transfer", needs_approval)]
async fn transfer(amount: u32) -> String {
    format!("sent {amount}")
}

#[test]
fn needs_approval_marks_the_definition_and_nothing_else() {
    const { assert!(<Transfer as Tool>::NEEDS_APPROVAL) };
    const { assert!(!<Add as Tool>::NEEDS_APPROVAL) };
    let transfer = Erased::new(Transfer).expect("a valid name");
    assert!(transfer.definition().needs_approval);
    assert_eq!(transfer.definition().name.as_str(), "transfer");
    assert!(
        !Erased::new(Add)
            .expect("a valid name")
            .definition()
            .needs_approval
    );
}

/// Sends an email: it cannot honour an idempotency key.
#[tool(at_most_once)]
async fn send_email(to: String) -> String {
    format!("sent to {to}")
}

/// Refunds, deduplicated by the provider's idempotency key.
#[tool(needs_approval, at_least_once)]
async fn refund(amount: u32) -> String {
    format!("refunded {amount}")
}

#[test]
fn at_most_once_and_at_least_once_set_the_delivery_contract() {
    use markov_core::tool::Delivery;
    let email = Erased::new(SendEmail).expect("a valid name");
    assert_eq!(email.definition().delivery, Some(Delivery::AtMostOnce));
    assert!(!email.definition().needs_approval);
    assert_eq!(
        email.definition().effective_delivery(),
        Delivery::AtMostOnce
    );
    let refund = Erased::new(Refund).expect("a valid name");
    assert_eq!(refund.definition().delivery, Some(Delivery::AtLeastOnce));
    assert_eq!(
        refund.definition().effective_delivery(),
        Delivery::AtLeastOnce,
        "a tool that needs approval is opted back into at least once"
    );
    // Unstated: the default follows the approval.
    let transfer = Erased::new(Transfer).expect("a valid name");
    assert_eq!(transfer.definition().delivery, None);
    assert_eq!(
        transfer.definition().effective_delivery(),
        Delivery::AtMostOnce
    );
    let add = Erased::new(Add).expect("a valid name");
    assert_eq!(add.definition().delivery, None);
    assert_eq!(add.definition().effective_delivery(), Delivery::AtLeastOnce);
}

#[test]
fn terminal_marks_the_definition_and_nothing_else() {
    const { assert!(<Answer as Tool>::TERMINAL) };
    const { assert!(!<Answer as Tool>::NEEDS_APPROVAL) };
    const { assert!(!<Add as Tool>::TERMINAL) };
    const { assert!(!<Transfer as Tool>::TERMINAL) };
    let answer = Erased::new(Answer).expect("a valid name");
    assert!(answer.definition().terminal);
    assert!(!answer.definition().needs_approval);
    assert!(
        !Erased::new(Add)
            .expect("a valid name")
            .definition()
            .terminal
    );
}

#[test]
fn names_and_descriptions_come_from_the_function() {
    assert_eq!(<Add as Tool>::NAME, "add");
    assert_eq!(
        Add.description(),
        "Adds two integers.\n\nBoth may be negative."
    );
    assert_eq!(<Greet as Tool>::NAME, "greet_caller");
    assert_eq!(Divide.description(), "Divide a by b");
}

#[test]
fn parameter_docs_are_the_schemas_descriptions() {
    let add = Erased::new(Add).expect("a valid name");
    let properties = &add.definition().input_schema["properties"];
    assert_eq!(properties["a"]["description"], "The first summand.");
    assert_eq!(
        properties["b"]["description"],
        "The second summand,\non two lines."
    );
    assert_eq!(properties["a"]["type"], "integer");
    assert!(
        add.definition().input_schema.get("description").is_none(),
        "the arguments struct's own doc is not sent to the model"
    );
    let divide = Erased::new(Divide).expect("a valid name");
    let properties = &divide.definition().input_schema["properties"];
    assert!(properties["a"].is_object());
    assert!(
        properties["a"].get("description").is_none(),
        "an undocumented parameter has no description: {properties}"
    );
}

#[test]
fn a_method_makes_its_struct_the_tool() {
    assert_eq!(<Tenant as Tool>::NAME, "greet_tenant");
    assert_eq!(<Clock as Tool>::NAME, "time");
    let tenant = Tenant {
        name: "acme".into(),
    };
    assert_eq!(tenant.description(), "Greets the tenant.");
    let definition = Erased::new(tenant)
        .expect("a valid name")
        .definition()
        .clone();
    assert_eq!(definition.input_schema["required"], json!(["greeting"]));
    assert_eq!(
        definition.input_schema["properties"]["greeting"]["description"],
        "How to greet."
    );
    assert!(definition.input_schema["properties"].get("cx").is_none());
    let clock = Erased::new(Clock { now: 7 }).expect("a valid name");
    assert_eq!(clock.definition().input_schema, json!({"type": "object"}));
    // The arguments struct is named after the struct.
    let _: TenantArgs = serde_json::from_value(json!({"greeting": "Hi"})).expect("args");
    let _: ClockArgs = serde_json::from_value(json!({})).expect("args");
}

#[test]
fn the_schema_lists_the_parameters_but_not_the_context() {
    let tool = Erased::new(Greet).expect("a valid name");
    let schema = &tool.definition().input_schema;
    assert_eq!(schema["required"], json!(["greeting"]));
    assert!(schema["properties"]["greeting"].is_object());
    assert!(schema["properties"].get("cx").is_none());
    let add = Erased::new(Add).expect("a valid name");
    assert_eq!(add.definition().input_schema["required"], json!(["a", "b"]));
}

#[tokio::test]
async fn the_erased_tool_calls_the_function() {
    let id = ToolCallId::new("c1");
    let state = NoState::default();
    let cx = ToolContext::new(&id, &[], &state);

    let add = Erased::new(Add).expect("tool");
    let out = add
        .call_json(&json!({"a": 2, "b": 3}), cx)
        .await
        .expect("adds");
    assert_eq!(out, ToolOutcome::Value(json!(5)));

    let greet = Erased::new(Greet).expect("tool");
    let out = greet
        .call_json(&json!({"greeting": "Hello"}), cx)
        .await
        .expect("greets");
    assert_eq!(out, ToolOutcome::Value(json!("Hello, c1")));

    let tenant = Erased::new(Tenant {
        name: "acme".into(),
    })
    .expect("tool");
    let out = tenant
        .call_json(&json!({"greeting": "Hello"}), cx)
        .await
        .expect("greets");
    assert_eq!(out, ToolOutcome::Value(json!("Hello, acme (c1)")));
    // The struct's own method stays callable.
    let clock = Clock { now: 42 };
    assert_eq!(clock.time().await, 42);
    let out = Erased::new(clock)
        .expect("tool")
        .call_json(&json!({}), cx)
        .await
        .expect("tells the time");
    assert_eq!(out, ToolOutcome::Value(json!(42)));

    let divide = Erased::new(Divide).expect("tool");
    let err = divide
        .call_json(&json!({"a": 1.0, "b": 0.0}), cx)
        .await
        .expect_err("fails");
    assert!(matches!(err, ToolCallError::Execution(m) if m == "cannot divide by zero"));
    let err = add
        .call_json(&json!({"a": "two"}), cx)
        .await
        .expect_err("bad input");
    assert!(matches!(err, ToolCallError::InvalidInput(_)));
}
