//! The studio's routes that need the application's help: a step's request
//! as the wire body the application's encoder writes (redacted), and a
//! session as the case file its exporter writes; who may read each, and
//! what a server without them answers.

use std::sync::Arc;

use markov_core::model::ModelError;
use markov_server::{ApiError, Server};
use markov_store::{SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use serde_json::{Value, json};

use crate::http::{Fixture, start};
use crate::studio::payments;

/// A GET as `key`: status, content type, content disposition and body.
async fn get(f: &Fixture, key: &str, path: &str) -> (u16, String, String, String) {
    let response = f
        .client
        .get(format!("{}{path}", f.base))
        .bearer_auth(key)
        .send()
        .await
        .expect("sent");
    let header = |name| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (kind, disposition) = (header("content-type"), header("content-disposition"));
    let status = response.status().as_u16();
    (
        status,
        kind,
        disposition,
        response.text().await.expect("a body"),
    )
}

/// The payments agent on `model`, served with an encoder that writes a
/// vendor-like body carrying a key field (refusing requests of more than
/// two messages), and an exporter that says what it was asked.
pub(crate) async fn hooked(model: ScriptedModel) -> Fixture {
    let model = Arc::new(model);
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    start(
        Server::builder()
            .agent(payments("You pay bills.", model))
            .wire_body("payments", |request| {
                if request.messages().len() > 2 {
                    return Err(ModelError::InvalidRequest(
                        "too many for this vendor".into(),
                    ));
                }
                Ok(json!({
                    "model": "vendor-model",
                    "system": request.system(),
                    "messages": request.messages().len(),
                    "api_key": "sk-secret-in-a-body",
                })
                .to_string()
                .into_bytes())
            })
            .case_export(|_store, id, steps| {
                Box::pin(async move {
                    match steps {
                        Some(steps) if steps.start > 5 => {
                            Err(ApiError::NotFound(format!("no steps {steps:?}")))
                        }
                        steps => Ok(format!("# case of {id}, steps {steps:?}\n")),
                    }
                })
            })
            .worker(WorkerId::new("test")),
        store,
        Arc::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steps_wire_body_is_the_encoders_with_keys_redacted_for_its_readers_only() {
    let f = hooked(ScriptedModel::builder().text("Hello.").text("Bye.").build()).await;
    let id = f.create().await;
    f.say(&id, "hi").await;
    f.say(&id, "bye").await;
    let (status, _, _, page) = get(&f, &f.key, &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 200, "{page}");
    let page: Value = serde_json::from_str(&page).expect("json");
    assert_eq!(page["wire"], true, "{page}");
    assert_eq!(page["exportable"], true, "{page}");

    let (status, _, _, wire) = get(&f, &f.key, &format!("/sessions/{id}/steps/0/wire")).await;
    assert_eq!(status, 200, "{wire}");
    assert!(!wire.contains("sk-secret-in-a-body"), "{wire}");
    let wire: Value = serde_json::from_str(&wire).expect("json");
    assert_eq!(
        wire["body"],
        json!({"model": "vendor-model", "system": "You pay bills.", "messages": 1,
               "api_key": "<redacted>"})
    );
    // What the provider cannot carry is said, not shown as a body.
    let (status, _, _, refused) = get(&f, &f.key, &format!("/sessions/{id}/steps/1/wire")).await;
    assert_eq!(status, 409, "{refused}");
    assert!(refused.contains("too many for this vendor"), "{refused}");
    let (status, _, _, _) = get(&f, &f.keys["bob"], &format!("/sessions/{id}/steps/0/wire")).await;
    assert_eq!(status, 404, "bob may not read alice's steps");
    let (status, _, _, _) = get(&f, &f.key, &format!("/sessions/{id}/steps/9/wire")).await;
    assert_eq!(status, 404, "no step 9");

    // A server without an encoder says so.
    let (g, id, _) = crate::studio::three_turns(crate::studio::script()).await;
    let (_, _, _, page) = get(&g, &g.key, &format!("/sessions/{id}/steps")).await;
    let page: Value = serde_json::from_str(&page).expect("json");
    assert_eq!(page["wire"], false, "{page}");
    assert_eq!(page["exportable"], false, "{page}");
    let (status, _, _, body) = get(&g, &g.key, &format!("/sessions/{id}/steps/0/wire")).await;
    assert_eq!(status, 409, "{body}");
    let (status, _, _, body) = get(&g, &g.key, &format!("/sessions/{id}/case")).await;
    assert_eq!(status, 409, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_or_a_range_of_its_steps_is_the_exporters_case_file() {
    let f = hooked(ScriptedModel::builder().text("Hello.").text("Bye.").build()).await;
    let id = f.create().await;
    f.say(&id, "hi").await;
    let (status, kind, disposition, body) = get(&f, &f.key, &format!("/sessions/{id}/case")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(kind, "application/toml");
    assert_eq!(disposition, format!("attachment; filename=\"{id}.toml\""));
    assert_eq!(body, format!("# case of {id}, steps None\n"));
    let (status, _, disposition, body) =
        get(&f, &f.key, &format!("/sessions/{id}/case?from=1&to=3")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, format!("# case of {id}, steps Some(1..3)\n"));
    assert_eq!(
        disposition,
        format!("attachment; filename=\"{id}-steps-1-3.toml\"")
    );
    let (_, _, _, body) = get(&f, &f.key, &format!("/sessions/{id}/case?from=2")).await;
    assert_eq!(
        body,
        format!("# case of {id}, steps Some(2..18446744073709551615)\n"),
        "from a step to the end"
    );
    // The exporter's error is answered as it is.
    let (status, _, _, body) = get(&f, &f.key, &format!("/sessions/{id}/case?from=7&to=8")).await;
    assert_eq!(status, 404, "{body}");
    for bad in ["from=3&to=3", "from=x", "to=-1"] {
        let (status, _, _, body) = get(&f, &f.key, &format!("/sessions/{id}/case?{bad}")).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, _, _, _) = get(&f, &f.keys["bob"], &format!("/sessions/{id}/case")).await;
    assert_eq!(status, 404, "bob may not export alice's session");
    let anonymous = f
        .client
        .get(format!("{}/sessions/{id}/case", f.base))
        .send()
        .await
        .expect("sent");
    assert_eq!(anonymous.status(), 401);
}
