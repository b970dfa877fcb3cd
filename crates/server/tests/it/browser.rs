//! The web page in a real headless browser (Debian's chromium, driven by
//! chromedriver over WebDriver): send a message, see the call that waits for
//! approval — hostile text in its arguments shown as visible code points,
//! never reordered — approve, edit or deny it, and see the run continue,
//! the tool run once with the arguments approved, and no extra model call.
//! Screenshots of the page go to the test's target directory. In CI a
//! missing browser is a failure, never a skip.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use markov_core::Item;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason, Usage};
use serde_json::{Value, json};

use crate::http::serve;

/// The WebDriver key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A right-to-left override: shown raw, `fdp.exe` would read `exe.pdf`.
const RLO: char = '\u{202E}';

/// A model that asks to pay the amount the user names, with a memo that
/// hides its real file name behind a right-to-left override, and once it
/// has read the call's result says what happened. It counts its calls and
/// keeps the results it read.
#[derive(Debug, Default)]
struct Cashier {
    calls: AtomicUsize,
    read: Mutex<Vec<String>>,
}

fn answer(content: Vec<Item>, stop: StopReason) -> ModelResponse {
    ModelResponse {
        content,
        stop_reason: stop,
        usage: Usage::default(),
    }
}

/// The shared [`Cashier`] as the server's model.
#[derive(Debug)]
struct Till(Arc<Cashier>);

#[async_trait]
impl Model for Till {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let this = &self.0;
        this.calls.fetch_add(1, Ordering::SeqCst);
        let last = request.messages().last();
        let results: Vec<&str> = last
            .map(|m| {
                m.item_list()
                    .iter()
                    .filter_map(|i| match i {
                        Item::ToolResult { content, .. } => Some(content.as_str()),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        if let Some(result) = results.first() {
            this.read.lock().expect("lock").push((*result).to_owned());
            let text = match result.find("paid ") {
                Some(at) => {
                    let amount: String = result[at + 5..]
                        .chars()
                        .take_while(char::is_ascii_digit)
                        .collect();
                    format!("Paid {amount}.")
                }
                None if result.contains("declined") => "Understood: not paying.".to_owned(),
                None => "Something went wrong.".to_owned(),
            };
            return Ok(answer(vec![Item::text(text)], StopReason::EndTurn));
        }
        let said = last.map(|m| m.text()).unwrap_or_default();
        let amount: u32 = said
            .split(|c: char| !c.is_ascii_digit())
            .find(|part| !part.is_empty())
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        let input = json!({"amount": amount, "memo": format!("invoice {RLO}fdp.exe")});
        let id = format!("call_{}", request.messages().len());
        Ok(answer(
            vec![Item::tool_use(id, "pay", input)],
            StopReason::ToolUse,
        ))
    }
}

/// Standard base64 (what WebDriver's screenshots are) to bytes.
fn base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let digits: Vec<u8> = text.bytes().filter_map(value).collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, d)| n | (u32::from(*d) << (18 - 6 * i)));
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}

/// chromedriver on a free port, killed on drop.
struct Driver {
    child: Child,
    url: String,
    profile: std::path::PathBuf,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A browser the test did not close (it failed midway) would outlive
        // chromedriver: its command line names our profile directory.
        let _ = Command::new("pkill")
            .arg("-f")
            .arg(self.profile.as_os_str())
            .status();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

fn installed() -> bool {
    std::path::Path::new("/usr/bin/chromium").exists()
        && std::path::Path::new("/usr/bin/chromedriver").exists()
}

async fn webdriver(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    body: Value,
) -> Value {
    let request = client.request(method.clone(), url);
    let request = if method == reqwest::Method::GET {
        request
    } else {
        request.json(&body)
    };
    let response = request.send().await.expect("webdriver answers");
    let value: Value = response.json().await.expect("webdriver json");
    value["value"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_a_waiting_call_visibly_and_approve_edit_and_deny_resume_the_run() {
    if !installed() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "chromium and chromedriver are not installed, and CI must run the browser test (.ci/run installs them)"
        );
        eprintln!("skipped: chromium / chromedriver not installed");
        return;
    }
    let cashier = Arc::new(Cashier::default());
    let f = serve(Till(Arc::clone(&cashier))).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let profile =
        std::env::temp_dir().join(format!("markov-chromium-{}-{port}", std::process::id()));
    let driver = Driver {
        child: Command::new("/usr/bin/chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts"),
        url: format!("http://127.0.0.1:{port}"),
        profile,
    };
    let client = reqwest::Client::new();
    let mut waited = Duration::ZERO;
    while client
        .get(format!("{}/status", driver.url))
        .send()
        .await
        .is_err()
    {
        assert!(
            waited < Duration::from_secs(20),
            "chromedriver never answered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
    }
    let session = webdriver(
        &client,
        reqwest::Method::POST,
        format!("{}/session", driver.url),
        json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--no-first-run", "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--window-size=900,1100",
                     format!("--user-data-dir={}", driver.profile.display())]
        }}}}),
    )
    .await;
    let sid = session["sessionId"]
        .as_str()
        .unwrap_or_else(|| panic!("no browser session: {session}"))
        .to_owned();
    let at = |path: &str| format!("{}/session/{sid}{path}", driver.url);
    let navigated = webdriver(
        &client,
        reqwest::Method::POST,
        at("/url"),
        json!({"url": f.base}),
    )
    .await;
    assert!(navigated.is_null(), "the page did not load: {navigated}");

    let find = |css: &'static str| {
        let client = client.clone();
        let url = at("/element");
        async move {
            let found = webdriver(
                &client,
                reqwest::Method::POST,
                url,
                json!({"using": "css selector", "value": css}),
            )
            .await;
            found[ELEMENT].as_str().map(str::to_owned)
        }
    };
    let script = |code: &'static str| {
        let client = client.clone();
        let url = at("/execute/sync");
        async move {
            webdriver(
                &client,
                reqwest::Method::POST,
                url,
                json!({"script": code, "args": []}),
            )
            .await
        }
    };
    let text_of = |id: &'static str| async move {
        match id {
            "log" => script("return document.getElementById('log').innerText").await,
            _ => script("return document.getElementById('approvals').innerText").await,
        }
        .as_str()
        .unwrap_or_default()
        .to_owned()
    };
    // Waits until `part` of the page (`log` or `approvals`) shows `needle`.
    let wait_for = |part: &'static str, needle: String| async move {
        let mut waited = Duration::ZERO;
        loop {
            let text = text_of(part).await;
            if text.contains(&needle) {
                return text;
            }
            assert!(
                waited < Duration::from_secs(20),
                "{needle:?} never showed in #{part}:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            waited += Duration::from_millis(100);
        }
    };
    let click = |css: &'static str| {
        let client = client.clone();
        async move {
            let element = find(css)
                .await
                .unwrap_or_else(|| panic!("no {css} on the page"));
            webdriver(
                &client,
                reqwest::Method::POST,
                at(&format!("/element/{element}/click")),
                json!({}),
            )
            .await;
        }
    };
    let type_into = |css: &'static str, text: String| {
        let client = client.clone();
        async move {
            let element = find(css)
                .await
                .unwrap_or_else(|| panic!("no {css} on the page"));
            webdriver(
                &client,
                reqwest::Method::POST,
                at(&format!("/element/{element}/clear")),
                json!({}),
            )
            .await;
            webdriver(
                &client,
                reqwest::Method::POST,
                at(&format!("/element/{element}/value")),
                json!({"text": text}),
            )
            .await;
        }
    };
    let say = |text: &'static str| async move {
        type_into("#text", text.to_owned()).await;
        click("#send").await;
    };
    let screenshot = |name: &'static str| {
        let client = client.clone();
        let url = at("/screenshot");
        async move {
            let png = webdriver(&client, reqwest::Method::GET, url, Value::Null).await;
            let bytes = base64(png.as_str().expect("a screenshot"));
            assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
            let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
            std::fs::write(&path, bytes).expect("the screenshot is saved");
            eprintln!("screenshot: {}", path.display());
        }
    };

    // 0. The page asks for a key; signed in, it shows the chat.
    type_into("#key", f.key.clone()).await;
    click("#signin-button").await;
    let mut waited = Duration::ZERO;
    while script("return document.getElementById('form').hidden").await != Value::Bool(false) {
        assert!(
            waited < Duration::from_secs(20),
            "the sign-in never showed the chat"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
    }

    // 1. A payment waits; its memo's override is shown, not obeyed.
    say("pay 5").await;
    wait_for("log", "waiting for your decision on 1 tool call".into()).await;
    let shown = wait_for("approvals", "\"amount\": 5".into()).await;
    assert!(shown.contains("Approve pay?"), "{shown}");
    assert!(
        shown.contains("invoice \\u{202E}fdp.exe"),
        "the override is a visible code point: {shown}"
    );
    assert!(
        !shown.contains(RLO),
        "no raw override reaches the page's text: {shown}"
    );
    assert!(shown.contains("expires"), "{shown}");
    let marked = script(
        "return Array.from(document.querySelectorAll('#approvals .escaped')).map(e => e.textContent)",
    )
    .await;
    assert!(
        marked
            .as_array()
            .is_some_and(|m| !m.is_empty() && m.iter().all(|t| t == "\\u{202E}")),
        "each override is marked: {marked}"
    );
    assert_eq!(
        f.pays.load(Ordering::SeqCst),
        0,
        "nothing paid before the approval"
    );
    assert_eq!(cashier.calls.load(Ordering::SeqCst), 1);
    screenshot("hitl-waiting.png").await;

    click("#approvals button.approve").await;
    let log = wait_for("log", "Paid 5.".into()).await;
    assert!(log.contains("approve: pay"), "{log}");
    assert!(log.contains("paid 5"), "the tool's result shows:\n{log}");
    assert_eq!(f.pays.load(Ordering::SeqCst), 1, "the tool ran once");
    assert_eq!(
        cashier.calls.load(Ordering::SeqCst),
        2,
        "no model call between the approval and the payment"
    );

    // 2. Edited: the payment runs with the arguments the user wrote.
    say("pay 7").await;
    wait_for("approvals", "\"amount\": 7".into()).await;
    click("#approvals button.edit").await;
    type_into(
        "#approvals textarea.edit-args",
        r#"{"amount": 3}"#.to_owned(),
    )
    .await;
    click("#approvals button.approve-edited").await;
    let log = wait_for("log", "Paid 3.".into()).await;
    assert!(log.contains("edit: pay"), "{log}");
    assert_eq!(f.pays.load(Ordering::SeqCst), 2);
    assert_eq!(cashier.calls.load(Ordering::SeqCst), 4);

    // 3. Denied with a reason the model reads.
    say("pay 9").await;
    wait_for("approvals", "\"amount\": 9".into()).await;
    type_into("#approvals input.deny-message", "over budget".to_owned()).await;
    click("#approvals button.deny").await;
    wait_for("log", "Understood: not paying.".into()).await;
    assert_eq!(f.pays.load(Ordering::SeqCst), 2, "nothing paid");
    assert_eq!(
        cashier.calls.load(Ordering::SeqCst),
        6,
        "two model calls a turn"
    );
    assert!(
        cashier
            .read
            .lock()
            .expect("lock")
            .last()
            .is_some_and(|r| r.contains("over budget")),
        "the model read the reason"
    );
    let mut waited = Duration::ZERO;
    while !text_of("approvals").await.is_empty() {
        assert!(
            waited < Duration::from_secs(20),
            "the decided call stays shown"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
    }
    screenshot("hitl-done.png").await;

    webdriver(&client, reqwest::Method::DELETE, at(""), json!({})).await;
    drop(driver);
}
