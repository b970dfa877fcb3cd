//! Command-line parsing for `cargo xtask`, by hand: four commands and a few flags do not
//! justify a dependency on an argument parser.

use std::ffi::OsString;

/// What `cargo xtask --help` prints.
pub(crate) const USAGE: &str = "\
Usage: cargo xtask <command>

Commands:
  test [-p <crate>]...
          cargo fmt --check, cargo clippy -D warnings, cargo test (incl. doc
          tests and tidy), cargo doc with RUSTDOCFLAGS=-D warnings; stops at
          the first failure, then readme. With -p, only the crates named
          (fmt checks all; readme runs with -p markov)
  readme  build every Rust snippet of README.md and docs/guide/*.md in a
          fresh crate with the [dependencies] block shown before it
          (offline, target/ reused)
  bench   build in release mode and run the benchmarks (markov-bench's
          figures and table, then its divan bench); see docs/PERFORMANCE.md
  bench --against <rev> [--rounds <n>] [--floor] -- <markov-bench arguments>
          build markov-bench at <rev> as well as here, run the figure the
          arguments name with each, alternately, <n> times (3 unless set),
          and print each number's range before and after; --floor (with
          server-processes <N> <W> [sqlite]) runs the floor as a third side
  eval <dataset> [-- <markov-eval run arguments>]
          run an eval dataset against the demo agent (markov-cli's
          markov-eval): offline on each case's script, or on the model the
          environment configures (OPENAI_BASE_URL, ANTHROPIC_API_KEY, ...);
          see docs/guide/evals.md
  stats [<dir>]
          production lines (no test modules, tests/, benches/ or
          examples/) and pub items per crate, as a table; <dir> is another
          checkout (git archive <rev> | tar -x -C <dir>), this one unless set
  help    print this message";

/// A parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Command {
    /// `cargo xtask test`, for the packages named with `-p` (all when none).
    Test(Vec<String>),
    /// `cargo xtask readme`.
    Readme,
    /// `cargo xtask bench`.
    Bench,
    /// `cargo xtask bench --against <rev>`: one figure, before and after.
    Against(Against),
    /// `cargo xtask eval <dataset> [-- <arguments>]`: the dataset and the
    /// arguments handed on to `markov-eval run`.
    Eval(String, Vec<String>),
    /// `cargo xtask stats [<dir>]`: the workspace at `dir`, this one when
    /// `None`.
    Stats(Option<String>),
    /// `cargo xtask help`, `-h` or `--help`.
    Help,
}

/// A figure measured with the binary of another revision and this one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Against {
    /// The revision the figure is compared with (anything `git` resolves).
    pub(crate) rev: String,
    /// How many times each binary runs the figure.
    pub(crate) rounds: u32,
    /// `markov-bench`'s arguments: the figure.
    pub(crate) figure: Vec<String>,
    /// `--floor`: the figure is `server-processes <N> <W> [sqlite]`, and
    /// this tree's binary also runs it as the floor (`server-processes
    /// <N> <W> floor`), a third side in the same rounds.
    pub(crate) floor: bool,
}

impl Against {
    /// The floor's arguments, when `--floor` was given: the figure with the
    /// floor in place of the store.
    pub(crate) fn floor_figure(&self) -> Option<Vec<String>> {
        self.floor.then(|| {
            let mut figure = self.figure[..3].to_vec();
            figure.push("floor".to_owned());
            figure
        })
    }
}

/// Runs of each binary unless `--rounds` says otherwise.
const DEFAULT_ROUNDS: u32 = 3;

/// Parses what follows `bench`.
fn parse_bench(args: impl Iterator<Item = OsString>) -> Result<Command, String> {
    let mut args = args.map(|arg| {
        arg.into_string()
            .map_err(|arg| format!("argument {arg:?} is not UTF-8"))
    });
    let mut rev = None;
    let mut rounds = DEFAULT_ROUNDS;
    let mut floor = false;
    let mut figure = Vec::new();
    while let Some(arg) = args.next() {
        match arg?.as_str() {
            "--floor" => floor = true,
            "--against" => match args.next() {
                Some(value) => rev = Some(value?),
                None => return Err("--against needs a revision".to_owned()),
            },
            "--rounds" => {
                rounds = match args.next().transpose()?.map(|n| n.parse::<u32>()) {
                    Some(Ok(n)) if n > 0 => n,
                    _ => return Err("--rounds needs a number above 0".to_owned()),
                };
            }
            "--" => {
                figure = args.collect::<Result<_, _>>()?;
                break;
            }
            other => return Err(format!("unexpected argument `{other}` after `bench`")),
        }
    }
    match rev {
        None if figure.is_empty() && rounds == DEFAULT_ROUNDS && !floor => Ok(Command::Bench),
        None => Err("--rounds, --floor and a figure go with --against <rev>".to_owned()),
        Some(_) if figure.is_empty() => {
            Err("name the figure after `--`, as markov-bench takes it: \
             cargo xtask bench --against <rev> -- server-processes 1000 2"
                .to_owned())
        }
        // The floor answers text only, on its own database: it stands
        // beside markov's SQLite figure without a tool call, nothing else.
        Some(_)
            if floor
                && !(figure[0] == "server-processes"
                    && matches!(figure.len(), 3 | 4)
                    && figure.get(3).is_none_or(|store| store == "sqlite")) =>
        {
            Err(format!(
                "--floor goes with `server-processes <N> <WORKERS> [sqlite]`, not `{}`",
                figure.join(" ")
            ))
        }
        Some(rev) => Ok(Command::Against(Against {
            rev,
            rounds,
            figure,
            floor,
        })),
    }
}

/// Parses the arguments after the program name.
///
/// The error is a one-line message; the caller prints it with [`USAGE`].
pub(crate) fn parse<I>(args: I) -> Result<Command, String>
where
    I: IntoIterator<Item = OsString>,
{
    let mut args = args.into_iter();
    let Some(first) = args.next() else {
        return Err("no command given".to_owned());
    };
    let command = match first.to_str() {
        Some("test") => {
            let mut packages = Vec::new();
            while let Some(flag) = args.next() {
                match flag.to_str() {
                    Some("-p" | "--package") => {
                        match args.next().and_then(|p| p.into_string().ok()) {
                            Some(package) => packages.push(package),
                            None => return Err("-p needs a crate name".to_owned()),
                        }
                    }
                    _ => return Err(format!("unexpected argument {flag:?} after `test`")),
                }
            }
            return Ok(Command::Test(packages));
        }
        Some("bench") => return parse_bench(args),
        Some("readme") => Command::Readme,
        Some("stats") => match args.next() {
            None => Command::Stats(None),
            Some(dir) => match dir.into_string() {
                Ok(dir) if !dir.starts_with('-') => Command::Stats(Some(dir)),
                Ok(dir) => return Err(format!("unexpected argument `{dir}` after `stats`")),
                Err(dir) => return Err(format!("argument {dir:?} is not UTF-8")),
            },
        },
        Some("eval") => {
            let mut args = args.map(|arg| {
                arg.into_string()
                    .map_err(|arg| format!("argument {arg:?} is not UTF-8"))
            });
            let dataset = match args.next().transpose()? {
                Some(dataset) if !dataset.starts_with('-') => dataset,
                _ => return Err("eval needs a dataset: cargo xtask eval <dataset>".to_owned()),
            };
            let rest = match args.next().transpose()? {
                None => Vec::new(),
                Some(dashes) if dashes == "--" => args.collect::<Result<_, _>>()?,
                Some(other) => {
                    return Err(format!(
                        "unexpected argument `{other}` after the dataset (put markov-eval's \
                         arguments after `--`)"
                    ));
                }
            };
            return Ok(Command::Eval(dataset, rest));
        }
        Some("help" | "-h" | "--help") => Command::Help,
        Some(other) => return Err(format!("unknown command `{other}`")),
        None => return Err(format!("unknown command {first:?}")),
    };
    if let Some(extra) = args.next() {
        return Err(format!(
            "unexpected argument {extra:?} after `{}`",
            first.to_string_lossy()
        ));
    }
    Ok(command)
}

#[cfg(test)]
mod tests {
    use super::{Command, parse};
    use std::ffi::OsString;

    fn parse_strs(args: &[&str]) -> Result<Command, String> {
        parse(args.iter().map(OsString::from))
    }

    #[test]
    fn known_commands() {
        assert_eq!(parse_strs(&["test"]), Ok(Command::Test(vec![])));
        assert_eq!(
            parse_strs(&["test", "-p", "markov-core", "-p", "markov"]),
            Ok(Command::Test(vec!["markov-core".into(), "markov".into()]))
        );
        assert_eq!(parse_strs(&["bench"]), Ok(Command::Bench));
        assert_eq!(parse_strs(&["stats"]), Ok(Command::Stats(None)));
        assert_eq!(
            parse_strs(&["stats", "/tmp/base"]),
            Ok(Command::Stats(Some("/tmp/base".into())))
        );
        assert!(parse_strs(&["stats", "a", "b"]).is_err());
        assert_eq!(parse_strs(&["help"]), Ok(Command::Help));
        assert_eq!(parse_strs(&["--help"]), Ok(Command::Help));
        assert_eq!(parse_strs(&["-h"]), Ok(Command::Help));
    }

    #[test]
    fn rejects_unknown_missing_and_extra() {
        assert_eq!(parse_strs(&[]), Err("no command given".to_owned()));
        assert_eq!(
            parse_strs(&["benches"]),
            Err("unknown command `benches`".to_owned())
        );
        assert!(parse_strs(&["test", "--fast"]).is_err());
        assert_eq!(
            parse_strs(&["test", "-p"]),
            Err("-p needs a crate name".to_owned())
        );
        assert!(parse_strs(&["bench", "--quick"]).is_err());
    }

    #[test]
    fn eval_takes_a_dataset_and_hands_on_the_rest() {
        assert_eq!(
            parse_strs(&["eval", "crates/cli/evals/demo.toml"]),
            Ok(Command::Eval("crates/cli/evals/demo.toml".into(), vec![]))
        );
        assert_eq!(
            parse_strs(&["eval", "d.toml", "--", "--repeat", "5"]),
            Ok(Command::Eval(
                "d.toml".into(),
                vec!["--repeat".into(), "5".into()]
            ))
        );
        assert!(parse_strs(&["eval"]).is_err());
        assert!(parse_strs(&["eval", "d.toml", "--repeat"]).is_err());
    }

    #[test]
    fn bench_against_a_revision() {
        use super::Against;
        assert_eq!(
            parse_strs(&["bench", "--against", "HEAD~1", "--", "provider-path"]),
            Ok(Command::Against(Against {
                rev: "HEAD~1".into(),
                rounds: 3,
                figure: vec!["provider-path".into()],
                floor: false,
            }))
        );
        assert_eq!(
            parse_strs(&[
                "bench",
                "--rounds",
                "5",
                "--against",
                "a73a1be",
                "--",
                "server-processes",
                "1000",
                "2"
            ]),
            Ok(Command::Against(Against {
                rev: "a73a1be".into(),
                rounds: 5,
                figure: vec!["server-processes".into(), "1000".into(), "2".into()],
                floor: false,
            }))
        );
        let refused = |args: &[&str]| parse_strs(args).expect_err("refused");
        assert!(refused(&["bench", "--against", "HEAD~1"]).contains("name the figure"));
        assert!(refused(&["bench", "--against"]).contains("needs a revision"));
        assert!(
            refused(&["bench", "--against", "x", "--rounds", "0", "--", "steps"])
                .contains("above 0")
        );
        assert!(refused(&["bench", "--", "steps"]).contains("go with --against"));
        assert!(refused(&["bench", "--floor"]).contains("go with --against"));
    }

    #[test]
    fn the_floor_stands_beside_the_sqlite_server_figure_only() {
        let parsed = |args: &[&str]| match parse_strs(args) {
            Ok(Command::Against(against)) => Ok(against),
            other => Err(format!("{other:?}")),
        };
        let against = parsed(&[
            "bench",
            "--against",
            "8c0bbc0",
            "--floor",
            "--",
            "server-processes",
            "1000",
            "2",
        ])
        .expect("a figure with its floor");
        assert_eq!(
            against.floor_figure(),
            Some(vec![
                "server-processes".into(),
                "1000".into(),
                "2".into(),
                "floor".into()
            ])
        );
        let sqlite = parsed(&[
            "bench",
            "--floor",
            "--against",
            "x",
            "--",
            "server-processes",
            "10000",
            "2",
            "sqlite",
        ])
        .expect("sqlite named");
        assert_eq!(
            sqlite.floor_figure().as_deref().map(|f| f[3].as_str()),
            Some("floor")
        );
        assert_eq!(
            parsed(&["bench", "--against", "x", "--", "steps"])
                .expect("no floor")
                .floor_figure(),
            None
        );
        for figure in [
            &["steps"][..],
            &["server-processes", "1000"],
            &["server-processes", "1000", "2", "postgres"],
            &["server-processes", "1000", "2", "sqlite", "tool-call"],
            &["server-processes", "1000", "2", "floor"],
        ] {
            let mut args = vec!["bench", "--against", "x", "--floor", "--"];
            args.extend_from_slice(figure);
            let refused = parse_strs(&args).expect_err("refused");
            assert!(
                refused.contains("--floor goes with"),
                "{figure:?}: {refused}"
            );
        }
    }
}
