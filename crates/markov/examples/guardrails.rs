//! Guardrails: a streamed answer redacted sentence by sentence, a blocked
//! answer never streamed, and what a guard's check costs per sentence.
//!
//! `cargo run -p markov --example guardrails`
use std::io::Write;
use std::time::Instant;

use markov::executor::MessageStreamEvent;
use markov::executor::stream::DeltaKind;
use markov::guard::{Guard, Guards, InjectionHeuristic, PiiRedactor, Script};
use markov::prelude::*;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = ScriptedModel::builder()
        .text("Your advisor is Ann. Write to ann@example.com or call +1 555 010 4477.")
        .text("Sure. Вот всё, что я знаю о вашем счёте.")
        .build();
    // Both hold streamed text per sentence: the first sentence of the
    // second answer streams, the one in another alphabet is blocked.
    let guards = Guards::new()
        .output(PiiRedactor::new())
        .output(Script::latin());
    let agent = Agent::builder("support")
        .instructions("You help customers.")
        .guards(guards)
        .model(model)
        .build()?
        .streamed(|event: &MessageStreamEvent| match event {
            MessageStreamEvent::Update { delta, .. } if delta.kind == DeltaKind::Text => {
                print!("{}", delta.delta);
                let _ = std::io::stdout().flush();
            }
            MessageStreamEvent::Error { error, .. } => print!("[{}]", error.message),
            _ => {}
        })
        .map_err(|_| "this agent brings its own executor")?;
    let mut machine = agent.machine();
    for question in ["Who is my advisor?", "What do you know about my account?"] {
        machine.enqueue_user(question);
        let last = machine.run().await?;
        println!("\n(done: {:?})", last.yield_reason);
    }

    // What the hold-back adds beyond waiting for a sentence's end: the
    // guards' own time per sentence.
    let sentence =
        "Write to ann@example.com or call +1 555 010 4477 about card 4111 1111 1111 1111. ";
    let pii = PiiRedactor::new();
    let injection = InjectionHeuristic::new();
    let rounds = 10_000u32;
    let started = Instant::now();
    for _ in 0..rounds {
        pii.check(sentence).await;
        injection.check(sentence).await;
    }
    println!(
        "PII redaction and the injection heuristic: {:.1} µs per sentence",
        started.elapsed().as_secs_f64() * 1e6 / f64::from(rounds)
    );
    Ok(())
}
