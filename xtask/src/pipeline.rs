//! `cargo xtask test`: the CI pipeline, one cargo command per step, run from
//! the workspace root and stopped at the first failure.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};

/// One step of the pipeline: a cargo invocation and its extra environment.
#[derive(Debug)]
struct Step {
    /// Short name used in the failure message.
    name: &'static str,
    /// Arguments to cargo.
    args: Vec<String>,
    /// Environment variables set for this step only.
    env: &'static [(&'static str, &'static str)],
    /// Whether its output holds `test result:` lines to count.
    counts_tests: bool,
}

impl Step {
    fn new(name: &'static str, args: &[&str]) -> Self {
        Step {
            name,
            args: args.iter().map(|arg| (*arg).to_owned()).collect(),
            env: &[],
            counts_tests: false,
        }
    }
}

/// The steps, in the order they run (cheapest first): for the whole
/// workspace, or for the packages named (`cargo xtask test -p <crate>`).
fn steps(packages: &[String]) -> Vec<Step> {
    let scope: Vec<String> = if packages.is_empty() {
        vec!["--workspace".to_owned()]
    } else {
        packages
            .iter()
            .flat_map(|p| ["-p".to_owned(), p.clone()])
            .collect()
    };
    let with_scope = |name, head: &[&str], tail: &[&str]| {
        let mut step = Step::new(name, head);
        step.args.extend(scope.iter().cloned());
        step.args.extend(tail.iter().map(|arg| (*arg).to_owned()));
        step
    };
    let mut steps = vec![
        Step::new("fmt", &["fmt", "--all", "--check"]),
        with_scope(
            "clippy",
            &["clippy"],
            &["--all-targets", "--", "-D", "warnings"],
        ),
        // The libraries and binaries as users build them for production:
        // code behind `cfg(debug_assertions)` or `cfg(test)` can break a
        // release build that every other step passes.
        with_scope(
            "release",
            &["clippy"],
            &["--release", "--", "-D", "warnings"],
        ),
        // Unit, integration and doc tests of every crate, and xtask's tidy test.
        Step {
            counts_tests: true,
            ..with_scope("test", &["test"], &[])
        },
    ];
    if packages.is_empty() || packages.iter().any(|p| p == "markov") {
        // The facade with every feature: its examples (built and linted)
        // and the README's and the guide's examples as doc tests.
        steps.push(Step::new(
            "facade",
            &[
                "clippy",
                "-p",
                "markov",
                "--all-features",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
        ));
        steps.push(Step {
            counts_tests: true,
            ..Step::new("facade tests", &["test", "-p", "markov", "--all-features"])
        });
    }
    steps.push(Step {
        env: &[("RUSTDOCFLAGS", "-D warnings")],
        ..with_scope("doc", &["doc"], &["--no-deps"])
    });
    steps
}

/// Runs every step in `root`, stopping at the first that fails.
pub(crate) fn run(root: &Path, packages: &[String]) -> Result<(), String> {
    // Set by cargo when it runs xtask, so the steps use the same toolchain.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let steps = steps(packages);
    let total = steps.len();
    let mut tests: Option<Counts> = None;
    for (index, step) in steps.iter().enumerate() {
        let number = index + 1;
        let shown = display(step);
        println!("$ {shown}");
        let mut command = Command::new(&cargo);
        command
            .args(&step.args)
            .envs(step.env.iter().copied())
            .current_dir(root);
        let could_not_start = |err: std::io::Error| {
            format!(
                "step {number}/{total} ({}) could not start `{}`: {err}",
                step.name,
                cargo.to_string_lossy()
            )
        };
        let status = if step.counts_tests {
            let (status, counts) = run_counting(&mut command).map_err(could_not_start)?;
            let sum = tests.get_or_insert_with(Counts::default);
            sum.passed += counts.passed;
            sum.failed += counts.failed;
            status
        } else {
            command.status().map_err(could_not_start)?
        };
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
    if packages.is_empty() || packages.iter().any(|p| p == "markov") {
        println!("$ cargo xtask readme");
        crate::readme::run(root)?;
    }
    println!("xtask: all {total} steps passed");
    if let Some(counts) = tests {
        // A plain closing line, so a reader of the log sees what ran.
        println!("tests: {} passed, {} failed", counts.passed, counts.failed);
    }
    Ok(())
}

/// Test counts summed over every `test result:` line of `cargo test`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    passed: u64,
    failed: u64,
}

impl Counts {
    /// Adds the counts of one `test result: ok. 3 passed; 0 failed; ...` line.
    fn add_line(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split([';', '.']) {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next())
                && let Ok(n) = n.parse::<u64>()
            {
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    _ => {}
                }
            }
        }
    }
}

/// Runs `command`, echoing its standard output line by line while counting tests.
fn run_counting(command: &mut Command) -> std::io::Result<(ExitStatus, Counts)> {
    let mut child = command.stdout(Stdio::piped()).spawn()?;
    let mut counts = Counts::default();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            counts.add_line(&line);
        }
    }
    Ok((child.wait()?, counts))
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
    use super::{Counts, display, steps};

    #[test]
    fn test_result_lines_are_counted() {
        let mut c = Counts::default();
        c.add_line("test result: ok. 13 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s");
        c.add_line(
            "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out",
        );
        c.add_line("running 3 tests");
        assert_eq!(
            c,
            Counts {
                passed: 15,
                failed: 1
            }
        );
    }

    #[test]
    fn steps_display_as_shell_commands() {
        let shown: Vec<String> = steps(&[]).iter().map(display).collect();
        assert_eq!(
            shown,
            [
                "cargo fmt --all --check",
                "cargo clippy --workspace --all-targets -- -D warnings",
                "cargo clippy --workspace --release -- -D warnings",
                "cargo test --workspace",
                "cargo clippy -p markov --all-features --all-targets -- -D warnings",
                "cargo test -p markov --all-features",
                "RUSTDOCFLAGS='-D warnings' cargo doc --workspace --no-deps",
            ]
        );
        let one: Vec<String> = steps(&["markov-core".to_owned()])
            .iter()
            .map(display)
            .collect();
        assert_eq!(
            one,
            [
                "cargo fmt --all --check",
                "cargo clippy -p markov-core --all-targets -- -D warnings",
                "cargo clippy -p markov-core --release -- -D warnings",
                "cargo test -p markov-core",
                "RUSTDOCFLAGS='-D warnings' cargo doc -p markov-core --no-deps",
            ]
        );
    }
}
