//! An eval binary of your own: the quickstart's calculator under
//! `markov-eval`'s command line, with its dataset in `evals/quickstart.toml`
//! (the facade's tests run it offline).
//!
//! `cargo run -p markov --features eval --example evals -- run crates/markov/evals/quickstart.toml`
//! (add a provider's variables, such as `OPENAI_BASE_URL`, for a real model).
use markov::prelude::*;

/// Adds two integers.
#[tool]
async fn add(a: i64, b: i64) -> i64 {
    a + b
}

/// The quickstart's calculator on `model`.
pub(crate) fn calculator(model: Arc<dyn Model>) -> Result<Agent, BuildError> {
    Agent::builder("calculator")
        .instructions("You do arithmetic with your tools.")
        .tool(Add)
        .shared_model(model)
        .build()
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    markov::eval::cli::main(calculator).await
}
