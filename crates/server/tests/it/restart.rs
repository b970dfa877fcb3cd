//! A server killed (SIGKILL) while a turn's tools ran, and started again on
//! the same database: the next message first finishes the interrupted turn
//! — replaying the model's recorded answer, running no completed call again
//! — and only then answers the new message, in order. And one of two
//! workers on one PostgreSQL killed the same way: the other continues the
//! turn on its own once the dead worker's lease expires, with the same
//! guarantees, and its client goes on there.

use std::convert::Infallible;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use markov_core::async_trait;
use markov_core::tool::{Delivery, Tool, ToolContext};
use markov_executor::Agent;
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata};
use markov_server::{Server, create_api_key};
use markov_store::testing::TempPostgres;
use markov_store::{PostgresStore, SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::fixtures::{
    ChildServer, client, get_session, listen, new_session, scratch_dir, serve_forever,
    wait_for_session,
};

#[derive(Deserialize, JsonSchema)]
struct PayArgs {
    amount: u32,
}

/// Pays: one line per execution in a file another process can count.
struct Pay(PathBuf);

#[async_trait]
impl Tool for Pay {
    const NAME: &'static str = "pay";
    type Args = PayArgs;
    type Output = String;
    type Error = std::io::Error;
    fn description(&self) -> String {
        "Pay an amount".into()
    }
    async fn call(&self, args: PayArgs, _cx: &ToolContext<'_>) -> Result<String, std::io::Error> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.0)?;
        writeln!(file, "paid {}", args.amount)?;
        file.sync_all()?;
        Ok(format!("paid {}", args.amount))
    }
}

#[derive(Deserialize, JsonSchema)]
struct NoArgs {}

/// In the child (`MARKOV_SERVER_DIR` set) writes a marker and never
/// returns: the moment to kill the server. Elsewhere it answers at once.
struct Hang(PathBuf);

#[async_trait]
impl Tool for Hang {
    const NAME: &'static str = "hang";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Wait".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        if std::env::var_os("MARKOV_SERVER_DIR").is_some() {
            let _ = std::fs::write(&self.0, "hanging");
            std::future::pending::<()>().await;
        }
        Ok("waited".into())
    }
}

fn agent(dir: &Path, model: ScriptedModel) -> Agent {
    agent_with(dir, model, ToolMetadata::new(Category::Other))
}

/// [`agent`], its `hang` tool registered with `hang`.
fn agent_with(dir: &Path, model: ScriptedModel, hang: ToolMetadata) -> Agent {
    Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(
            Pay(dir.join("effects")),
            ToolMetadata::new(Category::Action),
        )
        .tool_with(Hang(dir.join("marker")), hang)
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(model)
        .build()
        .expect("the agent builds")
}

/// Serves `agent` on a loopback port over the SQLite file in `dir`.
async fn serve(dir: &Path, agent: Agent) -> String {
    let store = Arc::new(SqliteStore::open(dir.join("sessions.db")).expect("the database"));
    // The same worker name across restarts: a restarted server takes its own
    // sessions back at once.
    let server = Server::builder()
        .agent(agent)
        .store(store)
        .worker(WorkerId::new("server"))
        .build()
        .expect("the server builds");
    listen(server, std::future::pending()).await.0
}

/// The lease of the PostgreSQL workers: the shortest a server accepts, so
/// that the survivor takes the dead worker's session back soon.
const SHORT_LEASE: Duration = markov_server::ServerBuilder::MIN_LEASE;

/// Serves `agent` on a loopback port as `worker` over the PostgreSQL
/// database at `url`, with leases of [`SHORT_LEASE`].
async fn serve_postgres(url: &str, worker: &str, agent: Agent) -> String {
    let store = Arc::new(PostgresStore::connect(url).await.expect("the database"));
    let server = Server::builder()
        .agent(agent)
        .store(store)
        .worker(WorkerId::new(worker))
        .lease(SHORT_LEASE)
        .build()
        .expect("the server builds");
    listen(server, std::future::pending()).await.0
}

/// The PostgreSQL worker the test kills: not a test on its own (ignored).
#[test]
#[ignore = "run as a child process by the shared-PostgreSQL test"]
fn postgres_worker_child() {
    let (Some(dir), Ok(url)) = (
        std::env::var_os("MARKOV_SERVER_DIR"),
        std::env::var("MARKOV_SERVER_DATABASE"),
    ) else {
        return;
    };
    let dir = PathBuf::from(dir);
    serve_forever(async {
        let model = ScriptedModel::builder()
            .tool_calls([("pay", json!({"amount": 5})), ("hang", json!({}))])
            .build()
            .fresh_call_ids();
        let base = serve_postgres(&url, "doomed", agent(&dir, model)).await;
        std::fs::write(dir.join("base"), &base).expect("the address is written");
    });
}

/// The server process the test kills: not a test on its own (ignored).
#[test]
#[ignore = "run as a child process by the restart test"]
fn server_child() {
    let Some(dir) = std::env::var_os("MARKOV_SERVER_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    serve_forever(async {
        let model = ScriptedModel::builder()
            .tool_calls([("pay", json!({"amount": 5})), ("hang", json!({}))])
            .build()
            .fresh_call_ids();
        let store = SqliteStore::open(dir.join("sessions.db")).expect("the database");
        let key = create_api_key(&store, "alice", &[]).await.expect("a key");
        std::fs::write(dir.join("key"), &key.key).expect("the key is written");
        drop(store);
        let hang = if std::env::var_os("MARKOV_SERVER_AT_MOST_ONCE").is_some() {
            ToolMetadata::new(Category::Other).with_delivery(Delivery::AtMostOnce)
        } else {
            ToolMetadata::new(Category::Other)
        };
        let base = serve(&dir, agent_with(&dir, model, hang)).await;
        std::fs::write(dir.join("base"), &base).expect("the address is written");
    });
}

fn lines(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
}

/// Starts the child test `test` over the SQLite file in `dir`: the child,
/// its base URL and the key it created.
async fn sqlite_child(
    dir: &Path,
    test: &str,
    envs: &[(&str, &str)],
) -> (ChildServer, String, String) {
    let mut child = ChildServer::spawn(test, dir, envs);
    let base = child.read("base").await;
    let key = std::fs::read_to_string(dir.join("key")).expect("the key");
    (child, base, key)
}

/// A key for alice in the PostgreSQL database at `url`, which every worker
/// on it accepts.
async fn postgres_key(url: &str) -> String {
    let store = PostgresStore::connect(url).await.expect("the database");
    create_api_key(&store, "alice", &[])
        .await
        .expect("a key")
        .key
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_turn_finishes_that_turn_before_the_next_message() {
    let dir = scratch_dir("restart");
    let (child, base, key) = sqlite_child(&dir, "restart::server_child", &[]).await;
    let client = client();
    let id = new_session(&client, &base, &key).await;
    // The turn pays, then hangs in its next tool; the server dies there.
    let url = format!("{base}/sessions/{id}/messages");
    let pending = tokio::spawn({
        let client = client.clone();
        let key = key.clone();
        async move {
            client
                .post(url)
                .bearer_auth(&key)
                .json(&json!({"text": "pay 5"}))
                .send()
                .await
        }
    });
    child.kill_at("marker").await;
    let _ = pending.await;
    assert_eq!(lines(&dir.join("effects")), 1, "paid once before the crash");

    // The server starts again on the same database; the model is asked only
    // after the tools (for the interrupted turn's reply) and for the new
    // message.
    let model = ScriptedModel::builder()
        .text("Paid 5.")
        .text("You said: thanks")
        .build()
        .fresh_call_ids();
    let base = serve(&dir, agent(&dir, model)).await;
    let response = client
        .post(format!("{base}/sessions/{id}/messages"))
        .bearer_auth(&key)
        .json(&json!({"text": "thanks"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    let stream = response.text().await.expect("the stream");
    assert!(stream.contains("event: done"), "{stream}");
    assert_eq!(
        lines(&dir.join("effects")),
        1,
        "the payment was not repeated"
    );

    let session = get_session(&client, &base, &key, &id).await;
    assert_eq!(
        texts(&session),
        owned(&[
            ("user", "pay 5"),
            ("assistant", "Paid 5."),
            ("user", "thanks"),
            ("assistant", "You said: thanks"),
        ]),
        "the interrupted turn first, then the new message"
    );
    assert_calls_once_and_payment_from_the_ledger(&session);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_inside_an_at_most_once_call_answers_it_interrupted_in_the_step_event() {
    let dir = scratch_dir("at-most-once");
    let at_most_once = [("MARKOV_SERVER_AT_MOST_ONCE", "1")];
    let (child, base, key) = sqlite_child(&dir, "restart::server_child", &at_most_once).await;
    let client = client();
    let id = new_session(&client, &base, &key).await;
    // The turn pays, then hangs inside its at-most-once `hang` call.
    let url = format!("{base}/sessions/{id}/messages");
    let pending = tokio::spawn({
        let client = client.clone();
        let key = key.clone();
        async move {
            client
                .post(url)
                .bearer_auth(&key)
                .json(&json!({"text": "pay 5"}))
                .send()
                .await
        }
    });
    child.kill_at("marker").await;
    let _ = pending.await;

    let model = ScriptedModel::builder()
        .text("Paid 5; the wait may not have happened.")
        .text("You said: thanks")
        .build()
        .fresh_call_ids();
    let hang = ToolMetadata::new(Category::Other).with_delivery(Delivery::AtMostOnce);
    let base = serve(&dir, agent_with(&dir, model, hang)).await;
    let response = client
        .post(format!("{base}/sessions/{id}/messages"))
        .bearer_auth(&key)
        .json(&json!({"text": "thanks"}))
        .send()
        .await
        .expect("sent");
    assert_eq!(response.status(), 200);
    let stream = response.text().await.expect("the stream");
    assert!(stream.contains("event: done"), "{stream}");
    let named: Vec<Value> = stream
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .filter_map(|event| event["interrupted"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(named.len(), 1, "one step event names the call: {stream}");
    assert_eq!(named[0]["tool"], "hang");
    assert_eq!(named[0]["args"], json!({}));
    assert!(named[0]["call_id"].is_string(), "{}", named[0]);
    assert_eq!(lines(&dir.join("effects")), 1, "paid once");

    let session = get_session(&client, &base, &key, &id).await;
    let results: Vec<String> = session["history"]
        .as_array()
        .expect("a history")
        .iter()
        .filter_map(|m| m["items"].as_array())
        .flatten()
        .filter(|i| i["type"] == "tool_result")
        .filter_map(|i| i["content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    assert_eq!(results[0], r#"{"ok":true,"data":"paid 5"}"#);
    assert!(
        results[1].contains(r#""type":"INTERRUPTED""#),
        "{}",
        results[1]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The texts of a session's history (`GET /sessions/{id}`), with their roles.
fn texts(session: &Value) -> Vec<(String, String)> {
    session["history"]
        .as_array()
        .expect("a history")
        .iter()
        .filter_map(|m| {
            let text = match &m["items"] {
                Value::String(s) => s.clone(),
                Value::Array(items) => items
                    .iter()
                    .filter(|i| i["type"] == "text")
                    .filter_map(|i| i["text"].as_str())
                    .collect(),
                _ => String::new(),
            };
            (!text.is_empty()).then(|| (m["role"].as_str().unwrap_or("").to_owned(), text))
        })
        .collect()
}

/// The interrupted turn's answer is in the history once, with one result
/// per call, the payment's read from the ledger rather than paid again.
fn assert_calls_once_and_payment_from_the_ledger(session: &Value) {
    let items: Vec<&Value> = session["history"]
        .as_array()
        .expect("a history")
        .iter()
        .filter_map(|m| m["items"].as_array())
        .flatten()
        .collect();
    let calls: Vec<&str> = items
        .iter()
        .filter(|i| i["type"] == "tool_use")
        .filter_map(|i| i["name"].as_str())
        .collect();
    assert_eq!(
        calls,
        ["pay", "hang"],
        "the recorded answer's calls, once each"
    );
    let results: Vec<&str> = items
        .iter()
        .filter(|i| i["type"] == "tool_result")
        .filter_map(|i| i["content"].as_str())
        .collect();
    assert_eq!(
        results,
        [
            r#"{"ok":true,"data":"paid 5"}"#,
            r#"{"ok":true,"data":"waited"}"#
        ],
        "the payment answered from the ledger"
    );
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(r, t)| ((*r).to_owned(), (*t).to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_turn_on_postgres_has_its_turn_finished_once_by_another() {
    let Some(postgres) = TempPostgres::for_test() else {
        return;
    };
    let url = postgres.new_database().expect("a database");
    let dir = scratch_dir("worker-killed");
    // One key for every worker: the key store is the shared database.
    let key = postgres_key(&url).await;
    let mut child = ChildServer::spawn(
        "restart::postgres_worker_child",
        &dir,
        &[("MARKOV_SERVER_DATABASE", &url)],
    );
    // The survivor serves beside it from the start: nobody starts it again
    // after the crash, it finds the dead worker's run by itself. Its model
    // is asked for the interrupted turn's reply, then for the next message.
    let survivor_model = ScriptedModel::builder()
        .text("Paid 5.")
        .text("You said: thanks")
        .build()
        .fresh_call_ids();
    let survivor = serve_postgres(&url, "survivor", agent(&dir, survivor_model)).await;
    let doomed = child.read("base").await;
    let client = client();
    let id = new_session(&client, &doomed, &key).await;
    let pending = post_in_background(&client, &doomed, &key, &id, "pay 5");
    child.kill_at("marker").await;
    let lost = pending.await.expect("the client's task");
    assert!(
        !lost.as_deref().unwrap_or("").contains("event: done"),
        "the killed worker never finished the turn: {lost:?}"
    );
    assert_eq!(lines(&dir.join("effects")), 1, "paid once before the crash");

    // The client goes on with the survivor: it waits until no run of the
    // session is in progress anywhere, then sends its next message there.
    let session = wait_for_session(
        &client,
        &survivor,
        &key,
        &id,
        |session| session["interrupted"] == json!(false),
        "the survivor never finished the dead worker's turn",
    )
    .await;
    assert_eq!(
        texts(&session),
        owned(&[("user", "pay 5"), ("assistant", "Paid 5.")]),
        "the survivor finished the turn by itself"
    );
    assert_calls_once_and_payment_from_the_ledger(&session);
    assert_eq!(
        lines(&dir.join("effects")),
        1,
        "the payment was not repeated"
    );
    let metrics = client
        .get(format!("{survivor}/metrics"))
        .bearer_auth(&key)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the metrics");
    assert!(
        metrics.contains("markov_runs_continued_total 1\n"),
        "the survivor counts the run it continued: {metrics}"
    );

    let stream = client
        .post(format!("{survivor}/sessions/{id}/messages"))
        .bearer_auth(&key)
        .json(&json!({"text": "thanks"}))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the stream");
    assert!(stream.contains("event: done"), "{stream}");
    let session = get_session(&client, &survivor, &key, &id).await;
    assert_eq!(
        texts(&session),
        owned(&[
            ("user", "pay 5"),
            ("assistant", "Paid 5."),
            ("user", "thanks"),
            ("assistant", "You said: thanks"),
        ])
    );
    assert_calls_once_and_payment_from_the_ledger(&session);
    assert_eq!(lines(&dir.join("effects")), 1, "paid once in all");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An input guard that, in the child (`MARKOV_SERVER_DIR` set), writes a
/// marker and never decides: the moment to kill the worker, while it
/// checks the user's message. Elsewhere it passes at once.
#[derive(Debug)]
struct SlowCheck(PathBuf);

#[async_trait]
impl markov_guard::Guard for SlowCheck {
    fn name(&self) -> &str {
        "slow-check"
    }
    async fn check(&self, _text: &str) -> markov_guard::Verdict {
        if std::env::var_os("MARKOV_SERVER_DIR").is_some() {
            let _ = std::fs::write(&self.0, "checking");
            std::future::pending::<()>().await;
        }
        markov_guard::Verdict::Pass
    }
}

/// `note`: writes its text into the state and asks the agent about it, so
/// that a state change and a user message wait in one batch.
struct NoteAndAsk;

#[async_trait]
impl markov_charter::command::Command for NoteAndAsk {
    const NAME: &'static str = "note";
    type Input = Value;
    type Error = markov_charter::command::CommandError;
    fn description(&self) -> String {
        "Note a text and ask about it".into()
    }
    async fn execute(
        &self,
        input: Value,
        cx: &markov_charter::command::CommandContext<'_>,
    ) -> Result<markov_charter::command::CommandResult, Self::Error> {
        let text = input["text"].as_str().unwrap_or_default().to_owned();
        cx.update_state(json!({ "note": text }))?;
        Ok(markov_charter::command::CommandResult::done()
            .message(cx.user_message(format!("What about {text}?"))))
    }
}

/// An agent whose input guard is [`SlowCheck`], with the `note` command.
fn guarded_agent(dir: &Path, model: ScriptedModel) -> Agent {
    let node = markov_charter::node::Node::builder("Greet the user.")
        .state(json!({}))
        .command(NoteAndAsk)
        .build()
        .expect("the node builds");
    Agent::builder("greeter")
        .node("greeter", node)
        .guards(markov_guard::Guards::new().input(SlowCheck(dir.join("checking"))))
        .model(model)
        .build()
        .expect("the agent builds")
}

/// The guarded worker the input-check crash tests kill: not a test on its
/// own (ignored). On PostgreSQL when `MARKOV_SERVER_DATABASE` is set, else
/// on the SQLite file in the directory.
#[test]
#[ignore = "run as a child process by the input-check crash tests"]
fn guarded_worker_child() {
    let Some(dir) = std::env::var_os("MARKOV_SERVER_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    serve_forever(async {
        // Never asked: the worker dies before the guard decides.
        let model = ScriptedModel::builder().build();
        let base = match std::env::var("MARKOV_SERVER_DATABASE") {
            Ok(url) => serve_postgres(&url, "doomed", guarded_agent(&dir, model)).await,
            Err(_) => {
                let store = SqliteStore::open(dir.join("sessions.db")).expect("the database");
                let key = create_api_key(&store, "alice", &[]).await.expect("a key");
                std::fs::write(dir.join("key"), &key.key).expect("the key is written");
                drop(store);
                serve(&dir, guarded_agent(&dir, model)).await
            }
        };
        std::fs::write(dir.join("base"), &base).expect("the address is written");
    });
}

/// Posts `text` to the session `id` at `base` in a task of its own,
/// returning the stream the client got (cut short when the worker dies).
fn post_in_background(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    id: &str,
    text: &str,
) -> tokio::task::JoinHandle<reqwest::Result<String>> {
    let (client, key) = (client.clone(), key.to_owned());
    let url = format!("{base}/sessions/{id}/messages");
    let body = json!({ "text": text });
    tokio::spawn(async move {
        client
            .post(url)
            .bearer_auth(&key)
            .json(&body)
            .send()
            .await?
            .text()
            .await
    })
}

/// Posts the `note` command to the session `id` at `base` in a task of its
/// own (its answer never comes when the worker dies).
fn note_in_background(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    id: &str,
) -> tokio::task::JoinHandle<reqwest::Result<String>> {
    let (client, key) = (client.clone(), key.to_owned());
    let url = format!("{base}/sessions/{id}/commands");
    tokio::spawn(async move {
        client
            .post(url)
            .bearer_auth(&key)
            .json(&json!({"name": "note", "input": {"text": "apples"}}))
            .send()
            .await?
            .text()
            .await
    })
}

/// Each message of the session's history: its role, and its text if any.
fn roles(session: &Value) -> Vec<String> {
    session["history"]
        .as_array()
        .expect("a history")
        .iter()
        .map(|m| m["role"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// What a session shows of the `note` command run while its worker died:
/// the command, its change of state and the question each once, in order,
/// the question answered, and the state changed.
fn assert_noted_once(session: &Value, answers: &[(&str, &str)]) {
    let mut expected = vec![
        "command".to_owned(),
        "instance".to_owned(),
        "user".to_owned(),
        "assistant".to_owned(),
    ];
    expected.extend(answers.iter().map(|(role, _)| (*role).to_owned()));
    assert_eq!(roles(session), expected, "{session}");
    let mut said = vec![
        ("user", "What about apples?"),
        ("assistant", "About apples."),
    ];
    said.extend_from_slice(answers);
    assert_eq!(texts(session), owned(&said), "{session}");
    let noted = session["history"]
        .as_array()
        .and_then(|h| h.iter().find(|m| m["role"] == "instance"))
        .map(|m| m.to_string())
        .unwrap_or_default();
    assert!(noted.contains("apples"), "the change of state: {noted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_while_the_input_guard_checks_a_command_s_message_applies_the_command_once_after_the_restart()
 {
    let dir = scratch_dir("input-check-command");
    let (child, base, key) = sqlite_child(&dir, "restart::guarded_worker_child", &[]).await;
    let client = client();
    let id = new_session(&client, &base, &key).await;
    // The command changes the state and queues its question; the guard
    // checks the question, with the change of state queued beside it.
    let pending = note_in_background(&client, &base, &key, &id);
    child.kill_at("checking").await;
    let lost = pending.await.expect("the client's task");
    assert!(
        !lost.as_deref().unwrap_or("").contains("success"),
        "the killed server never answered: {lost:?}"
    );

    let model = ScriptedModel::builder()
        .text("About apples.")
        .text("You said: thanks")
        .build()
        .fresh_call_ids();
    let base = serve(&dir, guarded_agent(&dir, model)).await;
    let stream = client
        .post(format!("{base}/sessions/{id}/messages"))
        .bearer_auth(&key)
        .json(&json!({"text": "thanks"}))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the stream");
    assert!(stream.contains("event: done"), "{stream}");
    let session = get_session(&client, &base, &key, &id).await;
    assert_noted_once(
        &session,
        &[("user", "thanks"), ("assistant", "You said: thanks")],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_the_input_guard_checks_a_command_s_message_has_the_command_applied_once_by_another()
 {
    let Some(postgres) = TempPostgres::for_test() else {
        return;
    };
    let url = postgres.new_database().expect("a database");
    let dir = scratch_dir("input-check-command-pg");
    let key = postgres_key(&url).await;
    let mut child = ChildServer::spawn(
        "restart::guarded_worker_child",
        &dir,
        &[("MARKOV_SERVER_DATABASE", &url)],
    );
    let model = ScriptedModel::builder()
        .text("About apples.")
        .build()
        .fresh_call_ids();
    let survivor = serve_postgres(&url, "survivor", guarded_agent(&dir, model)).await;
    let doomed = child.read("base").await;
    let client = client();
    let id = new_session(&client, &doomed, &key).await;
    let pending = note_in_background(&client, &doomed, &key, &id);
    child.kill_at("checking").await;
    let lost = pending.await.expect("the client's task");
    assert!(
        !lost.as_deref().unwrap_or("").contains("success"),
        "the killed worker never answered: {lost:?}"
    );
    let session = wait_for_session(
        &client,
        &survivor,
        &key,
        &id,
        |session| session["interrupted"] == json!(false) && !texts(session).is_empty(),
        "the survivor never went on with the run being checked",
    )
    .await;
    assert_noted_once(&session, &[]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_while_the_input_guard_checks_a_message_answers_it_after_the_restart() {
    let dir = scratch_dir("input-check");
    let (child, base, key) = sqlite_child(&dir, "restart::guarded_worker_child", &[]).await;
    let client = client();
    let id = new_session(&client, &base, &key).await;
    let pending = post_in_background(&client, &base, &key, &id, "hello there");
    child.kill_at("checking").await;
    let lost = pending.await.expect("the client's task");
    assert!(
        !lost.as_deref().unwrap_or("").contains("event: done"),
        "the killed server never answered: {lost:?}"
    );

    // Started again on the same database: the message that was being
    // checked is checked again and answered first, then the new one.
    let model = ScriptedModel::builder()
        .text("Hello to you.")
        .text("You said: thanks")
        .build()
        .fresh_call_ids();
    let base = serve(&dir, guarded_agent(&dir, model)).await;
    let stream = client
        .post(format!("{base}/sessions/{id}/messages"))
        .bearer_auth(&key)
        .json(&json!({"text": "thanks"}))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the stream");
    assert!(stream.contains("event: done"), "{stream}");
    let session = get_session(&client, &base, &key, &id).await;
    assert_eq!(
        texts(&session),
        owned(&[
            ("user", "hello there"),
            ("assistant", "Hello to you."),
            ("user", "thanks"),
            ("assistant", "You said: thanks"),
        ]),
        "the message checked when the server died is answered, first"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_while_the_input_guard_checks_a_message_has_it_answered_by_another() {
    let Some(postgres) = TempPostgres::for_test() else {
        return;
    };
    let url = postgres.new_database().expect("a database");
    let dir = scratch_dir("input-check-pg");
    let key = postgres_key(&url).await;
    let mut child = ChildServer::spawn(
        "restart::guarded_worker_child",
        &dir,
        &[("MARKOV_SERVER_DATABASE", &url)],
    );
    // The survivor serves beside it and finds the dead worker's run by
    // itself: its model answers the message that was being checked.
    let model = ScriptedModel::builder()
        .text("Hello to you.")
        .build()
        .fresh_call_ids();
    let survivor = serve_postgres(&url, "survivor", guarded_agent(&dir, model)).await;
    let doomed = child.read("base").await;
    let client = client();
    let id = new_session(&client, &doomed, &key).await;
    let pending = post_in_background(&client, &doomed, &key, &id, "hello there");
    child.kill_at("checking").await;
    let lost = pending.await.expect("the client's task");
    assert!(
        !lost.as_deref().unwrap_or("").contains("event: done"),
        "the killed worker never answered: {lost:?}"
    );
    let session = wait_for_session(
        &client,
        &survivor,
        &key,
        &id,
        |session| session["interrupted"] == json!(false) && !texts(session).is_empty(),
        "the survivor never answered the message being checked",
    )
    .await;
    assert_eq!(
        texts(&session),
        owned(&[("user", "hello there"), ("assistant", "Hello to you.")]),
        "the survivor checked the message again and answered it"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
