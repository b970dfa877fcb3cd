//! Tests of the generated tool list.

use std::convert::Infallible;

use markov_charter::ConfigError;
use markov_charter::charter::{AncestorView, Charter, PromptStyle};
use markov_charter::node::Node;
use markov_charter::pack::Pack;
use markov_charter::toolgen::{TRANSITION, TRANSITION_PREFIX, UPDATE_STATE, generate_tools};
use markov_charter::transition::{NodeTarget, Transition, TransitionResult};
use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext, ToolDefinition};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

#[derive(Deserialize, JsonSchema)]
struct Empty {}

macro_rules! tool {
    ($ty:ident, $name:literal, $desc:literal) => {
        tool!($ty, $name, $desc, false);
    };
    ($ty:ident, $name:literal, $desc:literal, $terminal:literal) => {
        struct $ty;
        #[async_trait]
        impl Tool for $ty {
            const NAME: &'static str = $name;
            const TERMINAL: bool = $terminal;
            type Args = Empty;
            type Output = String;
            type Error = Infallible;
            fn description(&self) -> String {
                $desc.into()
            }
            async fn call(
                &self,
                _args: Empty,
                _cx: &ToolContext<'_>,
            ) -> Result<String, Infallible> {
                Ok(String::new())
            }
        }
    };
}

tool!(NodeLookup, "lookup", "Node lookup");
tool!(CharterLookup, "lookup", "Charter lookup");
tool!(PackLookup, "lookup", "Pack lookup");
tool!(Answer, "answer", "Answer the user", true);
tool!(ParentShared, "shared", "Parent shared");
tool!(RootShared, "shared", "Root shared");
tool!(ParentTool, "parentTool", "Parent only");
tool!(RootTool, "rootTool", "Root only");
tool!(Clock, "clock", "Charter clock");
tool!(Note, "note", "Pack note");

#[derive(Serialize, Deserialize, JsonSchema)]
struct Counter {
    count: i64,
}

fn code_with(description: &str, arguments: Option<Value>) -> Transition {
    Transition::code_with_arguments(description, arguments, |_input| async {
        Err::<TransitionResult, _>("not taken in these tests".to_owned())
    })
}

fn charter() -> Charter {
    Charter::builder("test")
        .prompt_style(PromptStyle::Upstream)
        .tool(CharterLookup)
        .tool(Clock)
        .transition("goBack", code_with("Go back", None))
        .build()
        .expect("charter builds")
}

fn pack() -> Pack {
    Pack::builder("notes", "Notes")
        .tool(Note)
        .tool(PackLookup)
        .build()
        .expect("pack builds")
}

fn leaf() -> Node {
    Node::builder("Leaf.")
        .name("leaf")
        .state(Counter { count: 0 })
        .tool(NodeLookup)
        .tool(Answer)
        .transition("next", Transition::to_ref("Go next", "other"))
        .transition("back", Transition::reference("goBack"))
        .transition(
            "pick",
            code_with(
                "Pick an item",
                Some(json!({
                    "type": "object",
                    "properties": {
                        "qty": {"type": "integer"},
                        "item": {"type": "string"},
                    },
                    "required": ["item"],
                })),
            ),
        )
        .transition(
            "raw",
            code_with("Raw argument", Some(json!({"type": "string"}))),
        )
        .transition("free", Transition::general("Go anywhere"))
        .transition(
            "fixed",
            Transition::Serial {
                description: "Fixed target".into(),
                target: NodeTarget::Ref("other".into()),
                arguments: Some(json!({"type": "object", "properties": {"x": {"type": "number"}}})),
            },
        )
        .pack(pack())
        .build()
        .expect("leaf builds")
}

fn ancestor_nodes() -> (Node, Node) {
    let root = Node::builder("Root.")
        .tool(RootTool)
        .tool(RootShared)
        .build()
        .expect("root builds");
    let parent = Node::builder("Parent.")
        .tool(ParentShared)
        .tool(ParentTool)
        .build()
        .expect("parent builds");
    (root, parent)
}

fn names(tools: &[ToolDefinition]) -> Vec<&str> {
    tools.iter().map(|t| t.name.as_str()).collect()
}

fn find<'a>(tools: &'a [ToolDefinition], name: &str) -> &'a ToolDefinition {
    tools
        .iter()
        .find(|t| t.name.as_str() == name)
        .unwrap_or_else(|| panic!("no tool {name}"))
}

fn reason() -> Value {
    json!({"type": "string", "description": "Why you are making this transition"})
}

/// The whole tool list of a leaf as the model sees it, as a snapshot
/// (`UPDATE_EXPECT=1 cargo test` rewrites it after a deliberate change).
#[test]
fn the_tool_list_snapshot() {
    let tools = generate_tools(&charter(), &leaf(), &[], false).expect("tools generate");
    let text = serde_json::to_string_pretty(&tools).expect("tools serialize");
    expect_test::expect![[r#"
        [
          {
            "name": "updateState",
            "description": "Update the current state with a partial patch. The patch will be shallow-merged with the current state.",
            "input_schema": {
              "properties": {
                "patch": {
                  "properties": {
                    "count": {
                      "format": "int64",
                      "type": "integer"
                    }
                  },
                  "type": "object"
                }
              },
              "required": [
                "patch"
              ],
              "type": "object"
            }
          },
          {
            "name": "transition",
            "description": "Transition to a different node. Use this when the current task is complete or you need different capabilities.",
            "input_schema": {
              "properties": {
                "reason": {
                  "description": "Why you are making this transition",
                  "type": "string"
                },
                "to": {
                  "description": "The name of the transition to take",
                  "enum": [
                    "next",
                    "back"
                  ],
                  "type": "string"
                }
              },
              "required": [
                "to",
                "reason"
              ],
              "type": "object"
            }
          },
          {
            "name": "transition_pick",
            "description": "Pick an item",
            "input_schema": {
              "properties": {
                "item": {
                  "type": "string"
                },
                "qty": {
                  "type": "integer"
                },
                "reason": {
                  "description": "Why you are making this transition",
                  "type": "string"
                }
              },
              "required": [
                "reason",
                "item",
                "qty"
              ],
              "type": "object"
            }
          },
          {
            "name": "transition_raw",
            "description": "Raw argument",
            "input_schema": {
              "properties": {
                "args": {
                  "type": "string"
                },
                "reason": {
                  "description": "Why you are making this transition",
                  "type": "string"
                }
              },
              "required": [
                "reason",
                "args"
              ],
              "type": "object"
            }
          },
          {
            "name": "transition_free",
            "description": "Go anywhere",
            "input_schema": {
              "properties": {
                "node": {
                  "description": "Inline node definition",
                  "properties": {
                    "instructions": {
                      "description": "Instructions for the agent in this node",
                      "type": "string"
                    },
                    "tools": {
                      "description": "Tool references available in this node",
                      "items": {
                        "properties": {
                          "ref": {
                            "type": "string"
                          }
                        },
                        "required": [
                          "ref"
                        ],
                        "type": "object"
                      },
                      "type": "array"
                    },
                    "transitions": {
                      "description": "Available transitions from this node",
                      "type": "object"
                    },
                    "validator": {
                      "description": "Zodex-serialized state schema",
                      "type": "object"
                    }
                  },
                  "required": [
                    "instructions",
                    "tools",
                    "validator",
                    "transitions"
                  ],
                  "type": "object"
                },
                "reason": {
                  "description": "Why you are making this transition",
                  "type": "string"
                }
              },
              "required": [
                "reason",
                "node"
              ],
              "type": "object"
            }
          },
          {
            "name": "transition_fixed",
            "description": "Fixed target",
            "input_schema": {
              "properties": {
                "args": {
                  "properties": {
                    "x": {
                      "type": "number"
                    }
                  },
                  "type": "object"
                },
                "reason": {
                  "description": "Why you are making this transition",
                  "type": "string"
                }
              },
              "required": [
                "reason",
                "args"
              ],
              "type": "object"
            }
          },
          {
            "name": "lookup",
            "description": "Node lookup",
            "input_schema": {
              "type": "object"
            }
          },
          {
            "name": "answer",
            "description": "Answer the user",
            "input_schema": {
              "type": "object"
            },
            "terminal": true
          },
          {
            "name": "clock",
            "description": "Charter clock",
            "input_schema": {
              "type": "object"
            }
          },
          {
            "name": "note",
            "description": "Pack note",
            "input_schema": {
              "type": "object"
            }
          }
        ]"#]].assert_eq(&text);
}

#[test]
fn tools_come_in_spec_order_with_shadowing() {
    let charter = charter();
    let node = leaf();
    let (root, parent) = ancestor_nodes();
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
    let tools = generate_tools(&charter, &node, &ancestors, false).expect("tools generate");
    assert_eq!(
        names(&tools),
        [
            "updateState",
            "transition",
            "transition_pick",
            "transition_raw",
            "transition_free",
            "transition_fixed",
            "lookup",
            "answer",
            "shared",
            "parentTool",
            "rootTool",
            "clock",
            "note",
        ]
    );
    // The node's lookup shadows the charter's and the pack's; the parent's
    // shared tool shadows the root's.
    assert_eq!(find(&tools, "lookup").description, "Node lookup");
    assert_eq!(find(&tools, "shared").description, "Parent shared");
    // Only tools declared terminal are terminal; built-ins never are.
    let terminal: Vec<_> = tools
        .iter()
        .filter(|t| t.terminal)
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(terminal, ["answer"]);
}

#[test]
fn update_state_takes_a_partial_patch() {
    let charter = charter();
    let node = leaf();
    let tools = generate_tools(&charter, &node, &[], false).expect("tools generate");
    let update = &tools[0];
    assert_eq!(update.name.as_str(), UPDATE_STATE);
    assert_eq!(
        update.description,
        "Update the current state with a partial patch. The patch will be shallow-merged with the current state."
    );
    let patch = node.schema().partial_json_schema();
    assert!(patch.get("required").is_none());
    assert_eq!(patch["properties"]["count"]["type"], "integer");
    assert_eq!(
        update.input_schema,
        json!({
            "type": "object",
            "properties": {"patch": patch},
            "required": ["patch"],
        })
    );

    // Without a state type, the patch is any object.
    let bare = Node::builder("Bare.").build().expect("node builds");
    let tools = generate_tools(&charter, &bare, &[], false).expect("tools generate");
    assert_eq!(names(&tools), ["updateState", "lookup", "clock"]);
    assert_eq!(
        tools[0].input_schema,
        json!({
            "type": "object",
            "properties": {"patch": {"type": "object"}},
            "required": ["patch"],
        })
    );
}

#[test]
fn transitions_without_arguments_share_one_tool() {
    let tools = generate_tools(&charter(), &leaf(), &[], false).expect("tools generate");
    let transition = &tools[1];
    assert_eq!(transition.name.as_str(), TRANSITION);
    assert_eq!(
        transition.description,
        "Transition to a different node. Use this when the current task is complete or you need different capabilities."
    );
    assert_eq!(
        transition.input_schema,
        json!({
            "type": "object",
            "properties": {
                "to": {
                    "type": "string",
                    "enum": ["next", "back"],
                    "description": "The name of the transition to take",
                },
                "reason": reason(),
            },
            "required": ["to", "reason"],
        })
    );
    assert!(!transition.terminal);
}

#[test]
fn transitions_with_arguments_get_their_own_tools() {
    let tools = generate_tools(&charter(), &leaf(), &[], false).expect("tools generate");

    let pick = find(&tools, &format!("{TRANSITION_PREFIX}pick"));
    assert_eq!(pick.description, "Pick an item");
    assert_eq!(
        pick.input_schema,
        json!({
            "type": "object",
            "properties": {
                "reason": reason(),
                "item": {"type": "string"},
                "qty": {"type": "integer"},
            },
            // Optional `qty` is required too; argument names in sorted map order.
            "required": ["reason", "item", "qty"],
        })
    );
    // The `required` order is exact, not just set-equal.
    assert_eq!(
        pick.input_schema["required"],
        json!(["reason", "item", "qty"])
    );

    let raw = find(&tools, "transition_raw");
    assert_eq!(raw.description, "Raw argument");
    assert_eq!(
        raw.input_schema,
        json!({
            "type": "object",
            "properties": {"reason": reason(), "args": {"type": "string"}},
            "required": ["reason", "args"],
        })
    );

    let free = find(&tools, "transition_free");
    assert_eq!(free.description, "Go anywhere");
    assert_eq!(
        free.input_schema,
        json!({
            "type": "object",
            "properties": {
                "reason": reason(),
                "node": {
                    "type": "object",
                    "description": "Inline node definition",
                    "properties": {
                        "instructions": {
                            "type": "string",
                            "description": "Instructions for the agent in this node",
                        },
                        "tools": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {"ref": {"type": "string"}},
                                "required": ["ref"],
                            },
                            "description": "Tool references available in this node",
                        },
                        "validator": {
                            "type": "object",
                            "description": "Zodex-serialized state schema",
                        },
                        "transitions": {
                            "type": "object",
                            "description": "Available transitions from this node",
                        },
                    },
                    "required": ["instructions", "tools", "validator", "transitions"],
                },
            },
            "required": ["reason", "node"],
        })
    );

    let fixed = find(&tools, "transition_fixed");
    assert_eq!(fixed.description, "Fixed target");
    assert_eq!(
        fixed.input_schema,
        json!({
            "type": "object",
            "properties": {
                "reason": reason(),
                "args": {"type": "object", "properties": {"x": {"type": "number"}}},
            },
            "required": ["reason", "args"],
        })
    );
    assert!(!pick.terminal && !raw.terminal && !free.terminal && !fixed.terminal);
}

#[test]
fn argument_named_reason_is_required_once() {
    let node = Node::builder("Leaf.")
        .transition(
            "why",
            code_with(
                "Explain",
                Some(json!({"type": "object", "properties": {"reason": {"type": "string", "minLength": 3}}})),
            ),
        )
        .build()
        .expect("node builds");
    let tools = generate_tools(&charter(), &node, &[], false).expect("tools generate");
    let why = find(&tools, "transition_why");
    assert_eq!(
        why.input_schema,
        json!({
            "type": "object",
            "properties": {"reason": {"type": "string", "minLength": 3}},
            "required": ["reason"],
        })
    );
}

#[test]
fn ref_to_a_transition_with_arguments_gets_a_named_tool() {
    let charter = Charter::builder("test")
        .prompt_style(PromptStyle::Upstream)
        .transition("shared", Transition::general("Shared general"))
        .build()
        .expect("charter builds");
    let node = Node::builder("Leaf.")
        .transition("go", Transition::reference("shared"))
        .build()
        .expect("node builds");
    let tools = generate_tools(&charter, &node, &[], false).expect("tools generate");
    assert_eq!(names(&tools), ["updateState", "transition_go"]);
    assert_eq!(tools[1].description, "Shared general");
}

#[test]
fn pack_tools_only_for_non_workers() {
    let charter = charter();
    let node = leaf();
    let tools = generate_tools(&charter, &node, &[], true).expect("tools generate");
    assert!(!names(&tools).contains(&"note"));
    assert_eq!(names(&tools).last(), Some(&"clock"));
    let tools = generate_tools(&charter, &node, &[], false).expect("tools generate");
    assert_eq!(names(&tools).last(), Some(&"note"));

    let worker = Node::builder("Work.")
        .worker()
        .build()
        .expect("worker builds");
    let tools = generate_tools(&charter, &worker, &[], true).expect("tools generate");
    assert_eq!(names(&tools), ["updateState", "lookup", "clock"]);
}

#[test]
fn unknown_transition_refs_are_errors() {
    let charter = charter();
    let node = Node::builder("Leaf.")
        .transition("lost", Transition::reference("missing"))
        .build()
        .expect("node builds");
    let err = generate_tools(&charter, &node, &[], false).expect_err("unknown ref");
    assert_eq!(err, ConfigError::UnknownTransitionRef("missing".into()));
    assert_eq!(err.to_string(), "Unknown transition ref: missing");

    let node = Node::builder("Leaf.")
        .transition("lost", Transition::reference("ghost.t"))
        .build()
        .expect("node builds");
    let err = generate_tools(&charter, &node, &[], false).expect_err("unknown node");
    assert_eq!(
        err,
        ConfigError::UnknownNodeInTransitionRef("ghost.t".into())
    );
}

#[test]
fn cached_tool_lists_are_shared_per_node_and_context() {
    use markov_charter::toolgen::generate_tools_cached;
    let node = Node::builder("Cached.").build().expect("node");
    let charter = Charter::builder("c").build().expect("charter");
    let first = generate_tools_cached(&charter, &node, &[], false).expect("tools");
    let again = generate_tools_cached(&charter, &node, &[], false).expect("tools");
    assert!(std::sync::Arc::ptr_eq(&first, &again));
    let worker = generate_tools_cached(&charter, &node, &[], true).expect("tools");
    assert!(!std::sync::Arc::ptr_eq(&first, &worker));
    assert_eq!(
        &*first,
        generate_tools(&charter, &node, &[], false)
            .expect("tools")
            .as_slice()
    );
}
