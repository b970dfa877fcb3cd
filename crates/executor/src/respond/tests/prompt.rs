//! Byte-exact tests of the system prompt, as snapshots (`UPDATE_EXPECT=1
//! cargo test` rewrites them after a deliberate change; review the diff).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::respond::prompt::{STEP_WARNING_CRITICAL, system_prompt};
use expect_test::expect;
use markov_charter::charter::{AncestorView, Charter, PromptInput, PromptStyle};
use markov_charter::node::Node;
use markov_charter::pack::Pack;
use markov_charter::transition::Transition;
use markov_core::tool::ToolDefinition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

#[derive(Serialize, Deserialize, JsonSchema)]
struct Counter {
    count: i64,
}

#[derive(Serialize, Deserialize, JsonSchema)]
struct Mode {
    mode: String,
}

const IMPORTANT: &str = "**Important**: After calling a transition tool, you MUST respond to the user in your next message. Greet them or acknowledge the transition context - do not end your turn silently.";

fn plain_charter() -> Charter {
    Charter::builder("test")
        .prompt_style(PromptStyle::Upstream)
        .build()
        .expect("charter builds")
}

fn counter_node() -> Node {
    Node::builder("You count things.")
        .state(Counter { count: 0 })
        .transition(
            "next",
            Transition::to_ref("Move on to the next step", "other"),
        )
        .transition("shared", Transition::reference("shared"))
        .build()
        .expect("node builds")
}

static NO_PACK_STATES: BTreeMap<String, Value> = BTreeMap::new();

/// An input without ancestors, packs or pack states, at step 1 of 10.
fn base<'a>(charter: &'a Charter, node: &'a Node, state: &'a Value) -> PromptInput<'a> {
    PromptInput {
        charter,
        node,
        state,
        ancestors: &[],
        pack_states: &NO_PACK_STATES,
        packs: &[],
        current_step: 1,
        max_steps: 10,
    }
}

fn simple(charter: &Charter, node: &Node, state: &Value, steps: (usize, usize)) -> String {
    let input = PromptInput {
        current_step: steps.0,
        max_steps: steps.1,
        ..base(charter, node, state)
    };
    system_prompt(&input, &[])
}

#[test]
fn default_prompt_has_state_and_transitions() {
    let node = counter_node();
    let state = json!({"count": 0});
    let prompt = simple(&plain_charter(), &node, &state, (1, 10));
    expect![[r#"
        You count things.

        ## Current Node State
        ```json
        {
          "count": 0
        }
        ```

        ## Available Transitions
        - **next**: Move on to the next step
        - **shared**: Transition

        **Important**: After calling a transition tool, you MUST respond to the user in your next message. Greet them or acknowledge the transition context - do not end your turn silently."#]].assert_eq(&prompt);
    assert!(prompt.contains("\"count\": 0"));
    assert!(!prompt.ends_with('\n'));
}

#[test]
fn no_transitions_prints_none() {
    let node = Node::builder("Idle.").build().expect("node builds");
    let state = json!({});
    let prompt = simple(&plain_charter(), &node, &state, (1, 10));
    expect![[r#"
        Idle.

        ## Current Node State
        ```json
        {}
        ```

        ## Available Transitions
        None

        **Important**: After calling a transition tool, you MUST respond to the user in your next message. Greet them or acknowledge the transition context - do not end your turn silently."#]].assert_eq(&prompt);
}

#[test]
fn ancestor_context_numbers_from_the_root_and_truncates_by_chars() {
    // 99 ASCII chars, then multi-byte chars: the cut falls after the first "é".
    let long = format!("{}éèà and more", "r".repeat(99));
    let root = Node::builder(long).build().expect("root builds");
    let parent = Node::builder("Parent node.")
        .build()
        .expect("parent builds");
    let leaf = Node::builder("Leaf.").build().expect("leaf builds");
    let root_state = json!({"a": 1, "b": [true, null]});
    let parent_state = json!({});
    let ancestors = [
        AncestorView {
            node: &root,
            state: &root_state,
        },
        AncestorView {
            node: &parent,
            state: &parent_state,
        },
    ];
    let state = json!({"x": "y"});
    let prompt = system_prompt(
        &PromptInput {
            ancestors: &ancestors,
            ..base(&plain_charter(), &leaf, &state)
        },
        &[],
    );
    // Cut by characters, not bytes: 99 `r`s and the multi-byte `é`, then `...`.
    assert!(
        prompt.contains(&format!("{}é...", "r".repeat(99))),
        "{prompt}"
    );
    expect![[r#"
        Leaf.

        ## Current Node State
        ```json
        {
          "x": "y"
        }
        ```

        ## Available Transitions
        None

        **Important**: After calling a transition tool, you MUST respond to the user in your next message. Greet them or acknowledge the transition context - do not end your turn silently.

        ## Ancestor Context
        ### Ancestor 2: rrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrrré...
        State: {
          "a": 1,
          "b": [
            true,
            null
          ]
        }

        ### Ancestor 1: Parent node....
        State: {}"#]].assert_eq(&prompt);
}

fn packs() -> Vec<Pack> {
    vec![
        Pack::builder("notes", "Keeps notes.")
            .instructions("  Use the notes tool.\n")
            .build()
            .expect("pack builds"),
        Pack::builder("hidden", "Sometimes silent.")
            .dynamic_instructions(|state| {
                if state["on"] == json!(true) {
                    "On!".into()
                } else {
                    "   ".into()
                }
            })
            .build()
            .expect("pack builds"),
        Pack::builder("mode", "Has a mode.")
            .state(Mode {
                mode: "ENABLED".into(),
            })
            .dynamic_instructions(|state| {
                format!("Mode is {}", state["mode"].as_str().unwrap_or("?"))
            })
            .build()
            .expect("pack builds"),
        Pack::builder("bare", "No state at all.")
            .build()
            .expect("pack builds"),
    ]
}

#[test]
fn packs_section_shows_instructions_and_states() {
    let node = Node::builder("Leaf.").build().expect("node builds");
    let state = json!({});
    let packs = packs();
    let pack_states = BTreeMap::from([
        ("notes".to_owned(), json!({"items": ["a"]})),
        ("hidden".to_owned(), json!({"on": false})),
        // A null state counts as missing: the initial state is shown.
        ("mode".to_owned(), Value::Null),
    ]);
    let prompt = system_prompt(
        &PromptInput {
            packs: &packs,
            pack_states: &pack_states,
            ..base(&plain_charter(), &node, &state)
        },
        &[],
    );
    expect![[r#"
        Leaf.

        ## Current Node State
        ```json
        {}
        ```

        ## Available Transitions
        None

        **Important**: After calling a transition tool, you MUST respond to the user in your next message. Greet them or acknowledge the transition context - do not end your turn silently.

        ## Active Packs
        ### notes
        Keeps notes.

        Instructions:
        Use the notes tool.

        State: ```json
        {
          "items": [
            "a"
          ]
        }
        ```

        ### hidden
        Sometimes silent.

        State: ```json
        {
          "on": false
        }
        ```

        ### mode
        Has a mode.

        Instructions:
        Mode is ENABLED

        State: ```json
        {
          "mode": "ENABLED"
        }
        ```

        ### bare
        No state at all.

        State: ```json
        {}
        ```"#]].assert_eq(&prompt);

    // A non-empty dynamic result is shown.
    let on = BTreeMap::from([("hidden".to_owned(), json!({"on": true}))]);
    let prompt = system_prompt(
        &PromptInput {
            packs: &packs[1..2],
            pack_states: &on,
            ..base(&plain_charter(), &node, &state)
        },
        &[],
    );
    assert!(prompt.ends_with(
        "## Active Packs
### hidden
Sometimes silent.

Instructions:
On!

State: ```json
{
  \"on\": true
}
```"
    ));
}

#[test]
fn packs_section_is_absent_for_workers_and_without_packs() {
    let worker = Node::builder("Work.")
        .worker()
        .build()
        .expect("worker builds");
    let state = json!({});
    let packs = packs();
    let prompt = system_prompt(
        &PromptInput {
            packs: &packs,
            ..base(&plain_charter(), &worker, &state)
        },
        &[],
    );
    assert!(!prompt.contains("## Active Packs"));
    assert!(prompt.ends_with(IMPORTANT));

    let node = Node::builder("Leaf.").build().expect("node builds");
    let prompt = simple(&plain_charter(), &node, &state, (1, 10));
    assert!(!prompt.contains("## Active Packs"));
}

#[test]
fn step_warnings_follow_remaining_steps() {
    let node = Node::builder("Leaf.").build().expect("node builds");
    let state = json!({});
    let base = simple(&plain_charter(), &node, &state, (1, 10));
    let cases = [
        ((7, 10), None),
        (
            (8, 10),
            Some("⚠️ NOTICE: You have 2 steps remaining. Start wrapping up your work soon."),
        ),
        (
            (9, 10),
            Some(
                "⚠️ WARNING: You have only 1 step remaining after this one. Wrap up your work and prepare to respond to the user.",
            ),
        ),
        (
            (10, 10),
            Some(
                "⚠️ CRITICAL: This is your FINAL step. You MUST respond to the user now with whatever progress you have made. Do not use any tools.",
            ),
        ),
        (
            (11, 10),
            Some(
                "⚠️ CRITICAL: This is your FINAL step. You MUST respond to the user now with whatever progress you have made. Do not use any tools.",
            ),
        ),
    ];
    for (steps, warning) in cases {
        let prompt = simple(&plain_charter(), &node, &state, steps);
        let expected = match warning {
            Some(w) => format!("{base}\n\n{w}"),
            None => base.clone(),
        };
        assert_eq!(prompt, expected, "steps {steps:?}");
    }
}

#[test]
fn charter_instructions_are_prepended() {
    let charter = Charter::builder("test")
        .prompt_style(PromptStyle::Upstream)
        .instructions("You are helpful.")
        .build()
        .expect("charter builds");
    let node = Node::builder("Leaf.").build().expect("node builds");
    let state = json!({});
    let with = simple(&charter, &node, &state, (1, 10));
    let without = simple(&plain_charter(), &node, &state, (1, 10));
    assert_eq!(with, format!("You are helpful.\n\n{without}"));
    assert!(without.starts_with("Leaf.\n\n## Current Node State"));
}

#[derive(Debug, Clone, PartialEq)]
struct Seen {
    node: Option<String>,
    state: Value,
    ancestors: Vec<(String, Value)>,
    pack_states: BTreeMap<String, Value>,
    packs: Vec<String>,
    steps: (usize, usize),
}

#[test]
fn custom_builder_is_used_verbatim_with_unchanged_inputs() {
    let seen: Arc<Mutex<Option<Seen>>> = Arc::new(Mutex::new(None));
    let record = Arc::clone(&seen);
    let charter = Charter::builder("test")
        .prompt_style(PromptStyle::Upstream)
        .instructions("Never shown.")
        .system_prompt(move |input: &PromptInput<'_>| {
            *record.lock().expect("lock") = Some(Seen {
                node: input.node.name().map(str::to_owned),
                state: input.state.clone(),
                ancestors: input
                    .ancestors
                    .iter()
                    .map(|a| (a.node.instructions().to_owned(), a.state.clone()))
                    .collect(),
                pack_states: input.pack_states.clone(),
                packs: input.packs.iter().map(|p| p.name().to_owned()).collect(),
                steps: (input.current_step, input.max_steps),
            });
            format!("Custom prompt for {}", input.node.instructions())
        })
        .build()
        .expect("charter builds");
    let node = Node::builder("Leaf.")
        .name("leaf")
        .build()
        .expect("node builds");
    let root = Node::builder("Root.").build().expect("root builds");
    let root_state = json!({"r": 1});
    let ancestors = [AncestorView {
        node: &root,
        state: &root_state,
    }];
    let state = json!({"count": 3});
    let pack_states = BTreeMap::from([("notes".to_owned(), json!({"n": 2}))]);
    let packs = packs();
    let terminal = ToolDefinition::new("answer", "Answers", json!({"type": "object"}))
        .expect("valid name")
        .terminal(true);
    let prompt = system_prompt(
        &PromptInput {
            ancestors: &ancestors,
            packs: &packs[..1],
            pack_states: &pack_states,
            current_step: 10,
            max_steps: 10,
            ..base(&charter, &node, &state)
        },
        &[terminal],
    );
    assert_eq!(prompt, "Custom prompt for Leaf.");
    let seen = seen.lock().expect("lock").clone();
    assert_eq!(
        seen,
        Some(Seen {
            node: Some("leaf".into()),
            state,
            ancestors: vec![("Root.".into(), root_state)],
            pack_states,
            packs: vec!["notes".into()],
            steps: (10, 10),
        })
    );
}

#[test]
fn terminal_tools_section_follows_transitions() {
    let node = counter_node();
    let root = Node::builder("Root.").build().expect("root builds");
    let root_state = json!({});
    let ancestors = [AncestorView {
        node: &root,
        state: &root_state,
    }];
    let state = json!({"count": 0});
    let tools = vec![
        ToolDefinition::new("updateState", "Update", json!({"type": "object"})).expect("name"),
        ToolDefinition::new(
            "formatResult",
            "Format items into the final response",
            json!({}),
        )
        .expect("name")
        .terminal(true),
        ToolDefinition::new("lookup", "Look something up", json!({})).expect("name"),
        ToolDefinition::new("done", "Say goodbye", json!({}))
            .expect("name")
            .terminal(true),
    ];
    let prompt = system_prompt(
        &PromptInput {
            ancestors: &ancestors,
            ..base(&plain_charter(), &node, &state)
        },
        &tools,
    );
    expect![[r#"
        You count things.

        ## Current Node State
        ```json
        {
          "count": 0
        }
        ```

        ## Available Transitions
        - **next**: Move on to the next step
        - **shared**: Transition

        **Important**: After calling a transition tool, you MUST respond to the user in your next message. Greet them or acknowledge the transition context - do not end your turn silently.

        ## Terminal Tools
        These tools generate your final response:
        - formatResult: Format items into the final response
        - done: Say goodbye

        When you call a terminal tool, its output IS your response. Do not add text after calling one.

        ## Ancestor Context
        ### Ancestor 1: Root....
        State: {}"#]].assert_eq(&prompt);

    let non_terminal: Vec<_> = tools.into_iter().filter(|t| !t.terminal).collect();
    let prompt = system_prompt(
        &PromptInput {
            ancestors: &ancestors,
            ..base(&plain_charter(), &node, &state)
        },
        &non_terminal,
    );
    assert!(!prompt.contains("## Terminal Tools"));
    assert!(prompt.contains(&format!("{IMPORTANT}\n\n## Ancestor Context\n")));
}

#[test]
fn no_step_warning_when_a_step_value_is_zero() {
    use crate::respond::prompt::step_warning;
    // Upstream treats 0 as "not given".
    assert_eq!(step_warning(0, 10), None);
    assert_eq!(step_warning(1, 0), None);
    assert_eq!(step_warning(3, 3), Some(STEP_WARNING_CRITICAL));
}

/// The default style writes only what applies to the node.
#[test]
fn a_node_without_state_or_transitions_gets_no_empty_sections() {
    let charter = Charter::builder("test").build().expect("charter builds");
    let node = Node::builder("You help.").build().expect("node builds");
    let prompt = simple(&charter, &node, &json!({}), (1, 10));
    expect![[r#"You help."#]].assert_eq(&prompt);
}

#[test]
fn a_node_with_state_or_transitions_gets_their_sections() {
    let charter = Charter::builder("test").build().expect("charter builds");
    let node = counter_node();
    let prompt = simple(&charter, &node, &json!({"count": 2}), (1, 10));
    assert!(prompt.contains("## Current Node State"), "{prompt}");
    assert!(
        prompt.contains("## Available Transitions\n- **next**"),
        "{prompt}"
    );
    // A stateless node given a non-empty state still sees it.
    let plain = Node::builder("You help.").build().expect("node builds");
    let prompt = simple(&charter, &plain, &json!({"topic": "rust"}), (1, 10));
    assert!(prompt.contains("\"topic\": \"rust\""), "{prompt}");
    assert!(!prompt.contains("## Available Transitions"), "{prompt}");
}
