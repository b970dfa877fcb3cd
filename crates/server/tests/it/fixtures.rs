//! Set-up shared by this binary's scenario tests: scratch directories, a
//! server serving on a loopback port, and this test binary run again as a
//! server process that a test kills.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use markov_server::Server;
use serde_json::Value;

/// A new, empty directory under the system's temporary one, named after
/// `name` and unique to this call.
pub(crate) fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "markov-server-{name}-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).expect("a directory");
    dir
}

/// Serves `server` on a free loopback port until `shutdown` ends; its base
/// URL and the task that ends once the server has stopped.
pub(crate) async fn listen(
    server: Server,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> (String, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let base = format!("http://{}", listener.local_addr().expect("an address"));
    let stopped = tokio::spawn(server.serve_until(listener, shutdown));
    (base, stopped)
}

/// An HTTP client for the loopback servers. reqwest is built without a
/// default TLS provider; loopback is plain HTTP, but the client wants one
/// all the same.
pub(crate) fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// Creates a session at `base` as the holder of `key`: its id.
pub(crate) async fn new_session(client: &reqwest::Client, base: &str, key: &str) -> String {
    let created: Value = client
        .post(format!("{base}/sessions"))
        .bearer_auth(key)
        .send()
        .await
        .expect("sent")
        .json()
        .await
        .expect("json");
    created["id"].as_str().expect("an id").to_owned()
}

/// The session `id` at `base` as its holder reads it (`GET /sessions/{id}`,
/// answered 200).
pub(crate) async fn get_session(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    id: &str,
) -> Value {
    let response = client
        .get(format!("{base}/sessions/{id}"))
        .bearer_auth(key)
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200, "GET /sessions/{id} at {base}");
    response.json().await.expect("json")
}

/// Reads the session `id` at `base` until `ready` holds for it (two
/// minutes at most, then the test fails saying `never`), and returns it:
/// how a client waits for a surviving worker to finish another's run.
pub(crate) async fn wait_for_session(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    id: &str,
    ready: impl Fn(&Value) -> bool,
    never: &str,
) -> Value {
    let mut waited = Duration::ZERO;
    loop {
        let session = get_session(client, base, key, id).await;
        if ready(&session) {
            return session;
        }
        assert!(waited < Duration::from_secs(120), "{never}: {session}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += Duration::from_millis(50);
    }
}

/// Runs `serve` in the child process on a runtime of its own, then waits
/// forever: the child serves until its test kills it.
pub(crate) fn serve_forever(serve: impl Future<Output = ()>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        serve.await;
        std::future::pending::<()>().await;
    });
}

/// This test binary run again as the ignored test `test`: a server in a
/// process of its own, which the test kills (SIGKILL) at a moment the
/// child marks with a file in its directory (`MARKOV_SERVER_DIR`).
pub(crate) struct ChildServer {
    process: std::process::Child,
    dir: PathBuf,
}

impl ChildServer {
    /// Starts the child test `test` (its full path, `module::name`) with
    /// `MARKOV_SERVER_DIR` set to `dir` and the variables `envs`.
    pub(crate) fn spawn(test: &str, dir: &Path, envs: &[(&str, &str)]) -> ChildServer {
        let process = Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                test,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("MARKOV_SERVER_DIR", dir)
            .envs(envs.iter().copied())
            .spawn()
            .expect("the child server starts");
        ChildServer {
            process,
            dir: dir.to_owned(),
        }
    }

    /// Waits (two minutes at most) until the child has written the file
    /// `name` in its directory; a child that exits first fails the test.
    pub(crate) async fn wait_for(&mut self, name: &str) {
        let path = self.dir.join(name);
        let mut waited = Duration::ZERO;
        while !path.exists() {
            assert!(
                waited < Duration::from_secs(120),
                "{} never appeared",
                path.display()
            );
            if let Ok(Some(status)) = self.process.try_wait() {
                panic!("the server exited early: {status}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            waited += Duration::from_millis(20);
        }
    }

    /// Waits for the file `name` and reads it.
    pub(crate) async fn read(&mut self, name: &str) -> String {
        self.wait_for(name).await;
        std::fs::read_to_string(self.dir.join(name)).expect("the child's file")
    }

    /// Kills the child (SIGKILL) once it has written the file `name`.
    pub(crate) async fn kill_at(mut self, name: &str) {
        self.wait_for(name).await;
        self.process.kill().expect("SIGKILL");
        self.process.wait().expect("reaped");
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}
