//! The `support` example's building blocks, served on loopback: its
//! rehearsal model answers every conversation in full, and its API key is
//! made once and kept.

use std::sync::Arc;

use markov::prelude::*;
use markov::testkit::sse::events;
use serde_json::Value;

// Its `main` is not called here; its building blocks are `pub` for this test.
#[allow(dead_code, unreachable_pub)]
#[path = "../../examples/support.rs"]
mod example;

/// A directory of its own under the system's temporary one, removed after.
struct Dir(std::path::PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "markov-support-{name}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&path).expect("a temporary directory");
        Dir(path)
    }

    fn path(&self, file: &str) -> String {
        self.0.join(file).display().to_string()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rehearsal_answers_ten_conversations_in_full_and_the_key_is_made_once() {
    let dir = Dir::new("ten");
    let store = Arc::new(SqliteStore::open(dir.path("sessions.db")).expect("the database opens"));
    let key = example::api_key(&store, &dir.path("support-api-key"))
        .await
        .expect("a key");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path("support-api-key"))
            .expect("the key file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the key file is its owner's alone");
    }
    // A later start reads the same key and makes none.
    let again = example::api_key(&store, &dir.path("support-api-key"))
        .await
        .expect("the key again");
    assert_eq!(again, key);
    let keys = markov::store::KeyStore::keys(&*store).await.expect("keys");
    assert_eq!(keys.len(), 1, "one key made, on the first start");

    let agent = example::agent(example::rehearsal()).expect("the agent builds");
    let server = Server::builder()
        .agent(agent)
        .store(store)
        .build()
        .expect("the server builds");
    let listener = markov::server::bind("127.0.0.1:0").await.expect("a port");
    let base = format!("http://{}", listener.local_addr().expect("an address"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve_until(listener, async {
        let _ = stopped.await;
    }));
    // reqwest is built without a default TLS provider; loopback is plain
    // HTTP, but the client wants one all the same.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let post = |path: String, body: Value| {
        client
            .post(format!("{base}{path}"))
            .bearer_auth(&key)
            .json(&body)
            .send()
    };

    for conversation in 1..=10 {
        let created = post("/sessions".into(), json!({})).await.expect("sent");
        assert_eq!(created.status(), 201, "conversation {conversation}");
        let created: Value = created.json().await.expect("json");
        let id = created["id"].as_str().expect("an id").to_owned();

        let said = post(
            format!("/sessions/{id}/messages"),
            json!({"text": "Where is order A-1001? Please refund it."}),
        )
        .await
        .expect("sent");
        assert_eq!(said.status(), 200, "conversation {conversation}");
        let said = events(&said.text().await.expect("the stream"));
        let stream = format!("{said:?}");
        assert!(
            stream.contains("left the warehouse on Monday"),
            "conversation {conversation}: {stream}"
        );
        let done = &said.last().expect("events").1;
        assert_eq!(
            done["awaiting_approval"], true,
            "conversation {conversation}: {stream}"
        );

        let pending: Value = client
            .get(format!("{base}/sessions/{id}/approvals"))
            .bearer_auth(&key)
            .send()
            .await
            .expect("sent")
            .json()
            .await
            .expect("json");
        let pending = pending.as_array().expect("a list");
        assert_eq!(pending.len(), 1, "conversation {conversation}: {pending:?}");
        let request = pending[0]["request_id"].as_str().expect("an id");

        let decided = post(
            format!("/sessions/{id}/approvals/{request}"),
            json!({"decision": "approve"}),
        )
        .await
        .expect("sent");
        assert_eq!(decided.status(), 200, "conversation {conversation}");
        let decided = events(&decided.text().await.expect("the stream"));
        let stream = format!("{decided:?}");
        assert!(
            stream.contains("refunded 1500 cents on order A-1001"),
            "conversation {conversation}: {stream}"
        );
        assert!(
            stream.contains("Your refund of 15.00 is on its way."),
            "conversation {conversation}: the full answer, in {stream}"
        );
        let done = &decided.last().expect("events").1;
        assert_eq!(done["done"], true, "conversation {conversation}: {stream}");
        assert!(
            !stream.contains("script"),
            "conversation {conversation}: {stream}"
        );
    }

    let _ = stop.send(());
    serving.await.expect("joined").expect("served");
}
