//! `#[tool]` on plain async functions: names, descriptions, schemas, the
//! context parameter, fallible and infallible functions, and a call through
//! the erased tool the loop uses.

use markov_core::ToolCallId;
use markov_core::tool::{DynTool, Erased, NoState, Tool, ToolCallError, ToolContext, ToolOutcome};
use markov_macros::tool;
use serde_json::json;

/// Adds two integers.
///
/// Both may be negative.
#[tool]
async fn add(a: i64, b: i64) -> i64 {
    a + b
}

/// Greets the tenant the application handed to the run.
#[tool(name = "greet_tenant")]
async fn greet(cx: &ToolContext<'_>, greeting: String) -> String {
    let tenant = cx.deps::<&'static str>().copied().unwrap_or("nobody");
    format!("{greeting}, {tenant}")
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

#[test]
fn names_and_descriptions_come_from_the_function() {
    assert_eq!(<Add as Tool>::NAME, "add");
    assert_eq!(
        Add.description(),
        "Adds two integers.\n\nBoth may be negative."
    );
    assert_eq!(<Greet as Tool>::NAME, "greet_tenant");
    assert_eq!(Divide.description(), "Divide a by b");
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
    let tenant: &'static str = "acme";
    let cx = ToolContext::new(&id, &[], &state).with_deps(Some(&tenant));

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
    assert_eq!(out, ToolOutcome::Value(json!("Hello, acme")));

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
