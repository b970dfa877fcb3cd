//! `markov-eval`: runs eval datasets against the demo agent
//! ([`markov_cli::demo_eval_agent`]), offline on each case's script or on
//! the real model the environment configures, as `markov-demo` picks it.
//!
//! ```text
//! cargo run -p markov-cli --bin markov-eval -- run crates/cli/evals/demo.toml
//! OPENAI_BASE_URL=http://localhost:8080/v1 cargo run -p markov-cli --bin markov-eval -- \
//!     run crates/cli/evals/demo.toml --repeat 5 --min-pass-rate 0.6
//! cargo run -p markov-cli --bin markov-eval -- export --store target/eval/demo/sessions.db --session <id>
//! ```
//!
//! See `markov_eval::cli` for the flags and `docs/guide/evals.md`.

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    markov_eval::cli::main(markov_cli::demo_eval_agent).await
}
