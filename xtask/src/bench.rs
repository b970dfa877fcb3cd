//! `cargo xtask bench`: builds `markov-bench` in release mode and runs it,
//! then its divan bench, from the workspace root, stopping at the first
//! failure. What the figures mean is in `docs/PERFORMANCE.md`.

use std::path::Path;
use std::process::Command;

/// The cargo invocations, in order: the binary prints the figures, the
/// machine-readable `bench=...` lines and the table; the divan bench
/// (`crates/bench/benches/step.rs`) gives figure 1 per sample.
const STEPS: &[&[&str]] = &[
    &[
        "run",
        "--release",
        "--package",
        "markov-bench",
        "--bin",
        "markov-bench",
    ],
    &["bench", "--package", "markov-bench", "--bench", "step"],
];

/// Runs every step in `root`, stopping at the first that fails.
pub(crate) fn run(root: &Path) -> Result<(), String> {
    // Set by cargo when it runs xtask, so the steps use the same toolchain.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    for args in STEPS {
        let shown = format!("cargo {}", args.join(" "));
        println!("$ {shown}");
        let status = Command::new(&cargo)
            .args(*args)
            .current_dir(root)
            .status()
            .map_err(|err| format!("could not start `{shown}`: {err}"))?;
        if !status.success() {
            return Err(format!("`{shown}` failed ({status})"));
        }
    }
    Ok(())
}
