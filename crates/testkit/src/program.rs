//! The programs a test needs installed: found on `PATH`, and missing ones
//! a skip outside CI but a failure under `CI=true`.

use std::path::PathBuf;

/// The program `name` on `PATH`. Missing: `None` (the test skips, and
/// says so) outside CI, a failure under `CI=true`, with `install` saying
/// how to get it.
///
/// ```
/// let shell = markov_testkit::required_program("sh", "apt-get install dash");
/// assert!(shell.is_some_and(|path| path.ends_with("sh")));
/// ```
pub fn required_program(name: &str, install: &str) -> Option<PathBuf> {
    required(on_path(name), name, install)
}

/// `name` in one of the directories on `PATH`.
pub(crate) fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

/// `found`, or (when it is `None`) a skip outside CI and a failure under
/// `CI=true`, naming `name` and how to `install` it.
pub(crate) fn required(found: Option<PathBuf>, name: &str, install: &str) -> Option<PathBuf> {
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{name} is missing ({install}): under CI this is a failure"
        );
        eprintln!("{name} is missing: skipped ({install})");
    }
    found
}
