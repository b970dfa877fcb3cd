//! Streaming: the answer's text as the model writes it, then the step.
//!
//! `cargo run -p markov --example streaming`
use std::io::Write;

use markov::executor::MessageStreamEvent;
use markov::executor::stream::DeltaKind;
use markov::prelude::*;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = ScriptedModel::builder()
        .text("Streaming sends the answer in pieces as it is written.")
        .build();
    let agent = Agent::builder("streamer")
        .instructions("You explain things briefly.")
        .model(model)
        .build()?
        .streamed(|event: &MessageStreamEvent| {
            if let MessageStreamEvent::Update { delta, .. } = event
                && delta.kind == DeltaKind::Text
            {
                print!("{}", delta.delta);
                let _ = std::io::stdout().flush();
            }
        })
        .map_err(|_| "this agent brings its own executor")?;
    let mut machine = agent.machine();
    machine.enqueue_user("What is streaming?");
    let last = machine.run().await?;
    println!("\n(done: {:?})", last.yield_reason);
    Ok(())
}
