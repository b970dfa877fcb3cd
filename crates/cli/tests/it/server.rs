//! The `markov-serve` binary: without a provider it serves the demo agent
//! on the rehearsal model, over HTTP, its sessions in a SQLite file.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::json;

/// The server process, killed on drop.
struct Server(Child, std::path::PathBuf);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_file(&self.1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_answers_the_demo_question_over_http() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let db = std::env::temp_dir().join(format!("markov-server-{}-{port}.db", std::process::id()));
    let mut command = Command::new(env!("CARGO_BIN_EXE_markov-serve"));
    for var in crate::demo::PROVIDER_VARS {
        command.env_remove(var);
    }
    let _server = Server(
        command
            .args(["--port", &port.to_string(), "--database"])
            .arg(&db)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the server starts"),
        db,
    );
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let mut waited = Duration::ZERO;
    let created = loop {
        match client.post(format!("{base}/sessions")).send().await {
            Ok(response) => break response,
            Err(_) => {
                assert!(
                    waited < Duration::from_secs(30),
                    "the server never answered"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
                waited += Duration::from_millis(100);
            }
        }
    };
    assert_eq!(created.status(), 201);
    let id = created.json::<serde_json::Value>().await.expect("json")["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let stream = client
        .post(format!("{base}/sessions/{id}/messages"))
        .json(&json!({"text": "How many people live in Lisbon and Porto together?"}))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the stream");
    assert!(stream.contains("event: done"), "{stream}");
    assert!(stream.contains("777885"), "{stream}");
    let page = client
        .get(&base)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the page");
    assert!(page.contains("<title>markov</title>"));
}
