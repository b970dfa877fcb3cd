//! The web page in a real headless browser (Debian's chromium, driven by
//! chromedriver over WebDriver): send a message, see the streamed answer,
//! approve the confirmation, see the tool run once. In CI a missing browser
//! is a failure, never a skip.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use markov_core::Item;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason, Usage};
use serde_json::{Value, json};

use crate::http::serve;

/// The WebDriver key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A model that asks to pay, and once told to go on, presents the request
/// id it read in the envelope of the refused call (as a real model would).
#[derive(Debug)]
struct Cashier;

fn answer(content: Vec<Item>, stop: StopReason) -> ModelResponse {
    ModelResponse {
        content,
        stop_reason: stop,
        usage: Usage::default(),
    }
}

#[async_trait]
impl Model for Cashier {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
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
            let text = if result.contains("paid") {
                "Paid 5."
            } else {
                "Please approve the payment of 5."
            };
            return Ok(answer(vec![Item::text(text)], StopReason::EndTurn));
        }
        let said = last.map(|m| m.text()).unwrap_or_default();
        let mut input = json!({"amount": 5});
        if said.contains("go") {
            // The request id from the envelope the first call got.
            let token = request
                .messages()
                .iter()
                .rev()
                .flat_map(|m| m.item_list().iter())
                .find_map(|i| match i {
                    Item::ToolResult { content, .. } => {
                        serde_json::from_str::<Value>(content).ok().and_then(|v| {
                            v["error"]["confirmation_request"]["request_id"]
                                .as_str()
                                .map(str::to_owned)
                        })
                    }
                    _ => None,
                })
                .unwrap_or_default();
            input["confirmationToken"] = json!(token);
        }
        let id = format!("call_{}", request.messages().len());
        Ok(answer(
            vec![Item::tool_use(id, "pay", input)],
            StopReason::ToolUse,
        ))
    }
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
    let response = client
        .request(method, url)
        .json(&body)
        .send()
        .await
        .expect("webdriver answers");
    let value: Value = response.json().await.expect("webdriver json");
    value["value"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_streams_an_answer_and_an_approval_runs_the_tool_once() {
    if !installed() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "chromium and chromedriver are not installed, and CI must run the browser test (.ci/run installs them)"
        );
        eprintln!("skipped: chromium / chromedriver not installed");
        return;
    }
    let f = serve(Cashier).await;
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
                     "--disable-sync", format!("--user-data-dir={}", driver.profile.display())]
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
    let page_text = || {
        let client = client.clone();
        let url = at("/execute/sync");
        async move {
            webdriver(
                &client,
                reqwest::Method::POST,
                url,
                json!({"script": "return document.getElementById('log').innerText + '\\n' + document.getElementById('approvals').innerText", "args": []}),
            )
            .await
            .as_str()
            .unwrap_or_default()
            .to_owned()
        }
    };
    let wait_for = |needle: &'static str| async move {
        let mut waited = Duration::ZERO;
        loop {
            let text = page_text().await;
            if text.contains(needle) {
                return text;
            }
            assert!(
                waited < Duration::from_secs(20),
                "{needle:?} never showed:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
            waited += Duration::from_millis(100);
        }
    };
    let say = |text: &'static str| {
        let client = client.clone();
        async move {
            let input = find("#text")
                .await
                .unwrap_or_else(|| panic!("no input on the page"));
            webdriver(
                &client,
                reqwest::Method::POST,
                at(&format!("/element/{input}/value")),
                json!({"text": text}),
            )
            .await;
            let send = find("#send").await.expect("the button");
            webdriver(
                &client,
                reqwest::Method::POST,
                at(&format!("/element/{send}/click")),
                json!({}),
            )
            .await;
        }
    };

    say("pay 5").await;
    let shown = wait_for("Please approve the payment of 5.").await;
    assert!(
        shown.contains("calls pay"),
        "the streamed tool call shows:\n{shown}"
    );
    let approve = {
        let mut waited = Duration::ZERO;
        loop {
            if let Some(button) = find("button.approve").await {
                break button;
            }
            assert!(waited < Duration::from_secs(20), "no approve button");
            tokio::time::sleep(Duration::from_millis(100)).await;
            waited += Duration::from_millis(100);
        }
    };
    assert_eq!(
        f.pays.load(Ordering::SeqCst),
        0,
        "nothing paid before the approval"
    );
    webdriver(
        &client,
        reqwest::Method::POST,
        at(&format!("/element/{approve}/click")),
        json!({}),
    )
    .await;
    wait_for("approved: pay").await;

    say("go ahead").await;
    let shown = wait_for("Paid 5.").await;
    assert!(
        shown.contains("paid 5"),
        "the tool's result shows:\n{shown}"
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 1, "the tool ran once");

    webdriver(&client, reqwest::Method::DELETE, at(""), json!({})).await;
    drop(driver);
}
