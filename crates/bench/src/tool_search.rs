//! The tool-search figure: the tokens of the tool list offered per request
//! with 500 MCP tools, all offered beside all deferred, and the time of one
//! search.
//!
//! 500 generated tools (the shape of real MCP tools: a name, a sentence or
//! two of description, three or four described parameters) are served by
//! markov-mcp's own server over Streamable HTTP on a loopback port; the
//! client lists them and they are registered as they came (before) or
//! deferred (after). The tokens are core's conservative estimate of each
//! offered definition (`estimate_tool`), the bytes their JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::tokens::estimate_tool;
use markov_core::tool::{
    DynTool, NoState, SharedTool, ToolCallError, ToolContext, ToolDefinition, ToolOutcome,
};
use markov_mcp::{McpClient, McpServerConfig, McpToolServer};
use markov_policy::{
    Budget, Category, FoundScope, Mode, PolicyConfig, PolicyState, RegistryBinding, ToolMetadata,
    ToolRegistry, TurnBudgetState,
};
use serde_json::{Value, json};

/// Nouns and verbs the generated tools are named and described with.
const SERVICES: [&str; 25] = [
    "github",
    "jira",
    "slack",
    "gmail",
    "calendar",
    "drive",
    "notion",
    "linear",
    "sentry",
    "stripe",
    "shopify",
    "hubspot",
    "zendesk",
    "figma",
    "postgres",
    "redis",
    "s3",
    "docker",
    "kubernetes",
    "datadog",
    "pagerduty",
    "confluence",
    "trello",
    "asana",
    "salesforce",
];
const ACTIONS: [(&str, &str); 20] = [
    ("list_items", "Lists the items of"),
    ("get_item", "Fetches one item, by its id, from"),
    ("create_item", "Creates a new item in"),
    ("update_item", "Updates the fields of an existing item in"),
    ("delete_item", "Deletes an item, by its id, from"),
    ("search", "Searches, with a full-text query, across"),
    ("add_comment", "Adds a comment to an item in"),
    ("list_comments", "Lists the comments on an item in"),
    ("assign", "Assigns an item to a user in"),
    ("get_user", "Fetches a user's profile from"),
    ("list_users", "Lists the users of a workspace in"),
    ("export", "Exports items as CSV from"),
    ("import", "Imports items from a CSV file into"),
    ("archive", "Archives an item in"),
    ("restore", "Restores an archived item in"),
    ("get_stats", "Reports usage statistics of"),
    ("set_label", "Sets a label on an item in"),
    ("move_item", "Moves an item to another folder or project in"),
    ("watch", "Subscribes to changes of an item in"),
    ("get_history", "Lists the change history of an item in"),
];

/// A generated tool: answers its own name and arguments.
#[derive(Debug)]
struct Generated(ToolDefinition);

#[async_trait]
impl DynTool for Generated {
    fn definition(&self) -> &ToolDefinition {
        &self.0
    }

    async fn call_json(
        &self,
        input: &Value,
        _cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        Ok(ToolOutcome::Value(
            json!({"tool": self.0.name.as_str(), "input": input}),
        ))
    }
}

/// The `n` generated tools (at most 500).
fn generated(n: usize) -> Result<Vec<SharedTool>, String> {
    let mut tools = Vec::with_capacity(n);
    for (i, (service, (action, what))) in SERVICES
        .iter()
        .flat_map(|s| ACTIONS.iter().map(move |a| (s, a)))
        .take(n)
        .enumerate()
    {
        let schema = json!({
            "type": "object",
            "properties": {
                "workspace": {"type": "string", "description": format!("The {service} workspace or organization to act in.")},
                "id": {"type": "string", "description": "The item's id, as the service shows it."},
                "fields": {"type": "object", "description": "The fields to set, by name; unknown fields are refused."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 100, "description": "How many results to return at most (default 20)."}
            },
            "required": ["workspace"],
            "additionalProperties": false
        });
        let description = format!(
            "{what} {service}. Requires a connected {service} account; results are paginated (tool {i})."
        );
        let def = ToolDefinition::new(format!("{service}_{action}"), description, schema)
            .map_err(|e| e.to_string())?;
        tools.push(Arc::new(Generated(def)) as SharedTool);
    }
    Ok(tools)
}

fn measure(tools: &[markov_core::tool::ToolDefinition]) -> (u64, usize) {
    let tokens = tools.iter().map(estimate_tool).sum();
    let bytes = tools
        .iter()
        .map(|t| {
            serde_json::to_vec(&json!({
                "name": t.name.as_str(),
                "description": t.description,
                "input_schema": t.input_schema,
            }))
            .map_or(0, |v| v.len())
        })
        .sum();
    (tokens, bytes)
}

/// Lists the server's tools over MCP and registers them, deferred or not.
async fn registry(client: &McpClient, deferred: bool) -> Result<Arc<ToolRegistry>, String> {
    let builder = client
        .register(
            ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED)),
            |tool| {
                let metadata = McpClient::default_metadata(tool);
                if deferred {
                    metadata.deferred()
                } else {
                    metadata
                }
            },
        )
        .await
        .map_err(|e| e.to_string())?;
    builder.lock().map(Arc::new).map_err(|e| e.to_string())
}

/// The figure for `n` tools, printing its machine-readable line.
pub(crate) fn figure(n: usize) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let mut builder = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED));
        for tool in generated(n)? {
            builder = builder.register_shared(tool, ToolMetadata::new(Category::Retrieval));
        }
        let served = Arc::new(builder.lock().map_err(|e| e.to_string())?);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let stop = tokio_util::sync::CancellationToken::new();
        let serving = tokio::spawn(McpToolServer::new(served).serve_http(listener, stop.clone()));
        let client = McpClient::connect(
            McpServerConfig::http(format!("http://{addr}/mcp")).call_timeout(Duration::from_secs(10)),
        )
        .await
        .map_err(|e| e.to_string())?;

        let base: Arc<[ToolDefinition]> = Arc::from([]);
        let all = RegistryBinding::new(registry(&client, false).await?, Mode::TEXT);
        let all_list = all.offered_tools(&base, &Arc::from([]));
        let deferred = RegistryBinding::new(registry(&client, true).await?, Mode::TEXT);
        let deferred_list = deferred.offered_tools(&base, &Arc::from([]));

        // One search through the registry's path, then the list it leaves.
        let policy = PolicyState::new();
        let turn = TurnBudgetState::new();
        let session = deferred.session(&turn, &policy);
        let state = NoState::default();
        let id = ToolCallId::new("search");
        let input = json!({"query": "create a jira issue"});
        let mut times = Vec::new();
        for _ in 0..200 {
            let start = Instant::now();
            let executed = session
                .run(
                    markov_policy::ToolOrigin::Node,
                    deferred.registry().tool("search_tools"),
                    &id,
                    "search_tools",
                    std::borrow::Cow::Borrowed(&input),
                    ToolContext::new(&id, &[], &state),
                    "",
                )
                .await;
            times.push(start.elapsed());
            if executed.result.is_error {
                return Err(executed.result.content);
            }
        }
        times.sort_unstable();
        let search_us = times[times.len() / 2].as_secs_f64() * 1e6;
        let found = policy.found();
        if found.is_empty() || found.iter().any(|f| f.scope != FoundScope::Turn) {
            return Err(format!("the search found {found:?}"));
        }
        let found_list = deferred.offered_tools(&base, &found);

        client.close().await;
        stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), serving).await;

        let (all_tokens, all_bytes) = measure(&all_list);
        let (deferred_tokens, deferred_bytes) = measure(&deferred_list);
        let (found_tokens, _) = measure(&found_list);
        println!(
            "bench=tool_search tools={} all_tokens={all_tokens} all_bytes={all_bytes} deferred_tokens={deferred_tokens} deferred_bytes={deferred_bytes} found={} found_tokens={found_tokens} search_median_us={search_us:.1}",
            all_list.len(),
            found.len(),
        );
        Ok(())
    })
}
