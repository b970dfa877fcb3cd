//! The web page in a real headless browser (Debian's chromium, driven by
//! chromedriver over WebDriver), used as a person would: sign in, send a
//! message, watch the answer stream with its tool call as a card, reload
//! and find the conversation again, decide on a call that waits for
//! approval and watch the run go on, stop a running turn, read an error,
//! see hostile text stay text, and do it on a phone-width screen. Every
//! flow saves a screenshot in the test's target directory
//! (`CARGO_TARGET_TMPDIR`). In CI a missing browser is a failure, never a
//! skip. Every wait is on a condition, with a bound.

use std::convert::Infallible;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use markov_core::Item;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason, StreamEvent};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::Agent;
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata};
use markov_server::Server;
use markov_store::SqliteStore;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::{Fixture, Pay, start};

mod studio_agents;
mod team_page;

/// The WebDriver key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A right-to-left override: shown raw, `fdp.exe` would read `exe.pdf`.
const RLO: char = '\u{202E}';

/// How long any one condition may take to show on the page.
const PATIENCE: Duration = Duration::from_secs(30);

/// The model's name as the page shows it.
const MODEL: &str = "scripted test model (loopback, no network)";

/// What the hostile answer says: markup, a script, a `javascript:` link,
/// an override. None of it may run or hide anything.
const HOSTILE: &str = "Here is <b>bold</b> and <script>document.body.dataset.pwned = 'script'</script>\n\n\
<img src=x onerror=\"document.body.dataset.pwned = 'img'\">\n\n\
[click me](javascript:document.body.dataset.pwned='link') and [a real link](https://example.com/docs)\n\n\
The attachment is invoice \u{202E}fdp.exe";

/// The weather answer: markdown with a table and code.
const WEATHER: &str = "**Lisbon** is *sunny* today, 21 °C.\n\n\
| city | sky | °C |\n|---|---|---|\n| Lisbon | sunny | 21 |\n\n\
To check it yourself:\n\n```sh\ncurl 'https://wttr.in/Lisbon?format=3'\n```\n";

fn answer(content: Vec<Item>, stop: StopReason) -> ModelResponse {
    ModelResponse::new(content, stop)
}

/// A scripted model that does what the user's message asks: `weather`
/// (a lookup, then a markdown answer), `pay N` (a payment that needs
/// approval, with a memo that hides its real file name behind a
/// right-to-left override), `slow` (words for a minute), `fail` (a
/// provider error), `hostile` (a megabyte of tool output, then markup and
/// a `javascript:` link). It streams its text in pieces, counts its calls
/// and keeps the tool results it read.
#[derive(Debug, Default)]
struct Director {
    calls: AtomicUsize,
    read: Mutex<Vec<String>>,
}

impl Director {
    /// The answer to `request`, and how long to wait between its pieces.
    fn plan(&self, request: &ModelRequest<'_>) -> Result<(ModelResponse, Duration), ModelError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let messages = request.messages();
        let results: Vec<String> = messages
            .last()
            .map(|m| {
                m.item_list()
                    .iter()
                    .filter_map(|i| match i {
                        Item::ToolResult { content, .. } => Some(content.clone()),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let said = messages
            .iter()
            .rev()
            .find(|m| {
                m.role == markov_core::Role::User && !m.text().is_empty() && {
                    let items = m.item_list();
                    !items.iter().any(|i| matches!(i, Item::ToolResult { .. }))
                }
            })
            .map(|m| m.text())
            .unwrap_or_default();
        let quick = Duration::from_millis(10);
        let call = |name: &str, input: Value| {
            Item::tool_use(format!("call_{}", messages.len()), name, input)
        };
        if let Some(result) = results.first() {
            self.read.lock().expect("lock").push(result.clone());
        }
        let text = |t: &str| Ok((answer(vec![Item::text(t)], StopReason::EndTurn), quick));
        if said.starts_with("pay") {
            let Some(result) = results.first() else {
                let amount: u32 = said
                    .split(|c: char| !c.is_ascii_digit())
                    .find(|part| !part.is_empty())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(1);
                let input = json!({"amount": amount, "memo": format!("invoice {RLO}fdp.exe")});
                return Ok((answer(vec![call("pay", input)], StopReason::ToolUse), quick));
            };
            return match result.find("paid ") {
                Some(at) => {
                    let amount: String = result[at + 5..]
                        .chars()
                        .take_while(char::is_ascii_digit)
                        .collect();
                    text(&format!("Paid {amount}."))
                }
                None if result.contains("declined") || result.contains("DENIED") => {
                    text("Understood: not paying.")
                }
                None => text("Something went wrong."),
            };
        }
        // markov's reminder after a cut answer, the last message sent.
        let reminded = messages
            .last()
            .is_some_and(|m| m.role == markov_core::Role::System);
        match said.as_str() {
            "ramble" if reminded => text("In short: the city grew."),
            "ramble" => Ok((
                answer(
                    vec![Item::text("Once upon a time, a city grew, and grew, and")],
                    StopReason::MaxTokens,
                ),
                quick,
            )),
            "weather" if results.is_empty() => Ok((
                answer(
                    vec![
                        Item::text("Let me look that up."),
                        call("lookup", json!({"city": "Lisbon"})),
                    ],
                    StopReason::ToolUse,
                ),
                quick,
            )),
            "weather" => text(WEATHER),
            "hostile" if results.is_empty() => Ok((
                answer(vec![call("dump", json!({}))], StopReason::ToolUse),
                quick,
            )),
            "hostile" => text(HOSTILE),
            "picture" if results.is_empty() => Ok((
                answer(vec![call("snap", json!({}))], StopReason::ToolUse),
                quick,
            )),
            "picture" => text("A red dot."),
            "slow" => {
                // A minute of words: far longer than the test takes to
                // stop it.
                let words: Vec<String> = (1..=600).map(|n| format!("word{n} ")).collect();
                Ok((
                    answer(vec![Item::text(words.concat())], StopReason::EndTurn),
                    Duration::from_millis(100),
                ))
            }
            "too long" => Err(ModelError::ContextLength(
                "prompt is too long: 210000 tokens > 200000 maximum".into(),
            )),
            "fail" => Err(ModelError::Http {
                status: 400,
                message: "this model cannot answer that: the context is too long".into(),
                retry_after: None,
            }),
            _ => text(
                "Ask me about the `weather`, to `pay 5`, to be `slow`, to `fail`, or to be `hostile`.",
            ),
        }
    }
}

/// The shared [`Director`] as the server's model.
#[derive(Debug)]
struct Directed(Arc<Director>);

#[async_trait]
impl Model for Directed {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        self.0.plan(&request).map(|(response, _)| response)
    }

    /// The answer's text in pieces of a few characters, `pause` apart, as
    /// a real model writes it.
    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        let (response, pause) = match self.0.plan(&request) {
            Ok(planned) => planned,
            Err(error) => return futures::stream::once(async move { Err(error) }).boxed(),
        };
        let mut events = Vec::new();
        for (index, item) in response.content.iter().enumerate() {
            match item {
                Item::Text { text } => {
                    let chars: Vec<char> = text.chars().collect();
                    for piece in chars.chunks(if pause > Duration::from_millis(50) {
                        6
                    } else {
                        24
                    }) {
                        events.push(StreamEvent::TextDelta {
                            index,
                            text: piece.iter().collect(),
                        });
                    }
                }
                Item::ToolUse { id, name, input } => {
                    events.push(StreamEvent::ToolCallStart {
                        index,
                        id: id.clone(),
                        name: name.clone(),
                    });
                    events.push(StreamEvent::ToolCallDelta {
                        index,
                        partial_json: input.to_string(),
                    });
                }
                _ => {}
            }
        }
        events.push(StreamEvent::Done(response));
        futures::stream::iter(events)
            .then(move |event| async move {
                tokio::time::sleep(pause).await;
                Ok(event)
            })
            .boxed()
    }
}

#[derive(Deserialize, JsonSchema)]
struct LookupArgs {
    /// The city.
    city: String,
}

/// Looks the weather up (always sunny).
struct Lookup;

#[async_trait]
impl Tool for Lookup {
    const NAME: &'static str = "lookup";
    type Args = LookupArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Look up the weather in a city".into()
    }
    async fn call(&self, args: LookupArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok(format!("{}: 21 °C, sunny", args.city))
    }
}

#[derive(Deserialize, JsonSchema)]
struct NoArgs {}

/// Returns a megabyte of output, markup and an override in it.
struct Dump;

#[async_trait]
impl Tool for Dump {
    const NAME: &'static str = "dump";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Dump the log".into()
    }
    async fn call(&self, _args: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        let line = format!(
            "<img src=x onerror=\"document.body.dataset.pwned='tool'\"> {RLO}gol.exe <script>alert(1)</script>\n"
        );
        Ok(line.repeat(1024 * 1024 / line.len() + 1))
    }
}

/// The base64 of a 1×1 PNG.
const DOT: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==";

/// Returns a picture (a red dot) beside its text.
struct Snap;

#[async_trait]
impl Tool for Snap {
    const NAME: &'static str = "snap";
    type Args = NoArgs;
    type Output = markov_core::ToolOutcome;
    type Error = Infallible;
    fn description(&self) -> String {
        "Take a picture".into()
    }
    async fn call(
        &self,
        _args: NoArgs,
        _cx: &ToolContext<'_>,
    ) -> Result<markov_core::ToolOutcome, Infallible> {
        Ok(markov_core::ToolOutcome::Images {
            text: "a dot".into(),
            images: vec![markov_core::message::ImageData::new("image/png", DOT)],
        })
    }
}

/// The server with the [`Director`]'s agent: its tools `pay` (needs
/// approval), `lookup` and `dump`; its model named.
async fn serve_director() -> (Fixture, Arc<Director>) {
    let director = Arc::new(Director::default());
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("helper")
        .instructions("You help.")
        .tool_with(
            Pay(pays.clone()),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .tool_with(Lookup, ToolMetadata::new(Category::Retrieval))
        .tool_with(Dump, ToolMetadata::new(Category::Retrieval))
        .tool_with(Snap, ToolMetadata::new(Category::Retrieval))
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(Directed(Arc::clone(&director)))
        .build()
        .expect("the agent builds");
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let builder = Server::builder()
        .agent(agent)
        .model_description("helper", MODEL);
    (start(builder, store, pays).await, director)
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

/// A headless chromium, driven over WebDriver.
struct Browser {
    client: reqwest::Client,
    /// `<driver>/session/<id>`.
    session: String,
    driver: Driver,
}

impl Browser {
    /// A browser `width` × `height` pixels, or `None` (outside CI) when
    /// chromium is not installed. Narrower than a desktop window can be,
    /// it is a phone's screen (device emulation).
    async fn start(width: u32, height: u32) -> Option<Browser> {
        if !installed() {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "chromium and chromedriver are not installed, and CI must run the browser tests (.ci/run installs them)"
            );
            eprintln!("skipped: chromium / chromedriver not installed");
            return None;
        }
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
            assert!(waited < PATIENCE, "chromedriver never answered");
            tokio::time::sleep(Duration::from_millis(100)).await;
            waited += Duration::from_millis(100);
        }
        let mut options = json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--no-first-run", "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--hide-scrollbars", format!("--window-size={width},{height}"),
                     format!("--user-data-dir={}", driver.profile.display())]
        });
        if width < 600 {
            options["mobileEmulation"] = json!({
                "deviceMetrics": {"width": width, "height": height, "pixelRatio": 1, "touch": true}
            });
        }
        let created = call(
            &client,
            reqwest::Method::POST,
            format!("{}/session", driver.url),
            json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": options
            }}}),
        )
        .await;
        let id = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {created}"))
            .to_owned();
        Some(Browser {
            session: format!("{}/session/{id}", driver.url),
            client,
            driver,
        })
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        call(
            &self.client,
            reqwest::Method::POST,
            format!("{}{path}", self.session),
            body,
        )
        .await
    }

    async fn open(&self, url: &str) {
        let navigated = self.post("/url", json!({"url": url})).await;
        assert!(navigated.is_null(), "the page did not load: {navigated}");
    }

    async fn reload(&self) {
        let reloaded = self.post("/refresh", json!({})).await;
        assert!(reloaded.is_null(), "the page did not reload: {reloaded}");
    }

    /// Runs `code` (a function body) in the page.
    async fn run(&self, code: &str) -> Value {
        self.post("/execute/sync", json!({"script": code, "args": []}))
            .await
    }

    /// Waits until `expression` is truthy in the page; its value.
    async fn wait(&self, what: &str, expression: &str) -> Value {
        let mut waited = Duration::ZERO;
        loop {
            let value = self.run(&format!("return ({expression})")).await;
            let truthy = match &value {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::Object(o) => !o.contains_key("error"),
                Value::Array(_) | Value::Bool(true) => true,
            };
            if truthy {
                return value;
            }
            if waited >= PATIENCE {
                let text = self.run("return document.body.innerText").await;
                panic!(
                    "{what} never showed ({expression} is {value}); the page says:\n{}",
                    text.as_str().unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            waited += Duration::from_millis(100);
        }
    }

    /// The visible text of the first element `css` selects.
    async fn text(&self, css: &str) -> String {
        self.run(&format!(
            "const e = document.querySelector({}); return e ? e.innerText : ''",
            json!(css)
        ))
        .await
        .as_str()
        .unwrap_or_default()
        .to_owned()
    }

    async fn count(&self, css: &str) -> u64 {
        self.run(&format!(
            "return document.querySelectorAll({}).length",
            json!(css)
        ))
        .await
        .as_u64()
        .unwrap_or(0)
    }

    async fn element(&self, css: &str) -> String {
        let found = self
            .post("/element", json!({"using": "css selector", "value": css}))
            .await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no {css} on the page: {found}"))
            .to_owned()
    }

    /// Clicks `css` as a person would: WebDriver refuses an element that
    /// is hidden or covered. An element the page drew anew between
    /// finding and clicking (a list refreshed) is found again, a few times.
    async fn click(&self, css: &str) {
        let mut clicked = Value::Null;
        for _ in 0..3 {
            let element = self.element(css).await;
            clicked = self
                .post(&format!("/element/{element}/click"), json!({}))
                .await;
            if clicked["error"] != "stale element reference" {
                break;
            }
        }
        assert!(clicked.is_null(), "cannot click {css}: {clicked}");
    }

    async fn type_into(&self, css: &str, text: &str) {
        let element = self.element(css).await;
        self.post(&format!("/element/{element}/clear"), json!({}))
            .await;
        let typed = self
            .post(&format!("/element/{element}/value"), json!({"text": text}))
            .await;
        assert!(typed.is_null(), "cannot type into {css}: {typed}");
    }

    /// Types `text` as the message and sends it.
    async fn say(&self, text: &str) {
        self.wait(
            "the Send button",
            "!document.getElementById('send').disabled",
        )
        .await;
        self.type_into("#text", text).await;
        self.click("#send").await;
    }

    /// Opens the studio's steps of session `id` at `base` and signs in
    /// with `key`.
    async fn open_steps(&self, base: &str, id: &str, key: &str) {
        self.open(&format!("{base}/#steps/{id}")).await;
        self.sign_in(key).await;
    }

    async fn sign_in(&self, key: &str) {
        self.wait(
            "the sign-in form",
            "!document.getElementById('signin').hidden",
        )
        .await;
        self.type_into("#key", key).await;
        self.click("#signin-button").await;
        self.wait(
            "the chats",
            "!document.getElementById('app').hidden && document.getElementById('signin').hidden",
        )
        .await;
    }

    /// Saves the page as `name` in the test's target directory.
    async fn screenshot(&self, name: &str) {
        // Whatever is still being painted (a frame's worth of text) lands first.
        self.run("return new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
            .await;
        let png = call(
            &self.client,
            reqwest::Method::GET,
            format!("{}/screenshot", self.session),
            Value::Null,
        )
        .await;
        let bytes = base64(png.as_str().expect("a screenshot"));
        assert!(bytes.starts_with(b"\x89PNG"), "a PNG");
        let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
        std::fs::write(&path, bytes).expect("the screenshot is saved");
        eprintln!("screenshot: {}", path.display());
    }

    async fn close(self) {
        call(
            &self.client,
            reqwest::Method::DELETE,
            self.session.clone(),
            json!({}),
        )
        .await;
        drop(self.driver);
    }
}

async fn call(
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

/// The conversation's visible text.
async fn conversation(browser: &Browser) -> String {
    browser.text("#conversation").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_signs_in_sees_a_streamed_answer_with_its_tool_call_and_finds_it_after_a_reload() {
    // The fixture first: it sets up the TLS provider reqwest wants.
    let (f, _director) = serve_director().await;
    let Some(browser) = Browser::start(1000, 860).await else {
        return;
    };
    browser.open(&f.base).await;

    // Signing in: a wrong key is said to be wrong; the right one shows the
    // chats, the model and who is signed in.
    browser
        .wait(
            "the sign-in form",
            "!document.getElementById('signin').hidden",
        )
        .await;
    browser.type_into("#key", "mk_not_a_key").await;
    browser.click("#signin-button").await;
    browser
        .wait(
            "the refusal",
            "document.getElementById('signin-error').innerText.includes('not valid')",
        )
        .await;
    browser.screenshot("sign-in.png").await;
    browser.sign_in(&f.key).await;
    let header = browser.text("#top").await;
    assert!(
        header.contains("helper") && header.contains(MODEL) && header.contains("alice"),
        "the header names the agent, its model and the user: {header}"
    );

    // A streamed answer with a tool call: the user's words once, the call
    // as a card with its result read out of the envelope, the markdown
    // rendered.
    browser.say("weather").await;
    browser
        .wait(
            "the answer",
            "document.querySelector('#log .msg.assistant table') !== null && !document.body.classList.contains('running')",
        )
        .await;
    assert_eq!(
        browser.count("#log .msg.user").await,
        1,
        "sent once, shown once"
    );
    let card = browser.text("#log details.tool").await;
    assert!(card.contains("lookup"), "{card}");
    assert!(card.contains("city: Lisbon"), "{card}");
    assert!(card.contains("done"), "{card}");
    assert!(
        card.contains("Lisbon: 21 °C, sunny") && !card.contains("\"ok\""),
        "the result is read out of its envelope: {card}"
    );
    let answer = browser
        .run("return Array.from(document.querySelectorAll('#log .msg.assistant')).pop().innerText")
        .await;
    let answer = answer.as_str().unwrap_or_default();
    assert!(answer.contains("Lisbon is sunny today"), "{answer}");
    assert_eq!(
        browser
            .count(
                "#log .msg.assistant strong, #log .msg.assistant em, #log .msg.assistant pre code"
            )
            .await,
        3,
        "bold, emphasis and code are rendered"
    );
    assert!(
        !browser.text("#log").await.contains("**"),
        "no markdown left raw"
    );
    assert_eq!(browser.text("#send").await, "Send", "the composer is back");
    let before = conversation(&browser).await;
    browser.click("#log details.tool summary").await;
    let opened = browser.text("#log details.tool").await;
    assert!(opened.contains("\"city\": \"Lisbon\""), "{opened}");
    browser.screenshot("answer-with-a-tool-call.png").await;

    // Reloaded: the same conversation, from the server.
    browser.reload().await;
    browser
        .wait(
            "the restored conversation",
            "document.querySelector('#log .msg.assistant table') !== null",
        )
        .await;
    assert_eq!(browser.count("#log .msg.user").await, 1);
    assert_eq!(browser.count("#log details.tool").await, 1);
    assert_eq!(
        conversation(&browser).await,
        before,
        "the same conversation"
    );
    assert_eq!(browser.count("#sessions li").await, 1, "one chat listed");
    let listed = browser.text("#sessions").await;
    assert!(
        listed.contains("weather"),
        "called by its first message: {listed}"
    );

    // A new chat, then the first one again from the list.
    browser.click("#new").await;
    browser
        .wait(
            "an empty chat",
            "document.querySelectorAll('#log > *').length === 0",
        )
        .await;
    browser.say("hello").await;
    browser
        .wait(
            "the second answer",
            "document.getElementById('log').innerText.includes('Ask me about')",
        )
        .await;
    browser
        .wait(
            "two chats",
            "document.querySelectorAll('#sessions li').length === 2 && !document.body.classList.contains('running')",
        )
        .await;
    browser.click("#sessions li:last-child button").await;
    browser
        .wait(
            "the first chat",
            "document.querySelector('#log .msg.assistant table') !== null",
        )
        .await;
    assert_eq!(conversation(&browser).await, before);

    // Another principal sees none of alice's chats.
    browser.click("#signout").await;
    browser.sign_in(&f.keys["bob"]).await;
    assert_eq!(browser.count("#sessions li").await, 0, "bob has no chats");
    assert_eq!(browser.count("#log > *").await, 0);
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_a_waiting_call_visibly_and_approve_edit_and_deny_resume_the_run() {
    // The fixture first: it sets up the TLS provider reqwest wants.
    let (f, director) = serve_director().await;
    let Some(browser) = Browser::start(1000, 900).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;

    // 1. A payment waits; its memo's override is shown, not obeyed.
    browser.say("pay 5").await;
    let shown = browser
        .wait(
            "the waiting call",
            "document.getElementById('approvals').innerText.includes('\"amount\": 5') && document.getElementById('approvals').innerText",
        )
        .await;
    let shown = shown.as_str().unwrap_or_default().to_owned();
    assert!(shown.contains("Approve pay?"), "{shown}");
    assert!(
        shown.contains("invoice \\u{202E}fdp.exe"),
        "the override is a visible code point: {shown}"
    );
    assert!(
        !shown.contains(RLO),
        "no raw override reaches the page's text: {shown}"
    );
    assert!(shown.contains("Expires"), "{shown}");
    let marked = browser
        .run("return Array.from(document.querySelectorAll('#approvals .escaped')).map(e => e.textContent)")
        .await;
    assert!(
        marked
            .as_array()
            .is_some_and(|m| !m.is_empty() && m.iter().all(|t| t == "\\u{202E}")),
        "each override is marked: {marked}"
    );
    browser
        .wait("the composer waiting for the decision", "document.getElementById('send').disabled && document.getElementById('status').innerText.includes('decision')")
        .await;
    assert_eq!(
        f.pays.load(Ordering::SeqCst),
        0,
        "nothing paid before the approval"
    );
    assert_eq!(director.calls.load(Ordering::SeqCst), 1);
    browser.screenshot("approval-waiting.png").await;

    // Reloaded, the call still waits, shown once.
    browser.reload().await;
    browser
        .wait(
            "the waiting call again",
            "document.querySelectorAll('#approvals .approval').length === 1",
        )
        .await;
    assert_eq!(browser.count("#log .msg.user").await, 1);

    // Approved: the run goes on, live, and the tool runs once.
    browser.click("#approvals button.approve").await;
    let log = browser
        .wait(
            "the run after the approval",
            "document.getElementById('log').innerText.includes('Paid 5.') && document.getElementById('log').innerText",
        )
        .await;
    let log = log.as_str().unwrap_or_default().to_owned();
    assert!(log.contains("You approved the call of pay."), "{log}");
    assert!(log.contains("paid 5"), "the tool's result shows:\n{log}");
    assert_eq!(browser.count("#approvals .approval").await, 0);
    assert_eq!(f.pays.load(Ordering::SeqCst), 1, "the tool ran once");
    assert_eq!(
        director.calls.load(Ordering::SeqCst),
        2,
        "no model call between the approval and the payment"
    );
    browser
        .wait("the composer", "!document.getElementById('send').disabled")
        .await;
    browser.screenshot("approval-approved.png").await;

    // 2. Edited: the payment runs with the arguments the user wrote.
    browser.say("pay 7").await;
    browser
        .wait(
            "the second call",
            "document.getElementById('approvals').innerText.includes('\"amount\": 7')",
        )
        .await;
    browser.click("#approvals button.edit").await;
    browser
        .type_into("#approvals textarea.edit-args", r#"{"amount": 3}"#)
        .await;
    browser.click("#approvals button.approve-edited").await;
    let log = browser
        .wait(
            "the edited payment",
            "document.getElementById('log').innerText.includes('Paid 3.') && document.getElementById('log').innerText",
        )
        .await;
    assert!(
        log.as_str()
            .unwrap_or_default()
            .contains("approved with edited arguments"),
        "{log}"
    );
    assert_eq!(f.pays.load(Ordering::SeqCst), 2);
    assert_eq!(director.calls.load(Ordering::SeqCst), 4);

    // 3. Denied with a reason the model reads.
    browser.say("pay 9").await;
    browser
        .wait(
            "the third call",
            "document.getElementById('approvals').innerText.includes('\"amount\": 9')",
        )
        .await;
    browser
        .type_into("#approvals input.deny-message", "over budget")
        .await;
    browser.click("#approvals button.deny").await;
    browser
        .wait(
            "the model's answer to the denial",
            "document.getElementById('log').innerText.includes('Understood: not paying.')",
        )
        .await;
    assert_eq!(f.pays.load(Ordering::SeqCst), 2, "nothing paid");
    assert_eq!(
        director.calls.load(Ordering::SeqCst),
        6,
        "two model calls a turn"
    );
    assert!(
        director
            .read
            .lock()
            .expect("lock")
            .last()
            .is_some_and(|r| r.contains("over budget")),
        "the model read the reason"
    );
    browser
        .wait(
            "no call left waiting",
            "document.getElementById('approvals').innerText === ''",
        )
        .await;
    assert_eq!(
        browser.count("#log .msg.user").await,
        3,
        "each message once"
    );
    assert_eq!(
        browser.count("#log details.tool").await,
        3,
        "each call a card"
    );
    assert_eq!(
        browser.count("#log details.tool.failed").await,
        1,
        "the denied one failed"
    );
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_turn_is_rejoined_after_a_reload_and_stopped_and_errors_and_hostile_text_stay_readable()
 {
    // The fixture first: it sets up the TLS provider reqwest wants.
    let (f, _director) = serve_director().await;
    let Some(browser) = Browser::start(1000, 900).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;

    // A slow answer: Send is off and Stop on while it is written.
    browser.say("slow").await;
    browser
        .wait("the answer being written", "document.querySelector('#log .live') !== null && document.querySelector('#log .live').innerText.includes('word3 ')")
        .await;
    assert_eq!(
        browser
            .run("return [document.getElementById('send').disabled, document.getElementById('stop').hidden]")
            .await,
        json!([true, false])
    );
    // Reloaded mid-turn: the page joins the turn and shows its text from
    // the start, the question once.
    browser.reload().await;
    browser
        .wait("the turn joined again", "document.querySelector('#log .live') !== null && document.querySelector('#log .live').innerText.includes('word1 word2 word3 ')")
        .await;
    assert_eq!(browser.count("#log .msg.user").await, 1);
    let before = browser.text("#log .live").await.len();
    browser
        .wait(
            "more text",
            &format!("document.querySelector('#log .live').innerText.length > {before}"),
        )
        .await;
    browser.click("#stop").await;
    browser
        .wait("the stopped turn", "document.getElementById('log').innerText.includes('Stopped.') && !document.body.classList.contains('running')")
        .await;
    assert_eq!(
        browser.count("#log .msg.assistant.unkept").await,
        1,
        "what was written before the stop stays in view, marked"
    );
    assert_eq!(
        browser
            .run("return [document.getElementById('send').disabled, document.getElementById('stop').hidden]")
            .await,
        json!([false, true])
    );
    browser.screenshot("stopped.png").await;

    // A failed turn: the error, readable; the chat takes the next message.
    browser.say("fail").await;
    let error = browser
        .wait("the error", "document.querySelector('#log .error') && document.querySelector('#log .error').innerText")
        .await;
    let error = error.as_str().unwrap_or_default().to_owned();
    assert!(error.contains("The turn failed"), "{error}");
    assert!(error.contains("the context is too long"), "{error}");
    assert!(!error.contains("{\""), "no JSON: {error}");
    browser.screenshot("error.png").await;

    // A conversation too long for the model: the turn ends with a note that
    // says what the operator must configure, and the chat goes on.
    browser.say("too long").await;
    let note = browser
        .wait(
            "the context note",
            "[...document.querySelectorAll('#log *')].map(e => e.innerText).find(t => t && t.includes('no longer fits'))",
        )
        .await;
    let note = note.as_str().unwrap_or_default().to_owned();
    assert!(note.contains("context policy"), "{note}");
    browser.screenshot("context-exhausted.png").await;
    browser.say("hello").await;
    browser
        .wait(
            "the next answer",
            "document.getElementById('log').innerText.includes('Ask me about')",
        )
        .await;

    // Hostile text: markup stays text, no script runs, the `javascript:`
    // link is no link, the override is a visible code point, and the
    // megabyte of output is shown cut.
    browser.say("hostile").await;
    browser
        .wait("the hostile answer", "document.getElementById('log').innerText.includes('The attachment is invoice') && !document.body.classList.contains('running')")
        .await;
    let log = browser.text("#log").await;
    assert!(
        log.contains("Here is <b>bold</b> and <script>"),
        "markup shown as text:\n{log}"
    );
    assert!(log.contains("invoice \\u{202E}fdp.exe"), "{log}");
    assert!(
        !log.contains(RLO),
        "no raw override reaches the page's text"
    );
    assert_eq!(
        browser
            .run("return document.body.dataset.pwned === undefined")
            .await,
        json!(true),
        "nothing ran"
    );
    assert_eq!(
        browser
            .count("#log script, #log img, #log b, #log [onerror], #log a[href^='javascript']")
            .await,
        0
    );
    let links = browser
        .run("return Array.from(document.querySelectorAll('#log a')).map(a => [a.getAttribute('href'), a.target, a.rel])")
        .await;
    assert_eq!(
        links,
        json!([[
            "https://example.com/docs",
            "_blank",
            "noopener noreferrer nofollow"
        ]]),
        "only the real link is a link"
    );
    browser.click("#log details.tool summary").await;
    let shown = browser
        .run("return document.querySelector('#log details.tool .result pre').textContent.length")
        .await
        .as_u64()
        .unwrap_or(u64::MAX);
    assert!(shown < 10_000, "a megabyte of output is shown cut: {shown}");
    let more = browser.text("#log details.tool .result .more").await;
    assert!(
        more.contains("Show all") && more.contains("million characters"),
        "{more}"
    );
    browser
        .run("const c = document.getElementById('conversation'); c.scrollTop = c.scrollHeight")
        .await;
    browser.screenshot("hostile.png").await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markovs_reminder_after_a_cut_answer_is_shown_as_markovs_never_as_the_users() {
    let (f, director) = serve_director().await;
    let Some(browser) = Browser::start(1000, 860).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;
    browser.say("ramble").await;
    browser
        .wait(
            "the short answer",
            "document.getElementById('log').innerText.includes('In short') && !document.body.classList.contains('running')",
        )
        .await;
    assert_eq!(
        director.calls.load(Ordering::SeqCst),
        2,
        "the cut answer, then the short one"
    );
    for when in ["live", "after a reload"] {
        assert_eq!(
            browser.count("#log .msg.user").await,
            1,
            "{when}: the user's one message, and no other bubble of theirs"
        );
        let user = browser.text("#log .msg.user").await;
        assert_eq!(user.trim(), "ramble", "{when}");
        assert_eq!(browser.count("#log .msg.markov").await, 1, "{when}");
        let reminder = browser.text("#log .msg.markov").await;
        assert!(
            reminder.to_lowercase().contains("markov to the model") && reminder.contains("cut off"),
            "{when}: {reminder}"
        );
        let log = browser.text("#log").await;
        assert!(log.contains("In short: the city grew."), "{when}: {log}");
        if when == "live" {
            browser.screenshot("markov-reminder.png").await;
            browser.reload().await;
            browser
                .wait(
                    "the history",
                    "document.getElementById('log').innerText.includes('In short')",
                )
                .await;
        }
    }
    browser.screenshot("markov-reminder-reloaded.png").await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_fits_a_phone_screen() {
    // The fixture first: it sets up the TLS provider reqwest wants.
    let (f, _director) = serve_director().await;
    let Some(browser) = Browser::start(390, 844).await else {
        return;
    };
    browser.open(&f.base).await;
    browser
        .wait(
            "the sign-in form",
            "!document.getElementById('signin').hidden",
        )
        .await;
    assert_eq!(
        browser
            .run("return document.documentElement.scrollWidth <= window.innerWidth")
            .await,
        json!(true),
        "the sign-in fits the screen"
    );
    browser.screenshot("phone-sign-in.png").await;
    browser.sign_in(&f.key).await;
    let width = browser.run("return window.innerWidth").await;
    assert!(
        width.as_u64().is_some_and(|w| w <= 400),
        "a phone's width: {width}"
    );
    assert_eq!(
        browser
            .run("return getComputedStyle(document.getElementById('sidebar')).transform !== 'none'")
            .await,
        json!(true),
        "the chats are tucked away"
    );
    browser.say("weather").await;
    browser
        .wait("the answer", "document.querySelector('#log .msg.assistant table') !== null && !document.body.classList.contains('running')")
        .await;
    browser.say("pay 5").await;
    browser
        .wait(
            "the waiting call",
            "document.querySelectorAll('#approvals .approval').length === 1",
        )
        .await;
    browser.screenshot("phone-approval.png").await;
    assert_eq!(
        browser
            .run("return document.documentElement.scrollWidth <= window.innerWidth")
            .await,
        json!(true),
        "nothing is wider than the screen"
    );
    // The buttons of the waiting call are on the screen and work.
    browser.click("#approvals button.approve").await;
    browser
        .wait(
            "the payment",
            "document.getElementById('log').innerText.includes('Paid 5.')",
        )
        .await;
    // A conversation longer than the screen: it follows each answer to
    // its end.
    browser.say("weather").await;
    browser
        .wait("the second answer", "document.querySelectorAll('#log .msg.assistant table').length === 2 && !document.body.classList.contains('running')")
        .await;
    let scrolled = browser
        .run("const c = document.getElementById('conversation'); return [c.scrollHeight, c.clientHeight, c.scrollTop]")
        .await;
    let [height, shown, top] = [0, 1, 2].map(|i| scrolled[i].as_f64().unwrap_or(f64::NAN));
    assert!(
        height > shown && height - top - shown < 4.0,
        "the conversation follows the answer to its end: {scrolled}"
    );
    browser.screenshot("phone.png").await;
    browser.click("#menu").await;
    browser
        .wait(
            "the chats",
            "getComputedStyle(document.getElementById('sidebar')).transform === 'none'",
        )
        .await;
    browser.screenshot("phone-chats.png").await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markovs_follow_ups_notices_and_an_agents_hand_back_are_never_shown_as_the_users() {
    use markov_core::message::{Message, Metadata, Source};
    use markov_testkit::ScriptedModel;

    #[derive(Debug, Deserialize, JsonSchema)]
    struct Answer {
        #[allow(dead_code)]
        value: i64,
    }
    // A typed run whose first answer does not fit: markov asks again.
    let agent = Agent::builder("typed")
        .instructions("Answer in JSON.")
        .output::<Answer>()
        .model(
            ScriptedModel::builder()
                .text("forty-two")
                .text(r#"{"value": 42}"#)
                .build(),
        )
        .build()
        .expect("the agent builds");
    let mut machine = agent.machine();
    machine.enqueue_user("six times seven?");
    let typed = machine.run_typed::<Answer>().await.expect("a typed answer");
    assert_eq!(typed.attempts, 2);
    let mut messages = machine.history().to_vec();
    // A resume's notice, and text an agent instance handed back (as the run
    // records them).
    let id = machine.instance().id().clone();
    messages.push(Message::system(format!("[Resumed instance {id}]")));
    messages.push(
        Message::user("the child's findings").with_metadata(Metadata::with_source(Source {
            instance_id: Some(id),
            ..Source::default()
        })),
    );
    let users = messages
        .iter()
        .filter(|m| m.role == markov_core::Role::User)
        .count();
    assert_eq!(
        users, 2,
        "the user's question and the hand-back: {messages:?}"
    );

    let (f, _director) = serve_director().await;
    let Some(browser) = Browser::start(1000, 860).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;
    let shown = browser
        .run(&format!(
            "showStep({{messages: {}}}); return document.querySelectorAll('#log .msg').length",
            json!(messages)
        ))
        .await;
    assert!(shown.as_u64().is_some_and(|n| n >= 5), "{shown}");
    assert_eq!(
        browser.count("#log .msg.user").await,
        1,
        "only what the user wrote is their bubble"
    );
    assert_eq!(
        browser.text("#log .msg.user").await.trim(),
        "six times seven?"
    );
    let notes = browser
        .run("return [...document.querySelectorAll('#log .msg.markov')].map(e => e.innerText)")
        .await;
    let notes: Vec<String> = serde_json::from_value(notes).expect("the notes' texts");
    assert_eq!(notes.len(), 3, "{notes:?}");
    assert!(
        notes[0].contains("did not match the required format"),
        "{notes:?}"
    );
    assert!(notes[1].contains("[Resumed instance"), "{notes:?}");
    assert!(
        notes[2].contains("the child's findings")
            && notes[2].to_lowercase().contains("from an agent"),
        "{notes:?}"
    );
    browser.screenshot("markov-notes.png").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_results_image_is_a_thumbnail_in_its_card_never_base64_text() {
    let (f, _director) = serve_director().await;
    let Some(browser) = Browser::start(1200, 900).await else {
        return;
    };
    browser.open(&f.base).await;
    browser
        .wait(
            "the sign-in form",
            "!document.getElementById('signin').hidden",
        )
        .await;
    browser.sign_in(&f.key).await;
    browser.say("picture").await;
    browser
        .wait(
            "the answer",
            "document.getElementById('log').innerText.includes('A red dot.') && !document.body.classList.contains('running')",
        )
        .await;
    for when in ["live", "after a reload"] {
        assert_eq!(
            browser.count("#log details.tool img.thumb").await,
            1,
            "{when}: one thumbnail"
        );
        let src = browser
            .run("return document.querySelector('#log details.tool img.thumb').getAttribute('src')")
            .await;
        assert_eq!(src, json!(format!("data:image/png;base64,{DOT}")), "{when}");
        let loaded = browser
            .run("const i = document.querySelector('#log details.tool img.thumb'); return i.complete && i.naturalWidth")
            .await;
        assert_eq!(loaded, json!(1), "{when}: the image decodes");
        let card = browser
            .run("return document.querySelector('#log details.tool').textContent")
            .await;
        let card = card.as_str().unwrap_or_default();
        assert!(card.contains("a dot"), "{when}: {card}");
        assert!(
            !card.contains("iVBORw0KGgo"),
            "{when}: base64 as text: {card}"
        );
        if when == "live" {
            browser.reload().await;
            browser
                .wait(
                    "the history",
                    "document.getElementById('log').innerText.includes('A red dot.')",
                )
                .await;
        }
    }
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_answer_shows_as_blocked_and_none_of_it_is_shown() {
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("helper")
        .instructions("You help.")
        .guards(markov_guard::Guards::new().output(markov_guard::MaxLength::new(20)))
        .model(
            markov_testkit::ScriptedModel::builder()
                .text("The whole secret recipe, far longer than allowed.")
                .build(),
        )
        .build()
        .expect("the agent builds");
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(Server::builder().agent(agent), store, pays).await;
    let Some(browser) = Browser::start(1000, 700).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;
    browser.say("the recipe, please").await;
    browser
        .wait(
            "the block",
            "document.querySelector('#log .msg.markov.blocked') !== null && !document.body.classList.contains('running')",
        )
        .await;
    for when in ["live", "after a reload"] {
        let blocked = browser.text("#log .msg.markov.blocked").await;
        assert!(
            blocked.to_lowercase().contains("blocked by a guard")
                && blocked.contains("blocked by max-length"),
            "{when}: {blocked}"
        );
        let log = browser.text("#log").await;
        assert!(!log.contains("secret recipe"), "{when}: {log}");
        assert_eq!(browser.count("#log .msg.assistant").await, 0, "{when}");
        if when == "live" {
            browser.screenshot("blocked.png").await;
            browser.reload().await;
            browser
                .wait(
                    "the history",
                    "document.querySelector('#log .msg.markov.blocked') !== null",
                )
                .await;
        }
    }
    browser.close().await;
}

/// Blocks every text that holds its word.
#[derive(Debug)]
struct Forbid(&'static str);

#[async_trait]
impl markov_guard::Guard for Forbid {
    fn name(&self) -> &str {
        "forbid"
    }
    async fn check(&self, text: &str) -> markov_guard::Verdict {
        if text.contains(self.0) {
            markov_guard::Verdict::block("it mentions a forbidden word")
        } else {
            markov_guard::Verdict::Pass
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redacted_or_blocked_message_shows_as_the_conversation_keeps_it() {
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("helper")
        .instructions("You help.")
        .guards(
            markov_guard::Guards::new()
                .input(markov_guard::PiiRedactor::new())
                .input(Forbid("secret plan")),
        )
        .model(
            markov_testkit::ScriptedModel::builder()
                .text("Noted.")
                .build(),
        )
        .build()
        .expect("the agent builds");
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(Server::builder().agent(agent), store, pays).await;
    let Some(browser) = Browser::start(1000, 700).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;
    browser.say("Write to ann@example.com please.").await;
    browser
        .wait(
            "the answer",
            "document.getElementById('log').innerText.includes('Noted.') && !document.body.classList.contains('running')",
        )
        .await;
    browser.say("Tell me the secret plan.").await;
    browser
        .wait(
            "the block",
            "document.querySelector('#log .msg.markov.blocked') !== null && !document.body.classList.contains('running')",
        )
        .await;
    for when in ["live", "after a reload"] {
        let users = browser
            .run(
                "return [...document.querySelectorAll('#log .msg.user')].map((n) => n.textContent)",
            )
            .await;
        assert_eq!(users, json!(["Write to [EMAIL_1] please."]), "{when}");
        let page = browser.text("body").await;
        assert!(
            !page.contains("ann@example.com") && !page.contains("secret plan"),
            "{when}: {page}"
        );
        let blocked = browser.text("#log .msg.markov.blocked").await;
        assert!(blocked.contains("blocked by forbid"), "{when}: {blocked}");
        if when == "live" {
            browser.reload().await;
            browser
                .wait(
                    "the history",
                    "document.querySelector('#log .msg.markov.blocked') !== null",
                )
                .await;
        }
    }
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_developer_reads_a_200_step_session_as_a_timeline_opens_a_request_and_forks_a_step() {
    use markov_testkit::ScriptedModel;

    // A hundred turns, each a tool call and an answer: two hundred steps.
    // The first turn's call names a tool the agent does not have, and is
    // refused.
    let mut script = ScriptedModel::builder();
    for i in 0..100 {
        let tool = if i == 0 { "wire_money" } else { "pay" };
        script = script
            .tool_call(tool, json!({"amount": i}))
            .text(format!("Paid {i}."));
    }
    let model = script.text("Forked answer.").build();
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(Pay(pays.clone()), ToolMetadata::new(Category::Action))
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(model)
        .build()
        .expect("the agent builds");
    let f = crate::http::serve_agent(agent, pays).await;
    let id = f.create().await;
    for i in 0..100 {
        f.say(&id, &format!("pay {i}")).await;
    }
    let mut recorded = 0;
    let mut from = 0;
    loop {
        let (status, page) = f.get(&format!("/sessions/{id}/steps?from={from}")).await;
        assert_eq!(status, 200, "{page}");
        recorded += page["steps"].as_array().expect("steps").len();
        match page["next"].as_u64() {
            Some(next) => from = next,
            None => break,
        }
    }
    assert_eq!(recorded, 200, "two steps a turn");

    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open(&format!("{}/#{id}", f.base)).await;
    browser.sign_in(&f.key).await;
    browser
        .wait(
            "the chat",
            "document.getElementById('log').innerText.includes('Paid 99.')",
        )
        .await;
    // The chat links to its steps.
    browser.click("#steps-link").await;
    browser
        .wait(
            "the first page of steps",
            "document.querySelectorAll('#timeline > li').length === 50",
        )
        .await;
    // Paged: more arrive as the list's end scrolls into view.
    browser
        .wait(
            "all the steps",
            "(document.getElementById('studio').scrollTop = 1e9, document.querySelectorAll('#timeline > li').length === 200)",
        )
        .await;
    assert_eq!(browser.text("#studio-count").await, "200 steps");
    assert_eq!(
        browser.count("#timeline .body").await,
        0,
        "a step's detail is built when opened"
    );
    browser
        .run("document.getElementById('studio').scrollTop = 0")
        .await;
    // The refused call, flagged on its line and shown with its reason.
    browser.screenshot("studio-timeline.png").await;
    browser
        .wait(
            "the refused call's flag",
            "document.querySelector(\"#timeline > li[data-step='0'] summary\").innerText.includes('refused')",
        )
        .await;
    browser.click("#timeline > li[data-step='0'] summary").await;
    let step = browser
        .wait(
            "the step's detail",
            "document.querySelector(\"#timeline > li[data-step='0'] .body\").innerText",
        )
        .await;
    let step = step.as_str().unwrap_or_default();
    assert!(step.contains("wire_money"), "{step}");
    assert!(step.contains("REFUSED OR FAILED"), "{step}");
    assert!(step.contains("Unknown tool"), "{step}");
    browser.screenshot("studio-refused-call.png").await;
    browser.click("#timeline > li[data-step='1'] summary").await;
    let step = browser
        .wait(
            "the step's detail",
            "document.querySelector(\"#timeline > li[data-step='1'] .body\").innerText",
        )
        .await;
    let step = step.as_str().unwrap_or_default();
    assert!(step.contains("Paid 0."), "{step}");
    assert!(step.contains("in /"), "usage: {step}");
    browser
        .click("#timeline > li[data-step='1'] .show-request")
        .await;
    browser
        .wait(
            "the step's request",
            "document.querySelector(\"#timeline > li[data-step='1'] .request\")",
        )
        .await;
    let request = browser.text("#timeline > li[data-step='1'] .request").await;
    assert!(request.contains("You pay bills."), "{request}");
    assert!(
        request.contains("3 messages"),
        "pay 0, the call, its result: {request}"
    );
    assert!(request.contains("pay"), "{request}");
    assert!(
        request.contains("\"max_tokens\":") && !request.contains("<redacted>"),
        "a setting is not a credential: {request}"
    );
    browser
        .run("document.querySelector(\"#timeline > li[data-step='1'] .request\").scrollIntoView({block: 'end'})")
        .await;
    browser.screenshot("studio-request.png").await;

    // Forked at the answer's step: the fork asks the same again, and its
    // chat opens with the new answer.
    browser.click("#timeline > li[data-step='1'] .fork").await;
    browser
        .wait(
            "the fork's answer",
            "!document.getElementById('chat').hidden && document.getElementById('log').innerText.includes('Forked answer.')",
        )
        .await;
    let log = conversation(&browser).await;
    assert!(log.contains("pay 0"), "{log}");
    assert!(
        !log.contains("Paid 1."),
        "the fork stops before the later turns: {log}"
    );
    let listed = browser.text("#sessions").await;
    assert!(
        listed.contains("Fork of pay 0 at step 1"),
        "the fork is named for its source: {listed}"
    );
    browser.screenshot("studio-fork.png").await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timeline_shows_a_paused_approval_and_the_steps_stored_after_it_appear_while_open() {
    use markov_testkit::ScriptedModel;

    let f = crate::http::serve(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("Paid 5.")
            .build(),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "pay 5").await;
    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open_steps(&f.base, &id, &f.key).await;
    browser
        .wait(
            "the paused step",
            "document.querySelectorAll('#timeline > li').length === 1",
        )
        .await;
    // Waited for rather than read at once: a line's text is there once the
    // page has laid it out, which a loaded machine can take a frame to do.
    browser
        .wait(
            "the paused step's reason",
            "document.querySelector(\"#timeline > li[data-step='0'] .reason\").textContent === 'awaiting_approval'",
        )
        .await;
    browser
        .wait(
            "the waiting call on the step's line",
            "document.querySelector(\"#timeline > li[data-step='0'] .gist\").textContent.includes('waits: pay(amount: 5)')",
        )
        .await;
    browser.click("#timeline > li[data-step='0'] summary").await;
    let step = browser
        .wait(
            "the waiting call",
            "document.querySelector(\"#timeline > li[data-step='0'] .body\").innerText",
        )
        .await;
    let step = step.as_str().unwrap_or_default();
    assert!(step.contains("WAITING FOR APPROVAL"), "{step}");
    assert!(step.contains("pay {\"amount\":5}"), "{step}");
    browser.screenshot("studio-paused-approval.png").await;

    // Approved elsewhere: the steps the resumed run stores appear.
    let pending = f.pending(&id).await;
    let (status, _) = f
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 200);
    browser
        .wait(
            "the resumed run's steps",
            "document.getElementById('timeline').innerText.includes('Paid 5.')",
        )
        .await;
    assert_eq!(
        browser.count("#timeline > li").await,
        3,
        "resume, then answer"
    );
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_against_changed_instructions_shows_where_the_runs_part_step_by_step() {
    use markov_testkit::ScriptedModel;

    let recorded = Arc::new(ScriptedModel::builder().text("Hello.").text("Bye.").build());
    let live = Arc::new(
        ScriptedModel::builder()
            .text("Carefully: hello.")
            .text("Bye.")
            .build(),
    );
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(
        Server::builder()
            .agent(crate::studio::payments("You pay bills.", recorded))
            .replay_agent("payments", live, |model| {
                crate::studio::payments("You pay bills, carefully.", model)
            }),
        store,
        Arc::default(),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "hi").await;
    f.say(&id, "bye").await;
    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open_steps(&f.base, &id, &f.key).await;
    browser
        .wait(
            "the replay button",
            "!document.getElementById('replay-controls').hidden && document.querySelectorAll('#timeline > li').length === 2",
        )
        .await;
    browser.click("#replay").await;
    browser
        .wait(
            "the diff",
            "document.querySelectorAll('#replay-diff tr[data-step]').length === 2",
        )
        .await;
    let diff = browser.text("#replay-diff").await;
    assert!(diff.contains("The runs part at step 0"), "{diff}");
    assert!(diff.contains("No tool was called"), "{diff}");
    let first = browser.text("#replay-diff tr[data-step='0']").await;
    assert!(
        first.contains("Hello.") && first.contains("Carefully: hello."),
        "{first}"
    );
    assert!(
        first.contains("changed") && first.contains("live"),
        "{first}"
    );
    assert_eq!(
        browser.count("#replay-diff tr.parted").await,
        1,
        "the step where the runs part is marked"
    );
    browser.screenshot("studio-replay-diff.png").await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_shows_its_calls_decision_and_wire_body_and_a_turn_is_saved_as_a_test() {
    use markov_testkit::ScriptedModel;

    let f = crate::studio_hooks::hooked(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 3}))
            .text("Paid 3.")
            .build(),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "pay 3").await;
    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open_steps(&f.base, &id, &f.key).await;
    browser
        .wait(
            "the steps",
            "document.querySelectorAll('#timeline > li').length === 2 && !document.getElementById('save-case').hidden",
        )
        .await;
    let save = browser
        .run("return document.getElementById('save-case').getAttribute('href')")
        .await;
    assert_eq!(save, json!(format!("/sessions/{id}/case")));
    browser.click("#timeline > li[data-step='0'] summary").await;
    browser
        .wait(
            "the step's decision",
            "document.querySelector(\"#timeline > li[data-step='0'] .decision\")",
        )
        .await;
    browser.screenshot("studio-save-as-test.png").await;
    let step = browser
        .wait(
            "the step's detail",
            "document.querySelector(\"#timeline > li[data-step='0'] .body\").innerText",
        )
        .await;
    let step = step.as_str().unwrap_or_default();
    assert!(step.contains("POLICY DECISION"), "{step}");
    let decision = browser
        .text("#timeline > li[data-step='0'] .decision")
        .await;
    assert!(
        decision.starts_with("Allowed: the tool ran") || decision == "Not recorded for this step",
        "what the trace has, or that it has nothing: {decision}"
    );
    // The turn saved as a test: the exporter's file, for this step.
    let href = browser
        .run("return document.querySelector(\"#timeline > li[data-step='0'] .save-case\").getAttribute('href')")
        .await;
    assert_eq!(href, json!(format!("/sessions/{id}/case?from=0&to=1")));
    browser
        .run("fetch(document.querySelector(\"#timeline > li[data-step='0'] .save-case\").href).then((r) => r.text()).then((t) => { window.savedCase = t; })")
        .await;
    let saved = browser.wait("the saved case", "window.savedCase").await;
    assert_eq!(saved, json!(format!("# case of {id}, steps Some(0..1)\n")));

    // The request, then its wire body one click further, the key redacted.
    browser
        .click("#timeline > li[data-step='0'] .show-request")
        .await;
    browser
        .wait(
            "the wire body's toggle",
            "document.querySelector(\"#timeline > li[data-step='0'] details.wire summary\")",
        )
        .await;
    browser
        .click("#timeline > li[data-step='0'] details.wire summary")
        .await;
    let wire = browser
        .wait(
            "the wire body",
            "document.querySelector(\"#timeline > li[data-step='0'] details.wire pre\")?.innerText",
        )
        .await;
    let wire = wire.as_str().unwrap_or_default();
    assert!(wire.contains("vendor-model"), "{wire}");
    assert!(wire.contains("<redacted>"), "{wire}");
    assert!(!wire.contains("sk-secret-in-a-body"), "{wire}");
    browser
        .run("document.querySelector(\"#timeline > li[data-step='0'] details.wire\").scrollIntoView({block: 'end'})")
        .await;
    browser.screenshot("studio-wire-body.png").await;

    // A request the provider cannot carry says so where the body would be.
    browser.click("#timeline > li[data-step='1'] summary").await;
    browser
        .wait(
            "the second step's actions",
            "document.querySelector(\"#timeline > li[data-step='1'] .show-request\")",
        )
        .await;
    browser
        .click("#timeline > li[data-step='1'] .show-request")
        .await;
    browser
        .wait(
            "the second wire body's toggle",
            "document.querySelector(\"#timeline > li[data-step='1'] details.wire summary\")",
        )
        .await;
    browser
        .click("#timeline > li[data-step='1'] details.wire summary")
        .await;
    let refused = browser
        .wait(
            "the refusal",
            "document.querySelector(\"#timeline > li[data-step='1'] details.wire\").textContent.includes('Cannot show the wire body: the provider cannot encode')",
        )
        .await;
    assert_eq!(refused, json!(true));
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_after_a_context_views_cut_shows_its_request_and_forks() {
    use markov_charter::context::ContextPolicy;
    use markov_testkit::ScriptedModel;

    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .context_policy(
            ContextPolicy::builder()
                .keep_last_turns(2)
                .build()
                .expect("a policy"),
        )
        .model(
            ScriptedModel::builder()
                .text("Hello.")
                .text("Hello again.")
                .text("Still here.")
                .text("Forked.")
                .build(),
        )
        .build()
        .expect("the agent builds");
    let f = crate::http::serve_agent(agent, Arc::default()).await;
    let id = f.create().await;
    // The third turn's view leaves the first out; the first two turns'
    // views were the history as it is.
    for text in ["hi", "again", "still"] {
        f.say(&id, text).await;
    }
    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open_steps(&f.base, &id, &f.key).await;
    browser
        .wait(
            "the step",
            "document.querySelectorAll('#timeline > li').length === 3",
        )
        .await;
    browser.click("#timeline > li[data-step='0'] summary").await;
    browser
        .wait(
            "the first step's request, its view unchanged",
            "document.querySelectorAll(\"#timeline > li[data-step='0'] .show-request\").length === 1",
        )
        .await;
    browser.click("#timeline > li[data-step='2'] summary").await;
    // The view left the first turn out: its request is rebuilt as sent.
    browser
        .wait(
            "the request of the step after the cut",
            "document.querySelectorAll(\"#timeline > li[data-step='2'] .show-request\").length === 1",
        )
        .await;
    assert_eq!(
        browser
            .count("#timeline > li[data-step='2'] .no-request")
            .await,
        0
    );
    browser
        .click("#timeline > li[data-step='2'] .show-request")
        .await;
    browser
        .wait(
            "the step's request",
            "document.querySelector(\"#timeline > li[data-step='2'] .request\")",
        )
        .await;
    browser
        .run("document.querySelector(\"#timeline > li[data-step='2'] .request details\").open = true")
        .await;
    let request = browser.text("#timeline > li[data-step='2'] .request").await;
    assert!(
        request.contains("3 messages") && request.contains("still") && !request.contains("\"hi\""),
        "again, its answer and still; hi left out: {request}"
    );
    browser
        .run("document.querySelector(\"#timeline > li[data-step='2'] .request\").scrollIntoView({block: 'end'})")
        .await;
    browser.screenshot("studio-context-view.png").await;
    browser.click("#timeline > li[data-step='2'] .fork").await;
    browser
        .wait(
            "the fork's answer",
            "!document.getElementById('chat').hidden && document.getElementById('log').innerText.includes('Forked.')",
        )
        .await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_agents_thinking_is_not_shown_and_its_answer_is() {
    let pays = Arc::new(AtomicUsize::new(0));
    let answer = markov_core::model::ModelResponse::new(
        vec![
            markov_core::Item::Thinking {
                thinking: "The user's card is 4111 1111 1111 1111.".into(),
                signature: Some("signed".into()),
            },
            markov_core::Item::text("Your card is on file."),
        ],
        markov_core::model::StopReason::EndTurn,
    );
    let agent = Agent::builder("helper")
        .instructions("You help.")
        .guards(markov_guard::Guards::new().output(Forbid("4111")))
        .model(
            markov_testkit::ScriptedModel::builder()
                .response(answer)
                .build(),
        )
        .build()
        .expect("the agent builds");
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(Server::builder().agent(agent), store, pays).await;
    let Some(browser) = Browser::start(1000, 700).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;
    browser.say("is my card on file?").await;
    browser
        .wait(
            "the answer",
            "document.getElementById('log').innerText.includes('Your card is on file.') && !document.body.classList.contains('running')",
        )
        .await;
    for when in ["live", "after a reload"] {
        let log = browser.text("#log").await;
        assert!(log.contains("Your card is on file."), "{when}: {log}");
        assert!(!log.contains("4111"), "{when}: {log}");
        assert_eq!(browser.count("#log .thinking").await, 0, "{when}");
        if when == "live" {
            browser.screenshot("thinking-withheld.png").await;
            browser.reload().await;
            browser
                .wait(
                    "the history",
                    "document.getElementById('log').innerText.includes('Your card is on file.')",
                )
                .await;
        }
    }
    browser.close().await;
}

/// A model that thinks (signed), streaming its thinking in pieces, then
/// answers.
#[derive(Debug)]
struct Thinks {
    thoughts: Vec<&'static str>,
    answer: &'static str,
}

#[async_trait]
impl Model for Thinks {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        markov_core::model::collect_stream(self.stream(request)).await
    }

    fn stream<'a>(&'a self, _: ModelRequest<'a>) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        let mut events: Vec<Result<StreamEvent, ModelError>> = self
            .thoughts
            .iter()
            .map(|t| {
                Ok(StreamEvent::ThinkingDelta {
                    index: 0,
                    thinking: (*t).to_owned(),
                })
            })
            .collect();
        events.push(Ok(StreamEvent::TextDelta {
            index: 1,
            text: self.answer.to_owned(),
        }));
        events.push(Ok(StreamEvent::Done(answer(
            vec![
                Item::Thinking {
                    thinking: self.thoughts.concat(),
                    signature: Some("signed".into()),
                },
                Item::text(self.answer),
            ],
            StopReason::EndTurn,
        ))));
        futures::stream::iter(events).boxed()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_a_guard_blocks_partway_shows_what_was_streamed_and_that_the_rest_was_withheld() {
    let pays = Arc::new(AtomicUsize::new(0));
    let model = Thinks {
        thoughts: vec![
            "The user asks whether their card is on file. ",
            "It is 4111 1111 1111 1111. ",
            "Say yes. ",
        ],
        answer: "Your card is on file.",
    };
    let agent = Agent::builder("helper")
        .instructions("You help.")
        .guards(markov_guard::Guards::new().output(SentenceForbid("4111")))
        .model(model)
        .build()
        .expect("the agent builds");
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(Server::builder().agent(agent), store, pays).await;
    let Some(browser) = Browser::start(1000, 700).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;
    browser.say("is my card on file?").await;
    browser
        .wait(
            "the answer",
            "document.getElementById('log').innerText.includes('Your card is on file.') && !document.body.classList.contains('running')",
        )
        .await;
    let log = browser.text("#log").await;
    assert!(!log.contains("4111"), "{log}");
    assert_eq!(browser.count("#log .thinking").await, 1, "{log}");
    assert_eq!(browser.count("#log .thinking.withheld").await, 1, "{log}");
    // Opened, the box shows what was streamed, then the mark.
    browser
        .wait(
            "the thinking opened",
            "(() => { const box = document.querySelector('#log .thinking'); box.open = true; return box.open; })()",
        )
        .await;
    let shown = browser.text("#log .thinking").await;
    assert!(
        shown.contains("Thinking (partly withheld by a guard)")
            && shown.contains("The user asks whether their card is on file.")
            && shown.contains("The rest of this thinking was withheld by a guard."),
        "{shown}"
    );
    assert!(
        !shown.contains("[guard]"),
        "the mark reads as prose: {shown}"
    );
    browser.screenshot("thinking-partly-withheld.png").await;
    browser.close().await;
}

/// Blocks every sentence that holds its word, sentence by sentence.
#[derive(Debug)]
struct SentenceForbid(&'static str);

#[async_trait]
impl markov_guard::Guard for SentenceForbid {
    fn name(&self) -> &str {
        "forbid"
    }
    fn hold(&self) -> markov_guard::Hold {
        markov_guard::Hold::Sentence
    }
    async fn check(&self, text: &str) -> markov_guard::Verdict {
        if text.contains(self.0) {
            markov_guard::Verdict::block("it mentions a forbidden word")
        } else {
            markov_guard::Verdict::Pass
        }
    }
}
