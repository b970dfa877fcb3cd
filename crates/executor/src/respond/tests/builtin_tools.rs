//! Provider built-in tools on nodes: build checks, the offered list and its
//! shadowing , and the pipeline's skip .

use std::collections::BTreeMap;
use std::convert::Infallible;

use crate::respond::pipeline::{LeafView, ToolCall, run_tool_calls};
use markov_charter::ConfigError;
use markov_charter::charter::{AncestorView, Charter, PromptStyle};
use markov_charter::node::Node;
use markov_charter::toolgen::{generate_provider_tools, generate_tools};
use markov_core::async_trait;
use markov_core::tool::{ProviderTool, Tool, ToolContext, ToolDefinition};
use markov_core::{InstanceId, Item, Message};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize, JsonSchema)]
struct Empty {}

macro_rules! tool {
    ($ty:ident, $name:literal) => {
        struct $ty;
        #[async_trait]
        impl Tool for $ty {
            const NAME: &'static str = $name;
            type Args = Empty;
            type Output = String;
            type Error = Infallible;
            fn description(&self) -> String {
                concat!("The ", $name, " tool").into()
            }
            async fn call(
                &self,
                _args: Empty,
                _cx: &ToolContext<'_>,
            ) -> Result<String, Infallible> {
                Ok(concat!($name, " ran").into())
            }
        }
    };
}

tool!(Lookup, "lookup");
tool!(WebSearchClient, "web_search");
tool!(CharterCode, "code_execution");

fn web_search() -> ProviderTool {
    ProviderTool::new("web_search_20250305", "web_search")
        .expect("valid name")
        .with("max_uses", json!(5))
}

fn code_execution() -> ProviderTool {
    ProviderTool::new("code_execution_20250522", "code_execution").expect("valid name")
}

fn names(tools: &[ToolDefinition]) -> Vec<&str> {
    tools.iter().map(|t| t.name.as_str()).collect()
}

fn charter() -> Charter {
    Charter::builder("test")
        .prompt_style(PromptStyle::Upstream)
        .build()
        .expect("charter builds")
}

#[test]
fn the_offered_definition_is_the_vendor_object() {
    let node = Node::builder("Search.")
        .tool(Lookup)
        .provider_tool(web_search())
        .build()
        .expect("node builds");
    let offered = generate_provider_tools(&node, &[]);
    assert_eq!(
        serde_json::to_value(&offered).expect("serializes"),
        json!([{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}])
    );
    // Provider tools are offered apart: the executable list does not hold them.
    let tools = generate_tools(&charter(), &node, &[], false).expect("tools generate");
    assert_eq!(names(&tools), ["updateState", "lookup"]);
}

#[test]
fn names_are_checked_at_build() {
    let reserved = Node::builder("x")
        .provider_tool(ProviderTool::new("web_search_20250305", "updateState").expect("valid"))
        .build()
        .expect_err("reserved");
    assert!(
        matches!(&reserved, ConfigError::ReservedToolName { tool, .. } if tool == "updateState"),
        "{reserved:?}"
    );
    let transition = Node::builder("x")
        .provider_tool(ProviderTool::new("web_search_20250305", "transition_go").expect("valid"))
        .build()
        .expect_err("reserved prefix");
    assert!(matches!(transition, ConfigError::ReservedToolName { .. }));
    let with_tool = Node::builder("x")
        .tool(WebSearchClient)
        .provider_tool(web_search())
        .build()
        .expect_err("collides with a tool");
    assert_eq!(with_tool, ConfigError::DuplicateTool("web_search".into()));
    let twice = Node::builder("x")
        .provider_tool(web_search())
        .provider_tool(web_search())
        .build()
        .expect_err("declared twice");
    assert_eq!(twice, ConfigError::DuplicateTool("web_search".into()));
    assert!(ProviderTool::new("web_search_20250305", "web search").is_err());
}

#[test]
fn ancestors_provider_tools_are_offered_with_shadowing() {
    // The root offers two provider tools; the parent's executable
    // `web_search` is nearer, so it hides the root's provider `web_search`.
    let root = Node::builder("Root.")
        .provider_tool(web_search())
        .provider_tool(code_execution())
        .build()
        .expect("root builds");
    let parent = Node::builder("Parent.")
        .tool(WebSearchClient)
        .build()
        .expect("parent builds");
    let leaf = Node::builder("Leaf.")
        .tool(Lookup)
        .build()
        .expect("leaf builds");
    let state = json!({});
    let ancestors = [
        AncestorView {
            node: &root,
            state: &state,
        },
        AncestorView {
            node: &parent,
            state: &state,
        },
    ];
    assert_eq!(
        generate_provider_tools(&leaf, &ancestors),
        vec![code_execution()]
    );
    let tools = generate_tools(&charter(), &leaf, &ancestors, false).expect("tools generate");
    assert_eq!(names(&tools), ["updateState", "lookup", "web_search"]);

    // A nearer provider tool hides a farther executable tool of that name,
    // the charter's included.
    let charter = Charter::builder("test")
        .prompt_style(PromptStyle::Upstream)
        .tool(CharterCode)
        .build()
        .expect("charter builds");
    let searching = Node::builder("Leaf.")
        .provider_tool(web_search())
        .provider_tool(code_execution())
        .build()
        .expect("leaf builds");
    let ancestors = [AncestorView {
        node: &parent,
        state: &state,
    }];
    let tools = generate_tools(&charter, &searching, &ancestors, false).expect("tools generate");
    assert_eq!(names(&tools), ["updateState"]);
    assert_eq!(
        generate_provider_tools(&searching, &ancestors),
        vec![web_search(), code_execution()]
    );
}

/// An assistant message calling `(id, name)` in order, with no arguments.
fn calling(calls: &[(&str, &str)]) -> Message {
    Message::assistant_items(
        calls
            .iter()
            .map(|(id, name)| Item::tool_use(*id, *name, json!({})))
            .collect(),
    )
}

#[tokio::test]
async fn the_pipeline_skips_provider_tool_calls() {
    let charter = charter();
    let root = Node::builder("Root.")
        .provider_tool(code_execution())
        .build()
        .expect("root builds");
    let node = Node::builder("Search.")
        .tool(Lookup)
        .provider_tool(web_search())
        .build()
        .expect("node builds");
    let state = json!({});
    let ancestors = [AncestorView {
        node: &root,
        state: &state,
    }];
    let id = InstanceId::from("leaf");
    let root_id = InstanceId::from("root");
    let pack_states = BTreeMap::new();
    let leaf = LeafView {
        charter: &charter,
        node: &node,
        instance_id: &id,
        root_id: &root_id,
        state: &state,
        ancestors: &ancestors,
        pack_states: &pack_states,
        is_worker: false,
        history: &[],
        terminate_message: "Finished",
        policies: None,
        repeats: None,
        conversation: None,
        unrecorded: None,
        loop_guard: Default::default(),
        capture_content: false,
        usage: None,
        traces: None,
    };
    let message = calling(&[
        ("srv_1", "web_search"),
        ("c_1", "lookup"),
        ("srv_2", "code_execution"),
        ("c_2", "nope"),
    ]);
    let calls: Vec<ToolCall<'_>> = ToolCall::all_in(&message).collect();
    let outcome = run_tool_calls(&leaf, &calls).await;
    let results: Vec<(&str, &str)> = outcome
        .results
        .iter()
        .map(|r| (r.call_id.as_str(), r.content.as_str()))
        .collect();
    assert_eq!(
        results,
        [("c_1", "lookup ran"), ("c_2", "Unknown tool: nope")],
        "provider calls get no result, not `Unknown tool`"
    );
    assert_eq!(outcome.result_states_known.len(), 2);
    assert_eq!(outcome.result_items().len(), 2);
    assert!(outcome.replies.is_empty());
}

/// By default `updateState` is offered only to a node that has state.
#[test]
fn update_state_is_offered_only_to_a_node_with_state() {
    #[derive(serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
    struct Topic {
        topic: String,
    }
    let charter = Charter::builder("test").build().expect("charter builds");
    let plain = Node::builder("Search.")
        .tool(Lookup)
        .build()
        .expect("node builds");
    let tools = generate_tools(&charter, &plain, &[], false).expect("tools generate");
    assert_eq!(names(&tools), ["lookup"]);
    let stateful = Node::builder("Search.")
        .state(Topic {
            topic: "rust".into(),
        })
        .tool(Lookup)
        .build()
        .expect("node builds");
    let tools = generate_tools(&charter, &stateful, &[], false).expect("tools generate");
    assert_eq!(names(&tools), ["updateState", "lookup"]);
}
