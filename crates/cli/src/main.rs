//! `markov-demo`, the README's demo: an agent with two tools, `add` and
//! `population`, answers "How many people live in Lisbon and Porto
//! together?" and prints each step of the run.
//!
//! The model is chosen at start, and the first line says which:
//!
//! - `ANTHROPIC_API_KEY` or `ANTHROPIC_BASE_URL` set: the Messages API, at
//!   Anthropic or at another address (a local server such as llama.cpp's,
//!   the base URL without `/v1`);
//! - else `GEMINI_API_KEY` or `GEMINI_BASE_URL` set: the Gemini API;
//! - else `OPENAI_API_KEY` or `OPENAI_BASE_URL` set: OpenAI's Responses API
//!   with `MARKOV_OPENAI_API=responses`, else an OpenAI-compatible Chat
//!   Completions server (OpenAI, vLLM, Ollama, llama.cpp, LM Studio; the
//!   base URL with `/v1`);
//! - else a scripted model, labelled as a rehearsal.
//!
//! The line names the API, the endpoint and the model. `MARKOV_MODEL`
//! names the model; without it a local server is asked which model it
//! serves, and a server serving several is an error that lists them.
//! The first model call must call a tool (the question needs them): a
//! server that ignores the tools it is offered (no tool-capable chat
//! template) is then an error that says how to start it, not a confident
//! made-up answer.
//!
//! `--mcp <server>` (or `MARKOV_MCP=<server>`) adds an MCP server's tools
//! to the agent, each named `mcp_<its name>`: `<server>` is a Streamable
//! HTTP URL or a command line (shell syntax: quote a path with spaces)
//! that starts a stdio server. `--mcp-config <file>` adds the servers of an
//! `mcpServers` JSON file, as Claude Desktop, Cursor and VS Code read it.
//! Both repeat. The next lines name each server and its tools, and the
//! tools that need approval and why (see [`markov_cli::mcp`]); the demo
//! approves nothing, so a call to one of those ends the run waiting for
//! an approval.
//!
//! A failure is printed on stderr and the process exits with status 1.
//!
//! ```text
//! cargo run -p markov-cli --bin markov-demo
//! ANTHROPIC_API_KEY=... cargo run -p markov-cli --bin markov-demo
//! ANTHROPIC_BASE_URL=http://localhost:8080 cargo run -p markov-cli --bin markov-demo
//! OPENAI_BASE_URL=http://localhost:11434/v1 cargo run -p markov-cli --bin markov-demo
//! cargo run -p markov-cli --bin markov-demo -- --mcp "npx -y @modelcontextprotocol/server-everything"
//! cargo run -p markov-cli --bin markov-demo -- --mcp-config ~/.cursor/mcp.json
//! MARKOV_MCP=http://127.0.0.1:8000/mcp cargo run -p markov-cli --bin markov-demo
//! ```

use std::process::ExitCode;

use futures::StreamExt;
use markov_core::message::{Item, Message};
use markov_executor::{BuildError, RunError, RunOptions, run_machine};

use markov_cli::mcp::{McpArgs, McpServers};
use markov_cli::{QUESTION, demo_agent, pick_settled_model_or, scripted};
use markov_executor::ToolChoiceEnforcer;
use markov_runtime::tool_choice::ToolChoiceRule;

/// Why the demo stopped early.
#[derive(Debug, thiserror::Error)]
enum DemoError {
    /// A provider client could not be built from the environment.
    #[error("cannot configure the model: {0}")]
    Provider(#[from] markov_providers::ConfigError),
    /// The agent is invalid.
    #[error("invalid agent: {0}")]
    Agent(#[from] BuildError),
    /// The run failed.
    #[error("the run failed: {0}")]
    Run(#[from] RunError),
    /// An MCP server could not be reached or listed.
    #[error("cannot use the MCP server: {0}")]
    Mcp(#[from] markov_mcp::McpError),
    /// The command line is not understood.
    #[error("{0}")]
    Usage(String),
}

/// The demo's command line.
#[derive(Debug, clap::Parser)]
#[command(name = "markov-demo", version)]
struct DemoArgs {
    #[command(flatten)]
    mcp: McpArgs,
}

/// The command line, or a usage error (`--help` prints and exits).
fn demo_args() -> Result<DemoArgs, DemoError> {
    use clap::Parser;
    DemoArgs::try_parse().map_err(|err| match err.kind() {
        clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
            let _ = err.print();
            std::process::exit(0)
        }
        _ => DemoError::Usage(
            err.render()
                .to_string()
                .trim_start_matches("error: ")
                .trim_end()
                .to_owned(),
        ),
    })
}

/// Prints the text, tool calls and tool results of one message.
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

/// Builds the agent over the chosen model and runs it on [`QUESTION`].
async fn demo() -> Result<(), DemoError> {
    let args = demo_args()?;
    let configs = args.mcp.configs()?;
    let (model, label) = pick_settled_model_or(std::sync::Arc::new(scripted())).await?;
    println!("{label}");
    // The question needs the tools: the turn's first call must use one.
    let model = std::sync::Arc::new(ToolChoiceEnforcer::new(
        model,
        ToolChoiceRule::RequiredFirst,
    ));
    let mcp = McpServers::connect(configs).await?;
    for line in mcp.summary() {
        println!("{line}");
    }
    let agent = mcp.add_to(demo_agent(model));
    let mut machine = agent.build()?.machine();
    machine.enqueue_user(QUESTION);
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
    mcp.close().await;
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match demo().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
