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
//! The first model call must call a tool (the question needs them): an
//! answer without one is an error, not a confident made-up answer, and
//! the error tells a server that does not pass the tools (its chat
//! template has none, as llama.cpp's `GET /props` shows, or the call came
//! back as text) from a model that chose to answer in text (llama.cpp's
//! server does not enforce a required tool choice).
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
//! The answer's tokens fit the server's context: a local server is asked
//! for its context window (llama.cpp's `GET /props`, vLLM's model list)
//! and an answer may take a quarter of it; a server that does not say
//! gets the default (2 048 tokens for a model markov does not know).
//!
//! A failure, or a run that ends without an answer (the context used up,
//! a usage limit, the loop guard), is printed on stderr with the reason,
//! and the process exits with status 1.
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
use markov_core::message::{Item, Message, Role};
use markov_executor::{BuildError, MachineStep, RunError, RunOptions, YieldReason, run_machine};

use markov_charter::tool_choice::ToolChoiceRule;
use markov_cli::mcp::{McpArgs, McpServers};
use markov_cli::{QUESTION, demo_agent, pick_settled_model_or, scripted};
use markov_executor::ToolChoiceEnforcer;

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
    /// The model answered in text, and the server's chat template has no
    /// tools: the server never passed them to the model.
    #[error(
        "the server does not pass the tools to the model: its chat template has none, so the model never saw them. \
         Start llama-server with --jinja, and --chat-template-file <a template with tools> for a model whose own template has none \
         (docs/guide/local-models.md). The run failed: {0}"
    )]
    ToolsNotPassed(String),
    /// The run ended without an answer: why.
    #[error("no answer: {0}")]
    Unanswered(String),
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
                content,
                is_error,
                images,
                ..
            } => {
                println!(
                    "  tool {}: {content}",
                    if *is_error == Some(true) {
                        "error"
                    } else {
                        "result"
                    }
                );
                for image in images {
                    println!("  tool image: {}", image.note());
                }
            }
            _ => {}
        }
    }
}

/// Why a run that ended without an answer ended, in words (`None`: it
/// answered).
fn unanswered(step: &MachineStep, context_window: u32, max_tokens: u32) -> Option<String> {
    let answered = step
        .history
        .iter()
        .rev()
        .find(|m| m.role == Role::Assistant)
        .is_some_and(|m| !m.text().trim().is_empty());
    Some(match step.yield_reason {
        YieldReason::EndTurn if answered => return None,
        YieldReason::EndTurn => "the model ended its turn without an answer".to_owned(),
        YieldReason::ContextExhausted => format!(
            "the conversation no longer fits the model's context window (about {context_window} tokens, \
             answers of up to {max_tokens}): the model's answers used it up before it answered. \
             Start the server with a larger context (llama-server -c, vLLM --max-model-len)"
        ),
        YieldReason::UsageLimit => match &step.usage_limit {
            Some(limit) => format!("a usage limit ended the run before it answered: {limit}"),
            None => "a usage limit ended the run before it answered".to_owned(),
        },
        YieldReason::MaxTokens => format!(
            "the answer was cut by the token limit ({max_tokens} tokens) before it was complete"
        ),
        YieldReason::LoopDetected => {
            "the model kept calling one tool with the same arguments, and the loop guard ended the run"
                .to_owned()
        }
        YieldReason::Cancelled => "the run was stopped before the model answered".to_owned(),
        other => format!(
            "the run stopped without an answer ({})",
            other.as_str()
        ),
    })
}

/// Builds the agent over the chosen model and runs it on [`QUESTION`].
async fn demo() -> Result<(), DemoError> {
    let args = demo_args()?;
    let configs = args.mcp.configs()?;
    let chosen = pick_settled_model_or(std::sync::Arc::new(scripted())).await?;
    println!("{}", chosen.label);
    // The question needs the tools: the turn's first call must use one.
    let model = std::sync::Arc::new(ToolChoiceEnforcer::new(
        std::sync::Arc::clone(&chosen.model),
        ToolChoiceRule::RequiredFirst,
    ));
    let mcp = McpServers::connect(configs).await?;
    for line in mcp.summary() {
        println!("{line}");
    }
    let agent = demo_agent(&chosen, model).tools_with(mcp.under_policies());
    let mut machine = agent.build()?.machine();
    machine.enqueue_user(QUESTION);
    let mut steps = std::pin::pin!(run_machine(&mut machine, RunOptions::default()));
    let mut n = 0;
    let mut last = None;
    let outcome = loop {
        let Some(step) = steps.next().await else {
            break Ok(());
        };
        let step = match step {
            Ok(step) => step,
            Err(error) => break Err(DemoError::Run(error)),
        };
        n += 1;
        println!("step {n} ({}):", step.yield_reason.as_str());
        for message in &step.history {
            print_message(message);
        }
        last = Some(step);
    };
    mcp.close().await;
    if let Err(DemoError::Run(error)) = &outcome
        && chosen.template_has_tools == Some(false)
        && error
            .to_string()
            .contains(markov_providers::TEXT_INSTEAD_OF_TOOL_CALL)
    {
        // The server said its template has no tools: the model never saw
        // them, whatever it would have chosen.
        return Err(DemoError::ToolsNotPassed(error.to_string()));
    }
    outcome?;
    let why = match &last {
        Some(step) => unanswered(step, chosen.context_window(), chosen.settings().max_tokens),
        None => Some("the run made no step".to_owned()),
    };
    match why {
        Some(why) => Err(DemoError::Unanswered(why)),
        None => Ok(()),
    }
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
