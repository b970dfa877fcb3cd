//! The studio of several agents over HTTP: a sub-agent's steps under the
//! call that ran them (nested sub-agents nested), their usage counted in
//! the calling step, each one's request rebuilt exactly as its model
//! received it; an approval a sub-agent asks for, shown and decided in the
//! caller's conversation; and a team conversation's steps, every agent's,
//! in one timeline in the order they ran, with the handoffs marked.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use markov_core::tool::{SharedTool, Tool, ToolContext};
use markov_executor::Agent;
use markov_policy::{Budget, Category, PolicyConfig, ToolMetadata};
use markov_server::{Server, create_api_key};
use markov_store::{SqliteStore, WorkerId};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::http::{Fixture, Pay, names, serve_agent, start};

#[derive(Deserialize, JsonSchema)]
pub(crate) struct LookupArgs {
    /// What to look up.
    what: String,
}

/// Looks a thing up.
pub(crate) struct Lookup;

#[async_trait]
impl Tool for Lookup {
    const NAME: &'static str = "lookup";
    type Args = LookupArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Look a thing up".into()
    }
    async fn call(&self, args: LookupArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok(format!("{} is on shelf 4", args.what))
    }
}

/// The models of the nested agents: the assistant calls the desk, which
/// calls the clerk, which looks the thing up.
pub(crate) struct Nested {
    pub(crate) assistant: Arc<ScriptedModel>,
    pub(crate) desk: Arc<ScriptedModel>,
    pub(crate) clerk: Arc<ScriptedModel>,
}

impl Nested {
    pub(crate) fn new() -> Self {
        Nested {
            assistant: Arc::new(
                ScriptedModel::builder()
                    .tool_call("desk", json!({"request": "find the atlas"}))
                    .text("The atlas is on shelf 4.")
                    .build(),
            ),
            desk: Arc::new(
                ScriptedModel::builder()
                    .tool_call("clerk", json!({"request": "where is the atlas?"}))
                    .text("Shelf 4, says the clerk.")
                    .build(),
            ),
            clerk: Arc::new(
                ScriptedModel::builder()
                    .tool_call("lookup", json!({"what": "the atlas"}))
                    .text("Shelf 4.")
                    .build(),
            ),
        }
    }

    /// The assistant, with the desk (and the clerk under it) as tools.
    pub(crate) fn agent(&self) -> Agent {
        self.agent_on(Arc::clone(&self.desk), Arc::clone(&self.clerk))
    }

    /// [`Self::agent`] with the desk and the clerk on `desk` and `clerk`
    /// (their scripted models, wrapped).
    pub(crate) fn agent_on(
        &self,
        desk: impl markov_core::model::Model + 'static,
        clerk: impl markov_core::model::Model + 'static,
    ) -> Agent {
        let clerk = Agent::builder("clerk")
            .instructions("You are the clerk: you look things up.")
            .tool(Lookup)
            .model(clerk)
            .build()
            .expect("builds")
            .as_tool("clerk", "Asks the clerk.")
            .expect("a valid name");
        let desk = Agent::builder("desk")
            .instructions("You are the desk: ask the clerk.")
            .tools([Arc::new(clerk) as SharedTool])
            .model(desk)
            .build()
            .expect("builds")
            .as_tool("desk", "Asks the desk.")
            .expect("a valid name");
        Agent::builder("assistant")
            .instructions("You are the assistant: ask the desk.")
            .tools([Arc::new(desk) as SharedTool])
            .model(Arc::clone(&self.assistant))
            .build()
            .expect("builds")
    }
}

/// Serves `agent` with a developer's key (dave's) beside the fixture's.
async fn serve_with_developer(agent: Agent, pays: Arc<AtomicUsize>) -> (Fixture, String) {
    let f = serve_agent(agent, pays).await;
    let dave = create_api_key(&*f.store, "dave", &["developer".to_owned()])
        .await
        .expect("a key")
        .key;
    (f, dave)
}

async fn get_as(f: &Fixture, key: &str, path: &str) -> (u16, Value) {
    let response = f
        .client
        .get(format!("{}{path}", f.base))
        .bearer_auth(key)
        .send()
        .await
        .expect("sent");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The ids of the tool calls `messages` (a step's, as the page reads them)
/// make.
fn calls_in(messages: &Value) -> Vec<String> {
    messages
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|m| m["items"].as_array().cloned().unwrap_or_default())
        .filter(|i| i["type"] == "tool_use")
        .filter_map(|i| i["id"].as_str().map(str::to_owned))
        .collect()
}

fn requests(usage: &Value) -> u64 {
    usage["requests"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agents_steps_show_under_their_call_nested_with_their_usage_and_exact_requests() {
    let models = Nested::new();
    let (f, dave) = serve_with_developer(models.agent(), Arc::default()).await;
    let id = f.create().await;
    f.say(&id, "Where is the atlas?").await;

    // A developer reads them as the owner does.
    let (status, page) = get_as(&f, &dave, &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 200, "{page}");
    let steps = page["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 2, "the call, then the answer: {page}");
    assert!(steps[1].get("sub_agents").is_none(), "{page}");

    // Under the assistant's call to the desk: the desk's two steps.
    let runs = steps[0]["sub_agents"].as_array().expect("sub-agents");
    assert_eq!(runs.len(), 1, "{page}");
    let desk = &runs[0];
    assert_eq!(desk["agent"], "desk");
    assert_eq!(
        vec![desk["call_id"].as_str().expect("a call id").to_owned()],
        calls_in(&steps[0]["messages"]),
        "under the call that ran it"
    );
    let desk_steps = desk["steps"].as_array().expect("its steps");
    assert_eq!(desk_steps.len(), 2, "{desk}");
    assert_eq!(desk_steps[0]["yield_reason"], "tool_use");
    assert_eq!(desk_steps[1]["yield_reason"], "end_turn");
    assert_eq!(desk_steps[1]["done"], true);
    assert_eq!(desk_steps[0]["node"], "desk");
    assert_eq!(desk_steps[0]["tools"], 1, "the clerk was offered");
    assert!(desk_steps[0]["step_ms"].is_u64());
    // Each tool call with the policy's decision, as a top-level step's.
    let traced = desk_steps[0]["tool_calls"].as_array().expect("tool calls");
    assert_eq!(traced.len(), 1, "{desk}");
    assert_eq!(traced[0]["tool"], "clerk");
    assert_eq!(traced[0]["outcome"], "ran");
    let text: String = desk_steps[1]["messages"][0]["items"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(text, "Shelf 4, says the clerk.");
    assert!(
        desk_steps[1]["messages"][0]["items"][0]["html"]
            .as_str()
            .is_some_and(|h| h.contains("Shelf 4")),
        "assistant text also as sanitized html: {desk}"
    );

    // The clerk's steps nest under the desk's call to it, in the desk's
    // first step.
    assert!(desk_steps[1].get("sub_agents").is_none(), "{desk}");
    let clerk_runs = desk_steps[0]["sub_agents"].as_array().expect("nested");
    assert_eq!(clerk_runs.len(), 1);
    let clerk = &clerk_runs[0];
    assert_eq!(clerk["agent"], "clerk");
    assert_eq!(
        vec![clerk["call_id"].as_str().expect("an id").to_owned()],
        calls_in(&desk_steps[0]["messages"])
    );
    let clerk_steps = clerk["steps"].as_array().expect("the clerk's steps");
    assert_eq!(clerk_steps.len(), 2);
    assert_eq!(clerk_steps[0]["tool_calls"][0]["tool"], "lookup");

    // The usage rolls up: the clerk's into the desk's run, the desk's
    // into the assistant's calling step.
    let clerk_total: u64 = clerk_steps.iter().map(|s| requests(&s["usage"])).sum();
    assert_eq!(clerk_total, 2, "{clerk}");
    assert_eq!(requests(&clerk["usage"]), clerk_total);
    assert_eq!(
        requests(&desk_steps[0]["usage"]),
        1 + clerk_total,
        "the desk's first step counts the clerk's calls"
    );
    let desk_total: u64 = desk_steps.iter().map(|s| requests(&s["usage"])).sum();
    assert_eq!(requests(&desk["usage"]), desk_total);
    assert_eq!(
        requests(&desk["usage"]),
        4,
        "two of the desk's, two of the clerk's"
    );
    assert_eq!(
        requests(&steps[0]["usage"]),
        1 + desk_total,
        "the calling step's usage includes its sub-agents'"
    );

    // Every sub-agent step's request, rebuilt, is what its model received.
    let all: Vec<(&Value, &ScriptedModel, usize)> = vec![
        (&desk_steps[0], &*models.desk, 0),
        (&desk_steps[1], &*models.desk, 1),
        (&clerk_steps[0], &*models.clerk, 0),
        (&clerk_steps[1], &*models.clerk, 1),
    ];
    for (step, model, call) in all {
        assert_eq!(step["has_request"], true, "{step}");
        let at = step["at"].as_u64().expect("its place");
        let (status, body) = get_as(
            &f,
            &dave,
            &format!("/sessions/{id}/steps/0/sub_agents/{at}/request"),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let received = &model.requests()[call];
        let request = &body["request"];
        assert_eq!(request["system"], received.system.as_str(), "{body}");
        let mut sent = serde_json::to_value(&received.messages).expect("json");
        for message in sent.as_array_mut().expect("messages") {
            message
                .as_object_mut()
                .expect("a message")
                .remove("metadata");
        }
        assert_eq!(request["messages"], sent, "step {at}: {body}");
        assert_eq!(
            request["tools"],
            serde_json::to_value(&received.tools).expect("json")
        );
        assert_eq!(body["node"], step["node"]);
    }

    // Not another principal's; no such sub-agent step; not a step without one.
    let (status, _) = get_as(
        &f,
        &f.keys["bob"],
        &format!("/sessions/{id}/steps/0/sub_agents/0/request"),
    )
    .await;
    assert_eq!(status, 404, "bob");
    for path in ["0/sub_agents/99", "1/sub_agents/0", "7/sub_agents/0"] {
        let (status, body) =
            get_as(&f, &f.key, &format!("/sessions/{id}/steps/{path}/request")).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert!(body["error"].is_string(), "{body}");
    }

    // The document describes the route and the nested shapes.
    let (status, document) = f.get("/openapi.json").await;
    assert_eq!(status, 200);
    assert!(
        document["paths"]["/sessions/{id}/steps/{n}/sub_agents/{at}/request"]["get"].is_object(),
        "the route is documented"
    );
    let schemas = &document["components"]["schemas"];
    // What every step shows is one schema, which both kinds of step
    // include.
    for name in ["StepSummary", "SubAgentStepSummary"] {
        assert_eq!(
            schemas[name]["allOf"][0]["$ref"], "#/components/schemas/StepView",
            "{name}: {}",
            schemas[name]
        );
    }
    for field in ["sub_agents", "team", "index", "has_request", "wire"] {
        assert!(
            properties(schemas, "StepSummary").contains(&field.to_owned()),
            "{field}"
        );
    }
    for field in ["call_id", "agent", "usage", "steps"] {
        assert!(
            schemas["SubAgentRun"]["properties"][field].is_object(),
            "{field}"
        );
    }
    for field in [
        "at",
        "agent",
        "has_request",
        "wire",
        "messages",
        "tool_calls",
        "sub_agents",
    ] {
        assert!(
            properties(schemas, "SubAgentStepSummary").contains(&field.to_owned()),
            "{field}"
        );
    }
}

/// The properties of schema `name`, those of the schemas it includes
/// (`allOf`, by reference or inline) too.
fn properties(schemas: &Value, name: &str) -> Vec<String> {
    let schema = &schemas[name];
    let mut parts = vec![schema];
    parts.extend(schema["allOf"].as_array().into_iter().flatten());
    parts
        .into_iter()
        .flat_map(|part| match part["$ref"].as_str() {
            Some(reference) => {
                let name = reference.trim_start_matches("#/components/schemas/");
                properties(schemas, name)
            }
            None => part["properties"]
                .as_object()
                .map(|p| p.keys().cloned().collect())
                .unwrap_or_default(),
        })
        .collect()
}

/// The assistant whose `cashier` tool is a sub-agent with `pay`, which
/// needs approval.
pub(crate) fn cashier_assistant(
    pays: &Arc<AtomicUsize>,
    cashier: Arc<ScriptedModel>,
    assistant: ScriptedModel,
) -> Agent {
    let cashier = Agent::builder("cashier")
        .instructions("You pay.")
        .tool_with(
            Pay(pays.clone()),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .policies(PolicyConfig::new(Budget::UNLIMITED))
        .model(cashier)
        .build()
        .expect("builds")
        .as_tool("cashier", "Pays.")
        .expect("a valid name");
    Agent::builder("assistant")
        .instructions("You are the assistant.")
        .tools([Arc::new(cashier) as SharedTool])
        .model(assistant)
        .build()
        .expect("builds")
}

pub(crate) fn cashier_models() -> (Arc<ScriptedModel>, ScriptedModel) {
    (
        Arc::new(
            ScriptedModel::builder()
                .tool_call("pay", json!({"amount": 5}))
                .text("Paid 5.")
                .build(),
        ),
        ScriptedModel::builder()
            .tool_call("cashier", json!({"request": "pay 5"}))
            .text("Done: paid 5.")
            .build(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agents_approval_waits_in_the_callers_conversation_and_is_decided_there() {
    let pays = Arc::new(AtomicUsize::new(0));
    let (cashier, assistant) = cashier_models();
    let (f, _) = serve_with_developer(
        cashier_assistant(&pays, Arc::clone(&cashier), assistant),
        pays.clone(),
    )
    .await;
    let id = f.create().await;
    let events = f.say(&id, "Pay 5.").await;
    let done = &events.last().expect("events").1;
    assert_eq!(names(&events).last(), Some(&"done"), "{events:?}");
    assert_eq!(done["awaiting_approval"], true, "{done}");
    assert_eq!(pays.load(Ordering::SeqCst), 0, "nothing paid yet");

    // The caller's conversation shows the sub-agent's request, named for
    // the sub-agent, among its own.
    let (status, session) = f.get(&format!("/sessions/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(session["awaiting_approval"], true, "{session}");
    let pending = session["pending_approvals"].as_array().expect("pending");
    assert_eq!(pending.len(), 1, "{session}");
    assert_eq!(pending[0]["tool"], "cashier.pay");
    assert_eq!(pending[0]["args"], json!({"amount": 5}));
    let request = pending[0]["request_id"].as_str().expect("an id").to_owned();
    assert_eq!(f.pending(&id).await, [request.as_str()]);

    // The studio shows the waiting call inside the sub-agent's step, under
    // the call that ran it.
    let (_, page) = f.get(&format!("/sessions/{id}/steps")).await;
    let paused = &page["steps"][0];
    assert_eq!(paused["yield_reason"], "awaiting_approval", "{page}");
    let sub = &paused["sub_agents"][0]["steps"][0];
    assert_eq!(sub["agent"], "cashier");
    assert_eq!(sub["yield_reason"], "awaiting_approval", "{page}");
    assert_eq!(sub["approvals"][0]["tool"], "pay", "{page}");

    // Decided in the caller's conversation: the sub-agent pays once and
    // answers, then the caller.
    let (status, events) = f
        .decide(&id, &request, json!({"decision": "approve"}))
        .await;
    assert_eq!(status, 200, "{events:?}");
    let done = &events.last().expect("events").1;
    assert_eq!(done["response"], "Done: paid 5.", "{events:?}");
    assert_eq!(pays.load(Ordering::SeqCst), 1, "paid once");
    assert!(f.pending(&id).await.is_empty());

    // The resumed step holds the sub-agent's resumed steps; the request of
    // its answering step is rebuilt from the history the paused step
    // recorded: what the cashier's model received.
    let (_, page) = f.get(&format!("/sessions/{id}/steps")).await;
    let steps = page["steps"].as_array().expect("steps");
    let resumed = steps
        .iter()
        .find(|s| s["sub_agents"].is_array() && s["index"] != 0)
        .unwrap_or_else(|| panic!("a resumed step with the sub-agent: {page}"));
    let run = &resumed["sub_agents"][0];
    assert_eq!(run["call_id"], paused["sub_agents"][0]["call_id"]);
    let answered = run["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .find(|s| s["yield_reason"] == "end_turn")
        .unwrap_or_else(|| panic!("the cashier's answer: {run}"));
    let decided = answered["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(
            run["steps"][0]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten(),
        )
        .any(|t| t["tool"] == "pay" && t["approval"]["decision"].is_string());
    assert!(decided, "the pay call ran after the decision: {run}");
    assert_eq!(answered["has_request"], true, "{run}");
    let n = resumed["index"].as_u64().expect("an index");
    let at = answered["at"].as_u64().expect("at");
    let (status, body) = f
        .get(&format!("/sessions/{id}/steps/{n}/sub_agents/{at}/request"))
        .await;
    assert_eq!(status, 200, "{body}");
    // The same from a page that starts at the resumed step: the paused
    // step before it is read for the sub-agent's history.
    let (_, later) = f.get(&format!("/sessions/{id}/steps?from={n}")).await;
    let again = &later["steps"][0]["sub_agents"][0]["steps"];
    let again = again
        .as_array()
        .expect("steps")
        .iter()
        .find(|s| s["at"] == answered["at"])
        .unwrap_or_else(|| panic!("the cashier's answer again: {later}"));
    assert_eq!(again["has_request"], true, "{later}");
    let received = cashier.requests().last().cloned().expect("asked twice");
    let mut sent = serde_json::to_value(&received.messages).expect("json");
    for message in sent.as_array_mut().expect("messages") {
        message
            .as_object_mut()
            .expect("a message")
            .remove("metadata");
    }
    assert_eq!(body["request"]["messages"], sent, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_conversations_steps_are_every_agents_in_the_order_they_ran_with_the_handoffs() {
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
    let f = start(
        Server::builder()
            .team("support", team)
            .worker(WorkerId::new("server")),
        store,
        refunds.clone(),
    )
    .await;
    let dave = create_api_key(&*f.store, "dave", &["developer".to_owned()])
        .await
        .expect("a key")
        .key;
    let id = f.create().await;
    let events = f.say(&id, "Refund my 5, please.").await;
    assert_eq!(
        names(&events).iter().filter(|n| **n == "handoff").count(),
        2,
        "{events:?}"
    );

    let (status, page) = get_as(&f, &dave, &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 200, "{page}");
    let steps = page["steps"].as_array().expect("steps");
    let seen: Vec<(u64, &str, &str, u64)> = steps
        .iter()
        .map(|s| {
            (
                s["index"].as_u64().expect("index"),
                s["team"]["agent"].as_str().expect("an agent"),
                s["team"]["session"].as_str().expect("a session"),
                s["team"]["step"].as_u64().expect("its step"),
            )
        })
        .collect();
    let billing = format!("{id}~billing");
    assert_eq!(
        seen,
        [
            (0, "triage", id.as_str(), 0),
            (1, "billing", billing.as_str(), 0),
            (2, "billing", billing.as_str(), 1),
            (3, "triage", id.as_str(), 1),
        ],
        "{page}"
    );
    // The handoffs, on the first step after each.
    assert!(steps[0]["team"].get("handoff").is_none());
    assert_eq!(
        steps[1]["team"]["handoff"],
        json!({"from": "triage", "to": "billing", "reason": "a refund", "at": 1})
    );
    assert!(steps[2]["team"].get("handoff").is_none());
    assert_eq!(steps[3]["team"]["handoff"]["from"], "billing");
    assert_eq!(steps[3]["team"]["handoff"]["to"], "triage");
    assert_eq!(steps[3]["team"]["handoff"]["reason"], "refunded");
    // What each step added is its own agent's.
    assert_eq!(calls_in(&steps[1]["messages"]).len(), 1);
    let refund = steps[1]["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .flat_map(|m| m["items"].as_array().cloned().unwrap_or_default())
        .any(|i| i["name"] == "refund");
    assert!(refund, "billing's refund: {}", steps[1]);
    // Neither forked nor replayed one agent at a time: said why.
    assert_eq!(page["replayable"], false);
    assert_eq!(page["exportable"], false);
    assert_eq!(page["team"]["agents"], json!(["billing", "triage"]));
    assert!(
        page["team"]["no_fork"]
            .as_str()
            .is_some_and(|why| why.contains("team")),
        "{page}"
    );

    // Each step's request, read from its agent's own session.
    for step in steps {
        let session = step["team"]["session"].as_str().expect("a session");
        let n = step["team"]["step"].as_u64().expect("a step");
        let (status, body) =
            get_as(&f, &dave, &format!("/sessions/{session}/steps/{n}/request")).await;
        assert_eq!(status, 200, "{body}");
        let system = body["request"]["system"].as_str().unwrap_or_default();
        let agent = step["team"]["agent"].as_str().expect("an agent");
        assert!(system.contains(&format!("You are {agent}")), "{system}");
    }

    // Paged over the whole timeline.
    let (_, first) = get_as(&f, &dave, &format!("/sessions/{id}/steps?limit=3")).await;
    assert_eq!(first["steps"].as_array().expect("steps").len(), 3);
    assert_eq!(first["next"], 3);
    let (_, rest) = get_as(&f, &dave, &format!("/sessions/{id}/steps?from=3")).await;
    assert_eq!(rest["steps"].as_array().expect("steps").len(), 1, "{rest}");
    assert_eq!(rest["steps"][0]["index"], 3);
    assert_eq!(rest["steps"][0]["team"]["agent"], "triage");
    assert!(rest.get("next").is_none());
    // Another principal sees nothing of it.
    let (status, _) = get_as(&f, &f.keys["bob"], &format!("/sessions/{id}/steps")).await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_agents_approval_edited_or_denied_in_the_callers_conversation_reaches_the_sub_agent()
{
    // Edited: the sub-agent's call runs once, with the edited arguments.
    let pays = Arc::new(AtomicUsize::new(0));
    let (cashier, assistant) = cashier_models();
    let f = serve_agent(
        cashier_assistant(&pays, Arc::clone(&cashier), assistant),
        pays.clone(),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "Pay 5.").await;
    let pending = f.pending(&id).await;
    assert_eq!(pending.len(), 1);
    let (status, events) = f
        .decide(
            &id,
            &pending[0],
            json!({"decision": "edit", "args": {"amount": 6}}),
        )
        .await;
    assert_eq!(status, 200, "{events:?}");
    assert_eq!(pays.load(Ordering::SeqCst), 1, "paid once: {events:?}");
    let asked = cashier.requests();
    let result = asked
        .last()
        .expect("the cashier asked again")
        .messages
        .iter()
        .flat_map(|m| m.item_list())
        .find_map(|i| match i {
            markov_core::Item::ToolResult { content, .. } => Some(format!("{content:?}")),
            _ => None,
        })
        .expect("the pay call's result");
    assert!(result.contains("paid 6"), "the edited amount: {result}");

    // Denied: the sub-agent reads the refusal and nothing is paid.
    let pays = Arc::new(AtomicUsize::new(0));
    let (cashier, assistant) = cashier_models();
    let f = serve_agent(
        cashier_assistant(&pays, Arc::clone(&cashier), assistant),
        pays.clone(),
    )
    .await;
    let id = f.create().await;
    f.say(&id, "Pay 5.").await;
    let pending = f.pending(&id).await;
    let (status, events) = f
        .decide(
            &id,
            &pending[0],
            json!({"decision": "deny", "message": "not today"}),
        )
        .await;
    assert_eq!(status, 200, "{events:?}");
    assert_eq!(pays.load(Ordering::SeqCst), 0, "nothing paid");
    let asked = cashier.requests();
    let refusal = format!("{:?}", asked.last().expect("asked again").messages);
    assert!(refusal.contains("not today"), "{refusal}");
}
