//! Tool definitions rendered in each vendor's tool format.

use markov_core::ToolDefinition;
use serde_json::json;

fn defs() -> Vec<ToolDefinition> {
    vec![
        ToolDefinition::new(
            "search",
            "Search the knowledge base",
            json!({"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}),
        )
        .expect("valid name"),
    ]
}

#[cfg(feature = "openai")]
#[test]
fn openai_tool_schemas_are_functions() {
    assert_eq!(
        markov_providers::openai::tool_schemas(&defs()),
        json!([{"type": "function", "function": {
            "name": "search",
            "description": "Search the knowledge base",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
        }}])
    );
}

#[cfg(feature = "anthropic")]
#[test]
fn anthropic_tool_schemas_have_input_schema() {
    assert_eq!(
        markov_providers::anthropic::tool_schemas(&defs()),
        json!([{
            "name": "search",
            "description": "Search the knowledge base",
            "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
        }])
    );
}
