//! A `restate-server` and the fixture service, both child processes on
//! loopback, and a client of the ingress and the admin API.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) use markov_testkit::engine::TempDir;
use markov_testkit::engine::{FixtureChild, FixtureLogs, engine_binary, free_port, kill_group};

use serde_json::{Value, json};

/// The `restate-server` binary: `MARKOV_RESTATE_SERVER`, else on PATH.
/// Missing: a skip outside CI, a failure under `CI=true`.
fn server_binary() -> Option<PathBuf> {
    engine_binary(
        "MARKOV_RESTATE_SERVER",
        "restate-server",
        &[],
        "npm install -g @restatedev/restate-server",
    )
}

/// A Restate server with the fixture service started in a new directory
/// named `name` (stalling at `stall`, see [`Fixture::start`]) and
/// registered, and a client: `None` (outside CI) when Restate is not
/// installed.
pub(crate) async fn deployed(
    name: &str,
    stall: Option<&str>,
) -> Option<(Server, TempDir, Fixture, Client)> {
    let server = Server::start()?;
    let dir = TempDir::new(name);
    let fixture = Fixture::start(&dir.0, stall);
    let client = Client::new(&server);
    client.register(fixture.port).await;
    Some((server, dir, fixture, client))
}

/// A session's stored history.
pub(crate) async fn history(client: &Client, session: &str) -> Vec<Value> {
    let snapshot = client.shared(session, "snapshot").await;
    snapshot["history"].as_array().cloned().unwrap_or_default()
}

/// How many user text messages `history` holds.
pub(crate) fn user_messages(history: &[Value]) -> usize {
    history
        .iter()
        .filter(|m| m["role"] == "user" && m["items"][0]["type"] == "text")
        .count()
}

/// The content of the result of the call `call` in `history`, as JSON text.
pub(crate) fn tool_result_text(history: &[Value], call: &str) -> String {
    history
        .iter()
        .flat_map(|m| m["items"].as_array().cloned().unwrap_or_default())
        .find(|i| i["type"] == "tool_result" && i["tool_use_id"] == call)
        .map(|i| i["content"].to_string())
        .unwrap_or_else(|| panic!("no result for {call}: {history:?}"))
}

/// One `restate-server` node on loopback with its own data directory.
pub(crate) struct Server {
    child: Child,
    pub(crate) ingress: String,
    pub(crate) admin: String,
    _dir: TempDir,
}

impl Server {
    /// Starts a single-node server, or `None` (skip) when the binary is
    /// missing outside CI. Ports are picked free and the start retried
    /// when one was taken meanwhile.
    pub(crate) fn start() -> Option<Server> {
        let binary = server_binary()?;
        for _ in 0..5 {
            let dir = TempDir::new("server");
            let (node, admin, ingress) = (free_port(), free_port(), free_port());
            let log = std::fs::File::create(dir.0.join("server.log")).expect("log file");
            let mut child = Command::new(&binary)
                // npm's restate-server is a node script that starts the
                // server as its child: a group of its own lets the test
                // kill both.
                .process_group(0)
                .arg("--no-logo")
                .env("RESTATE_BASE_DIR", dir.0.join("data"))
                .env("RESTATE_BIND_IP", "127.0.0.1")
                .env("RESTATE_BIND_PORT", node.to_string())
                .env("RESTATE_ADMIN__BIND_PORT", admin.to_string())
                .env("RESTATE_INGRESS__BIND_PORT", ingress.to_string())
                .env("RESTATE_LISTEN_MODE", "tcp")
                .env("RESTATE_LOG_FORMAT", "compact")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("restate-server starts");
            let admin = format!("http://127.0.0.1:{admin}");
            let ingress = format!("http://127.0.0.1:{ingress}");
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                let up = |url: String| {
                    std::net::TcpStream::connect(url.trim_start_matches("http://")).is_ok()
                };
                if up(admin.clone()) && up(ingress.clone()) && health(&admin) {
                    return Some(Server {
                        child,
                        ingress,
                        admin,
                        _dir: dir,
                    });
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            kill_group(&mut child);
            eprintln!(
                "restate-server did not come up; retrying: {}",
                std::fs::read_to_string(dir.0.join("server.log")).unwrap_or_default()
            );
        }
        panic!("restate-server did not start in five attempts");
    }
}

fn health(admin: &str) -> bool {
    let Some(rest) = admin.strip_prefix("http://") else {
        return false;
    };
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(rest) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(
            format!("GET /health HTTP/1.1\r\nHost: {rest}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .is_err()
    {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200")
}

impl Drop for Server {
    fn drop(&mut self) {
        kill_group(&mut self.child);
    }
}

/// The fixture service (the ignored test `fixture::serve`, in a child
/// process), killable and restartable on the same port.
pub(crate) struct Fixture {
    child: FixtureChild,
    pub(crate) port: u16,
    logs: FixtureLogs,
}

impl Fixture {
    fn new(dir: &Path) -> Fixture {
        Fixture {
            child: FixtureChild::new(
                "fixture::serve",
                "listening ",
                vec![("MARKOV_FIXTURE_DIR".to_owned(), dir.into())],
            ),
            port: 0,
            logs: FixtureLogs(dir.to_owned()),
        }
    }

    /// Starts the fixture writing to `dir`, stalling once at `stall`.
    pub(crate) fn start(dir: &Path, stall: Option<&str>) -> Fixture {
        let mut fixture = Fixture::new(dir);
        if let Some(stall) = stall {
            fixture.child.set_env("MARKOV_FIXTURE_STALL", stall);
        }
        fixture.spawn();
        fixture
    }

    /// Starts the fixture serving the caller of the fixture agent as a
    /// sub-agent (see `fixture::caller`), stalling once at `stall`.
    pub(crate) fn start_sub_agent(dir: &Path, stall: &str) -> Fixture {
        let mut fixture = Fixture::new(dir);
        fixture.child.set_env("MARKOV_FIXTURE_STALL", stall);
        fixture.child.set_env(crate::fixture::SUB_AGENT, "1");
        fixture.spawn();
        fixture
    }

    /// Starts the fixture with every model call taking `ms`.
    pub(crate) fn start_slow(dir: &Path, ms: u64) -> Fixture {
        let mut fixture = Fixture::new(dir);
        fixture
            .child
            .set_env("MARKOV_FIXTURE_MODEL_MS", ms.to_string());
        fixture.spawn();
        fixture
    }

    /// Starts the fixture with no logs, for timing.
    pub(crate) fn start_quiet(dir: &Path) -> Fixture {
        let mut fixture = Fixture::new(dir);
        fixture.child.set_env("MARKOV_FIXTURE_QUIET", "1");
        fixture.spawn();
        fixture
    }

    fn spawn(&mut self) {
        // A restarted service binds the port it had: Restate sends an
        // invocation's retries to the deployment it started on.
        self.child
            .set_env("MARKOV_FIXTURE_PORT", self.port.to_string());
        let port = self.child.start();
        self.port = port
            .parse()
            .unwrap_or_else(|_| panic!("unexpected fixture output: {port:?}"));
    }

    /// SIGKILL, then a new process on the same port.
    pub(crate) fn kill_and_restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// SIGKILL, then a new process on the same port serving the agent
    /// `version` (`v2`: new instructions and a tool added; `v3`: the
    /// `guarded` tool removed too).
    pub(crate) fn redeploy(&mut self, version: &str) {
        self.kill();
        self.child.set_env("MARKOV_FIXTURE_AGENT", version);
        self.spawn();
    }

    /// SIGKILL.
    pub(crate) fn kill(&mut self) {
        self.child.kill();
    }

    /// The lines of one of the fixture's logs.
    pub(crate) fn lines(&self, file: &str) -> Vec<String> {
        self.logs.lines(file)
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

/// A client of one server's ingress and admin API.
pub(crate) struct Client {
    http: reqwest::Client,
    ingress: String,
    admin: String,
}

impl Client {
    pub(crate) fn new(server: &Server) -> Client {
        Client::at(&server.ingress, &server.admin)
    }

    /// A client of the ingress and admin API at these addresses.
    pub(crate) fn at(ingress: &str, admin: &str) -> Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        Client {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .expect("client"),
            ingress: ingress.to_owned(),
            admin: admin.to_owned(),
        }
    }

    /// Registers the service at `port`.
    pub(crate) async fn register(&self, port: u16) {
        let response = self
            .http
            .post(format!("{}/deployments", self.admin))
            .json(&json!({ "uri": format!("http://127.0.0.1:{port}"), "force": true }))
            .send()
            .await
            .expect("the admin API answers");
        assert!(
            response.status().is_success(),
            "registration failed: {}",
            response.text().await.unwrap_or_default()
        );
    }

    /// Runs a turn and waits for its result.
    pub(crate) async fn send(&self, session: &str, message: &str) -> Value {
        let response = self
            .http
            .post(format!("{}/MarkovSession/{session}/send", self.ingress))
            .json(&message)
            .send()
            .await
            .expect("the ingress answers");
        assert!(
            response.status().is_success(),
            "the turn failed: {}",
            response.status()
        );
        response.json().await.expect("json")
    }

    /// Registers the service at `port`; whether the server took it.
    pub(crate) async fn try_register(&self, port: u16) -> bool {
        self.http
            .post(format!("{}/deployments", self.admin))
            .json(&json!({ "uri": format!("http://127.0.0.1:{port}"), "force": true }))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    }

    /// Starts a turn without waiting; its invocation id.
    pub(crate) async fn send_async(&self, session: &str, message: &str) -> String {
        let answer: Value = self
            .http
            .post(format!(
                "{}/MarkovSession/{session}/send/send",
                self.ingress
            ))
            .json(&message)
            .send()
            .await
            .expect("the ingress answers")
            .json()
            .await
            .expect("json");
        answer["invocationId"]
            .as_str()
            .unwrap_or_else(|| panic!("no invocation id: {answer}"))
            .to_owned()
    }

    /// Waits for an invocation's result.
    pub(crate) async fn attach(&self, invocation: &str) -> Value {
        let response = self
            .http
            .get(format!(
                "{}/restate/invocation/{invocation}/attach",
                self.ingress
            ))
            .send()
            .await
            .expect("the ingress answers");
        let status = response.status();
        let text = response.text().await.expect("a body");
        assert!(status.is_success(), "the turn failed: {status} {text}");
        serde_json::from_str(&text).expect("json")
    }

    /// Calls a shared handler of a session.
    pub(crate) async fn shared(&self, session: &str, handler: &str) -> Value {
        self.http
            .post(format!(
                "{}/MarkovSession/{session}/{handler}",
                self.ingress
            ))
            .send()
            .await
            .expect("the ingress answers")
            .json()
            .await
            .expect("json")
    }

    /// The invocation's status and last failure, as the admin API's
    /// `sys_invocation` table has them.
    pub(crate) async fn invocation_state(&self, invocation: &str) -> Value {
        self.http
            .post(format!("{}/query", self.admin))
            .header("accept", "application/json")
            .json(&json!({ "query": format!(
                "SELECT status, retry_count, last_failure, last_failure_error_code FROM sys_invocation WHERE id = '{invocation}'"
            ) }))
            .send()
            .await
            .expect("the admin API answers")
            .json()
            .await
            .expect("json")
    }

    /// Resolves an awakeable with `value`.
    pub(crate) async fn resolve(&self, awakeable: &str, value: Value) {
        let response = self
            .http
            .post(format!(
                "{}/restate/awakeables/{awakeable}/resolve",
                self.ingress
            ))
            .json(&value)
            .send()
            .await
            .expect("the ingress answers");
        assert!(
            response.status().is_success(),
            "resolve failed: {}",
            response.status()
        );
    }
}

/// Three `restate-server` nodes on loopback forming one cluster (every
/// node runs every role; logs and partitions replicated on two nodes).
pub(crate) struct Cluster {
    pub(crate) nodes: Vec<Option<Server>>,
}

impl Cluster {
    /// Starts the cluster, or `None` (skip) when the binary is missing
    /// outside CI.
    pub(crate) fn start() -> Option<Cluster> {
        let binary = server_binary()?;
        // A port picked free can be taken by another test before its node
        // binds it, and then the cluster never forms: a few attempts with
        // fresh ports, each bounded, and the nodes' logs shown when all fail.
        let mut logs = String::new();
        for attempt in 1..=3 {
            match Cluster::attempt(&binary) {
                Ok(cluster) => return Some(cluster),
                Err(tail) => {
                    eprintln!("the cluster did not come up (attempt {attempt}):\n{tail}");
                    logs = tail;
                }
            }
        }
        panic!("the cluster did not come up in three attempts; the last nodes' logs:\n{logs}");
    }

    /// One start with fresh ports: the cluster, or the tail of each node's
    /// log when it did not come up within its deadline.
    fn attempt(binary: &std::path::Path) -> Result<Cluster, String> {
        let ports: Vec<(u16, u16, u16)> = (0..3)
            .map(|_| (free_port(), free_port(), free_port()))
            .collect();
        let metadata = format!(
            "[{}]",
            ports
                .iter()
                .map(|(node, _, _)| format!("\"http://127.0.0.1:{node}\""))
                .collect::<Vec<_>>()
                .join(",")
        );
        let mut nodes = Vec::new();
        for (i, (node, admin, ingress)) in ports.iter().enumerate() {
            let dir = TempDir::new("cluster");
            let log = std::fs::File::create(dir.0.join("server.log")).expect("log file");
            let child = Command::new(binary)
                .process_group(0)
                .arg("--no-logo")
                .env("RESTATE_BASE_DIR", dir.0.join("data"))
                .env("RESTATE_CLUSTER_NAME", "markov-test")
                .env("RESTATE_NODE_NAME", format!("n{}", i + 1))
                .env(
                    "RESTATE_AUTO_PROVISION",
                    if i == 0 { "true" } else { "false" },
                )
                .env("RESTATE_METADATA_CLIENT__ADDRESSES", &metadata)
                .env("RESTATE_DEFAULT_REPLICATION", "2")
                .env("RESTATE_BIND_IP", "127.0.0.1")
                .env("RESTATE_BIND_PORT", node.to_string())
                .env("RESTATE_ADMIN__BIND_PORT", admin.to_string())
                .env("RESTATE_INGRESS__BIND_PORT", ingress.to_string())
                .env("RESTATE_LISTEN_MODE", "tcp")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("restate-server starts");
            nodes.push(Some(Server {
                child,
                ingress: format!("http://127.0.0.1:{ingress}"),
                admin: format!("http://127.0.0.1:{admin}"),
                _dir: dir,
            }));
        }
        let deadline = Instant::now() + Duration::from_secs(45);
        for server in nodes.iter().flatten() {
            while !health(&server.admin) {
                if Instant::now() >= deadline {
                    let tail = nodes
                        .iter()
                        .flatten()
                        .map(|node| {
                            let log = std::fs::read_to_string(node._dir.0.join("server.log"))
                                .unwrap_or_default();
                            let lines: Vec<&str> = log.lines().collect();
                            let from = lines.len().saturating_sub(15);
                            format!("--- {}\n{}", node.admin, lines[from..].join("\n"))
                        })
                        .collect::<Vec<_>>()
                        .join("\n");
                    return Err(tail);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(Cluster { nodes })
    }

    /// SIGKILL to node `i`.
    pub(crate) fn kill(&mut self, i: usize) {
        if let Some(mut server) = self.nodes[i].take() {
            kill_group(&mut server.child);
        }
    }
}
