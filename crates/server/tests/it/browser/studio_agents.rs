//! Several agents in the browser: a sub-agent's steps open under the call
//! that ran them (collapsed at first, nested sub-agents nested), with
//! their request; a team conversation's timeline, every agent's steps
//! labelled and the handoffs marked, says why it offers no fork; and an
//! approval a sub-agent asks for waits in the caller's chat and is
//! decided there.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use markov_server::Server;
use markov_store::SqliteStore;
use markov_testkit::ScriptedModel;
use serde_json::json;

use super::Browser;
use crate::http::{serve_agent, start};
use crate::studio_agents::{Nested, cashier_assistant, cashier_models};

const STEP: &str = "#timeline > li[data-step='0']";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agents_steps_open_under_their_call_nested_with_their_request() {
    let models = Nested::new();
    let f = serve_agent(models.agent(), Arc::default()).await;
    let id = f.create().await;
    f.say(&id, "Where is the atlas?").await;
    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open_steps(&f.base, &id, &f.key).await;
    browser
        .wait(
            "the steps",
            "document.querySelectorAll('#timeline > li').length === 2",
        )
        .await;
    // The line says the step ran sub-agents: the desk's two, the clerk's two.
    browser
        .wait(
            "the sub-agent count",
            &format!(
                "document.querySelector(\"{STEP} .subs\")?.textContent === '4 sub-agent steps'"
            ),
        )
        .await;
    browser.click(&format!("{STEP} > details > summary")).await;
    // Under the call to the desk, collapsed.
    let run = format!("{STEP} .call[data-call] + details.sub-agent");
    browser
        .wait(
            "the desk's run",
            &format!("document.querySelector(\"{run}\")"),
        )
        .await;
    assert_eq!(
        browser
            .run(&format!("return document.querySelector(\"{run}\").open"))
            .await,
        json!(false),
        "collapsed at first"
    );
    let head = browser.text(&format!("{run} > summary")).await;
    assert!(head.contains("desk"), "{head}");
    assert!(head.contains("2 steps"), "{head}");
    assert!(head.contains("counted in this step's usage"), "{head}");
    browser.click(&format!("{run} > summary")).await;
    assert_eq!(browser.count(&format!("{run} > details.sub-step")).await, 2);
    // The desk's first step: its call to the clerk, the clerk's run nested
    // under it.
    let desk_step = format!("{run} > details.sub-step[data-at='2']");
    browser.click(&format!("{desk_step} > summary")).await;
    let clerk = format!("{desk_step} > .body details.sub-agent");
    browser
        .wait(
            "the clerk's run",
            &format!("document.querySelector(\"{clerk}\")"),
        )
        .await;
    browser
        .wait(
            "the clerk's run",
            &format!("document.querySelector(\"{clerk}\")"),
        )
        .await;
    browser.click(&format!("{clerk} > summary")).await;
    let clerk_step = format!("{clerk} > details.sub-step[data-at='0']");
    browser.click(&format!("{clerk_step} > summary")).await;
    let body = browser
        .wait(
            "the clerk's step",
            &format!("document.querySelector(\"{clerk_step} > .body\")?.innerText"),
        )
        .await;
    let body = body.as_str().unwrap_or_default();
    assert!(body.contains("lookup"), "{body}");
    assert!(
        body.contains("INPUT FROM THE CALLING AGENT\nwhere is the atlas?"),
        "the caller's request, not the user's words: {body}"
    );
    assert!(body.contains("the atlas is on shelf 4"), "{body}");
    assert!(body.contains("Allowed: the tool ran"), "{body}");
    // Its request, as the clerk's model received it.
    browser
        .click(&format!("{clerk_step} > .body .show-request"))
        .await;
    let request = browser
        .wait(
            "the clerk's request",
            &format!("document.querySelector(\"{clerk_step} > .body .request\")?.innerText"),
        )
        .await;
    let request = request.as_str().unwrap_or_default();
    assert!(
        request.contains("You are the clerk: you look things up."),
        "{request}"
    );
    assert!(request.contains("1 message"), "{request}");
    browser
        .run(&format!(
            "document.querySelector(\"{STEP} > details > summary\").scrollIntoView({{block: 'start'}})"
        ))
        .await;
    browser.screenshot("studio-sub-agents.png").await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_conversations_timeline_labels_each_agents_steps_and_marks_the_handoffs() {
    let refunds = Arc::new(AtomicUsize::new(0));
    let team = crate::team::team(
        ScriptedModel::builder()
            .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
            .text("Glad it is sorted.")
            .build(),
        ScriptedModel::builder()
            .tool_call("refund", json!({"amount": 5}))
            .tool_call("hand_back", json!({"reason": "refunded"}))
            .build(),
        &refunds,
    );
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let f = start(Server::builder().team("support", team), store, refunds).await;
    let id = f.create().await;
    f.say(&id, "Refund my 5, please.").await;
    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open_steps(&f.base, &id, &f.key).await;
    browser
        .wait(
            "every agent's steps",
            "document.querySelectorAll('#timeline > li').length === 4",
        )
        .await;
    let agents = browser
        .run("return [...document.querySelectorAll('#timeline > li > details > summary .agent')].map(e => e.textContent)")
        .await;
    assert_eq!(agents, json!(["triage", "billing", "billing", "triage"]));
    let marks = browser
        .run("return [...document.querySelectorAll('#timeline > li')].map(li => li.querySelector('.handoff-mark')?.innerText ?? null)")
        .await;
    assert_eq!(
        marks,
        json!([
            null,
            "triage handed the conversation to billing: a refund",
            null,
            "billing handed the conversation to triage: refunded"
        ])
    );
    assert!(
        browser
            .run("return document.getElementById('replay-controls').hidden")
            .await
            == json!(true),
        "no replay of a team conversation"
    );
    browser.screenshot("studio-team-lines.png").await;
    // Billing's step: its refund, its request from billing's own session,
    // and why there is no fork.
    let billing = "#timeline > li[data-step='1']";
    browser.click(&format!("{billing} summary")).await;
    let body = browser
        .wait(
            "billing's step",
            &format!("document.querySelector(\"{billing} .body\")?.innerText"),
        )
        .await;
    let body = body.as_str().unwrap_or_default();
    assert!(body.contains("refund"), "{body}");
    assert!(
        body.contains("GIVEN BY THE HANDOFF (MARKOV'S NOTE TO BILLING)"),
        "what the handoff gave is not the user's words: {body}"
    );
    assert_eq!(browser.count(&format!("{billing} .fork")).await, 0);
    let why = browser.text(&format!("{billing} .no-fork")).await;
    assert!(
        why.contains("Forking and replaying are not offered"),
        "{why}"
    );
    browser.click(&format!("{billing} .show-request")).await;
    let request = browser
        .wait(
            "billing's request",
            &format!("document.querySelector(\"{billing} .request\")?.innerText"),
        )
        .await;
    assert!(
        request
            .as_str()
            .is_some_and(|r| r.contains("You are billing.")),
        "{request}"
    );
    browser
        .run(&format!(
            "document.querySelector(\"{billing}\").scrollIntoView({{block: 'start'}})"
        ))
        .await;
    browser.screenshot("studio-team-timeline.png").await;
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agents_approval_waits_in_the_callers_chat_and_is_decided_there() {
    let pays = Arc::new(AtomicUsize::new(0));
    let (cashier, assistant) = cashier_models();
    let f = serve_agent(cashier_assistant(&pays, cashier, assistant), pays.clone()).await;
    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open(&f.base).await;
    browser.sign_in(&f.key).await;
    browser.say("Pay 5.").await;
    let shown = browser
        .wait(
            "the sub-agent's waiting call",
            "document.querySelectorAll('#approvals .approval').length === 1 && document.getElementById('approvals').innerText",
        )
        .await;
    let shown = shown.as_str().unwrap_or_default().to_owned();
    assert!(shown.contains("Approve cashier.pay?"), "{shown}");
    assert!(shown.contains("\"amount\": 5"), "{shown}");
    assert_eq!(pays.load(Ordering::SeqCst), 0, "nothing paid yet");
    browser.screenshot("sub-agent-approval.png").await;

    browser.click("#approvals button.approve").await;
    browser
        .wait(
            "the caller's answer after the sub-agent paid",
            "document.getElementById('log').innerText.includes('Done: paid 5.') && !document.body.classList.contains('running')",
        )
        .await;
    assert_eq!(pays.load(Ordering::SeqCst), 1, "paid once");
    assert_eq!(browser.count("#approvals .approval").await, 0);
    browser.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agents_step_and_a_team_step_show_their_wire_body() {
    use crate::studio_hooks::vendor_body;
    // The clerk, under the desk, with an encoder.
    let models = Nested::new();
    let f = start(
        Server::builder()
            .agent(models.agent())
            .wire_body("clerk", vendor_body),
        Arc::new(SqliteStore::in_memory().expect("a database")),
        Arc::default(),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "Where is the atlas?").await;
    let Some(browser) = Browser::start(1366, 768).await else {
        return;
    };
    browser.open_steps(&f.base, &id, &f.key).await;
    browser
        .wait(
            "the steps",
            "document.querySelectorAll('#timeline > li').length === 2",
        )
        .await;
    browser.click(&format!("{STEP} > details > summary")).await;
    let run = format!("{STEP} .call[data-call] + details.sub-agent");
    browser
        .wait(
            "the desk's run",
            &format!("document.querySelector(\"{run}\")"),
        )
        .await;
    browser.click(&format!("{run} > summary")).await;
    // The desk has no encoder: its request shows, its wire body does not.
    let desk_step = format!("{run} > details.sub-step[data-at='2']");
    browser.click(&format!("{desk_step} > summary")).await;
    browser
        .wait(
            "the desk's step",
            &format!("document.querySelector(\"{desk_step} > .body > .actions .show-request\")"),
        )
        .await;
    browser
        .click(&format!("{desk_step} > .body > .actions .show-request"))
        .await;
    browser
        .wait(
            "the desk's request",
            &format!("document.querySelector(\"{desk_step} > .body > .request\")"),
        )
        .await;
    assert_eq!(
        browser
            .count(&format!("{desk_step} > .body > .request details.wire"))
            .await,
        0,
        "no wire body without an encoder"
    );
    let clerk = format!("{desk_step} > .body details.sub-agent");
    browser
        .wait(
            "the clerk's run",
            &format!("document.querySelector(\"{clerk}\")"),
        )
        .await;
    browser.click(&format!("{clerk} > summary")).await;
    let clerk_step = format!("{clerk} > details.sub-step[data-at='0']");
    browser.click(&format!("{clerk_step} > summary")).await;
    browser
        .wait(
            "the clerk's step",
            &format!("document.querySelector(\"{clerk_step} > .body .show-request\")"),
        )
        .await;
    browser
        .click(&format!("{clerk_step} > .body .show-request"))
        .await;
    let wire = format!("{clerk_step} > .body .request details.wire");
    browser
        .wait(
            "the clerk's wire body's toggle",
            &format!("document.querySelector(\"{wire} > summary\")"),
        )
        .await;
    browser.click(&format!("{wire} > summary")).await;
    let body = browser
        .wait(
            "the clerk's wire body",
            &format!("document.querySelector(\"{wire} pre\")?.innerText"),
        )
        .await;
    let body = body.as_str().unwrap_or_default();
    assert!(body.contains("vendor-model"), "{body}");
    assert!(
        body.contains("You are the clerk: you look things up."),
        "{body}"
    );
    assert!(body.contains("where is the atlas?"), "{body}");
    browser
        .run(&format!(
            "document.querySelector(\"{wire}\").scrollIntoView({{block: 'center'}})"
        ))
        .await;
    browser.screenshot("studio-sub-agent-wire.png").await;

    // A team's step: billing's wire body, read from billing's session.
    let refunds = Arc::new(AtomicUsize::new(0));
    let team = crate::team::team(
        ScriptedModel::builder()
            .tool_call("transfer_to_billing", json!({"reason": "a refund"}))
            .text("Glad it is sorted.")
            .build(),
        ScriptedModel::builder()
            .tool_call("refund", json!({"amount": 5}))
            .tool_call("hand_back", json!({"reason": "refunded"}))
            .build(),
        &refunds,
    );
    let g = start(
        Server::builder()
            .team("support", team)
            .wire_body("billing", vendor_body),
        Arc::new(SqliteStore::in_memory().expect("a database")),
        refunds,
    )
    .await;
    let id = g.create().await;
    g.say(&id, "Refund my 5, please.").await;
    browser.open_steps(&g.base, &id, &g.key).await;
    browser
        .wait(
            "every agent's steps",
            "document.querySelectorAll('#timeline > li').length === 4",
        )
        .await;
    // Triage has no encoder; billing has.
    let triage = "#timeline > li[data-step='0']";
    browser.click(&format!("{triage} summary")).await;
    browser
        .wait(
            "triage's step",
            &format!("document.querySelector(\"{triage} .show-request\")"),
        )
        .await;
    browser.click(&format!("{triage} .show-request")).await;
    browser
        .wait(
            "triage's request",
            &format!("document.querySelector(\"{triage} .request\")"),
        )
        .await;
    assert_eq!(browser.count(&format!("{triage} details.wire")).await, 0);
    let billing = "#timeline > li[data-step='1']";
    browser.click(&format!("{billing} summary")).await;
    browser
        .wait(
            "billing's step",
            &format!("document.querySelector(\"{billing} .show-request\")"),
        )
        .await;
    browser.click(&format!("{billing} .show-request")).await;
    let wire = format!("{billing} .request details.wire");
    browser
        .wait(
            "billing's wire body's toggle",
            &format!("document.querySelector(\"{wire} > summary\")"),
        )
        .await;
    browser.click(&format!("{wire} > summary")).await;
    let body = browser
        .wait(
            "billing's wire body",
            &format!("document.querySelector(\"{wire} pre\")?.innerText"),
        )
        .await;
    let body = body.as_str().unwrap_or_default();
    assert!(body.contains("vendor-model"), "{body}");
    assert!(body.contains("You are billing."), "{body}");
    assert!(body.contains("refund"), "{body}");
    browser
        .run(&format!(
            "document.querySelector(\"{wire}\").scrollIntoView({{block: 'center'}})"
        ))
        .await;
    browser.screenshot("studio-team-wire.png").await;
    browser.close().await;
}
