//! What the durable engines' crash tests share (with the `engine` feature):
//! the fixture agent's scripted model and tools, which write what really
//! happened to files a test reads, and the child processes around them.
//!
//! A test of an engine adapter (Restate, Temporal) runs the fixture agent
//! in a child process it can kill: an ignored test of its own test binary
//! ([`FixtureChild::spawn`] re-runs the binary for just that test), which
//! builds the agent from a [`FixtureConfig`] read from the environment,
//! wraps the model and tools in the engine's journaling, and serves it.
//! The parent then counts effects and model calls in the logs:
//!
//! - `model.log`: `begin <step> <version>` before each model answer and
//!   `end <step> <first user message>` after it (`version` is `v2` when the
//!   instructions are the changed agent's);
//! - `effects.log`: `effect record <note> <idempotency key>` each time the
//!   at-most-once `record` tool really ran (and `effect guarded …` for the
//!   one behind an approval).
//!
//! The model's script: step 0 calls `record` (or `guarded`, when the first
//! user message says "guarded") with the note `first`, step 1 calls
//! `record` with `second`, then it answers `done after <n> steps`.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use markov_core::async_trait;
use markov_core::message::{Item, Role};
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
use markov_core::tool::{Delivery, Tool, ToolContext};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

/// How the fixture agent behaves, as the parent test set it in the
/// child's environment.
#[derive(Debug, Clone)]
pub struct FixtureConfig {
    /// Where the logs are written (`MARKOV_FIXTURE_DIR`).
    pub dir: PathBuf,
    /// The agent's version (`MARKOV_FIXTURE_AGENT`, default `v1`): `v2`
    /// has changed instructions and the tool `tally` added; `v3` has the
    /// `guarded` tool removed too.
    pub version: String,
    /// No logs written, for timing (`MARKOV_FIXTURE_QUIET` set).
    pub quiet: bool,
    /// Every model call takes this long (`MARKOV_FIXTURE_MODEL_MS`), so
    /// that sessions are in flight when a test kills something.
    pub model_delay: Option<Duration>,
    /// Stall (longer than any test waits) the first time this point is
    /// reached, across restarts (`MARKOV_FIXTURE_STALL`: `tool`, or
    /// `model:<step>`).
    pub stall: Option<String>,
}

impl FixtureConfig {
    /// The configuration the parent test set in this process's environment.
    ///
    /// # Errors
    /// `MARKOV_FIXTURE_DIR` is not set.
    pub fn from_env() -> Result<Self, String> {
        let dir = std::env::var_os("MARKOV_FIXTURE_DIR")
            .ok_or("MARKOV_FIXTURE_DIR is not set")?
            .into();
        Ok(FixtureConfig {
            dir,
            version: std::env::var("MARKOV_FIXTURE_AGENT").unwrap_or_else(|_| "v1".to_owned()),
            quiet: std::env::var_os("MARKOV_FIXTURE_QUIET").is_some(),
            model_delay: std::env::var("MARKOV_FIXTURE_MODEL_MS")
                .ok()
                .and_then(|ms| ms.parse().ok())
                .map(Duration::from_millis),
            stall: std::env::var("MARKOV_FIXTURE_STALL").ok(),
        })
    }

    /// A configuration that writes no logs, never waits and never stalls:
    /// the fixture's script alone, for timing in process.
    pub fn quiet() -> Self {
        FixtureConfig {
            dir: PathBuf::new(),
            version: "v1".to_owned(),
            quiet: true,
            model_delay: None,
            stall: None,
        }
    }

    /// The agent's instructions for its version (the changed agent's end
    /// with "briefly", which the model writes into `model.log`).
    pub fn instructions(&self) -> &'static str {
        if self.version == "v1" {
            "Record what you are asked to."
        } else {
            "Record what you are asked to, briefly."
        }
    }

    /// Whether the agent of this version has the `guarded` tool.
    pub fn has_guarded(&self) -> bool {
        self.version != "v3"
    }

    /// Whether the agent of this version has the `tally` tool.
    pub fn has_tally(&self) -> bool {
        self.version != "v1"
    }

    fn append(&self, file: &str, line: &str) {
        if self.quiet {
            return;
        }
        append_line(&self.dir.join(file), line);
    }

    async fn stall_once(&self, what: &str) {
        if self.quiet || self.stall.as_deref() != Some(what) {
            return;
        }
        let marker = self.dir.join("stalled");
        if marker.exists() {
            return;
        }
        append_line(&marker, what);
        tokio::time::sleep(Duration::from_secs(600)).await;
    }
}

/// Appends `line` to `path` and syncs it: what a test reads after killing
/// the process was really written.
fn append_line(path: &Path, line: &str) {
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| {
            writeln!(f, "{line}")?;
            f.sync_all()
        });
    if let Err(error) = written {
        eprintln!("cannot write {}: {error}", path.display());
    }
}

/// The fixture's scripted model (see the module's documentation).
#[derive(Debug, Clone)]
pub struct FixtureModel {
    config: Arc<FixtureConfig>,
}

impl FixtureModel {
    /// The model, logging as `config` says.
    pub fn new(config: &FixtureConfig) -> Self {
        FixtureModel {
            config: Arc::new(config.clone()),
        }
    }
}

#[async_trait]
impl Model for FixtureModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let messages = request.messages();
        let step = messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        let version = if request.system().contains("briefly") {
            "v2"
        } else {
            "v1"
        };
        let config = &self.config;
        config.append("model.log", &format!("begin {step} {version}"));
        config.stall_once(&format!("model:{step}")).await;
        if let Some(delay) = config.model_delay {
            tokio::time::sleep(delay).await;
        }
        let first_user = messages
            .iter()
            .find(|m| m.role == Role::User)
            .map(|m| m.text())
            .unwrap_or_default();
        let tool = if first_user.contains("guarded") {
            "guarded"
        } else {
            "record"
        };
        let response = match step {
            0 => ModelResponse::new(
                vec![Item::tool_use("call_1", tool, json!({"note": "first"}))],
                StopReason::ToolUse,
            ),
            1 => ModelResponse::new(
                vec![Item::tool_use(
                    "call_2",
                    "record",
                    json!({"note": "second"}),
                )],
                StopReason::ToolUse,
            ),
            _ => ModelResponse::new(
                vec![Item::text(format!("done after {step} steps"))],
                StopReason::EndTurn,
            ),
        };
        config.append(
            "model.log",
            &format!("end {step} {}", first_user.replace(' ', "_")),
        );
        Ok(response)
    }
}

/// The arguments of the fixture's tools.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct NoteArgs {
    /// What to record.
    pub note: String,
}

/// A side effect that must not happen twice: at most once. Logs
/// `effect record <note> <key>` when it really runs.
#[derive(Debug, Clone)]
pub struct Record {
    config: Arc<FixtureConfig>,
}

impl Record {
    /// The tool, logging as `config` says.
    pub fn new(config: &FixtureConfig) -> Self {
        Record {
            config: Arc::new(config.clone()),
        }
    }
}

#[async_trait]
impl Tool for Record {
    const NAME: &'static str = "record";
    const DELIVERY: Option<Delivery> = Some(Delivery::AtMostOnce);
    type Args = NoteArgs;
    type Output = String;
    type Error = std::convert::Infallible;

    fn description(&self) -> String {
        "Record a note.".into()
    }

    async fn call(&self, args: NoteArgs, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let key = cx.idempotency_key().unwrap_or("-");
        self.config
            .append("effects.log", &format!("effect record {} {key}", args.note));
        self.config.stall_once("tool").await;
        Ok(format!("recorded {}", args.note))
    }
}

/// The same side effect, meant to be registered behind the application's
/// approval. Logs `effect guarded <note> <key>` when it really runs.
#[derive(Debug, Clone)]
pub struct Guarded {
    config: Arc<FixtureConfig>,
}

impl Guarded {
    /// The tool, logging as `config` says.
    pub fn new(config: &FixtureConfig) -> Self {
        Guarded {
            config: Arc::new(config.clone()),
        }
    }
}

#[async_trait]
impl Tool for Guarded {
    const NAME: &'static str = "guarded";
    type Args = NoteArgs;
    type Output = String;
    type Error = std::convert::Infallible;

    fn description(&self) -> String {
        "Record a note, once a person approves.".into()
    }

    async fn call(&self, args: NoteArgs, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let key = cx.idempotency_key().unwrap_or("-");
        self.config.append(
            "effects.log",
            &format!("effect guarded {} {key}", args.note),
        );
        Ok(format!("guarded {}", args.note))
    }
}

/// The tool the changed agent adds; no side effect.
#[derive(Debug, Clone, Copy)]
pub struct Tally;

#[async_trait]
impl Tool for Tally {
    const NAME: &'static str = "tally";
    type Args = NoteArgs;
    type Output = String;
    type Error = std::convert::Infallible;

    fn description(&self) -> String {
        "Count a note.".into()
    }

    async fn call(&self, args: NoteArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        Ok(format!("counted {}", args.note))
    }
}

/// A temporary directory, removed on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new, empty directory named after `name` (unique within and across
    /// processes).
    pub fn new(name: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "markov-{name}-{}-{}-{}",
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

/// A loopback port free at the time of asking.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// SIGKILL to `child`'s process group (it leads one), then reaps it.
pub fn kill_group(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .status();
    let _ = child.kill();
    let _ = child.wait();
}

/// An engine's server binary: the path in the environment variable `var`,
/// else `name` on `PATH`, else the first of `also` that exists. Missing:
/// `None` (the test skips) outside CI, a failure under `CI=true`, with
/// `install` saying how to get it.
pub fn engine_binary(var: &str, name: &str, also: &[PathBuf], install: &str) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(var) {
        return Some(PathBuf::from(path));
    }
    let found =
        crate::program::on_path(name).or_else(|| also.iter().find(|p| p.is_file()).cloned());
    crate::program::required(found, name, install)
}

/// The fixture agent in a child process: the running test binary again,
/// running only the ignored test that serves the agent. Killed on drop.
#[derive(Debug)]
pub struct FixtureChild {
    child: Option<Child>,
    test: String,
    env: Vec<(String, OsString)>,
    ready: String,
}

impl FixtureChild {
    /// A child to run the ignored test `test` (its full path in the test
    /// binary, e.g. `fixture::serve`) with `env`, ready once a line of its
    /// output contains `ready`. Not started yet: see [`start`](Self::start).
    pub fn new(test: &str, ready: &str, env: Vec<(String, OsString)>) -> Self {
        FixtureChild {
            child: None,
            test: test.to_owned(),
            env,
            ready: ready.to_owned(),
        }
    }

    /// Sets (or replaces) one environment variable for the next start.
    pub fn set_env(&mut self, key: &str, value: impl Into<OsString>) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.into()));
    }

    /// Starts the child and waits (at most 120 s) for its ready line;
    /// returns what follows `ready` on that line, trimmed.
    pub fn start(&mut self) -> String {
        self.kill();
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                &self.test,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the fixture starts");
        let stdout = child.stdout.take().expect("stdout");
        let (lines, found) = std::sync::mpsc::channel();
        let ready = self.ready.clone();
        // Read on a thread of its own, which keeps reading (and dropping)
        // the child's output after the ready line, so that its pipe never
        // fills or closes under it.
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut seen = String::new();
            let mut line = String::new();
            loop {
                line.clear();
                match reader.read_line(&mut line) {
                    Ok(0) | Err(_) => {
                        let _ = lines.send(Err(seen));
                        return;
                    }
                    Ok(_) => {}
                }
                if let Some(at) = line.find(&ready) {
                    let _ = lines.send(Ok(line[at + ready.len()..].trim().to_owned()));
                    break;
                }
                seen.push_str(&line);
            }
            let _ = std::io::copy(&mut reader, &mut std::io::sink());
        });
        let rest = match found.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(rest)) => rest,
            Ok(Err(seen)) => {
                let _ = child.kill();
                panic!("the fixture exited before it was ready: {seen:?}")
            }
            Err(_) => {
                let _ = child.kill();
                panic!("the fixture was not ready in 120 s")
            }
        };
        self.child = Some(child);
        rest
    }

    /// SIGKILL (nothing if it is not running).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for FixtureChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The fixture's logs in `dir`, as a test reads them.
#[derive(Debug, Clone)]
pub struct FixtureLogs(pub PathBuf);

impl FixtureLogs {
    /// The lines of one log (none when it does not exist yet).
    pub fn lines(&self, file: &str) -> Vec<String> {
        std::fs::read_to_string(self.0.join(file))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// How many lines of `file` start with `line`.
    pub fn count(&self, file: &str, line: &str) -> usize {
        self.lines(file)
            .iter()
            .filter(|l| l.starts_with(line))
            .count()
    }

    /// Waits (at most 30 s) until `file` has a line starting with `line`
    /// and the fixture has stalled.
    pub fn wait_for_stall(&self, file: &str, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.count(file, line) > 0 && self.0.join("stalled").exists() {
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
