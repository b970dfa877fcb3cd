//! Command-line parsing for `cargo xtask`, by hand: three commands and one flag do not
//! justify a dependency on an argument parser.

use std::ffi::OsString;

/// What `cargo xtask --help` prints.
pub(crate) const USAGE: &str = "\
Usage: cargo xtask <command>

Commands:
  test [-p <crate>]...
          cargo fmt --check, cargo clippy -D warnings, cargo test (incl. doc
          tests and tidy), cargo doc with RUSTDOCFLAGS=-D warnings; stops at
          the first failure. With -p, only the crates named (fmt checks all)
  bench   build in release mode and run the benchmarks (markov-bench's
          figures and table, then its divan bench); see docs/PERFORMANCE.md
  help    print this message";

/// A parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Command {
    /// `cargo xtask test`, for the packages named with `-p` (all when none).
    Test(Vec<String>),
    /// `cargo xtask bench`.
    Bench,
    /// `cargo xtask help`, `-h` or `--help`.
    Help,
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
        Some("bench") => Command::Bench,
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
}
