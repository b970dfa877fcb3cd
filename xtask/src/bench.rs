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

/// `cargo xtask bench --against <rev>`: builds `markov-bench` at `rev` (in
/// `target/against/<commit>`, kept for the next comparison) and here (the
/// working tree as it is, uncommitted changes included), runs the figure
/// with each binary in turn, `rounds` times — each round beginning with
/// the next side, so that a machine growing busier or quieter weighs on
/// every side — and prints every run's `bench=` lines, then each number's
/// range per side. With `--floor`, this tree's binary also runs the floor
/// under the server's figure, a third side in the same rounds.
pub(crate) fn against(root: &Path, against: &crate::flags::Against) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let commit = resolve(root, &against.rev)?;
    let dir = root.join("target").join("against").join(&commit[..12]);
    let source = checkout(root, &commit, &dir)?;
    let before = build(&cargo, &source, Some(&dir.join("target")))?;
    let after = build(&cargo, root, None)?;
    let mut sides = vec![
        ("before", &before, against.figure.clone()),
        ("after", &after, against.figure.clone()),
    ];
    if let Some(floor) = against.floor_figure() {
        sides.push(("floor", &after, floor));
    }
    let mut runs = vec![Vec::new(); sides.len()];
    for round in 0..against.rounds as usize {
        for turn in 0..sides.len() {
            let side = (round + turn) % sides.len();
            let (label, exe, figure) = &sides[side];
            println!("$ {label}: markov-bench {}", figure.join(" "));
            let out = Command::new(exe)
                .args(figure)
                .current_dir(root)
                .output()
                .map_err(|err| format!("could not start {}: {err}", exe.display()))?;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            for line in bench_lines(&stdout) {
                println!("{label} {line}");
            }
            if !out.status.success() {
                return Err(format!(
                    "{label}'s markov-bench failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            runs[side].push(stdout);
        }
    }
    println!();
    println!(
        "{} runs each; before: {} ({}), after: this working tree{}",
        against.rounds,
        against.rev,
        &commit[..12],
        if against.floor {
            ", floor: this working tree's floor"
        } else {
            ""
        }
    );
    let labelled: Vec<(&str, &[String])> = sides
        .iter()
        .zip(&runs)
        .map(|((label, _, _), runs)| (*label, runs.as_slice()))
        .collect();
    print!("{}", summarize(&labelled));
    Ok(())
}

/// The commit `rev` names.
fn resolve(root: &Path, rev: &str) -> Result<String, String> {
    let out = Command::new("git")
        .args(["rev-parse", "--verify", "--quiet"])
        .arg(format!("{rev}^{{commit}}"))
        .current_dir(root)
        .output()
        .map_err(|err| format!("could not start git: {err}"))?;
    let commit = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || commit.len() < 12 {
        return Err(format!("`{rev}` names no commit here"));
    }
    Ok(commit)
}

/// The source tree of `commit` in `dir/src`, written once: extracted to a
/// directory beside it and renamed into place, so that an interrupted
/// extraction is never taken for a whole one.
fn checkout(root: &Path, commit: &str, dir: &Path) -> Result<std::path::PathBuf, String> {
    let source = dir.join("src");
    if source.join("Cargo.toml").is_file() {
        return Ok(source);
    }
    let partial = dir.join("src.partial");
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial)
        .map_err(|err| format!("cannot create {}: {err}", partial.display()))?;
    // `git archive | tar -x`: the commit's files, without a second
    // worktree registered in the repository.
    let mut archive = Command::new("git")
        .args(["archive", "--format=tar", commit])
        .current_dir(root)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|err| format!("could not start git archive: {err}"))?;
    let tar = archive.stdout.take().ok_or("git archive gave no output")?;
    let extracted = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(&partial)
        .stdin(tar)
        .status()
        .map_err(|err| format!("could not start tar: {err}"))?;
    let archived = archive
        .wait()
        .map_err(|err| format!("git archive: {err}"))?;
    if !archived.success() || !extracted.success() {
        return Err(format!(
            "could not extract {commit} into {}",
            partial.display()
        ));
    }
    std::fs::rename(&partial, &source)
        .map_err(|err| format!("cannot move {} into place: {err}", partial.display()))?;
    Ok(source)
}

/// Builds `markov-bench` in release mode in `source` (into `target`, else
/// the workspace's own), and returns the binary's path.
fn build(
    cargo: &std::ffi::OsStr,
    source: &Path,
    target: Option<&Path>,
) -> Result<std::path::PathBuf, String> {
    let mut command = Command::new(cargo);
    command
        .args([
            "build",
            "--release",
            "--package",
            "markov-bench",
            "--bin",
            "markov-bench",
        ])
        .current_dir(source);
    if let Some(target) = target {
        command.env("CARGO_TARGET_DIR", target);
    }
    println!(
        "$ cargo build --release --package markov-bench (in {})",
        source.display()
    );
    let status = command
        .status()
        .map_err(|err| format!("could not start cargo: {err}"))?;
    if !status.success() {
        return Err(format!(
            "building markov-bench in {} failed ({status})",
            source.display()
        ));
    }
    let exe = target
        .map_or_else(|| source.join("target"), Path::to_path_buf)
        .join("release")
        .join("markov-bench");
    Ok(exe)
}

/// The `bench=...` lines of a run's output.
fn bench_lines(stdout: &str) -> impl Iterator<Item = &str> {
    stdout.lines().filter(|line| line.starts_with("bench="))
}

/// The numbers of the n-th `bench=` line of the runs.
#[derive(Debug)]
struct Table {
    /// The line's fields that are not numbers, on each side (from its
    /// first run), empty where the side has no such line.
    titles: Vec<String>,
    /// Each number's values on each side, in the order the line gives
    /// them.
    numbers: Vec<(String, Vec<Vec<f64>>)>,
}

/// Each number of each `bench=` line, its range over each side's runs (a
/// column per side, headed by its label), one table per line (the n-th
/// line of every run: a figure prints its lines in the same order every
/// time). Fields that are not numbers (`bench=server`, `store=sqlite`)
/// name the table: the first side's, then any other side's that differ,
/// under its label. A line is matched by its place, so the floor's line
/// (`store=floor`) shares the table of markov's.
fn summarize(sides: &[(&str, &[String])]) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;

    let mut tables: BTreeMap<usize, Table> = BTreeMap::new();
    for (side, (_, runs)) in sides.iter().enumerate() {
        for run in *runs {
            for (index, line) in bench_lines(run).enumerate() {
                let Table {
                    titles,
                    numbers: keys,
                } = tables.entry(index).or_insert_with(|| Table {
                    titles: vec![String::new(); sides.len()],
                    numbers: Vec::new(),
                });
                let mut named = Vec::new();
                for field in line.split_whitespace() {
                    let Some((key, value)) = field.split_once('=') else {
                        continue;
                    };
                    match value.parse::<f64>() {
                        Ok(number) => {
                            let at = match keys.iter().position(|(k, _)| k == key) {
                                Some(at) => at,
                                None => {
                                    keys.push((key.to_owned(), vec![Vec::new(); sides.len()]));
                                    keys.len() - 1
                                }
                            };
                            keys[at].1[side].push(number);
                        }
                        Err(_) => named.push(field),
                    }
                }
                if titles[side].is_empty() {
                    titles[side] = named.join(" ");
                }
            }
        }
    }
    let range = |values: &[f64]| -> String {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        match values.len() {
            0 => "–".to_owned(),
            _ if min == max => format!("{min}"),
            _ => format!("{min}–{max}"),
        }
    };
    let mut out = String::new();
    for Table {
        titles,
        numbers: keys,
    } in tables.values()
    {
        let first = titles.iter().find(|title| !title.is_empty());
        let _ = writeln!(out, "\n{}", first.map_or("", String::as_str));
        for ((label, _), title) in sides.iter().zip(titles) {
            if !title.is_empty() && Some(title) != first {
                let _ = writeln!(out, "  {label}: {title}");
            }
        }
        let width = keys.iter().map(|(key, _)| key.len()).max().unwrap_or(0);
        let _ = write!(out, "  {:width$}", "");
        for (label, _) in sides {
            let _ = write!(out, "  {label:>22}");
        }
        let _ = writeln!(out);
        for (key, values) in keys {
            let _ = write!(out, "  {key:width$}");
            for values in values {
                let _ = write!(out, "  {:>22}", range(values));
            }
            let _ = writeln!(out);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::summarize;

    #[test]
    fn summary_gives_each_number_s_range_before_and_after_per_line() {
        let run = |steps: u32, p99: f64| {
            format!(
                "a figure's table\n\
                 bench=server store=sqlite sessions=1000 steps_per_s={steps} p99_ms={p99}\n\
                 bench=other k=10 us=2\n"
            )
        };
        let before = [run(739, 1060.7), run(2320, 300.7)];
        let after = [run(2110, 361.5), run(2004, 365.1), run(2110, 300.0)];
        assert_eq!(
            summarize(&[("before", &before), ("after", &after)]),
            "
bench=server store=sqlite
                               before                   after
  sessions                       1000                    1000
  steps_per_s                739–2320               2004–2110
  p99_ms                 300.7–1060.7               300–365.1

bench=other
                      before                   after
  k                       10                      10
  us                       2                       2
"
        );
    }

    #[test]
    fn a_number_one_side_lacks_is_a_dash() {
        let before = ["bench=x old=1\n".to_owned()];
        let after = ["bench=x new=2\n".to_owned()];
        let summary = summarize(&[("before", &before), ("after", &after)]);
        let rows: Vec<Vec<&str>> = summary
            .lines()
            .map(|line| line.split_whitespace().collect())
            .collect();
        assert!(rows.contains(&vec!["old", "1", "–"]), "{summary}");
        assert!(rows.contains(&vec!["new", "–", "2"]), "{summary}");
    }

    #[test]
    fn the_floor_is_a_third_column_of_the_same_table() {
        let line = |store: &str, cpu: u32| {
            format!(
                "bench=server_processes store={store} sessions=1000 cpu_per_step_us_workers={cpu}\n"
            )
        };
        let before = [line("sqlite", 740), line("sqlite", 700)];
        let after = [line("sqlite", 450)];
        let floor = [line("floor", 320), line("floor", 290)];
        assert_eq!(
            summarize(&[("before", &before), ("after", &after), ("floor", &floor)]),
            "
bench=server_processes store=sqlite
  floor: bench=server_processes store=floor
                                           before                   after                   floor
  sessions                                   1000                    1000                    1000
  cpu_per_step_us_workers                 700–740                     450                 290–320
"
        );
    }
}
