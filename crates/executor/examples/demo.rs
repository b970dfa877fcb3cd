//! The README's demo: an agent with two tools answers one question.
//!
//! With no provider configured it runs on a scripted model, and says so.

use std::convert::Infallible;

use futures::StreamExt;
use markov_core::message::{Item, Message};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Instance, Machine, RunOptions, StandardExecutor, run_machine};
use markov_runtime::charter::Charter;
use markov_runtime::node::Node;
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

/// Adds two integers.
struct Add;

#[derive(Deserialize, JsonSchema)]
struct AddArgs {
    /// The first addend.
    a: i64,
    /// The second addend.
    b: i64,
}

impl Tool for Add {
    const NAME: &'static str = "add";
    type Args = AddArgs;
    type Output = i64;
    type Error = Infallible;
    fn description(&self) -> String {
        "Add two integers.".into()
    }
    async fn call(&self, args: AddArgs, _cx: &ToolContext<'_>) -> Result<i64, Infallible> {
        Ok(args.a + args.b)
    }
}

/// Looks up a city's population in a small table.
struct Population;

#[derive(Deserialize, JsonSchema)]
struct PopulationArgs {
    /// The city.
    city: String,
}

#[derive(Debug, thiserror::Error)]
#[error("no population known for {0}")]
struct UnknownCity(String);

impl Tool for Population {
    const NAME: &'static str = "population";
    type Args = PopulationArgs;
    type Output = i64;
    type Error = UnknownCity;
    fn description(&self) -> String {
        "Population of a city (Lisbon, Porto).".into()
    }
    async fn call(&self, args: PopulationArgs, _cx: &ToolContext<'_>) -> Result<i64, UnknownCity> {
        match args.city.as_str() {
            "Lisbon" => Ok(545_923),
            "Porto" => Ok(231_962),
            _ => Err(UnknownCity(args.city)),
        }
    }
}

fn print_message(message: &Message) {
    for item in message.item_list() {
        match item {
            Item::Text { text } => println!("  {:?}: {text}", message.role),
            Item::ToolUse { name, input, .. } => println!("  model calls {name}({input})"),
            Item::ToolResult {
                content, is_error, ..
            } => println!(
                "  tool {}: {content}",
                if *is_error == Some(true) {
                    "error"
                } else {
                    "result"
                }
            ),
            _ => {}
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("model: scripted (no provider configured; this run is a rehearsal, not a real model)");
    let model = ScriptedModel::builder()
        .tool_calls([
            ("population", json!({"city": "Lisbon"})),
            ("population", json!({"city": "Porto"})),
        ])
        .tool_call("add", json!({"a": 545_923, "b": 231_962}))
        .text("Lisbon and Porto have 777885 inhabitants together.")
        .build();
    let node = Node::builder("You answer questions about cities with your tools.")
        .name("cities")
        .tool(Add)
        .tool(Population)
        .build()?;
    let charter = Charter::builder("demo")
        .node("cities", node.clone())
        .build()?;
    let mut machine = Machine::new(
        charter,
        StandardExecutor::new(model),
        Instance::new(node, json!({})),
    )?;
    machine.enqueue_user("How many people live in Lisbon and Porto together?");
    let mut steps = std::pin::pin!(run_machine(&mut machine, RunOptions::default()));
    let mut n = 0;
    while let Some(step) = steps.next().await {
        let step = step?;
        n += 1;
        println!("step {n} ({}):", step.yield_reason.as_str());
        for message in &step.history {
            print_message(message);
        }
    }
    Ok(())
}
