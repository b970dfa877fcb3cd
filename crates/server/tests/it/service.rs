//! The service as an attacker and an operator see it, over real loopback
//! HTTP: credentials, ownership, roles, hosts and origins, the browser's
//! cookie, bearer tokens, slow clients, body and rate limits, cancel and
//! deadlines, reconnecting, shutdown and restart (SQLite and Postgres),
//! several agents, the OpenAPI document and the metrics.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use markov_core::Item;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Agent, CANCELLED_TOOL_CALL};
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata};
use markov_server::{BuildError, JwtConfig, Limits, Server, ServerBuilder};
use markov_store::testing::TempPostgres;
use markov_store::{PostgresStore, SessionId, SqliteStore, Store, WorkerId};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::{Counted, Hang};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::http::{Fixture, Pay, Slow, events, names, results, serve, serve_agent, start};

const PROTECTED: &[(&str, &str)] = &[
    ("GET", "/me"),
    ("GET", "/agents"),
    ("POST", "/sessions"),
    ("GET", "/sessions"),
    ("POST", "/agents/payments/sessions"),
    ("GET", "/agents/payments/sessions"),
    ("GET", "/sessions/x"),
    ("POST", "/sessions/x/messages"),
    ("GET", "/sessions/x/events"),
    ("POST", "/sessions/x/cancel"),
    ("GET", "/sessions/x/approvals"),
    ("POST", "/sessions/x/approvals/y"),
    ("POST", "/sessions/x/commands"),
    ("GET", "/sessions/x/steps"),
    ("GET", "/sessions/x/steps/0/request"),
    ("GET", "/sessions/x/steps/0/sub_agents/0/request"),
    ("POST", "/sessions/x/steps/0/fork"),
    ("POST", "/sessions/x/replay"),
    ("GET", "/sessions/x/steps/0/wire"),
    ("GET", "/sessions/x/steps/0/sub_agents/0/wire"),
    ("GET", "/sessions/x/case"),
    ("GET", "/openapi.json"),
    ("GET", "/metrics"),
];

impl Fixture {
    fn request(&self, method: &str, path: &str) -> reqwest::RequestBuilder {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("a method");
        self.client
            .request(method, format!("{}{path}", self.base))
            .header("content-type", "application/json")
    }

    /// Sends `method path` with `key`'s credential: its status and JSON body.
    async fn send_as(&self, key: &str, method: &str, path: &str, body: Value) -> (u16, Value) {
        let response = self
            .request(method, path)
            .bearer_auth(key)
            .body(body.to_string())
            .send()
            .await
            .expect("sent");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    fn port(&self) -> u16 {
        self.base
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("a port")
    }
}

fn key_id(key: &str) -> &str {
    key.trim_start_matches("mk_")
        .split('_')
        .next()
        .expect("an id")
}

/// Waits (at most twenty seconds) until `ready` holds.
async fn until(what: &str, mut ready: impl AsyncFnMut() -> bool) {
    for _ in 0..400 {
        if ready().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never happened: {what}");
}

// --- identity -------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_but_the_public_ones_needs_a_live_credential() {
    let f = serve(ScriptedModel::builder().text("hi").build()).await;
    let bob = f.keys["bob"].clone();
    assert!(f.store.revoke_key(key_id(&bob)).await.expect("revokes"));
    let forged = format!("mk_{}_{}", key_id(&f.key), "0".repeat(64));
    for (method, path) in PROTECTED {
        let anonymous = f.request(method, path).send().await.expect("sent");
        assert_eq!(
            anonymous.status(),
            401,
            "{method} {path} without a credential"
        );
        assert_eq!(
            anonymous.headers()["www-authenticate"],
            "Bearer",
            "{method} {path}"
        );
        for key in [forged.as_str(), bob.as_str(), "not-a-key"] {
            let (status, body) = f.send_as(key, method, path, json!({})).await;
            assert_eq!(status, 401, "{method} {path} with {key}: {body}");
        }
    }
    let (status, _) = f.send_as(&f.key, "GET", "/sessions", Value::Null).await;
    assert_eq!(status, 200, "a live key");
    for path in ["/", "/assets/app.js", "/assets/app.css", "/healthz"] {
        let response = f.request("GET", path).send().await.expect("sent");
        assert_eq!(response.status(), 200, "{path} is public");
        let policy = response.headers()["content-security-policy"]
            .to_str()
            .expect("text")
            .to_owned();
        assert!(
            policy.contains("frame-ancestors 'none'"),
            "{path}: {policy}"
        );
        assert_eq!(response.headers()["x-content-type-options"], "nosniff");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_principals_session_is_not_found_and_stays_as_it_was() {
    let f = serve(ScriptedModel::builder().text("Hello, alice.").build()).await;
    let id = f.create().await;
    let said = f.say(&id, "hi").await;
    assert_eq!(names(&said).last(), Some(&"done"));
    let (_, before) = f.get(&format!("/sessions/{id}")).await;
    let bob = f.keys["bob"].clone();
    let (status, listed) = f.send_as(&bob, "GET", "/sessions", Value::Null).await;
    assert_eq!(
        (status, listed),
        (200, json!([])),
        "bob sees none of alice's"
    );
    for (method, path) in PROTECTED
        .iter()
        .filter(|(_, p)| p.starts_with("/sessions/x"))
    {
        let theirs = path.replacen("/x", &format!("/{id}"), 1);
        let (status, body) = f
            .send_as(
                &bob,
                method,
                &theirs,
                json!({"text": "hi", "name": "c", "decision": "approve"}),
            )
            .await;
        let (missing_status, missing) = f
            .send_as(
                &bob,
                method,
                path,
                json!({"text": "hi", "name": "c", "decision": "approve"}),
            )
            .await;
        assert_eq!(status, 404, "{method} {theirs}: {body}");
        assert_eq!(missing_status, 404, "{method} {path}");
        assert_eq!(
            body["error"].as_str().map(|e| e.replace(&id, "x")),
            missing["error"].as_str().map(str::to_owned),
            "the same answer as for a session that does not exist"
        );
    }
    let (_, after) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(before["history"], after["history"], "nothing changed");
}

/// Asks to pay 5 after a user's text; answers "Done." after the results.
#[derive(Debug, Default)]
struct PayFive(AtomicUsize);

#[async_trait]
impl Model for PayFive {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let n = self.0.fetch_add(1, Ordering::SeqCst);
        let answered = request.messages().last().is_some_and(|m| {
            m.item_list()
                .iter()
                .any(|i| matches!(i, Item::ToolResult { .. }))
        });
        if answered {
            return Ok(markov_testkit::text_response("Done."));
        }
        Ok(ModelResponse::new(
            vec![Item::tool_use(
                format!("call-{n}"),
                "pay",
                json!({"amount": 5}),
            )],
            StopReason::ToolUse,
        ))
    }
}

fn paying_agent(pays: &Arc<AtomicUsize>) -> Agent {
    Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(
            Pay(pays.clone()),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(PayFive::default())
        .build()
        .expect("the agent builds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deciding_on_a_tool_that_needs_a_role_is_refused_without_it() {
    let pays = Arc::new(AtomicUsize::new(0));
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let builder = Server::builder()
        .agent(paying_agent(&pays))
        .approval_role("pay", "approver");
    let mut f = start(builder, store, pays.clone()).await;
    // carol has no role: her own payment waits for a decision she may not give.
    f.key = f.keys["carol"].clone();
    let id = f.create().await;
    f.say(&id, "pay 5").await;
    let pending = f.pending(&id).await;
    assert_eq!(pending.len(), 1);
    let (status, refused) = f
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 403, "{refused:?}");
    assert!(
        refused[0].1["error"]
            .as_str()
            .is_some_and(|e| e.contains("`approver` role")),
        "{refused:?}"
    );
    assert_eq!(f.pending(&id).await, pending, "still waiting");
    assert_eq!(pays.load(Ordering::SeqCst), 0);
    // alice is an approver: her payment goes through.
    f.key = f.keys["alice"].clone();
    let id = f.create().await;
    f.say(&id, "pay 5").await;
    let pending = f.pending(&id).await;
    let (status, events) = f
        .decide(&id, &pending[0], json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(names(&events).last(), Some(&"done"), "{events:?}");
    assert_eq!(pays.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_hosts_and_origins_are_refused_and_configured_ones_served() {
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let builder = Server::builder()
        .agent(paying_agent(&Arc::default()))
        .allowed_host("agents.example")
        .cors_origin("https://app.example");
    let f = start(builder, store, Arc::default()).await;
    let port = f.port();
    let get = |host: String, origin: Option<String>| {
        let mut request = f
            .request("GET", "/sessions")
            .bearer_auth(&f.key)
            .header("host", host);
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        request.send()
    };
    for (host, origin, expected) in [
        (format!("127.0.0.1:{port}"), None, 200),
        (
            format!("localhost:{port}"),
            Some(format!("http://localhost:{port}")),
            200,
        ),
        (format!("agents.example:{port}"), None, 200),
        (
            "agents.example".into(),
            Some("https://agents.example".into()),
            200,
        ),
        ("evil.example".into(), None, 403),
        (format!("evil.example:{port}"), None, 403),
        (
            format!("127.0.0.1:{port}"),
            Some("http://evil.example".into()),
            403,
        ),
        (format!("127.0.0.1:{port}"), Some("null".into()), 403),
        (
            format!("127.0.0.1:{port}"),
            Some("https://app.example".into()),
            200,
        ),
    ] {
        let response = get(host.clone(), origin.clone()).await.expect("sent");
        assert_eq!(
            response.status(),
            expected,
            "Host {host}, Origin {origin:?}"
        );
    }
    // CORS: the configured origin's preflight is answered; no other's.
    let preflight = |origin: &'static str| {
        f.request("OPTIONS", "/sessions")
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization")
            .send()
    };
    let allowed = preflight("https://app.example").await.expect("sent");
    assert_eq!(
        allowed.headers()["access-control-allow-origin"],
        "https://app.example"
    );
    let refused = preflight("https://other.example").await.expect("sent");
    assert_eq!(refused.status(), 403);
    assert!(
        !refused
            .headers()
            .contains_key("access-control-allow-origin")
    );

    // Without configuration, no CORS at all.
    let plain = serve(ScriptedModel::builder().build()).await;
    let preflight = plain
        .request("OPTIONS", "/sessions")
        .header("origin", plain.base.clone())
        .header("access-control-request-method", "POST")
        .send()
        .await
        .expect("sent");
    assert!(
        !preflight
            .headers()
            .contains_key("access-control-allow-origin")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_signs_in_with_a_key_and_gets_a_strict_http_only_cookie() {
    let f = serve(ScriptedModel::builder().build()).await;
    let sign_in = |key: String| {
        f.request("POST", "/auth/session")
            .header("origin", f.base.clone())
            .body(json!({"key": key}).to_string())
            .send()
    };
    let refused = sign_in("mk_0123456789ab_nope".into()).await.expect("sent");
    assert_eq!(refused.status(), 401);
    let signed = sign_in(f.key.clone()).await.expect("sent");
    assert_eq!(signed.status(), 204);
    let cookie = signed.headers()["set-cookie"]
        .to_str()
        .expect("text")
        .to_owned();
    for part in ["markov_session=", "HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(cookie.contains(part), "{part} in {cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: {cookie}");
    let value = cookie.split(';').next().expect("a value").to_owned();
    let me = f
        .request("GET", "/me")
        .header("cookie", value.clone())
        .send()
        .await
        .expect("sent");
    assert_eq!(me.status(), 200);
    let me: Value = me.json().await.expect("json");
    assert_eq!(me["principal"], "alice");
    let without_origin = f
        .request("POST", "/sessions")
        .header("cookie", value.clone())
        .send()
        .await
        .expect("sent");
    assert_eq!(
        without_origin.status(),
        403,
        "a browser's POST carries its origin"
    );
    let from_page = f
        .request("POST", "/sessions")
        .header("cookie", value.clone())
        .header("origin", f.base.clone())
        .send()
        .await
        .expect("sent");
    assert_eq!(from_page.status(), 201);
    let tampered = value.replace("markov_session=", "markov_session=x");
    let forged = f
        .request("GET", "/me")
        .header("cookie", tampered)
        .send()
        .await
        .expect("sent");
    assert_eq!(forged.status(), 401);

    // Served behind TLS, the cookie is Secure.
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let builder = Server::builder()
        .agent(paying_agent(&Arc::default()))
        .public_url("https://agents.example");
    let tls = start(builder, store, Arc::default()).await;
    let signed = tls
        .request("POST", "/auth/session")
        .body(json!({"key": tls.key}).to_string())
        .send()
        .await
        .expect("sent");
    assert_eq!(signed.status(), 204);
    assert!(
        signed.headers()["set-cookie"]
            .to_str()
            .expect("text")
            .contains("Secure")
    );
}

impl Fixture {
    /// Signs a browser in with `key`: the `markov_session=...` cookie.
    async fn cookie_for(&self, key: &str) -> String {
        let signed = self
            .request("POST", "/auth/session")
            .header("origin", self.base.clone())
            .body(json!({"key": key}).to_string())
            .send()
            .await
            .expect("sent");
        assert_eq!(signed.status(), 204);
        signed.headers()["set-cookie"]
            .to_str()
            .expect("text")
            .split(';')
            .next()
            .expect("a value")
            .to_owned()
    }

    /// `method path` with the browser's `cookie` (from the page's origin).
    async fn as_browser(&self, cookie: &str, method: &str, path: &str) -> u16 {
        self.request(method, path)
            .header("cookie", cookie)
            .header("origin", self.base.clone())
            .send()
            .await
            .expect("sent")
            .status()
            .as_u16()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_key_or_signing_out_ends_the_browser_sign_in_at_the_next_request() {
    let f = serve(ScriptedModel::builder().build()).await;
    let bob = f.keys["bob"].clone();
    let cookie = f.cookie_for(&bob).await;
    assert_eq!(f.as_browser(&cookie, "GET", "/me").await, 200);
    assert_eq!(f.as_browser(&cookie, "POST", "/sessions").await, 201);
    assert!(f.store.revoke_key(key_id(&bob)).await.expect("revokes"));
    for (method, path) in [("GET", "/me"), ("GET", "/sessions"), ("POST", "/sessions")] {
        assert_eq!(
            f.as_browser(&cookie, method, path).await,
            401,
            "{method} {path} after the key is revoked"
        );
    }

    // Signing out refuses the cookie's value itself, not only this
    // browser's copy of it; another sign-in with the same key goes on.
    let carol = f.keys["carol"].clone();
    let cookie = f.cookie_for(&carol).await;
    let other = f.cookie_for(&carol).await;
    assert_eq!(f.as_browser(&cookie, "GET", "/me").await, 200);
    let out = f
        .request("DELETE", "/auth/session")
        .header("cookie", cookie.clone())
        .header("origin", f.base.clone())
        .send()
        .await
        .expect("sent");
    assert_eq!(out.status(), 204);
    assert_eq!(
        f.as_browser(&cookie, "GET", "/me").await,
        401,
        "the signed-out cookie replayed"
    );
    assert_eq!(f.as_browser(&cookie, "POST", "/sessions").await, 401);
    assert_eq!(f.as_browser(&other, "GET", "/me").await, 200);
}

impl Fixture {
    /// Signs the browser with `cookie` out: the answer's status.
    async fn sign_out(&self, cookie: &str) -> u16 {
        self.request("DELETE", "/auth/session")
            .header("cookie", cookie)
            .header("origin", self.base.clone())
            .send()
            .await
            .expect("sent")
            .status()
            .as_u16()
    }
}

/// The key every worker of these tests signs cookies with.
const SHARED_COOKIE_KEY: [u8; 32] = [5; 32];

/// A worker over `store` that signs cookies with the shared key.
async fn cookie_worker<S>(store: Arc<S>, worker: &str) -> crate::http::Fixture
where
    S: markov_store::Store + markov_store::KeyStore + 'static,
{
    let builder = Server::builder()
        .agent(paying_agent(&Arc::default()))
        .worker(WorkerId::new(worker))
        .cookie_key(SHARED_COOKIE_KEY.to_vec());
    start(builder, store, Arc::default()).await
}

/// Signs in on `a` and out again there: `b`, another worker on the same
/// database, refuses the signed-out cookie at its next request and still
/// accepts another sign-in of the same key. The signed-out cookie and
/// the one still signed in.
async fn sign_out_on_one_worker_and_replay_on_another(
    a: &crate::http::Fixture,
    b: &crate::http::Fixture,
) -> (String, String) {
    let carol = a.keys["carol"].clone();
    let cookie = a.cookie_for(&carol).await;
    let other = a.cookie_for(&carol).await;
    assert_eq!(
        b.as_browser(&cookie, "GET", "/me").await,
        200,
        "both workers accept it"
    );
    assert_eq!(a.sign_out(&cookie).await, 204);
    assert_eq!(
        b.as_browser(&cookie, "GET", "/me").await,
        401,
        "the cookie signed out on another worker"
    );
    assert_eq!(b.as_browser(&cookie, "POST", "/sessions").await, 401);
    assert_eq!(a.as_browser(&cookie, "GET", "/me").await, 401);
    assert_eq!(b.as_browser(&other, "GET", "/me").await, 200);
    (cookie, other)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sign_out_on_one_worker_is_refused_by_another_and_after_a_restart() {
    let dir = crate::fixtures::scratch_dir("sign-out");
    let file = dir.join("sessions.db");
    let open = || Arc::new(SqliteStore::open(&file).expect("a database"));
    let a = cookie_worker(open(), "a").await;
    let b = cookie_worker(open(), "b").await;
    let (cookie, other) = sign_out_on_one_worker_and_replay_on_another(&a, &b).await;
    drop((a, b));

    // A server started again on the same file.
    let restarted = cookie_worker(open(), "restarted").await;
    assert_eq!(
        restarted.as_browser(&cookie, "GET", "/me").await,
        401,
        "the signed-out cookie after a restart"
    );
    assert_eq!(restarted.as_browser(&other, "GET", "/me").await, 200);
    drop(restarted);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_sign_out_on_one_worker_is_refused_by_another_and_after_a_restart() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let connect = async || Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let a = cookie_worker(connect().await, "a").await;
    let b = cookie_worker(connect().await, "b").await;
    let (cookie, other) = sign_out_on_one_worker_and_replay_on_another(&a, &b).await;
    drop((a, b));

    let restarted = cookie_worker(connect().await, "restarted").await;
    assert_eq!(
        restarted.as_browser(&cookie, "GET", "/me").await,
        401,
        "the signed-out cookie after a restart"
    );
    assert_eq!(restarted.as_browser(&other, "GET", "/me").await, 200);
}

/// Bob's and carol's keys, used (so remembered) on both workers, then bob's
/// revoked through `a`'s store: `b` refuses it at its very next request,
/// and still accepts carol's.
async fn revoke_on_one_worker_and_present_to_another(
    a: &crate::http::Fixture,
    b: &crate::http::Fixture,
) {
    let bob = a.keys["bob"].clone();
    let carol = a.keys["carol"].clone();
    for f in [a, b] {
        for key in [&bob, &carol, &bob] {
            let (status, _) = f.send_as(key, "GET", "/me", Value::Null).await;
            assert_eq!(status, 200, "a live key");
        }
    }
    assert!(a.store.revoke_key(key_id(&bob)).await.expect("revokes"));
    let (status, _) = b.send_as(&bob, "GET", "/me", Value::Null).await;
    assert_eq!(status, 401, "the revoked key on the other worker");
    let (status, _) = a.send_as(&bob, "GET", "/me", Value::Null).await;
    assert_eq!(status, 401, "the revoked key on the worker that revoked it");
    for f in [a, b] {
        let (status, _) = f.send_as(&carol, "GET", "/me", Value::Null).await;
        assert_eq!(status, 200, "another key stays live");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_revoked_on_one_worker_is_refused_by_another_at_its_next_request() {
    let dir = crate::fixtures::scratch_dir("revoke");
    let file = dir.join("sessions.db");
    let open = || Arc::new(SqliteStore::open(&file).expect("a database"));
    let a = cookie_worker(open(), "a").await;
    let b = cookie_worker(open(), "b").await;
    revoke_on_one_worker_and_present_to_another(&a, &b).await;
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_key_revoked_on_one_worker_is_refused_by_another_at_its_next_request() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let connect = async || Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let a = cookie_worker(connect().await, "a").await;
    let b = cookie_worker(connect().await, "b").await;
    revoke_on_one_worker_and_present_to_another(&a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_tokens_from_an_external_issuer_are_accepted_only_when_valid() {
    let secret = [9u8; 32];
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let builder = Server::builder()
        .agent(paying_agent(&Arc::default()))
        .jwt(JwtConfig::hs256(&secret, "https://idp.example", "markov").expect("config"));
    let f = start(builder, store, Arc::default()).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_secs();
    let token = |aud: &str, exp: u64| {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &json!({"sub": "dave", "roles": ["approver"], "iss": "https://idp.example", "aud": aud, "exp": exp}),
            &jsonwebtoken::EncodingKey::from_secret(&secret),
        )
        .expect("encodes")
    };
    let (status, me) = f
        .send_as(&token("markov", now + 300), "GET", "/me", Value::Null)
        .await;
    assert_eq!(status, 200);
    assert_eq!(me, json!({"principal": "dave", "roles": ["approver"]}));
    let (status, _) = f
        .send_as(&token("other", now + 300), "GET", "/me", Value::Null)
        .await;
    assert_eq!(status, 401, "another audience");
    let (status, _) = f
        .send_as(&token("markov", now - 3600), "GET", "/me", Value::Null)
        .await;
    assert_eq!(status, 401, "expired");
    let (status, _) = f.send_as(&f.key, "GET", "/me", Value::Null).await;
    assert_eq!(status, 200, "keys still work");
}

// --- limits ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_are_closed_and_the_service_keeps_answering() {
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let mut limits = Limits::default();
    limits.header_timeout = Duration::from_millis(300);
    limits.max_connections = 32;
    let builder = Server::builder()
        .agent(paying_agent(&Arc::default()))
        .limits(limits);
    let f = start(builder, store, Arc::default()).await;
    let address = f.base.trim_start_matches("http://").to_owned();
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut stream = tokio::net::TcpStream::connect(&address)
            .await
            .expect("connects");
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            .await
            .expect("half a request");
        slow.push(stream);
    }
    // The service still answers a whole request.
    let response =
        tokio::time::timeout(Duration::from_secs(20), f.request("GET", "/healthz").send())
            .await
            .expect("answered while 200 clients dawdle")
            .expect("sent");
    assert_eq!(response.status(), 200);
    // And every slow client was closed: it reads the end of the stream
    // (or a reset), never a response.
    let closed = futures::future::join_all(slow.into_iter().map(|mut stream| async move {
        let mut buffer = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut buffer)).await;
        matches!(read, Ok(Ok(_)) | Ok(Err(_)))
            && !String::from_utf8_lossy(&buffer).contains("200 OK")
    }))
    .await;
    assert!(
        closed.iter().all(|c| *c),
        "{} still open",
        closed.iter().filter(|c| !**c).count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_refused_before_it_is_sent() {
    let f = serve(ScriptedModel::builder().build()).await;
    let id = f.create().await;
    let address = f.base.trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&address)
        .await
        .expect("connects");
    let head = format!(
        "POST /sessions/{id}/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n",
        f.key
    );
    stream.write_all(head.as_bytes()).await.expect("the head");
    // Not one byte of the body is sent: the answer comes all the same.
    let mut answer = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut answer))
        .await
        .expect("answered before the body")
        .expect("reads");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "the unread body ends the connection: {answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_past_its_rate_gets_429_with_retry_after_and_others_do_not() {
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let mut limits = Limits::default();
    limits.requests_per_minute = std::num::NonZeroU32::new(3).expect("three");
    let builder = Server::builder()
        .agent(paying_agent(&Arc::default()))
        .limits(limits);
    let f = start(builder, store, Arc::default()).await;
    for _ in 0..3 {
        let (status, _) = f.send_as(&f.key, "GET", "/sessions", Value::Null).await;
        assert_eq!(status, 200);
    }
    let limited = f
        .request("GET", "/sessions")
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("sent");
    assert_eq!(limited.status(), 429);
    let wait: u64 = limited.headers()["retry-after"]
        .to_str()
        .expect("text")
        .parse()
        .expect("seconds");
    assert!((1..=60).contains(&wait), "{wait}");
    let (status, _) = f
        .send_as(&f.keys["bob"], "GET", "/sessions", Value::Null)
        .await;
    assert_eq!(status, 200, "bob has his own rate");
}

// --- cancel and deadlines -------------------------------------------------------------

fn hanging_agent(pays: &Arc<AtomicUsize>, hang: &Counted<Hang>) -> Agent {
    Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(Pay(pays.clone()), ToolMetadata::new(Category::Action))
        .tool_with(hang.clone(), ToolMetadata::new(Category::Other))
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(
            ScriptedModel::builder()
                .tool_calls([("pay", json!({"amount": 2})), ("hang", json!({}))])
                .text("Hello again.")
                .build(),
        )
        .build()
        .expect("the agent builds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_turn_answers_every_call_and_the_session_takes_the_next_message() {
    let pays = Arc::new(AtomicUsize::new(0));
    let hang = Counted::new(Hang);
    let f = serve_agent(hanging_agent(&pays, &hang), pays.clone()).await;
    let id = f.create().await;
    let stream = tokio::spawn({
        let request = f
            .request("POST", &format!("/sessions/{id}/messages"))
            .bearer_auth(&f.key)
            .body(json!({"text": "pay 2 and wait"}).to_string());
        async move {
            request
                .send()
                .await
                .expect("sent")
                .text()
                .await
                .expect("a stream")
        }
    });
    until("the tool hangs", async || hang.calls() == 1).await;
    let (status, body) = f
        .send_as(
            &f.key,
            "POST",
            &format!("/sessions/{id}/cancel"),
            Value::Null,
        )
        .await;
    assert_eq!((status, body), (202, json!({"cancelling": true})));
    let stream = tokio::time::timeout(Duration::from_secs(20), stream)
        .await
        .expect("the stream ends")
        .expect("joins");
    let events = events(&stream);
    let (_, done) = events.last().expect("events");
    assert_eq!(done["yield_reason"], "cancelled", "{stream}");
    assert_eq!(done["stopped"], "cancelled");
    let (_, session) = f.get(&format!("/sessions/{id}")).await;
    let results = results(&session);
    assert_eq!(results.len(), 2, "one result per call: {results:?}");
    assert!(results[0].contains("paid 2"), "{results:?}");
    assert!(results[1].contains(CANCELLED_TOOL_CALL), "{results:?}");
    assert_eq!(session["running"], false);
    let (status, _) = f
        .send_as(
            &f.key,
            "POST",
            &format!("/sessions/{id}/cancel"),
            Value::Null,
        )
        .await;
    assert_eq!(status, 409, "nothing left to cancel");
    let next = f.say(&id, "hello?").await;
    assert_eq!(
        next.last().map(|(_, d)| d["response"].clone()),
        Some(json!("Hello again."))
    );
    assert_eq!(pays.load(Ordering::SeqCst), 1, "paid once");
    assert_eq!(hang.calls(), 1, "the cancelled call never ran again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_past_its_deadline_is_cancelled_and_says_so() {
    let pays = Arc::new(AtomicUsize::new(0));
    let hang = Counted::new(Hang);
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let mut limits = Limits::default();
    limits.run_deadline = Duration::from_millis(300);
    let builder = Server::builder()
        .agent(hanging_agent(&pays, &hang))
        .limits(limits);
    let f = start(builder, store, pays.clone()).await;
    let id = f.create().await;
    let events = tokio::time::timeout(Duration::from_secs(20), f.say(&id, "pay 2 and wait"))
        .await
        .expect("the deadline ends the run");
    let (name, done) = events.last().expect("events");
    assert_eq!(name, "done");
    assert_eq!(done["stopped"], "deadline", "{events:?}");
    assert_eq!(done["yield_reason"], "cancelled");
}

// --- reconnecting -------------------------------------------------------------------

/// The id of each event of an SSE text, in order.
fn ids(stream: &str) -> Vec<String> {
    stream
        .lines()
        .filter_map(|line| line.strip_prefix("id:"))
        .map(|id| id.trim().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_lost_its_stream_gets_what_it_missed_then_the_rest_live() {
    let model = Slow(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 1}))
            .text("Paid 1.")
            .build(),
        Duration::from_millis(400),
    );
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(Pay(pays.clone()), ToolMetadata::new(Category::Action))
        .model(model)
        .build()
        .expect("the agent builds");
    let f = serve_agent(agent, pays).await;
    let id = f.create().await;
    let mut response = f
        .request("POST", &format!("/sessions/{id}/messages"))
        .bearer_auth(&f.key)
        .body(json!({"text": "pay 1"}).to_string())
        .send()
        .await
        .expect("sent");
    // Read the first event, then lose the connection.
    let mut first = String::new();
    while !first.contains("\n\n") {
        let chunk = response
            .chunk()
            .await
            .expect("reads")
            .expect("a first event");
        first.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(response);
    let seen = ids(&first);
    assert_eq!(seen.len(), 1, "{first}");
    let rest = f
        .request("GET", &format!("/sessions/{id}/events"))
        .bearer_auth(&f.key)
        .header("last-event-id", seen[0].clone())
        .send()
        .await
        .expect("sent");
    assert_eq!(rest.status(), 200);
    let rest = tokio::time::timeout(Duration::from_secs(20), rest.text())
        .await
        .expect("the run ends")
        .expect("a stream");
    let missed = ids(&rest);
    assert!(!missed.contains(&seen[0]), "nothing twice: {rest}");
    assert!(rest.contains("event: done"), "{rest}");
    assert!(rest.contains("Paid 1."), "{rest}");
    // Once the run is over, a client that asks for nothing in particular
    // learns that nothing runs.
    let idle = f
        .request("GET", &format!("/sessions/{id}/events"))
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("sent");
    assert_eq!(idle.status(), 204, "no run in progress and no replay asked");
    // From the start (the event id before the run's first), every event
    // once, in order.
    let run = seen[0].split_once('-').expect("<run>-<seq>").0;
    let all = f
        .request("GET", &format!("/sessions/{id}/events"))
        .bearer_auth(&f.key)
        .header("last-event-id", format!("{run}-0"))
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("a stream");
    let mut expected = seen.clone();
    expected.extend(missed);
    assert_eq!(ids(&all), expected);
}

/// A message as stored, without what the server adds for pages (`html`).
fn stored(message: &Value) -> Value {
    let mut message = message.clone();
    if let Some(object) = message.as_object_mut() {
        object.remove("html");
    }
    if let Some(items) = message["items"].as_array_mut() {
        for item in items.iter_mut().filter_map(Value::as_object_mut) {
            item.remove("html");
        }
    }
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_opens_a_running_session_joins_the_run_where_its_history_ends() {
    let model = Slow(
        ScriptedModel::builder()
            .text("Hello.")
            .tool_call("pay", json!({"amount": 1}))
            .text("**Paid** 1.")
            .build(),
        Duration::from_millis(400),
    );
    let pays = Arc::new(AtomicUsize::new(0));
    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(Pay(pays.clone()), ToolMetadata::new(Category::Action))
        .model(model)
        .build()
        .expect("the agent builds");
    let f = serve_agent(agent, pays).await;
    let id = f.create().await;
    f.say(&id, "hello").await;
    let (_, before) = f.get(&format!("/sessions/{id}")).await;
    let earlier = before["history"].as_array().expect("a history").len();
    assert!(earlier > 0);
    assert_eq!(before["running"], false);
    assert_eq!(before["live_run"], Value::Null, "no run, nothing to join");
    // A second turn, its first step stored, then the page opens the session.
    let mut response = f
        .request("POST", &format!("/sessions/{id}/messages"))
        .bearer_auth(&f.key)
        .body(json!({"text": "pay 1"}).to_string())
        .send()
        .await
        .expect("sent");
    let mut first = String::new();
    while !first.contains("event: step") {
        let chunk = response
            .chunk()
            .await
            .expect("reads")
            .expect("the first step");
        first.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(response);
    let (status, opened) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(opened["running"], true, "{opened}");
    let live = &opened["live_run"];
    assert_eq!(live["history_len"], earlier, "{opened}");
    assert_eq!(live["message"], "pay 1", "{opened}");
    let from = live["last_event_id"].as_str().expect("an event id");
    assert!(from.ends_with("-0"), "from the run's first event: {from}");
    let rest = f
        .request("GET", &format!("/sessions/{id}/events"))
        .bearer_auth(&f.key)
        .header("last-event-id", from)
        .send()
        .await
        .expect("sent");
    let rest = tokio::time::timeout(Duration::from_secs(20), rest.text())
        .await
        .expect("the run ends")
        .expect("a stream");
    let events = events(&rest);
    assert_eq!(
        events.last().map(|(n, _)| n.as_str()),
        Some("done"),
        "{rest}"
    );
    // The history up to `history_len`, then the run's steps: the session
    // as stored, each message once.
    let mut shown: Vec<Value> = opened["history"].as_array().expect("a history")[..earlier]
        .iter()
        .map(stored)
        .collect();
    for (name, data) in &events {
        if name == "step" {
            shown.extend(
                data["messages"]
                    .as_array()
                    .expect("messages")
                    .iter()
                    .map(stored),
            );
        }
    }
    let (_, after) = f.get(&format!("/sessions/{id}")).await;
    let history: Vec<Value> = after["history"]
        .as_array()
        .expect("a history")
        .iter()
        .map(stored)
        .collect();
    assert_eq!(shown, history);
    // The answer's markdown arrives rendered, in the stream and the history.
    let answer = events
        .iter()
        .filter(|(n, _)| n == "step")
        .flat_map(|(_, d)| d["messages"].as_array().cloned().unwrap_or_default())
        .find(|m| m["role"] == "assistant" && m["items"][0]["type"] == "text")
        .expect("the answer");
    assert_eq!(
        answer["items"][0]["html"],
        "<p><strong>Paid</strong> 1.</p>\n"
    );
    let last = after["history"]
        .as_array()
        .and_then(|h| h.last())
        .expect("a message");
    assert_eq!(
        last["items"][0]["html"],
        "<p><strong>Paid</strong> 1.</p>\n"
    );
}

// --- shutdown and restart -----------------------------------------------------------------

/// Works for a while, counting its calls.
#[derive(Clone, Default)]
struct Work(Arc<AtomicUsize>);

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct NoArgs {}

#[async_trait]
impl Tool for Work {
    const NAME: &'static str = "work";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Work for a while".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        self.0.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok("worked".into())
    }
}

fn working_agent(pays: &Arc<AtomicUsize>, work: &Work, model: ScriptedModel) -> Agent {
    Agent::builder("payments")
        .instructions("You work, then pay.")
        .tool_with(Pay(pays.clone()), ToolMetadata::new(Category::Action))
        .tool_with(work.clone(), ToolMetadata::new(Category::Other))
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(model)
        .build()
        .expect("the agent builds")
}

/// Starts a turn that works, shuts the server down while the tool works,
/// and checks the step was stored and the stream said so; returns the
/// session.
async fn shut_down_mid_turn(f: &mut Fixture, work: &Work) -> String {
    let id = f.create().await;
    let stream = tokio::spawn({
        let request = f
            .request("POST", &format!("/sessions/{id}/messages"))
            .bearer_auth(&f.key)
            .body(json!({"text": "work, then pay 3"}).to_string());
        async move {
            request
                .send()
                .await
                .expect("sent")
                .text()
                .await
                .expect("a stream")
        }
    });
    until("the tool works", async || {
        work.0.load(Ordering::SeqCst) == 1
    })
    .await;
    f.shutdown.cancel();
    let stopped = f.stopped.take().expect("running");
    tokio::time::timeout(Duration::from_secs(20), stopped)
        .await
        .expect("the server stops")
        .expect("joins")
        .expect("stops cleanly");
    let stream = tokio::time::timeout(Duration::from_secs(20), stream)
        .await
        .expect("the stream ends")
        .expect("joins");
    let events = events(&stream);
    assert_eq!(names(&events), ["step", "interrupted"], "{stream}");
    assert_eq!(
        events[0].1["yield_reason"], "tool_use",
        "the working step was stored"
    );
    id
}

async fn until_answered(f: &Fixture, id: &str) -> Value {
    let mut session = Value::Null;
    until("the interrupted turn is finished", async || {
        session = f.get(&format!("/sessions/{id}")).await.1;
        session["history"].to_string().contains("Paid 3.") && session["running"] == false
    })
    .await;
    session
}

fn continuation() -> ScriptedModel {
    ScriptedModel::builder()
        .tool_call("pay", json!({"amount": 3}))
        .text("Paid 3.")
        .build()
        .fresh_call_ids()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_stores_the_running_step_and_a_restarted_server_continues_the_turn() {
    let dir = crate::fixtures::scratch_dir("shutdown");
    let pays = Arc::new(AtomicUsize::new(0));
    let work = Work::default();
    let first_model = ScriptedModel::builder()
        .tool_call("work", json!({}))
        .build();
    let store = Arc::new(SqliteStore::open(dir.join("sessions.db")).expect("a database"));
    let builder = Server::builder().agent(working_agent(&pays, &work, first_model));
    let mut f = start(builder, store.clone(), pays.clone()).await;
    let id = shut_down_mid_turn(&mut f, &work).await;
    let info = store
        .info(&SessionId::new(id.clone()))
        .await
        .expect("stored");
    assert!(info.running, "the turn is recorded as in progress");

    // The server starts again on the same file: it finishes the turn by
    // itself, without a message.
    let store = Arc::new(SqliteStore::open(dir.join("sessions.db")).expect("a database"));
    let builder = Server::builder().agent(working_agent(&pays, &work, continuation()));
    let mut g = start(builder, store, pays.clone()).await;
    g.key = f.key.clone();
    let session = until_answered(&g, &id).await;
    assert_eq!(
        work.0.load(Ordering::SeqCst),
        1,
        "the stored step is not run again"
    );
    assert_eq!(pays.load(Ordering::SeqCst), 1, "paid once");
    assert_eq!(results(&session).len(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_another_worker_continues_the_turn_a_stopped_server_left() {
    let Some(server) = TempPostgres::for_test() else {
        return;
    };
    let url = server.new_database().expect("a database");
    let pays = Arc::new(AtomicUsize::new(0));
    let work = Work::default();
    let first_model = ScriptedModel::builder()
        .tool_call("work", json!({}))
        .build();
    let store = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let builder = Server::builder()
        .agent(working_agent(&pays, &work, first_model))
        .worker(WorkerId::new("first"));
    let mut f = start(builder, store, pays.clone()).await;
    let id = shut_down_mid_turn(&mut f, &work).await;

    let store = Arc::new(PostgresStore::connect(&url).await.expect("connects"));
    let builder = Server::builder()
        .agent(working_agent(&pays, &work, continuation()))
        .worker(WorkerId::new("second"));
    let mut g = start(builder, store, pays.clone()).await;
    g.key = f.key.clone();
    until_answered(&g, &id).await;
    assert_eq!(work.0.load(Ordering::SeqCst), 1);
    assert_eq!(pays.load(Ordering::SeqCst), 1);
}

/// Answers with how many messages it was sent: what each worker's machine
/// held shows in the replies.
#[derive(Debug)]
struct Counter;

#[async_trait]
impl Model for Counter {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        Ok(ModelResponse::new(
            vec![Item::text(format!("heard {}", request.messages().len()))],
            StopReason::EndTurn,
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_take_turns_on_a_session_and_each_sees_the_others_turns() {
    let dir = crate::fixtures::scratch_dir("turns");
    let file = dir.join("sessions.db");
    let agent = || {
        Agent::builder("counter")
            .instructions("Count.")
            .model(Counter)
            .build()
            .expect("the agent builds")
    };
    // Two servers on one database, as behind a load balancer; each keeps
    // the sessions it served in memory between messages.
    let serve_on = |worker: &str| {
        let store = Arc::new(SqliteStore::open(&file).expect("a database"));
        start(
            Server::builder()
                .agent(agent())
                .worker(WorkerId::new(worker)),
            store,
            Arc::default(),
        )
    };
    let a = serve_on("a").await;
    let mut b = serve_on("b").await;
    b.key = a.key.clone();
    let id = a.create().await;
    let reply = |events: Vec<(String, Value)>| events.last().map(|(_, d)| d["response"].clone());
    assert_eq!(reply(a.say(&id, "one").await), Some(json!("heard 1")));
    assert_eq!(reply(a.say(&id, "two").await), Some(json!("heard 3")));
    assert_eq!(reply(b.say(&id, "three").await), Some(json!("heard 5")));
    // Back on the first server, whose machine of the session is stale.
    assert_eq!(reply(a.say(&id, "four").await), Some(json!("heard 7")));
    let (status, session) = a
        .send_as(&a.key, "GET", &format!("/sessions/{id}"), Value::Null)
        .await;
    assert_eq!(status, 200);
    let texts: Vec<String> = session["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter_map(|m| m["items"].as_array())
        .flatten()
        .filter_map(|i| i["text"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        texts,
        [
            "one", "heard 1", "two", "heard 3", "three", "heard 5", "four", "heard 7"
        ]
    );
    a.shutdown.cancel();
    b.shutdown.cancel();
    let _ = std::fs::remove_dir_all(&dir);
}

// --- several agents, the document, the metrics -----------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_server_serves_several_agents_each_with_its_own_sessions() {
    let named = |name: &str, reply: &str| {
        Agent::builder(name)
            .instructions("Say who you are.")
            .model(ScriptedModel::builder().text(reply).build())
            .build()
            .expect("the agent builds")
    };
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let builder = Server::builder()
        .agent(named("triage", "I am triage."))
        .agent(named("billing", "I am billing."))
        .model_description("billing", "scripted (billing's rehearsal)");
    let f = start(builder, store, Arc::default()).await;
    let (status, created) = f
        .send_as(&f.key, "POST", "/agents/billing/sessions", Value::Null)
        .await;
    assert_eq!(status, 201);
    assert_eq!(created["agent"], "billing");
    let billing = created["id"].as_str().expect("an id").to_owned();
    let said = f.say(&billing, "who are you?").await;
    assert_eq!(
        said.last().map(|(_, d)| d["response"].clone()),
        Some(json!("I am billing."))
    );
    let triage = f.create().await;
    let said = f.say(&triage, "who are you?").await;
    assert_eq!(
        said.last().map(|(_, d)| d["response"].clone()),
        Some(json!("I am triage."))
    );
    let (_, listed) = f
        .send_as(&f.key, "GET", "/agents/billing/sessions", Value::Null)
        .await;
    let listed: Vec<&str> = listed
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|s| s["id"].as_str())
        .collect();
    assert_eq!(listed, [billing.as_str()]);
    let (_, agents) = f.send_as(&f.key, "GET", "/agents", Value::Null).await;
    assert_eq!(
        agents,
        json!([
            {"name": "billing", "default": false, "model": "scripted (billing's rehearsal)"},
            {"name": "triage", "default": true, "model": null},
        ]),
        "each agent with the model it answers with, where the server names it"
    );
    let (status, _) = f
        .send_as(&f.key, "POST", "/agents/nobody/sessions", Value::Null)
        .await;
    assert_eq!(status, 404);
    let twice = Server::builder()
        .agent(named("triage", "one"))
        .agent(named("triage", "two"))
        .store(Arc::new(SqliteStore::in_memory().expect("a database")))
        .build();
    assert!(matches!(twice, Err(BuildError::DuplicateAgent(name)) if name == "triage"));
    let unserved = Server::builder()
        .agent(named("triage", "one"))
        .model_description("billing", "a model")
        .store(Arc::new(SqliteStore::in_memory().expect("a database")))
        .build();
    assert!(matches!(unserved, Err(BuildError::UnknownAgent(name)) if name == "billing"));
}

#[test]
fn a_lease_outside_its_bounds_is_refused_and_one_inside_them_builds() {
    let with_lease = |lease: Duration| {
        Server::builder()
            .agent(
                Agent::builder("a")
                    .instructions("Answer.")
                    .model(ScriptedModel::builder().build())
                    .build()
                    .expect("an agent"),
            )
            .store(Arc::new(SqliteStore::in_memory().expect("a database")))
            .lease(lease)
            .build()
    };
    for refused in [
        Duration::ZERO,
        ServerBuilder::MIN_LEASE - Duration::from_millis(1),
        ServerBuilder::MAX_LEASE + Duration::from_millis(1),
        Duration::MAX,
    ] {
        let built = with_lease(refused);
        assert!(
            matches!(built, Err(BuildError::Lease(lease)) if lease == refused),
            "{refused:?}: {built:?}"
        );
    }
    for accepted in [
        ServerBuilder::MIN_LEASE,
        Duration::from_secs(5),
        ServerBuilder::MAX_LEASE,
    ] {
        assert!(with_lease(accepted).is_ok(), "{accepted:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_lists_every_route_and_every_listed_route_answers() {
    let f = serve_agent(paying_agent(&Arc::default()), Arc::default()).await;
    let id = f.create().await;
    let (status, document) = f.send_as(&f.key, "GET", "/openapi.json", Value::Null).await;
    assert_eq!(status, 200);
    let mut documented = BTreeSet::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("methods").keys() {
            documented.insert((method.to_uppercase(), path.clone()));
        }
    }
    let mut routes: BTreeSet<(String, String)> = PROTECTED
        .iter()
        .map(|(m, p)| {
            let p = p
                .replace(
                    "/sessions/x/approvals/y",
                    "/sessions/{id}/approvals/{request}",
                )
                .replace("/sessions/x", "/sessions/{id}")
                .replace("/steps/0", "/steps/{n}")
                .replace("/sub_agents/0", "/sub_agents/{at}")
                .replace("/agents/payments", "/agents/{agent}");
            ((*m).to_owned(), p)
        })
        .collect();
    routes.insert(("GET".into(), "/healthz".into()));
    routes.insert(("POST".into(), "/auth/session".into()));
    routes.insert(("DELETE".into(), "/auth/session".into()));
    assert_eq!(documented, routes, "the document and the routes differ");
    for (method, path) in &documented {
        let concrete = path
            .replace("{id}", &id)
            .replace("{agent}", "payments")
            .replace("{request}", "nope")
            .replace("{n}", "0")
            .replace("{at}", "0");
        let response = f
            .request(method, &concrete)
            .bearer_auth(&f.key)
            .header("origin", f.base.clone())
            .body(
                json!({"text": "hi", "name": "c", "decision": "approve", "key": f.key}).to_string(),
            )
            .send()
            .await
            .expect("sent");
        let status = response.status().as_u16();
        let body = response.text().await.unwrap_or_default();
        assert_ne!(status, 405, "{method} {path} is not routed: {body}");
        assert!(
            !body.contains("no route for this path"),
            "{method} {path} is not routed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_runs_steps_and_tool_calls_for_prometheus() {
    let pays = Arc::new(AtomicUsize::new(0));
    let hang = Counted::new(Hang);
    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(Pay(pays.clone()), ToolMetadata::new(Category::Action))
        .tool_with(hang, ToolMetadata::new(Category::Other))
        .model(
            ScriptedModel::builder()
                .tool_call("pay", json!({"amount": 4}))
                .text("Paid 4.")
                .build(),
        )
        .build()
        .expect("the agent builds");
    let f = serve_agent(agent, pays).await;
    let id = f.create().await;
    f.say(&id, "pay 4").await;
    let anonymous = f.request("GET", "/metrics").send().await.expect("sent");
    assert_eq!(anonymous.status(), 401);
    let text = f
        .request("GET", "/metrics")
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("text");
    for line in [
        "markov_http_requests_total{route=\"/sessions\",method=\"POST\",status=\"201\"} 1",
        "markov_http_requests_total{route=\"/sessions/{id}/messages\",method=\"POST\",status=\"200\"} 1",
        "markov_steps_total 2",
        "markov_tool_calls_total 1",
        "markov_runs_total{outcome=\"done\"} 1",
        "markov_runs_in_progress 0",
    ] {
        assert!(text.contains(line), "{line:?} in:\n{text}");
    }
    assert!(
        text.contains("markov_http_request_duration_seconds_bucket"),
        "{text}"
    );
    assert!(
        text.contains("markov_run_duration_seconds_count 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_session_s_first_message_finds_it_in_memory_not_read_back() {
    let f = serve_agent(paying_agent(&Arc::default()), Arc::default()).await;
    let id = f.create().await;
    f.say(&id, "hello").await;
    let text = f
        .request("GET", "/metrics")
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("text");
    assert!(
        text.contains("markov_sessions_opened_total{source=\"memory\"} 1\n"),
        "{text}"
    );
    assert!(
        !text.contains("markov_sessions_opened_total{source=\"store\"}"),
        "{text}"
    );
}

#[test]
fn an_allowed_host_that_is_not_one_is_a_build_error_not_a_panic() {
    let with_host = |host: &str| {
        Server::builder()
            .agent(
                Agent::builder("a")
                    .instructions("Answer.")
                    .model(ScriptedModel::builder().build())
                    .build()
                    .expect("an agent"),
            )
            .store(Arc::new(SqliteStore::in_memory().expect("a database")))
            .allowed_host(host)
            .build()
    };
    for refused in ["[::1]é", "[::1]:é", "[::1]x", "a/b", "evil.com:x"] {
        let built = with_host(refused);
        assert!(
            matches!(&built, Err(BuildError::Address(reason)) if reason.contains("allowed host")),
            "{refused:?}: {built:?}"
        );
    }
    for accepted in ["[::1]", "[::1]:8080", "agents.example"] {
        assert!(with_host(accepted).is_ok(), "{accepted:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_says_which_routes_need_a_credential_and_describes_every_answer() {
    let f = serve_agent(paying_agent(&Arc::default()), Arc::default()).await;
    let id = f.create().await;
    let (_, document) = f.send_as(&f.key, "GET", "/openapi.json", Value::Null).await;
    let global = &document["security"];
    assert_eq!(global, &json!([{"bearer": []}, {"cookie": []}]));
    let schemes = &document["components"]["securitySchemes"];
    assert_eq!(schemes["bearer"]["scheme"], "bearer");
    assert_eq!(schemes["cookie"]["in"], "cookie");
    assert_eq!(schemes["cookie"]["name"], "markov_session");
    let mut public = BTreeSet::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("methods") {
            let responses = operation["responses"].as_object().expect("responses");
            for (status, response) in responses {
                let content = response["content"].as_object();
                if status == "204" {
                    assert!(content.is_none(), "{method} {path} {status} has no body");
                    continue;
                }
                let content = content
                    .unwrap_or_else(|| panic!("{method} {path} {status} has no body described"));
                for (media, body) in content {
                    assert!(
                        body["schema"].is_object(),
                        "{method} {path} {status} {media} has no schema"
                    );
                    if status.starts_with('4') {
                        assert_eq!(
                            body["schema"]["$ref"], "#/components/schemas/ErrorBody",
                            "{method} {path} {status}"
                        );
                    }
                }
            }
            let needs_credential = operation.get("security") != Some(&json!([]));
            if needs_credential {
                for status in ["401", "429"] {
                    assert!(
                        responses.contains_key(status),
                        "{method} {path} documents {status}"
                    );
                }
            } else {
                public.insert(format!("{} {path}", method.to_uppercase()));
            }
            let concrete = path
                .replace("{id}", &id)
                .replace("{agent}", "payments")
                .replace("{request}", "nope");
            // Without a credential (a sign-in's body is the key it signs
            // in with, not a credential of the request).
            let anonymous = f
                .request(&method.to_uppercase(), &concrete)
                .header("origin", f.base.clone())
                .body(json!({"key": f.key, "text": "hi"}).to_string())
                .send()
                .await
                .expect("sent");
            let status = anonymous.status().as_u16();
            if needs_credential {
                assert_eq!(status, 401, "{method} {path} without a credential");
            } else {
                assert!(
                    (200..300).contains(&status),
                    "{method} {path} needs no credential: {status}"
                );
            }
        }
    }
    assert_eq!(
        public,
        BTreeSet::from([
            "DELETE /auth/session".to_owned(),
            "GET /healthz".to_owned(),
            "POST /auth/session".to_owned(),
        ])
    );
    // Runs stream their events; each is described, by name.
    let names: BTreeSet<String> = document["components"]["schemas"]["RunEvent"]["oneOf"]
        .as_array()
        .expect("variants")
        .iter()
        .map(|v| {
            v["properties"]["event"]["enum"][0]
                .as_str()
                .expect("a name")
                .to_owned()
        })
        .collect();
    assert_eq!(
        names,
        [
            "decided",
            "delta",
            "done",
            "error",
            "handoff",
            "interrupted",
            "step",
            "thinking"
        ]
        .map(str::to_owned)
        .into()
    );
    for path in [
        "/sessions/{id}/messages",
        "/sessions/{id}/approvals/{request}",
    ] {
        assert_eq!(
            document["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
                ["$ref"],
            "#/components/schemas/RunEvent",
            "{path}"
        );
    }
}
