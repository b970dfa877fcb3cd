//! The demo and the service with MCP servers' tools: `--mcp` (repeatable,
//! shell words), `MARKOV_MCP`, `--mcp-config` (the `mcpServers` file),
//! and the approval lines. The reference servers (`.ci/run` installs them)
//! are found on `PATH`; under `CI=true` a missing one is a failure.

use std::path::PathBuf;
use std::process::Output;

use markov_testkit::required_program;

use crate::fixtures::without_provider;

/// Runs the demo on the scripted model with `args` and `set` applied.
fn demo(args: &[&str], set: &[(&str, &str)]) -> Output {
    let mut command = without_provider(env!("CARGO_BIN_EXE_markov-demo"));
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
    assert!(
        stderr.contains("a value is required for '--mcp <SERVER>'"),
        "{stderr}"
    );
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

/// A fresh directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("markov-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creates a directory");
    dir
}

#[test]
fn a_command_whose_path_has_spaces_is_one_word_when_quoted() {
    let Some(time) = required_program("mcp-server-time", "pip install mcp-server-time") else {
        return;
    };
    let dir = scratch("spaces").join("my tools");
    std::fs::create_dir_all(&dir).expect("creates a directory");
    let script = dir.join("time server");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nexec '{}' \"$@\"\n", time.display()),
    )
    .expect("writes");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let spec = format!("'{}' --local-timezone UTC", script.display());
    let output = demo(&["--mcp", &spec], &[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.lines().nth(1).unwrap_or_default(),
        format!(
            "mcp: {}: mcp_get_current_time, mcp_convert_time",
            script.display()
        ),
        "{stdout}"
    );
}

#[test]
fn config_files_and_repeated_flags_add_every_server_and_say_which_tools_need_approval() {
    let (Some(everything), Some(filesystem), Some(time)) = (
        required_program(
            "mcp-server-everything",
            "npm install -g @modelcontextprotocol/server-everything",
        ),
        required_program(
            "mcp-server-filesystem",
            "npm install -g @modelcontextprotocol/server-filesystem",
        ),
        required_program("mcp-server-time", "pip install mcp-server-time"),
    ) else {
        return;
    };
    let dir = scratch("config");
    let file = dir.join("mcp.json");
    std::fs::write(
        &file,
        serde_json::json!({"mcpServers": {
            "files": {"command": filesystem, "roots": [&dir],
                      "noApproval": ["create_directory"]},
            "everything": {"command": everything, "args": ["stdio"], "approval": "all",
                           "includeTools": ["echo", "get-sum"]}
        }})
        .to_string(),
    )
    .expect("writes");
    let time = time.to_string_lossy().into_owned();
    let output = demo(
        &["--mcp", &time, "--mcp-config", &file.to_string_lossy()],
        &[],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines[1],
        format!("mcp: {time}: mcp_get_current_time, mcp_convert_time"),
        "{stdout}"
    );
    // The files: destructive tools need approval, read-only ones not, and
    // the file's exemption wins over the hints.
    for line in [
        "  files_write_file needs approval: the server marks it destructive",
        "  files_move_file needs approval: the server marks it destructive",
        "  everything_echo needs approval: the configuration requires approval for all tools",
        "  everything_get-sum needs approval: the configuration requires approval for all tools",
    ] {
        assert!(lines.contains(&line), "{line:?} missing in\n{stdout}");
    }
    assert!(!stdout.contains("files_read_text_file needs"), "{stdout}");
    assert!(!stdout.contains("files_create_directory needs"), "{stdout}");
    assert!(
        stdout.contains("Lisbon and Porto have 777885 inhabitants together."),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_service_takes_the_same_flags_and_logs_the_approvals() {
    let Some(filesystem) = required_program(
        "mcp-server-filesystem",
        "npm install -g @modelcontextprotocol/server-filesystem",
    ) else {
        return;
    };
    let dir = scratch("serve");
    let file = dir.join("mcp.json");
    std::fs::write(
        &file,
        serde_json::json!({"mcpServers": {"files": {"command": filesystem, "args": [&dir]}}})
            .to_string(),
    )
    .expect("writes");
    let mut command = without_provider(env!("CARGO_BIN_EXE_markov-serve"));
    command.env_remove("MARKOV_MCP");
    let mut child = command
        .args(["--port", "0", "--database"])
        .arg(dir.join("sessions.db"))
        .arg("--mcp-config")
        .arg(&file)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("markov-serve starts");
    let stderr = child.stderr.take().expect("piped");
    let (found, log) = std::thread::scope(|scope| {
        let reader = scope.spawn(move || {
            use std::io::BufRead;
            let mut log = String::new();
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                log.push_str(&line);
                log.push('\n');
                if line.contains("files_move_file needs approval") || line.contains("error") {
                    return (line.contains("needs approval"), log);
                }
            }
            (false, log)
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !reader.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
        reader.join().unwrap_or((false, String::new()))
    });
    assert!(found, "{log}");
    assert!(
        log.contains("files_move_file needs approval: the server marks it destructive"),
        "{log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
