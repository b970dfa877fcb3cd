//! The command line, for a binary of your own over your agent:
//!
//! ```no_run
//! use markov_executor::Agent;
//!
//! #[tokio::main(flavor = "current_thread")]
//! async fn main() -> std::process::ExitCode {
//!     markov_eval::cli::main(|model| {
//!         Agent::builder("calculator").instructions("Do arithmetic.").shared_model(model).build()
//!     })
//!     .await
//! }
//! ```
//!
//! ```text
//! my-evals run evals/calc.toml [--out DIR] [--baseline OLD/report.json]
//!     [--model auto|scripted|env] [--repeat N] [--concurrency N] [--tag T]...
//!     [--timeout SECS] [--min-pass-rate 0.8] [--fail-on-regression]
//! my-evals export --store DIR/sessions.db --session ID [--from N] [--to M] [--out case.toml]
//! ```
//!
//! `run` prints the table (a progress bar on a terminal, a line per run
//! otherwise), writes `report.json`, `junit.xml` and the sessions
//! (`sessions.db`) to `--out` (`target/eval/<dataset>` by default), and
//! exits with 1 when the pass rate is below `--min-pass-rate` (1 by
//! default) or, with `--fail-on-regression`, when a pass rate fell
//! against the baseline. `--model auto` (the default) runs a real model
//! when the environment configures a provider (`OPENAI_BASE_URL`,
//! `ANTHROPIC_API_KEY`, ...), else each case's script.
//!
//! `export` writes a stored session, or the user turns of its recorded
//! steps `--from`..`--to`, as a case in a dataset of its own
//! ([`crate::export_dataset`]), to add to yours.

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use markov_core::model::Model;
use markov_executor::{Agent, BuildError};
use markov_store::{SessionId, SqliteStore, Store};

use crate::{Comparison, Dataset, ModelChoice, Report, Runner, export_dataset};

#[derive(Debug, Parser)]
#[command(name = "markov-eval", about = "Run a markov agent's eval datasets")]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs a dataset and reports.
    Run(RunArgs),
    /// Writes a stored session as a case.
    Export(ExportArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The dataset (TOML, or JSONL: one case per line).
    dataset: PathBuf,
    /// Where report.json, junit.xml and sessions.db go.
    #[arg(long)]
    out: Option<PathBuf>,
    /// A report to compare with.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Which model the agent runs on.
    #[arg(long, value_enum, default_value_t = ModelArg::Auto)]
    model: ModelArg,
    /// Runs each case this many times (the dataset's repeats otherwise).
    #[arg(long)]
    repeat: Option<u32>,
    /// Runs at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Runs only the cases with one of these tags.
    #[arg(long = "tag")]
    tags: Vec<String>,
    /// The longest one run may take, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// The pass rate below which the command fails.
    #[arg(long, default_value_t = 1.0)]
    min_pass_rate: f64,
    /// Fails when a pass rate fell against the baseline.
    #[arg(long)]
    fail_on_regression: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModelArg {
    /// A real model when the environment configures one, else scripted.
    Auto,
    /// Each case's script.
    Scripted,
    /// The model the environment configures (an error when none is).
    Env,
}

#[derive(Debug, clap::Args)]
struct ExportArgs {
    /// The SQLite session store.
    #[arg(long)]
    store: PathBuf,
    /// The session's id.
    #[arg(long)]
    session: String,
    /// Only the user turns of the recorded steps from this one (from 0)...
    #[arg(long)]
    from: Option<u64>,
    /// ...to the step before this one (the last step when unset).
    #[arg(long)]
    to: Option<u64>,
    /// The file to write (stdout when unset).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Runs the command line of `std::env::args` over the agent `factory`
/// builds; prints errors on stderr.
pub async fn main(
    factory: impl Fn(Arc<dyn Model>) -> Result<Agent, BuildError> + Send + Sync + 'static,
) -> ExitCode {
    main_with(std::env::args_os(), factory).await
}

/// [`main`] with the arguments given (the program name first).
pub async fn main_with(
    args: impl IntoIterator<Item = OsString>,
    factory: impl Fn(Arc<dyn Model>) -> Result<Agent, BuildError> + Send + Sync + 'static,
) -> ExitCode {
    let args = match Args::try_parse_from(args) {
        Ok(args) => args,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let outcome = match args.command {
        Command::Run(run) => run_command(run, factory).await,
        Command::Export(export) => export_command(export).await,
    };
    match outcome {
        Ok(code) => code,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run_command(
    args: RunArgs,
    factory: impl Fn(Arc<dyn Model>) -> Result<Agent, BuildError> + Send + Sync + 'static,
) -> Result<ExitCode, String> {
    let dataset = Dataset::load(&args.dataset).map_err(|e| e.to_string())?;
    let model = match args.model {
        ModelArg::Scripted => ModelChoice::Scripted,
        ModelArg::Auto => ModelChoice::from_env().await.map_err(|e| e.to_string())?,
        ModelArg::Env => match ModelChoice::from_env().await.map_err(|e| e.to_string())? {
            ModelChoice::Scripted => {
                return Err(
                    "--model env: no provider is configured (set OPENAI_BASE_URL, \
                     ANTHROPIC_API_KEY, ...)"
                        .to_owned(),
                );
            }
            live => live,
        },
    };
    let baseline = match &args.baseline {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            Some(Report::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?)
        }
        None => None,
    };
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("target/eval").join(&dataset.name));
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let db = out.join("sessions.db");
    let store: Arc<dyn Store> =
        Arc::new(SqliteStore::open(&db).map_err(|e| format!("{}: {e}", db.display()))?);
    println!("model: {}", model.label());
    let mut runner = Runner::new(factory)
        .model(model)
        .concurrency(args.concurrency)
        .timeout(Duration::from_secs(args.timeout))
        .store(store, db.display().to_string())
        .tags(args.tags.clone());
    if let Some(n) = args.repeat {
        runner = runner.repeat(n);
    }
    let bar = std::io::stdout().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
        {
            bar.set_style(style);
        }
        bar
    });
    let shown = bar.clone();
    runner = runner.on_progress(move |done, total, case, run| {
        let verdict = match (&run.error, run.passed) {
            (Some(_), _) => "error",
            (None, true) => "pass",
            (None, false) => "FAIL",
        };
        match &shown {
            Some(bar) => {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
                bar.set_message(format!("{case}#{} {verdict}", run.repeat));
            }
            None => println!("[{done}/{total}] {case}#{} {verdict}", run.repeat),
        }
    });
    let report = runner.run(&dataset).await.map_err(|e| e.to_string())?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    print!("{}", report.table());
    write(&out.join("report.json"), &report.to_json())?;
    write(&out.join("junit.xml"), &report.to_junit())?;
    println!(
        "wrote {} and {}",
        out.join("report.json").display(),
        out.join("junit.xml").display()
    );
    let mut failed = report.summary.pass_rate + 1e-9 < args.min_pass_rate;
    if let Some(baseline) = baseline {
        let comparison = Comparison::new(&baseline, &report);
        print!("{}", comparison.table());
        failed |= args.fail_on_regression && comparison.has_regressions();
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn write(path: &std::path::Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

async fn export_command(args: ExportArgs) -> Result<ExitCode, String> {
    if !args.store.exists() {
        return Err(format!("{}: no such store", args.store.display()));
    }
    let store = SqliteStore::open(&args.store).map_err(|e| e.to_string())?;
    let steps = match (args.from, args.to) {
        (None, None) => None,
        (from, to) => Some(from.unwrap_or(0)..to.unwrap_or(u64::MAX)),
    };
    let dataset = export_dataset(&store, &SessionId::new(args.session.clone()), steps)
        .await
        .map_err(|e| e.to_string())?;
    let text = dataset.to_toml().map_err(|e| e.to_string())?;
    match &args.out {
        Some(path) => write(path, &text)?,
        None => print!("{text}"),
    }
    Ok(ExitCode::SUCCESS)
}
