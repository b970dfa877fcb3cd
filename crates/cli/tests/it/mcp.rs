//! The demo with an MCP server's tools: `--mcp` and `MARKOV_MCP`.

use std::path::PathBuf;
use std::process::{Command, Output};

use crate::demo::PROVIDER_VARS;

/// Runs the demo on the scripted model with `args` and `set` applied.
fn demo(args: &[&str], set: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_markov-demo"));
    for var in PROVIDER_VARS {
        command.env_remove(var);
    }
    command.env_remove("MARKOV_MCP");
    command.args(args).envs(set.iter().copied());
    command.output().expect("the demo binary runs")
}

#[test]
fn an_mcp_server_that_cannot_start_is_an_error_not_a_panic() {
    let output = demo(&[], &[("MARKOV_MCP", "/nonexistent/mcp-server --stdio")]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with(
            "error: cannot use the MCP server: cannot start MCP server `/nonexistent/mcp-server`"
        ),
        "{stderr}"
    );
}

#[test]
fn a_flag_without_its_server_is_a_usage_error() {
    let output = demo(&["--mcp"], &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--mcp needs a server"), "{stderr}");
}

/// markov-mcp's stdio test server, when the workspace's build has made it
/// beside the demo (`cargo test --workspace` does; `-p markov-cli` alone
/// does not, and then this test has nothing to run).
fn test_server() -> Option<PathBuf> {
    let demo = PathBuf::from(env!("CARGO_BIN_EXE_markov-demo"));
    let server = demo.with_file_name(format!(
        "markov-mcp-test-server{}",
        std::env::consts::EXE_SUFFIX
    ));
    server.is_file().then_some(server)
}

#[test]
fn the_flag_adds_the_servers_tools_with_a_prefix() {
    let Some(server) = test_server() else {
        // `cargo test --workspace`, what CI runs, builds it: there a
        // missing server is a failure, never a skip.
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "markov-mcp-test-server was not built beside markov-demo (run the workspace's tests)"
        );
        eprintln!("skipped: markov-mcp-test-server is not built (test the workspace to build it)");
        return;
    };
    let server = server.to_string_lossy().into_owned();
    let output = demo(&["--mcp", &server], &[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let second = stdout.lines().nth(1).unwrap_or_default();
    assert!(
        second.starts_with("mcp: ")
            && second.ends_with("mcp_add, mcp_echo_key, mcp_fail, mcp_sleep, mcp_die, mcp_pid"),
        "{stdout}"
    );
    assert!(
        stdout.contains("Lisbon and Porto have 777885 inhabitants together."),
        "{stdout}"
    );
}
