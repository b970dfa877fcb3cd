//! markov's build tasks, run as `cargo xtask <command>` (see `.cargo/config.toml`).
//!
//! Commands:
//!
//! - `test`: the checks CI runs, in order, stopping at the first failure:
//!   `cargo fmt --check`, `cargo clippy -D warnings`, `cargo test` (unit,
//!   integration and doc tests, plus the `tidy` test in `src/tidy.rs`)
//!   and `cargo doc` with `RUSTDOCFLAGS=-D warnings`; the facade once more
//!   with every feature (its examples, the README's and the guide's).
//!   `-p <crate>` limits the checks to the crates named. Last, `readme` (for the
//!   whole workspace or `-p markov`).
//! - `readme`: every Rust snippet of the README and the guide
//!   (`docs/guide/*.md`) built in a fresh crate with the `[dependencies]`
//!   block shown before it (`src/readme.rs`).
//! - `bench`: the benchmarks of `crates/bench` in release mode: the
//!   `markov-bench` binary (figures, table and one `bench=...` line per
//!   figure), then its divan bench. Never part of `test`. With
//!   `--against <rev> -- <figure>`: one figure with the binary of `rev`
//!   and this tree's, alternately, and each number's range before and
//!   after; `--floor` adds the server's floor as a third side.
//! - `eval <dataset> [-- <arguments>]`: runs an eval dataset against the
//!   demo agent with `markov-cli`'s `markov-eval run` (offline on each
//!   case's script, or on the model the environment configures); the
//!   arguments after `--` go to it. Not part of `test`: the datasets CI
//!   runs are run by their crates' tests.
//! - `stats [<dir>]`: production lines and `pub` items per crate, as a
//!   table (`src/stats.rs`), of this workspace or the checkout at `dir`.
//! - `help`: prints the usage.
//!
//! Arguments are parsed by hand in `flags.rs` to keep this crate free of
//! dependencies; it builds fast on a cold cache.

mod bench;
mod flags;
mod pipeline;
mod readme;
mod stats;
#[cfg(test)]
mod tidy;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use flags::Command;

fn main() -> ExitCode {
    let command = match flags::parse(std::env::args_os().skip(1)) {
        Ok(command) => command,
        Err(message) => {
            eprintln!("xtask: {message}\n\n{}", flags::USAGE);
            return ExitCode::from(2);
        }
    };
    let result = match command {
        Command::Help => {
            println!("{}", flags::USAGE);
            Ok(())
        }
        Command::Test(packages) => {
            workspace_root().and_then(|root| pipeline::run(&root, &packages))
        }
        Command::Readme => workspace_root().and_then(|root| readme::run(&root)),
        Command::Stats(dir) => match dir {
            Some(dir) => stats::run(Path::new(&dir)),
            None => workspace_root().and_then(|root| stats::run(&root)),
        },
        Command::Eval(dataset, rest) => {
            workspace_root().and_then(|root| eval(&root, &dataset, &rest))
        }
        Command::Bench => workspace_root().and_then(|root| bench::run(&root)),
        Command::Against(against) => {
            workspace_root().and_then(|root| bench::against(&root, &against))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo run -p markov-cli --bin markov-eval -- run <dataset> <rest>` in
/// `root`.
fn eval(root: &Path, dataset: &str, rest: &[String]) -> Result<(), String> {
    // The dataset is named from where the command was typed; cargo runs
    // from the root.
    let dataset = std::env::current_dir()
        .map_err(|e| format!("no current directory: {e}"))?
        .join(dataset);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = std::process::Command::new(cargo)
        .current_dir(root)
        .args([
            "run",
            "-q",
            "-p",
            "markov-cli",
            "--bin",
            "markov-eval",
            "--",
            "run",
        ])
        .arg(&dataset)
        .args(rest)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "the eval of {} failed ({status})",
            dataset.display()
        ))
    }
}

/// The workspace root: the parent of this crate's manifest directory.
fn workspace_root() -> Result<PathBuf, String> {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| format!("{} has no parent directory", manifest_dir.display()))
}
