//! `markov-serve`: the demo agent as an HTTP service with a web page, on
//! `127.0.0.1`, its sessions in a SQLite file (or PostgreSQL with
//! `--database-url`).
//!
//! ```text
//! cargo run -p markov-cli --bin markov-serve              # http://127.0.0.1:8080
//! cargo run -p markov-cli --bin markov-serve -- --port 9000 --database /tmp/sessions.db
//! cargo run -p markov-cli --bin markov-serve -- --database-url "host=127.0.0.1 user=markov"
//! ```
//!
//! The model is chosen as for `markov-demo` (see the library); without a
//! key it is the scripted [`Rehearsal`], and the
//! first line says so.

use std::process::ExitCode;
use std::sync::Arc;

use markov_cli::tools::{Add, Population};
use markov_cli::{INSTRUCTIONS, Rehearsal, model_override, pick_model_or};
use markov_core::model::ModelSettings;
use markov_executor::Agent;
use markov_policy::{Category, ToolMetadata};
use markov_server::router;
use markov_store::{PostgresStore, SqliteStore, Store, WorkerId};

/// The command line.
struct Args {
    port: u16,
    database: String,
    database_url: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        port: 8080,
        database: "markov-sessions.db".into(),
        database_url: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--port" => {
                args.port = value()?.parse().map_err(|e| format!("--port: {e}"))?;
            }
            "--database" => args.database = value()?,
            "--database-url" => args.database_url = Some(value()?),
            other => {
                return Err(format!(
                    "unknown argument {other:?} (use --port, --database, --database-url)"
                ));
            }
        }
    }
    Ok(args)
}

async fn serve() -> Result<(), String> {
    let args = args()?;
    let (model, label) = pick_model_or(Arc::new(Rehearsal)).map_err(|e| e.to_string())?;
    let agent = Agent::builder("cities")
        .instructions(INSTRUCTIONS)
        .tool_with(Add, ToolMetadata::new(Category::Other))
        .tool_with(Population, ToolMetadata::new(Category::Retrieval))
        .shared_model(model)
        .settings(ModelSettings {
            model: model_override(),
            ..ModelSettings::default()
        })
        .build()
        .map_err(|e| e.to_string())?;
    let (store, where_): (Arc<dyn Store>, String) = match &args.database_url {
        Some(url) => (
            Arc::new(
                PostgresStore::connect(url)
                    .await
                    .map_err(|e| e.to_string())?,
            ),
            "PostgreSQL".into(),
        ),
        None => (
            Arc::new(SqliteStore::open(&args.database).map_err(|e| e.to_string())?),
            format!("SQLite file {}", args.database),
        ),
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
        .await
        .map_err(|e| format!("cannot listen on 127.0.0.1:{}: {e}", args.port))?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    println!("{label}");
    println!("serving on http://{address} (sessions in {where_})");
    markov_server::serve(listener, router(agent, store, WorkerId::random()))
        .await
        .map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> ExitCode {
    match serve().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
