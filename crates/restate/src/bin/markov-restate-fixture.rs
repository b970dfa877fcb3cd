//! The service the crate's tests kill and restart: a scripted agent on
//! `MarkovSession` whose model and tools write what really happened to
//! files in `MARKOV_FIXTURE_DIR`.
//!
//! - `model.log`: `begin N V` and `end N` around each real model call, `N`
//!   being the assistant messages the request holds (the step's index) and
//!   `V` the agent's version the instructions name (`v1`, `v2`).
//! - `effects.log`: `effect <tool> <note> <idempotency key>`, once per real
//!   side effect.
//! - `MARKOV_FIXTURE_STALL` = `model:N` stalls the first model call of step
//!   `N`, `tool` the first tool call after its effect (a marker file makes
//!   the stall happen once across restarts), so that a test can kill the
//!   process there.
//!
//! - `MARKOV_FIXTURE_MODEL_MS`: every model call takes that long, so that
//!   sessions are in flight when a test kills something.
//! - `MARKOV_FIXTURE_QUIET` set: no logs written (for timing the journal
//!   alone).
//! - `MARKOV_FIXTURE_AGENT` = `v2`: the agent changed for a redeploy: new
//!   instructions and a tool `tally` added; `v3`: that, and the `guarded`
//!   tool removed.
//!
//! Prints `listening <port>` once it serves on a loopback port (a free
//! one, or `MARKOV_FIXTURE_PORT`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use markov_core::async_trait;
use markov_core::message::{Item, Role};
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
use markov_core::tool::{Delivery, Tool, ToolContext};
use markov_executor::Agent;
use markov_policy::{Category, ToolMetadata};
use markov_restate::{JournaledModel, SessionObject, journaled};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

fn append(path: &Path, line: &str) {
    if std::env::var_os("MARKOV_FIXTURE_QUIET").is_some() {
        return;
    }
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| {
            writeln!(f, "{line}")?;
            f.sync_all()
        });
    if let Err(error) = written {
        eprintln!("cannot write {}: {error}", path.display());
    }
}

/// Stalls (for longer than any test waits) the first time `what` is
/// reached, across restarts of the process.
async fn stall_once(dir: &Path, what: &str) {
    let wanted = std::env::var("MARKOV_FIXTURE_STALL").unwrap_or_default();
    if wanted != what {
        return;
    }
    let marker = dir.join("stalled");
    if marker.exists() {
        return;
    }
    append(&marker, what);
    tokio::time::sleep(Duration::from_secs(600)).await;
}

#[derive(Debug)]
struct FileModel {
    dir: PathBuf,
}

#[async_trait]
impl Model for FileModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let messages = request.messages();
        let step = messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        let version = if request.system().contains("briefly") {
            "v2"
        } else {
            "v1"
        };
        let log = self.dir.join("model.log");
        append(&log, &format!("begin {step} {version}"));
        stall_once(&self.dir, &format!("model:{step}")).await;
        if let Some(ms) = std::env::var("MARKOV_FIXTURE_MODEL_MS")
            .ok()
            .and_then(|ms| ms.parse().ok())
        {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let first_user = messages
            .iter()
            .find(|m| m.role == Role::User)
            .map(|m| m.text())
            .unwrap_or_default();
        let tool = if first_user.contains("guarded") {
            "guarded"
        } else {
            "record"
        };
        let response = match step {
            0 => ModelResponse::new(
                vec![Item::tool_use("call_1", tool, json!({"note": "first"}))],
                StopReason::ToolUse,
            ),
            1 => ModelResponse::new(
                vec![Item::tool_use(
                    "call_2",
                    "record",
                    json!({"note": "second"}),
                )],
                StopReason::ToolUse,
            ),
            _ => ModelResponse::new(
                vec![Item::text(format!("done after {step} steps"))],
                StopReason::EndTurn,
            ),
        };
        append(
            &log,
            &format!("end {step} {}", first_user.replace(' ', "_")),
        );
        Ok(response)
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
struct NoteArgs {
    note: String,
}

/// A side effect that must not happen twice: at most once.
struct Record {
    dir: PathBuf,
}

#[async_trait]
impl Tool for Record {
    const NAME: &'static str = "record";
    const DELIVERY: Option<Delivery> = Some(Delivery::AtMostOnce);
    type Args = NoteArgs;
    type Output = String;
    type Error = std::convert::Infallible;

    fn description(&self) -> String {
        "Record a note.".into()
    }

    async fn call(&self, args: NoteArgs, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let key = cx.idempotency_key().unwrap_or("-");
        append(
            &self.dir.join("effects.log"),
            &format!("effect record {} {key}", args.note),
        );
        stall_once(&self.dir, "tool").await;
        Ok(format!("recorded {}", args.note))
    }
}

/// The same side effect, behind the application's approval.
struct Guarded {
    dir: PathBuf,
}

#[async_trait]
impl Tool for Guarded {
    const NAME: &'static str = "guarded";
    type Args = NoteArgs;
    type Output = String;
    type Error = std::convert::Infallible;

    fn description(&self) -> String {
        "Record a note, once a person approves.".into()
    }

    async fn call(&self, args: NoteArgs, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let key = cx.idempotency_key().unwrap_or("-");
        append(
            &self.dir.join("effects.log"),
            &format!("effect guarded {} {key}", args.note),
        );
        Ok(format!("guarded {}", args.note))
    }
}

/// The tool the changed agent adds.
struct Tally;

#[async_trait]
impl Tool for Tally {
    const NAME: &'static str = "tally";
    type Args = NoteArgs;
    type Output = String;
    type Error = std::convert::Infallible;

    fn description(&self) -> String {
        "Count a note.".into()
    }

    async fn call(&self, args: NoteArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        Ok(format!("counted {}", args.note))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(
        std::env::var_os("MARKOV_FIXTURE_DIR").ok_or("MARKOV_FIXTURE_DIR is not set")?,
    );
    let version = std::env::var("MARKOV_FIXTURE_AGENT").unwrap_or_else(|_| "v1".to_owned());
    let mut tools = vec![(
        journaled(Record { dir: dir.clone() })?,
        ToolMetadata::new(Category::Action),
    )];
    if version != "v3" {
        tools.push((
            journaled(Guarded { dir: dir.clone() })?,
            ToolMetadata::new(Category::Action).with_confirmation(),
        ));
    }
    if version != "v1" {
        tools.push((journaled(Tally)?, ToolMetadata::new(Category::Retrieval)));
    }
    let instructions = if version == "v1" {
        "Record what you are asked to."
    } else {
        "Record what you are asked to, briefly."
    };
    let agent = Agent::builder("fixture")
        .instructions(instructions)
        .model(JournaledModel::new(FileModel { dir: dir.clone() }))
        .tools_with(tools)
        .build()?;
    // A restarted service binds the port it had: Restate sends an
    // invocation's retries to the deployment it started on.
    let port: u16 = std::env::var("MARKOV_FIXTURE_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    let mut tries = 0;
    let listener = loop {
        match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            Ok(listener) => break listener,
            Err(error) if tries < 50 => {
                tries += 1;
                eprintln!("port {port} not free yet: {error}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => return Err(error.into()),
        }
    };
    println!("listening {}", listener.local_addr()?.port());
    SessionObject::new(agent).serve(listener).await;
    Ok(())
}
