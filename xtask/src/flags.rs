//! Command-line parsing for `cargo xtask`, by hand: three commands do not
//! justify a dependency on an argument parser.

use std::ffi::OsString;

/// What `cargo xtask --help` prints.
pub(crate) const USAGE: &str = "\
Usage: cargo xtask <command>

Commands:
  test    cargo fmt --check, cargo clippy -D warnings, cargo test (incl. doc
          tests and tidy), cargo doc with RUSTDOCFLAGS=-D warnings; stops at
          the first failure
  bench   build in release mode and run the benchmarks (markov-bench's
          figures and table, then its divan bench); see docs/PERFORMANCE.md
  help    print this message";

/// A parsed command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    /// `cargo xtask test`.
    Test,
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
        Some("test") => Command::Test,
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
        assert_eq!(parse_strs(&["test"]), Ok(Command::Test));
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
        assert!(parse_strs(&["bench", "--quick"]).is_err());
    }
}
