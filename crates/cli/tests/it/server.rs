//! The `markov-serve` binary: without a provider it serves the demo agent
//! on the rehearsal model, over HTTP, its sessions and API keys in a
//! SQLite file; `keys` creates, lists and revokes keys; SIGTERM stops it
//! cleanly; `--help` documents every flag; `--team` serves the demo team,
//! its handoffs, hand-backs and approvals over HTTP.

use std::process::{Command, Stdio};

use markov_testkit::sse::events;
use serde_json::json;

use crate::fixtures::{Server, closed_port, once_listening, printed_key, without_provider};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_answers_the_demo_question_over_http() {
    let port = closed_port();
    let db = std::env::temp_dir().join(format!("markov-server-{}-{port}.db", std::process::id()));
    let created = keys(&db, &["create", "alice", "--role", "approver"]);
    assert!(created.status.success(), "{created:?}");
    let key = String::from_utf8_lossy(&created.stdout).trim().to_owned();
    assert!(key.starts_with("mk_"), "the key is printed alone: {key:?}");
    let mut command = without_provider(env!("CARGO_BIN_EXE_markov-serve"));
    let _server = Server(
        command
            .args(["--port", &port.to_string(), "--database"])
            .arg(&db)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the server starts"),
        db.clone(),
    );
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let created = once_listening(|| {
        client
            .post(format!("{base}/sessions"))
            .bearer_auth(&key)
            .send()
    })
    .await;
    assert_eq!(created.status(), 201);
    let id = created.json::<serde_json::Value>().await.expect("json")["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let stream = client
        .post(format!("{base}/sessions/{id}/messages"))
        .bearer_auth(&key)
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
    let anonymous = client
        .get(format!("{base}/sessions"))
        .send()
        .await
        .expect("sent");
    assert_eq!(anonymous.status(), 401);

    // A revoked key signs nobody in, at once.
    let id = key
        .trim_start_matches("mk_")
        .split('_')
        .next()
        .expect("an id");
    let listed = keys(&db, &["list"]);
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(
        listed.contains(id) && listed.contains("alice") && listed.contains("approver"),
        "{listed}"
    );
    assert!(
        !listed.contains(&key),
        "the list never shows a secret: {listed}"
    );
    assert!(keys(&db, &["revoke", id]).status.success());
    let revoked = client
        .get(format!("{base}/sessions"))
        .bearer_auth(&key)
        .send()
        .await
        .expect("sent");
    assert_eq!(revoked.status(), 401);
    assert!(!keys(&db, &["revoke", id]).status.success(), "revoked once");

    // SIGTERM: it stops accepting, and exits cleanly.
    let mut server = _server;
    let status = server.terminate().await;
    assert!(status.success(), "{status}");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut server.0.stdout.take().expect("stdout"), &mut out)
        .expect("reads");
    assert!(
        out.contains("serving on http://127.0.0.1:") && out.contains("stopped"),
        "{out}"
    );
}

fn keys(db: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_markov-serve"))
        .arg("keys")
        .args(args)
        .arg("--database")
        .arg(db)
        .output()
        .expect("markov-serve keys runs")
}

#[test]
fn help_documents_every_flag() {
    let help = Command::new(env!("CARGO_BIN_EXE_markov-serve"))
        .arg("--help")
        .output()
        .expect("runs");
    assert!(help.status.success());
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    for flag in [
        "--database ",
        "--database-url",
        "--bind",
        "--port",
        "--allowed-host",
        "--public-url",
        "--cors-origin",
        "--approval-role",
        "--require-approval",
        "--context ",
        "--jwt-issuer",
        "--jwt-audience",
        "--jwt-public-key",
        "--jwt-algorithm",
        "--rate-limit",
        "--run-deadline",
        "--max-connections",
        "--header-timeout",
        "--max-body",
        "--worker",
        "--team",
        "--handoff-history",
        "keys",
    ] {
        let line = help
            .lines()
            .position(|l| l.trim_start().starts_with(flag))
            .unwrap_or_else(|| panic!("{flag} is not in --help:\n{help}"));
        // Each flag has its own description under it.
        let described = help
            .lines()
            .nth(line + 1)
            .is_some_and(|l| l.trim().len() > 10)
            || help
                .lines()
                .nth(line)
                .is_some_and(|l| l.trim().len() > flag.len() + 10);
        assert!(described, "{flag} has no description:\n{help}");
    }
    let keys = Command::new(env!("CARGO_BIN_EXE_markov-serve"))
        .args(["keys", "--help"])
        .output()
        .expect("runs");
    let keys = String::from_utf8_lossy(&keys.stdout).into_owned();
    for command in ["create", "list", "revoke"] {
        assert!(keys.contains(command), "{keys}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_logs_requests_and_failed_turns_and_the_database_is_in_the_data_directory() {
    let port = closed_port();
    let model_port = closed_port();
    let root = std::env::temp_dir().join(format!("markov-serve-{}-{port}", std::process::id()));
    let cwd = root.join("checkout");
    let data = root.join("data");
    std::fs::create_dir_all(&cwd).expect("a directory");
    struct Cleanup(std::path::PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(root.clone());
    let mut command = without_provider(env!("CARGO_BIN_EXE_markov-serve"));
    // A model server that is not there: every turn fails.
    let mut child = command
        .current_dir(&cwd)
        .env("XDG_DATA_HOME", &data)
        .env(
            "OPENAI_BASE_URL",
            format!("http://127.0.0.1:{model_port}/v1"),
        )
        .env("MARKOV_MODEL", "absent-model")
        .args(["--port", &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the server starts");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut printed = String::new();
    let key = printed_key(&mut stdout, &mut printed)
        .unwrap_or_else(|| panic!("the server stopped before printing a key:\n{printed}"));
    let label = printed.lines().next().unwrap_or_default().to_owned();
    assert!(
        label.starts_with("model: ") && label.contains("absent-model"),
        "{printed}"
    );
    let server = Server(child, root.join("unused"));
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let agents = once_listening(|| {
        client
            .get(format!("{base}/agents"))
            .bearer_auth(&key)
            .send()
    })
    .await
    .json::<serde_json::Value>()
    .await
    .expect("json");
    assert_eq!(
        agents[0]["model"],
        label.trim_start_matches("model: "),
        "the page names the model as the console does"
    );
    let id = client
        .post(format!("{base}/sessions"))
        .bearer_auth(&key)
        .send()
        .await
        .expect("sent")
        .json::<serde_json::Value>()
        .await
        .expect("json")["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let stream = client
        .post(format!("{base}/sessions/{id}/messages"))
        .bearer_auth(&key)
        .json(&json!({"text": "hello"}))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the stream");
    assert!(stream.contains("event: error"), "{stream}");

    let mut server = server;
    server.terminate().await;
    let mut log = String::new();
    std::io::Read::read_to_string(&mut server.0.stderr.take().expect("stderr"), &mut log)
        .expect("reads");
    assert!(
        !log.contains('\u{1b}'),
        "no colour codes off a terminal:\n{log}"
    );
    let line = |needle: &str| {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} on the console:\n{log}"))
            .to_owned()
    };
    let request = line("route=/sessions/{id}/messages");
    assert!(
        request.contains("status=200") && request.contains("admin"),
        "{request}"
    );
    line("route=/agents");
    let failed = line("a run failed");
    assert!(
        failed.contains(&id),
        "the failed turn names its session: {failed}"
    );
    assert!(failed.contains("connection"), "and why: {failed}");
    assert!(!log.contains(&key), "no secret on the console");

    // The database is where a user's data goes, nothing in the directory
    // the server was started from.
    assert!(data.join("markov").join("sessions.db").exists());
    let left: Vec<_> = std::fs::read_dir(&cwd)
        .expect("lists")
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .expect("names");
    assert!(
        left.is_empty(),
        "files left in the working directory: {left:?}"
    );
}

/// A `markov-serve` started on a free port with a database of its own,
/// `args` and `envs` (no provider variable otherwise), with the key it
/// printed and its base URL, once it answers.
async fn started(args: &[&str], envs: &[(&str, String)]) -> (Server, String, String) {
    // A port found free can be taken by another test before the server
    // binds it: then the server says so on stderr and another port is tried.
    for attempt in 1..=3 {
        let port = closed_port();
        let db =
            std::env::temp_dir().join(format!("markov-serve-h-{}-{port}.db", std::process::id()));
        let log = db.with_extension("stderr");
        let mut command = without_provider(env!("CARGO_BIN_EXE_markov-serve"));
        let mut child = command
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .args(["--port", &port.to_string(), "--database"])
            .arg(&db)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("a log file"))
            .spawn()
            .expect("the server starts");
        let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut printed = String::new();
        let Some(key) = printed_key(&mut stdout, &mut printed) else {
            let _ = child.wait();
            let stderr = std::fs::read_to_string(&log).unwrap_or_default();
            let _ = std::fs::remove_file(&log);
            let _ = std::fs::remove_file(&db);
            if attempt < 3 && stderr.contains("in use") {
                continue;
            }
            panic!("the server stopped before printing a key:\n{printed}\nstderr:\n{stderr}");
        };
        // The rest of stdout is not read: drained so the server never blocks.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let _ = rustls::crypto::ring::default_provider().install_default();
        return (Server(child, db), key, format!("http://127.0.0.1:{port}"));
    }
    unreachable!("the loop returns or panics")
}

/// A new session's id.
async fn new_session(client: &reqwest::Client, base: &str, key: &str) -> String {
    let response = once_listening(|| {
        client
            .post(format!("{base}/sessions"))
            .bearer_auth(key)
            .send()
    })
    .await;
    let body = response.json::<serde_json::Value>().await.expect("json");
    body["id"].as_str().expect("an id").to_owned()
}

/// Sends `text` to the session and returns the event stream as text.
async fn say(client: &reqwest::Client, base: &str, key: &str, id: &str, text: &str) -> String {
    client
        .post(format!("{base}/sessions/{id}/messages"))
        .bearer_auth(key)
        .json(&json!({ "text": text }))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the stream")
}

/// A fake llama-server with a context of `N_CTX` tokens (a token counted
/// per four bytes of the request body) that refuses longer requests as
/// llama.cpp does; it rambles when asked to, summarizes when asked to,
/// and says hello otherwise.
const N_CTX: usize = 1024;

async fn small_llama_server() -> markov_testkit::http::FakeServer {
    use markov_testkit::http::{FakeServer, Reply, openai};
    let server = FakeServer::start().await;
    openai::serve_as_llama_cpp(&server, "smol", N_CTX as u32, false);
    server.answer_with(|request| {
        let body = request.body.to_string();
        let n_prompt_tokens = body.len() / 4;
        if n_prompt_tokens > N_CTX {
            return Reply::json(
                400,
                json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": n_prompt_tokens, "n_ctx": N_CTX}}),
            );
        }
        let answer = |text: &str| {
            if request.body["stream"] == true {
                Reply::sse(&openai::text_events(text))
            } else {
                Reply::json(200, openai::text(text))
            }
        };
        let system = request.body["messages"][0]["content"].to_string();
        if system.contains("You summarize") {
            return answer("The user asked for a long story.");
        }
        if body.contains("Tell me a long story") && !body.contains("Once upon a time") {
            return answer(&"Once upon a time, a city grew. ".repeat(200));
        }
        answer("Hello again!")
    });
    server
}

/// Runs the rambling session on a served agent with `args`: the story,
/// then "Hi"; returns the stream of "Hi".
async fn hi_after_a_long_story(args: &[&str]) -> String {
    let model = small_llama_server().await;
    let (_server, key, base) = started(
        args,
        &[("OPENAI_BASE_URL", format!("{}/v1", model.base_url()))],
    )
    .await;
    let client = reqwest::Client::new();
    let id = new_session(&client, &base, &key).await;
    let story = say(&client, &base, &key, &id, "Tell me a long story").await;
    assert!(story.contains("Once upon a time"), "{story}");
    let posts = || {
        model
            .requests()
            .into_iter()
            .filter(|r| r.method == "POST")
            .count()
    };
    let before = posts();
    let hi = say(&client, &base, &key, &id, "Hi").await;
    assert!(posts() > before, "the model was asked");
    // Every answer fits the context the server reported: a quarter of it.
    for request in model.requests().iter().filter(|r| r.method == "POST") {
        assert_eq!(request.body["max_completion_tokens"], N_CTX / 4);
    }
    hi
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_session_outgrows_a_small_context_and_still_answers() {
    // The default policy: the story no longer fits, and "Hi" is answered.
    let hi = hi_after_a_long_story(&[]).await;
    assert!(hi.contains("Hello again!"), "{hi}");
    assert!(!hi.contains("context_exhausted"), "{hi}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recent_context_policy_keeps_a_session_alive_too() {
    let hi = hi_after_a_long_story(&["--context", "recent"]).await;
    assert!(hi.contains("Hello again!"), "{hi}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_context_policy_a_session_dies_of_its_length() {
    // What --context none chooses: the whole history, refused.
    let hi = hi_after_a_long_story(&["--context", "none"]).await;
    assert!(hi.contains("context_exhausted"), "{hi}");
    assert!(!hi.contains("Hello again!"), "{hi}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_approval_makes_a_tool_wait_for_a_person() {
    let (_server, key, base) = started(&["--require-approval", "population"], &[]).await;
    let client = reqwest::Client::new();
    let id = new_session(&client, &base, &key).await;
    let asked = say(
        &client,
        &base,
        &key,
        &id,
        "How many people live in Lisbon and Porto together?",
    )
    .await;
    assert!(asked.contains("\"awaiting_approval\":true"), "{asked}");
    assert!(!asked.contains("777885"), "nothing ran: {asked}");
    let pending = client
        .get(format!("{base}/sessions/{id}/approvals"))
        .bearer_auth(&key)
        .send()
        .await
        .expect("sent")
        .json::<serde_json::Value>()
        .await
        .expect("json");
    let requests: Vec<String> = pending
        .as_array()
        .or_else(|| pending["approvals"].as_array())
        .expect("a list")
        .iter()
        .map(|r| r["request_id"].as_str().expect("an id").to_owned())
        .collect();
    assert_eq!(requests.len(), 2, "both lookups wait: {pending}");
    let mut last = String::new();
    for request in requests {
        last = client
            .post(format!("{base}/sessions/{id}/approvals/{request}"))
            .bearer_auth(&key)
            .json(&json!({"decision": "approve"}))
            .send()
            .await
            .expect("sent")
            .text()
            .await
            .expect("the stream");
    }
    assert!(last.contains("777885"), "{last}");
}

#[test]
fn require_approval_of_an_unknown_tool_is_refused() {
    let db = std::env::temp_dir().join(format!("markov-serve-ra-{}.db", std::process::id()));
    let mut command = without_provider(env!("CARGO_BIN_EXE_markov-serve"));
    let output = command
        .args(["--port", &closed_port().to_string(), "--database"])
        .arg(&db)
        .args(["--require-approval", "delete"])
        .output()
        .expect("runs");
    let _ = std::fs::remove_file(&db);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "--require-approval delete: the agent has no such tool (it has add and population)"
        ),
        "{stderr}"
    );
}

/// `GET` of `path` with `key`: the status and the body as text.
async fn get_text(client: &reqwest::Client, base: &str, key: &str, path: &str) -> (u16, String) {
    let response = client
        .get(format!("{base}{path}"))
        .bearer_auth(key)
        .send()
        .await
        .expect("sent");
    let status = response.status().as_u16();
    (status, response.text().await.expect("a body"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_studio_reads_replays_and_exports_a_served_session_with_no_extra_service() {
    // Without a context policy, so that each step's request is the
    // history's first messages and can be rebuilt.
    let (_server, key, base) = started(&["--context", "none"], &[]).await;
    let client = reqwest::Client::new();
    let id = new_session(&client, &base, &key).await;
    let answer = say(
        &client,
        &base,
        &key,
        &id,
        "How many people live in Lisbon and Porto together?",
    )
    .await;
    assert!(answer.contains("777885"), "{answer}");

    // The steps: the lookups, the sum, the answer.
    let (status, page) = get_text(&client, &base, &key, &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 200, "{page}");
    let page: serde_json::Value = serde_json::from_str(&page).expect("json");
    let steps = page["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 3, "{page}");
    assert_eq!(page["replayable"], true, "{page}");
    assert_eq!(page["exportable"], true, "{page}");
    assert_eq!(
        page["wire"], false,
        "the rehearsal has no wire form: {page}"
    );
    let (status, request) = get_text(
        &client,
        &base,
        &key,
        &format!("/sessions/{id}/steps/1/request"),
    )
    .await;
    assert_eq!(status, 200, "{request}");
    assert!(request.contains("population"), "{request}");
    let (status, wire) = get_text(
        &client,
        &base,
        &key,
        &format!("/sessions/{id}/steps/1/wire"),
    )
    .await;
    assert_eq!(status, 409, "{wire}");

    // Replayed against the agent as served: as recorded.
    let replay = client
        .post(format!("{base}/sessions/{id}/replay"))
        .bearer_auth(&key)
        .json(&json!({}))
        .send()
        .await
        .expect("sent");
    assert_eq!(replay.status(), 200);
    let report = replay.json::<serde_json::Value>().await.expect("json");
    assert!(report["parted_at"].is_null(), "{report}");
    assert_eq!(
        report["steps"].as_array().map(Vec::len),
        Some(3),
        "{report}"
    );
    assert!(
        report["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .all(|s| s["answered_from"] == "recorded"),
        "{report}"
    );

    // Saved as a test: the case file runs offline on the eval runner, and
    // passes.
    let (status, case) = get_text(&client, &base, &key, &format!("/sessions/{id}/case")).await;
    assert_eq!(status, 200, "{case}");
    let file = std::env::temp_dir().join(format!(
        "markov-serve-case-{}-{id}.toml",
        std::process::id()
    ));
    std::fs::write(&file, &case).expect("written");
    let dataset = markov_eval::Dataset::load(&file);
    let _ = std::fs::remove_file(&file);
    let dataset = dataset.expect("the case file reads");
    assert_eq!(dataset.cases.len(), 1, "{case}");
    assert!(!dataset.cases[0].script.is_empty(), "{case}");
    assert!(!dataset.cases[0].expect.is_empty(), "{case}");
    let report = markov_eval::Runner::new(markov_cli::demo_eval_agent)
        .model(markov_eval::ModelChoice::Scripted)
        .run(&dataset)
        .await
        .expect("runs");
    assert_eq!(
        (report.summary.passed, report.summary.runs),
        (1, 1),
        "{}\n{case}",
        report.table()
    );
    // A range of steps: the turn they belong to.
    let (status, range) = get_text(
        &client,
        &base,
        &key,
        &format!("/sessions/{id}/case?from=2&to=3"),
    )
    .await;
    assert_eq!(status, 200, "{range}");
    assert!(range.contains(&format!("{id}-steps-2-3")), "{range}");
    let (status, _) = get_text(
        &client,
        &base,
        &key,
        &format!("/sessions/{id}/case?from=7&to=9"),
    )
    .await;
    assert_eq!(status, 404, "no such steps");
    let (status, _) = get_text(
        &client,
        &base,
        &key,
        &format!("/sessions/{id}/case?from=3&to=1"),
    )
    .await;
    assert_eq!(status, 400, "an empty range");
    let (status, openapi) = get_text(&client, &base, &key, "/openapi.json").await;
    assert_eq!(status, 200);
    for path in ["/sessions/{id}/case", "/sessions/{id}/steps/{n}/wire"] {
        assert!(openapi.contains(path), "{path} is documented");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steps_wire_body_is_what_the_provider_was_sent_without_its_key() {
    const SECRET: &str = "sk-do-not-show-this-0123456789";
    let model = small_llama_server().await;
    let (_server, key, base) = started(
        &["--context", "none"],
        &[
            ("OPENAI_BASE_URL", format!("{}/v1", model.base_url())),
            ("OPENAI_API_KEY", SECRET.to_owned()),
        ],
    )
    .await;
    let client = reqwest::Client::new();
    let id = new_session(&client, &base, &key).await;
    let hi = say(&client, &base, &key, &id, "Hi").await;
    assert!(hi.contains("Hello again!"), "{hi}");
    let sent: Vec<_> = model
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .collect();
    assert_eq!(sent.len(), 1, "one model call");
    assert!(
        sent[0].headers.iter().any(|(_, v)| v.contains(SECRET)),
        "the key went in a header"
    );

    let (status, page) = get_text(&client, &base, &key, &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("\"wire\":true"), "{page}");
    let (status, wire) = get_text(
        &client,
        &base,
        &key,
        &format!("/sessions/{id}/steps/0/wire"),
    )
    .await;
    assert_eq!(status, 200, "{wire}");
    assert!(!wire.contains(SECRET), "no key in the wire body: {wire}");
    let wire: serde_json::Value = serde_json::from_str(&wire).expect("json");
    assert_eq!(wire["step"], 0);
    assert_eq!(
        wire["body"], sent[0].body,
        "the body as the provider was sent it"
    );
}

/// The data of the events named `name`.
fn named<'a>(events: &'a [(String, serde_json::Value)], name: &str) -> Vec<&'a serde_json::Value> {
    events
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, d)| d)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_team_hands_off_waits_for_approval_and_hands_back() {
    let (_server, key, base) = started(
        &[
            "--team",
            "support",
            "--handoff-history",
            "last-turns=1",
            "--require-approval",
            "add",
        ],
        &[],
    )
    .await;
    let client = reqwest::Client::new();
    let id = new_session(&client, &base, &key).await;
    let agents = client
        .get(format!("{base}/agents"))
        .bearer_auth(&key)
        .send()
        .await
        .expect("sent")
        .json::<serde_json::Value>()
        .await
        .expect("json");
    assert_eq!(agents[0]["name"], "support", "{agents}");
    assert_eq!(agents[0]["team"], json!(["cities", "maths"]), "{agents}");

    // A first turn without a handoff: cities answers.
    let hello = events(&say(&client, &base, &key, &id, "Hello").await);
    let done = named(&hello, "done")[0];
    assert_eq!(done["agent"], "cities", "{hello:?}");
    assert!(named(&hello, "handoff").is_empty(), "{hello:?}");

    // Cities looks both cities up and hands the adding to maths, whose
    // call waits for a person.
    let asked = events(
        &say(
            &client,
            &base,
            &key,
            &id,
            "How many people live in Lisbon and Porto together?",
        )
        .await,
    );
    let handoffs = named(&asked, "handoff");
    assert_eq!(handoffs.len(), 1, "{asked:?}");
    assert_eq!(
        (handoffs[0]["from"].as_str(), handoffs[0]["to"].as_str()),
        (Some("cities"), Some("maths"))
    );
    assert!(
        handoffs[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("545923") && r.contains("231962")),
        "{asked:?}"
    );
    let steps = named(&asked, "step");
    let first_of_maths = steps
        .iter()
        .find(|s| s["agent"] == "maths")
        .expect("a step of maths");
    // The last turn only (the question and the handoff's note, one
    // message), not the greeting before it.
    assert_eq!(first_of_maths["handoff_context"], 1, "{asked:?}");
    let done = named(&asked, "done")[0];
    assert_eq!(done["agent"], "maths");
    assert_eq!(done["awaiting_approval"], true, "{asked:?}");
    let pending = client
        .get(format!("{base}/sessions/{id}/approvals"))
        .bearer_auth(&key)
        .send()
        .await
        .expect("sent")
        .json::<serde_json::Value>()
        .await
        .expect("json");
    let pending = pending.as_array().expect("a list").clone();
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0]["tool"], "add");

    // Approved: maths adds, hands the sum back, and cities answers.
    let request = pending[0]["request_id"].as_str().expect("an id");
    let resumed = client
        .post(format!("{base}/sessions/{id}/approvals/{request}"))
        .bearer_auth(&key)
        .json(&json!({"decision": "approve"}))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("the stream");
    let resumed = events(&resumed);
    let handoffs = named(&resumed, "handoff");
    assert_eq!(handoffs.len(), 1, "{resumed:?}");
    assert_eq!(
        (handoffs[0]["from"].as_str(), handoffs[0]["to"].as_str()),
        (Some("maths"), Some("cities"))
    );
    let done = named(&resumed, "done")[0];
    assert_eq!(done["agent"], "cities", "{resumed:?}");
    assert!(
        done["response"]
            .as_str()
            .is_some_and(|r| r.contains("777885")),
        "{resumed:?}"
    );

    let session = client
        .get(format!("{base}/sessions/{id}"))
        .bearer_auth(&key)
        .send()
        .await
        .expect("sent")
        .json::<serde_json::Value>()
        .await
        .expect("json");
    assert_eq!(session["agent"], "support");
    assert_eq!(session["awaiting_approval"], false);
    let team = &session["team"];
    assert_eq!(team["current_agent"], "cities", "{session}");
    assert_eq!(
        team["speakers"],
        json!([null, "cities", null, "cities"]),
        "{session}"
    );
    let pairs: Vec<(String, String)> = team["handoffs"]
        .as_array()
        .expect("the handoffs")
        .iter()
        .map(|h| (h["from"].to_string(), h["to"].to_string()))
        .collect();
    assert_eq!(
        pairs,
        [
            ("\"cities\"".to_owned(), "\"maths\"".to_owned()),
            ("\"maths\"".to_owned(), "\"cities\"".to_owned())
        ]
    );
}

#[test]
fn a_handoff_history_that_is_none_is_refused() {
    let output = Command::new(env!("CARGO_BIN_EXE_markov-serve"))
        .args(["--team", "support", "--handoff-history", "last-turns=0"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("last-turns=N"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_team_hands_maths_a_summary_when_asked_to() {
    let (_server, key, base) =
        started(&["--team", "support", "--handoff-history", "summary"], &[]).await;
    let client = reqwest::Client::new();
    let id = new_session(&client, &base, &key).await;
    let asked = events(
        &say(
            &client,
            &base,
            &key,
            &id,
            "How many people live in Lisbon and Porto together?",
        )
        .await,
    );
    let maths = named(&asked, "step")
        .into_iter()
        .find(|s| s["agent"] == "maths")
        .expect("a step of maths");
    // One message: the summary and the handoff's note.
    assert_eq!(maths["handoff_context"], 1, "{asked:?}");
    let given = maths.to_string();
    assert!(
        given.contains("A summary of the conversation so far"),
        "{given}"
    );
    assert_eq!(named(&asked, "handoff").len(), 2, "{asked:?}");
    let done = named(&asked, "done")[0];
    assert_eq!(done["agent"], "cities");
    assert!(
        done["response"]
            .as_str()
            .is_some_and(|r| r.contains("777885")),
        "{asked:?}"
    );
}
