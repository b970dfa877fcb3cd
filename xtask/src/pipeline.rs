//! `cargo xtask test`: the CI pipeline, one cargo command per step, run from
//! the workspace root and stopped at the first failure.

use std::path::Path;
use std::process::Command;

/// One step of the pipeline: a cargo invocation and its extra environment.
#[derive(Debug)]
struct Step {
    /// Short name used in the failure message.
    name: &'static str,
    /// Arguments to cargo.
    args: &'static [&'static str],
    /// Environment variables set for this step only.
    env: &'static [(&'static str, &'static str)],
}

/// The steps, in the order they run: cheapest first.
const STEPS: &[Step] = &[
    Step {
        name: "fmt",
        args: &["fmt", "--all", "--check"],
        env: &[],
    },
    Step {
        name: "clippy",
        args: &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
        env: &[],
    },
    Step {
        // Unit, integration and doc tests of every crate, and xtask's tidy test.
        name: "test",
        args: &["test", "--workspace"],
        env: &[],
    },
    Step {
        name: "doc",
        args: &["doc", "--workspace", "--no-deps"],
        env: &[("RUSTDOCFLAGS", "-D warnings")],
    },
];

/// Runs every step in `root`, stopping at the first that fails.
pub(crate) fn run(root: &Path) -> Result<(), String> {
    // Set by cargo when it runs xtask, so the steps use the same toolchain.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let total = STEPS.len();
    for (index, step) in STEPS.iter().enumerate() {
        let number = index + 1;
        let shown = display(step);
        println!("$ {shown}");
        let status = Command::new(&cargo)
            .args(step.args)
            .envs(step.env.iter().copied())
            .current_dir(root)
            .status()
            .map_err(|err| {
                format!(
                    "step {number}/{total} ({}) could not start `{}`: {err}",
                    step.name,
                    cargo.to_string_lossy()
                )
            })?;
        if !status.success() {
            let how = match status.code() {
                Some(code) => format!("exit code {code}"),
                None => format!("no exit code ({status})"),
            };
            return Err(format!(
                "step {number}/{total} ({}) failed with {how}: {shown}",
                step.name
            ));
        }
    }
    println!("xtask: all {total} steps passed");
    Ok(())
}

/// The step as a shell command line, e.g. `RUSTDOCFLAGS='-D warnings' cargo doc`.
fn display(step: &Step) -> String {
    let mut words: Vec<String> = step
        .env
        .iter()
        .map(|(key, value)| format!("{key}={}", quote(value)))
        .collect();
    words.push("cargo".to_owned());
    words.extend(step.args.iter().map(|arg| quote(arg)));
    words.join(" ")
}

/// Quotes a word for display if it contains a space.
fn quote(word: &str) -> String {
    if word.contains(' ') {
        format!("'{word}'")
    } else {
        word.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::{STEPS, display};

    #[test]
    fn steps_display_as_shell_commands() {
        let shown: Vec<String> = STEPS.iter().map(display).collect();
        assert_eq!(
            shown,
            [
                "cargo fmt --all --check",
                "cargo clippy --workspace --all-targets -- -D warnings",
                "cargo test --workspace",
                "RUSTDOCFLAGS='-D warnings' cargo doc --workspace --no-deps",
            ]
        );
    }
}
