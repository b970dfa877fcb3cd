//! The floor under figure 7: a server that does only what any durable
//! chat service must do with a message, on the crates markov's server is
//! built on, and nothing of markov's. `server-processes <N> <W> floor`
//! runs it in place of the workers, with the same clients, the same fake
//! provider and the same CPU accounting, so the two figures differ by
//! exactly what markov adds.
//!
//! A message here is: the HTTP request read (axum on hyper, a connection
//! per message, as the clients send them), the bearer key compared, the
//! user's message committed to SQLite in memory with the session's row
//! counted up, one streamed call of the Anthropic Messages API through
//! reqwest (its events parsed as JSON, the text gathered), the answer
//! committed the same way, and two server-sent events written back (`step`
//! with the answer, then `done`). The database is a connection behind a
//! mutex, used on the request's own task: no thread is handed any work,
//! which is as cheap as a durable write gets (an in-memory database never
//! waits on a disk). No agent, no policy, no trace, no price, no history
//! sent back: the model is sent the one message.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::StreamExt;
use serde_json::{Value, json};

/// What every request shares.
struct Floor {
    db: Mutex<rusqlite::Connection>,
    http: reqwest::Client,
    messages_url: String,
    key: String,
    sessions: AtomicU64,
}

impl Floor {
    /// The floor over the Messages API at `provider_url`, accepting `key`.
    fn new(provider_url: &str, key: &str) -> rusqlite::Result<Self> {
        Ok(Floor {
            db: Mutex::new(database()?),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(300))
                .build()
                .expect("a client"),
            messages_url: format!("{}/v1/messages", provider_url.trim_end_matches('/')),
            key: key.to_owned(),
            sessions: AtomicU64::new(0),
        })
    }
}

/// `serve-worker <provider> floor`: the floor server over the fake provider
/// at `provider_url`, on a free loopback port, printed (`port=N key=K`) as
/// the real worker prints it; it serves until it is killed.
pub(crate) fn worker(provider_url: &str) -> std::process::ExitCode {
    crate::server::answer_heap_requests();
    let runtime = markov_bench::two_thread_runtime();
    runtime.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let floor = Floor::new(provider_url, "floor-key").expect("a database");
        let listener = markov_server::bind("127.0.0.1:0").await.expect("a port");
        println!(
            "port={} key={}",
            listener.local_addr().expect("an address").port(),
            floor.key
        );
        serve(listener, Arc::new(floor)).await;
    });
    std::process::ExitCode::SUCCESS
}

/// Serves `floor` on `listener`.
async fn serve(listener: tokio::net::TcpListener, floor: Arc<Floor>) {
    let app = Router::new()
        .route("/sessions", post(create))
        .route("/sessions/{id}/messages", post(message))
        .with_state(floor);
    // As markov's server does: events are small writes, and Nagle's
    // algorithm would hold each for the client's delayed acknowledgement.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let _ = axum::serve(listener, app).await;
}

/// The database in memory: sessions, and their messages in order.
fn database() -> rusqlite::Result<rusqlite::Connection> {
    let db = rusqlite::Connection::open_in_memory()?;
    db.execute_batch(
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, revision INTEGER NOT NULL);
         CREATE TABLE messages (session TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL,
                                PRIMARY KEY (session, seq));",
    )?;
    Ok(db)
}

/// The bearer key, compared.
fn authorized(floor: &Floor, headers: &HeaderMap) -> bool {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|key| key == floor.key)
}

async fn create(State(floor): State<Arc<Floor>>, headers: HeaderMap) -> Response {
    if !authorized(&floor, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let id = format!("s{}", floor.sessions.fetch_add(1, Ordering::Relaxed));
    let inserted = floor
        .db
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .prepare_cached("INSERT INTO sessions (id, revision) VALUES (?1, 0)")
        .and_then(|mut insert| insert.execute([&id]));
    match inserted {
        Ok(_) => (StatusCode::CREATED, axum::Json(json!({ "id": id }))).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn message(
    State(floor): State<Arc<Floor>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if !authorized(&floor, &headers) {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let Some(text) = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["text"].as_str().map(str::to_owned))
    else {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    };
    let user = json!({"role": "user", "content": text});
    match commit(&floor, &id, &user) {
        Ok(_) => {}
        Err(rusqlite::Error::QueryReturnedNoRows) => return StatusCode::NOT_FOUND.into_response(),
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
    // The head goes out now, the events as they are ready: the same writes
    // as a streamed answer of markov's.
    let events = futures::stream::once(async move {
        let (step, done) = match answer(&floor, &text).await {
            Ok(answer) => {
                let assistant = json!({"role": "assistant", "content": answer});
                match commit(&floor, &id, &assistant) {
                    Ok(seq) => (
                        json!({"seq": seq, "message": assistant}),
                        json!({"reason": "end_turn"}),
                    ),
                    Err(error) => (Value::Null, json!({"error": error.to_string()})),
                }
            }
            Err(error) => (Value::Null, json!({"error": error})),
        };
        let mut out = String::new();
        if !step.is_null() {
            out.push_str(&format!("event: step\ndata: {step}\n\n"));
        }
        out.push_str(&format!("event: done\ndata: {done}\n\n"));
        Ok::<_, std::convert::Infallible>(out)
    });
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        axum::body::Body::from_stream(events),
    )
        .into_response()
}

/// Appends `message` to session `id` and counts its row up, in one
/// transaction: the message's sequence number (`QueryReturnedNoRows` when
/// there is no such session).
fn commit(floor: &Floor, id: &str, message: &Value) -> rusqlite::Result<i64> {
    let mut db = floor.db.lock().unwrap_or_else(|p| p.into_inner());
    let tx = db.transaction()?;
    // Counted up, then read: an `UPDATE … RETURNING` would have SQLite
    // build a temporary table for its one row.
    if tx
        .prepare_cached("UPDATE sessions SET revision = revision + 1 WHERE id = ?1")?
        .execute([id])?
        != 1
    {
        return Err(rusqlite::Error::QueryReturnedNoRows);
    }
    let seq: i64 = tx
        .prepare_cached("SELECT revision FROM sessions WHERE id = ?1")?
        .query_row([id], |row| row.get(0))?;
    tx.prepare_cached("INSERT INTO messages (session, seq, body) VALUES (?1, ?2, ?3)")?
        .execute(rusqlite::params![id, seq, message.to_string()])?;
    tx.commit()?;
    Ok(seq)
}

/// One streamed Messages API call with `text` as the user's message: the
/// answer's text.
async fn answer(floor: &Floor, text: &str) -> Result<String, String> {
    let response = floor
        .http
        .post(&floor.messages_url)
        .header("x-api-key", "sk-ant-bench")
        .header("anthropic-version", "2023-06-01")
        .json(&json!({
            "model": "claude-sonnet-4-5",
            "max_tokens": 1024,
            "stream": true,
            "system": "Answer.",
            "messages": [{"role": "user", "content": text}],
        }))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("the provider answered {}", response.status()));
    }
    let mut chunks = response.bytes_stream();
    let mut pending = Vec::new();
    let mut answer = String::new();
    while let Some(chunk) = chunks.next().await {
        pending.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
        // Each complete event's `data:` line, parsed.
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
                let data: Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
                if data["type"] == "content_block_delta" {
                    answer.push_str(data["delta"]["text"].as_str().unwrap_or_default());
                }
            }
        }
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use markov_testkit::Recording;
    use markov_testkit::http::FakeServer;

    use super::Floor;

    #[test]
    fn a_message_is_answered_by_the_model_and_both_are_committed() {
        markov_bench::two_thread_runtime().block_on(answered_and_committed());
    }

    async fn answered_and_committed() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let provider = FakeServer::start().await;
        provider
            .answer_with(crate::server::answer)
            .recording(Recording::Off);
        let floor = Arc::new(Floor::new(&provider.base_url(), "k").expect("a database"));
        let listener = markov_server::bind("127.0.0.1:0").await.expect("a port");
        let base = format!("http://{}", listener.local_addr().expect("an address"));
        tokio::spawn(super::serve(listener, Arc::clone(&floor)));

        let client = reqwest::Client::new();
        let refused = client
            .post(format!("{base}/sessions"))
            .bearer_auth("wrong")
            .send()
            .await
            .expect("an answer");
        assert_eq!(refused.status(), reqwest::StatusCode::UNAUTHORIZED);
        let id = crate::server::new_session(&client, &base, "k").await;
        assert_eq!(id, "s0");
        let stream = client
            .post(format!("{base}/sessions/{id}/messages"))
            .bearer_auth("k")
            .json(&serde_json::json!({"text": "hi"}))
            .send()
            .await
            .expect("an answer")
            .text()
            .await
            .expect("the events");
        assert!(stream.starts_with("event: step\ndata: "), "{stream}");
        assert!(stream.contains(r#""content":"ok""#), "{stream}");
        assert!(
            stream.ends_with("event: done\ndata: {\"reason\":\"end_turn\"}\n\n"),
            "{stream}"
        );

        {
            let db = floor.db.lock().expect("the database");
            let rows: Vec<(i64, String)> = db
                .prepare("SELECT seq, body FROM messages WHERE session = 's0' ORDER BY seq")
                .and_then(|mut rows| {
                    rows.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
                        .collect()
                })
                .expect("the messages");
            assert_eq!(
                rows,
                [
                    (1, r#"{"content":"hi","role":"user"}"#.to_owned()),
                    (2, r#"{"content":"ok","role":"assistant"}"#.to_owned()),
                ]
            );
            let revision: i64 = db
                .query_row("SELECT revision FROM sessions WHERE id = 's0'", [], |row| {
                    row.get(0)
                })
                .expect("the session");
            assert_eq!(revision, 2);
        }

        let missing = client
            .post(format!("{base}/sessions/nobody/messages"))
            .bearer_auth("k")
            .json(&serde_json::json!({"text": "hi"}))
            .send()
            .await
            .expect("an answer");
        assert_eq!(missing.status(), reqwest::StatusCode::NOT_FOUND);
    }
}
