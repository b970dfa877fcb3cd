//! Machine snapshots: round trips, the JSON shape, typed
//! errors for malformed input, and properties (no panic on random JSON; a
//! snapshot of registered nodes is a fixed point).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::*;
use markov_charter::ConfigError;
use markov_charter::charter::Charter;
use markov_charter::command::{Command, CommandContext, CommandResult};
use markov_charter::node::{ExecutorConfig, Node};
use markov_charter::pack::Pack;
use markov_charter::serial::{SerialError, serialize_node};
use markov_charter::transition::{Transition, transition_to};
use markov_core::InstanceId;
use markov_core::async_trait;
use markov_executor::serialize::{
    DeserializeError, SerializeError, SerializedMachine, serialize_machine,
};
use markov_executor::{
    Executor, Instance, Machine, RunOptions, StandardExecutor, SuspendInfo, run_to_completion,
};
use markov_testkit::ScriptedModel;
use proptest::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};

/// 2024-01-15T10:30:00.000Z.
fn jan_15() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_705_314_600)
}

fn counter_node() -> Node {
    Node::builder("Count things.")
        .name("counter")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .tool(Increment)
        .build()
        .expect("node builds")
}

fn todo_pack() -> Pack {
    Pack::builder("todo", "A todo list")
        .dynamic_instructions(|s| format!("{} items", s["items"].as_array().map_or(0, Vec::len)))
        .build()
        .expect("pack builds")
}

fn executor() -> Arc<dyn Executor> {
    Arc::new(StandardExecutor::new(ScriptedModel::builder().build()))
}

struct Fixture {
    charter: Charter,
    main: Node,
    helper: Node,
}

fn fixture() -> Fixture {
    let main = counter_node();
    let helper = Node::builder("Help.")
        .pack(todo_pack())
        .build()
        .expect("node builds");
    let charter = Charter::builder("test")
        .node("main", main.clone())
        .node("helper", helper.clone())
        .pack(todo_pack())
        .build()
        .expect("charter builds");
    Fixture {
        charter,
        main,
        helper,
    }
}

fn roundtrip(charter: &Charter, machine: &Machine) -> (String, Machine) {
    let snapshot = serialize_machine(machine).expect("serializes");
    let text = serde_json::to_string(&snapshot).expect("to json");
    let read = serde_json::from_str::<SerializedMachine>(&text).expect("reads");
    let restored = restore_on(charter.clone(), executor(), read).expect("deserializes");
    (text, restored)
}

#[test]
fn registered_nodes_round_trip_ids_tree_states_suspension_and_packs() {
    let f = fixture();
    let child = Instance::with_id("child-1".into(), f.helper.clone(), json!({"note": "x"}))
        .with_suspended(SuspendInfo {
            suspend_id: "s1".into(),
            reason: "approval".into(),
            suspended_at: jan_15() + Duration::from_millis(123),
            metadata: Some(json!({"who": "ops"})),
        });
    let root = Instance::with_id(
        "root".into(),
        f.main.clone(),
        json!({"count": 3, "label": "a"}),
    )
    .with_child(child)
    .with_child(Instance::with_id(
        "child-2".into(),
        f.main.clone(),
        json!({"count": 1}),
    ));
    let mut machine = machine_with_history(
        f.charter.clone(),
        executor(),
        root,
        vec![markov_core::Message::user("hi")],
    );
    // Pack state as a tool would have left it.
    let (_, restored) = roundtrip(&f.charter, &machine);
    assert_eq!(
        restored.instance().pack_states()["todo"],
        Value::Null,
        "a pack without initial state keeps its null state"
    );

    // Now with a pack state.
    let with_items = {
        let snapshot = serialize_machine(&machine).expect("serializes");
        let mut v = serde_json::to_value(&snapshot).expect("json");
        v["instance"]["packInstances"][0]["state"] = json!({"items": [1, 2]});
        SerializedMachine::from_json_value(v).expect("reads")
    };
    machine = restore_on(f.charter.clone(), executor(), with_items).expect("deserializes");

    let (text, restored) = roundtrip(&f.charter, &machine);
    let json: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(json["formatVersion"], 1);
    assert_eq!(json["instance"]["node"], json!({"ref": "main"}));
    assert_eq!(
        json["instance"]["packInstances"],
        json!([{"state": {"items": [1, 2]}, "pack": {"ref": "todo"}}])
    );
    let c1 = &json["instance"]["children"][0];
    assert_eq!(
        c1["suspended"],
        json!({"suspendId": "s1", "reason": "approval",
               "suspendedAt": "2024-01-15T10:30:00.123Z", "metadata": {"who": "ops"}})
    );
    assert!(c1.get("children").is_none(), "empty children are omitted");
    assert!(c1.get("packInstances").is_none());
    assert_eq!(json["history"][0]["role"], "user");

    let root = restored.instance();
    assert_eq!(root.id().as_str(), "root");
    assert_eq!(
        root.node().id(),
        f.main.id(),
        "a ref keeps the node's identity"
    );
    assert_eq!(root.state(), &json!({"count": 3, "label": "a"}));
    let kids: Vec<_> = root.children().iter().map(|c| c.id().to_string()).collect();
    assert_eq!(kids, ["child-1", "child-2"]);
    assert_eq!(root.children()[0].node().id(), f.helper.id());
    assert_eq!(
        root.children()[0].suspended(),
        machine.instance().children()[0].suspended()
    );
    // The parsed state is stored: the typed node fills `label`.
    assert_eq!(
        root.children()[1].state(),
        &json!({"count": 1, "label": ""})
    );
    assert_eq!(root.pack_states()["todo"], json!({"items": [1, 2]}));
    assert_eq!(root.packs().len(), 1);
    assert_eq!(
        root.packs()[0]
            .instructions()
            .render(&root.pack_states()["todo"]),
        "2 items"
    );
    assert_eq!(restored.history(), machine.history());
    assert!(restored.queue().is_empty());
}

#[test]
fn suspended_at_is_iso_with_milliseconds_and_restores_equal() {
    let f = fixture();
    let info = SuspendInfo {
        suspend_id: "wait-1".into(),
        reason: "needs approval".into(),
        suspended_at: jan_15(),
        metadata: Some(json!({"ticket": 7})),
    };
    let machine = machine_on_shared(
        f.charter.clone(),
        executor(),
        Instance::new(f.main.clone(), json!({"count": 0})).with_suspended(info.clone()),
    )
    .expect("machine builds");
    let snapshot = serialize_machine(&machine).expect("serializes");
    let stored = snapshot.instance.suspended.as_ref().expect("suspended");
    assert_eq!(stored.suspended_at, "2024-01-15T10:30:00.000Z");
    let (_, restored) = roundtrip(&f.charter, &machine);
    assert_eq!(restored.instance().suspended(), Some(&info));
}

#[test]
fn sub_millisecond_time_is_truncated_and_ancient_time_is_an_error() {
    let f = fixture();
    let suspend = |at| {
        Instance::new(f.main.clone(), json!({"count": 0})).with_suspended(SuspendInfo {
            suspend_id: "s".into(),
            reason: "r".into(),
            suspended_at: at,
            metadata: None,
        })
    };
    let m = machine_on(
        f.charter.clone(),
        StandardExecutor::new(ScriptedModel::builder().build()),
        suspend(jan_15() + Duration::from_micros(1_999)),
    )
    .expect("machine builds");
    let (_, restored) = roundtrip(&f.charter, &m);
    assert_eq!(
        restored.instance().suspended().map(|s| s.suspended_at),
        Some(jan_15() + Duration::from_millis(1))
    );
    let m = machine_on(
        f.charter.clone(),
        StandardExecutor::new(ScriptedModel::builder().build()),
        suspend(UNIX_EPOCH - Duration::from_secs(1)),
    )
    .expect("machine builds");
    assert!(matches!(
        serialize_machine(&m),
        Err(SerializeError::InvalidTimestamp(_))
    ));
}

/// A node command for the command-ref test.
struct Reset;

#[derive(Deserialize, schemars::JsonSchema)]
struct ResetInput {}

#[async_trait]
impl Command for Reset {
    const NAME: &'static str = "reset";
    type Input = ResetInput;
    type Error = Infallible;
    fn description(&self) -> String {
        "Reset".into()
    }
    async fn execute(
        &self,
        _: ResetInput,
        _cx: &CommandContext<'_>,
    ) -> Result<CommandResult, Infallible> {
        Ok(CommandResult::done())
    }
}

/// A charter with a shared tool, a registered code transition, a node holding
/// a command, and an inline node using all of them.
fn inline_fixture() -> (Charter, Node) {
    let done = Transition::code("Finish", |_| async {
        Ok(markov_charter::transition::cede(None))
    });
    let with_command = Node::builder("Has a command.")
        .command(Reset)
        .transition("finish", done.clone())
        .build()
        .expect("node builds");
    let charter = Charter::builder("test")
        .tool(Add)
        .node("main", counter_node())
        .node("commander", with_command.clone())
        .transition("done", done.clone())
        .build()
        .expect("charter builds");
    let add = charter.tools().get("add").cloned().expect("add");
    let reset = with_command.command("reset").cloned().expect("reset");
    let target = Node::builder("Inner.")
        .name("inner")
        .build()
        .expect("node builds");
    let inline = Node::builder("Work inline.")
        .name("worker-ish")
        .state(Counter {
            count: 5,
            label: "z".into(),
        })
        .shared_tool(add)
        .shared_command("reset", reset)
        .transition("done", done)
        .transition("back", Transition::reference("commander.finish"))
        .transition(
            "to_main",
            Transition::Serial {
                description: "Go to main".into(),
                target: markov_charter::transition::NodeTarget::Ref("main".into()),
                arguments: Some(
                    json!({"type": "object", "properties": {"why": {"type": "string"}}}),
                ),
            },
        )
        .transition("deeper", Transition::to("Go deeper", target))
        .executor_config(ExecutorConfig {
            model: Some("m".into()),
            max_tokens: Some(100),
            temperature: Some(0.7),
        })
        .build()
        .expect("node builds");
    (charter, inline)
}

#[test]
fn inline_node_round_trips_instructions_schema_transitions_tools_commands() {
    let (charter, inline) = inline_fixture();
    let machine = machine_on_shared(
        charter.clone(),
        executor(),
        Instance::with_id(
            "i".into(),
            inline.clone(),
            json!({"count": 5, "label": "z"}),
        ),
    )
    .expect("machine builds");
    let first = serialize_machine(&machine).expect("serializes");
    let node = serde_json::to_value(&first.instance.node).expect("json");
    assert_eq!(node["name"], "worker-ish");
    assert_eq!(node["instructions"], "Work inline.");
    assert_eq!(node["validator"]["required"], json!(["count"]));
    assert_eq!(node["transitions"]["done"], json!({"ref": "done"}));
    assert_eq!(
        node["transitions"]["back"],
        json!({"ref": "commander.finish"})
    );
    assert_eq!(
        node["transitions"]["to_main"],
        json!({"type": "serial", "description": "Go to main", "node": {"ref": "main"},
               "arguments": {"type": "object", "properties": {"why": {"type": "string"}}}}),
        "description and arguments are kept (upstream loses them)"
    );
    assert_eq!(node["transitions"]["deeper"]["description"], "Go deeper");
    assert_eq!(
        node["transitions"]["deeper"]["node"]["instructions"],
        "Inner."
    );
    assert_eq!(node["tools"], json!({"add": {"ref": "add"}}));
    assert_eq!(
        node["commands"],
        json!({"reset": {"ref": "commander.reset"}})
    );
    assert_eq!(node["initialState"], json!({"count": 5, "label": "z"}));
    assert_eq!(
        node["executorConfig"],
        json!({"model": "m", "maxTokens": 100, "temperature": 0.7})
    );

    let text = serde_json::to_string(&first).expect("json");
    let restored = restore_on(
        charter.clone(),
        executor(),
        serde_json::from_str::<SerializedMachine>(&text).expect("reads"),
    )
    .expect("deserializes");
    let n = restored.instance().node();
    assert_ne!(n.id(), inline.id(), "an inline node is a new node");
    assert_eq!(n.instructions(), "Work inline.");
    assert_eq!(n.schema().json_schema(), inline.schema().json_schema());
    let names: Vec<_> = n.transitions().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["done", "back", "to_main", "deeper"], "order kept");
    assert_eq!(
        n.transition("to_main").and_then(Transition::description),
        Some("Go to main")
    );
    assert_eq!(n.initial_state(), inline.initial_state());
    assert_eq!(n.executor_config(), inline.executor_config());
    assert!(n.tools().get("add").is_some());
    assert!(n.command("reset").is_some());
    // And the second snapshot is the first.
    assert_eq!(serialize_machine(&restored).expect("serializes"), first);
}

#[test]
fn unregistered_code_transition_fails_strict_but_not_history() {
    let charter = Charter::builder("test")
        .node("main", counter_node())
        .build()
        .expect("charter builds");
    let node = Node::builder("Loose.")
        .transition(
            "go",
            Transition::code("Go", |_| async {
                Ok(transition_to(
                    markov_charter::transition::NodeTarget::Ref("main".into()),
                    None,
                ))
            }),
        )
        .build()
        .expect("node builds");
    let machine = machine_on(
        charter.clone(),
        StandardExecutor::new(ScriptedModel::builder().build()),
        Instance::new(node.clone(), json!({})),
    )
    .expect("machine builds");
    let err = serialize_machine(&machine).unwrap_err();
    assert!(matches!(
        err,
        SerializeError::Node(SerialError::UnregisteredTransition(ref t)) if t == "go"
    ));
    assert!(
        err.to_string().starts_with(
            "CodeTransition and GeneralTransition must be registered in the charter for serialization"
        ),
        "{err}"
    );
    // History's lenient form writes the name as a ref.
    assert_eq!(
        serialize_node(&charter, &node)["transitions"]["go"],
        json!({"ref": "go"})
    );
}

#[test]
fn inline_pack_merges_with_the_charter_pack() {
    let charter_pack = todo_pack();
    let local = Pack::builder("todo", "Local todo")
        .instructions("Keep it short.")
        .build()
        .expect("pack builds");
    let node = Node::builder("Root.")
        .pack(local)
        .build()
        .expect("node builds");
    let charter = Charter::builder("test")
        .node("root", node.clone())
        .pack(charter_pack)
        .build()
        .expect("charter builds");
    let machine = machine_on(
        charter.clone(),
        StandardExecutor::new(ScriptedModel::builder().build()),
        Instance::new(node, json!({})),
    )
    .expect("machine builds");
    let snapshot = serialize_machine(&machine).expect("serializes");
    let pack = serde_json::to_value(&snapshot.instance.pack_instances[0].pack).expect("json");
    assert_eq!(pack["name"], "todo");
    assert_eq!(pack["description"], "Local todo");
    assert_eq!(pack["instructions"], "Keep it short.");
    let (_, restored) = roundtrip(&charter, &machine);
    let p = &restored.instance().packs()[0];
    assert_eq!(p.description(), "Local todo");
    assert_eq!(p.instructions().render(&json!({})), "Keep it short.");

    // Without a charter pack of that name, the merge fails.
    let bare = Charter::builder("bare")
        .node("root", restored.instance().node().clone())
        .build()
        .expect("charter builds");
    let err = restore_on(bare, executor(), snapshot.into_owned()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Pack not found in charter for inline merge: todo"
    );
}

#[tokio::test]
async fn a_restored_machine_continues_the_conversation() {
    let model = Arc::new(
        ScriptedModel::builder()
            .text("Hello!")
            .text("Welcome back.")
            .build(),
    );
    let node = counter_node();
    let charter = Charter::builder("test")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    let mut machine = machine_on_shared(
        charter.clone(),
        Arc::new(StandardExecutor::shared(model.clone())),
        Instance::new(node, json!({"count": 0})),
    )
    .expect("machine builds");
    machine.enqueue_user("hi");
    run_to_completion(&mut machine, RunOptions::default())
        .await
        .expect("first turn");
    let text =
        serde_json::to_string(&serialize_machine(&machine).expect("serializes")).expect("json");
    drop(machine);

    let mut restored = restore_on(
        charter,
        Arc::new(StandardExecutor::shared(model.clone())),
        serde_json::from_str::<SerializedMachine>(&text).expect("reads"),
    )
    .expect("deserializes");
    restored.enqueue_user("I'm back");
    let last = run_to_completion(&mut restored, RunOptions::default())
        .await
        .expect("second turn");
    assert!(last.done);
    let texts: Vec<_> = restored.history().iter().map(|m| m.text()).collect();
    assert_eq!(texts, ["hi", "Hello!", "I'm back", "Welcome back."]);
    assert_eq!(
        model.requests()[1].messages.len(),
        3,
        "the model saw the history"
    );
}

fn snapshot_json(instance: Value) -> Value {
    json!({"instance": instance, "history": []})
}

fn load(charter: &Charter, json: Value) -> Result<Machine, DeserializeError> {
    let data = SerializedMachine::from_json_value(json)?;
    restore_on(charter.clone(), executor(), data)
}

fn load_err(charter: &Charter, json: Value) -> String {
    match load(charter, json) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn malformed_snapshots_give_typed_errors() {
    let (charter, _) = inline_fixture();
    let ok = json!({"id": "r", "node": {"ref": "main"}, "state": {"count": 1}});
    assert!(
        load(&charter, snapshot_json(ok.clone())).is_ok(),
        "no formatVersion reads as 1"
    );

    let cases: Vec<(Value, &str)> = vec![
        (
            snapshot_json(json!({"id": "r", "node": {"ref": "nope"}, "state": {}})),
            "Unknown node ref: nope",
        ),
        (
            snapshot_json(json!({"id": "r", "node": {"ref": "main"}, "state": {"count": "x"}})),
            "Invalid state: invalid type: string \"x\", expected i64",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"ref": "main"}, "state": {"count": 1},
                "suspended": {"suspendId": "s", "reason": "r", "suspendedAt": "yesterday"}}),
            ),
            "Invalid suspendedAt \"yesterday\"",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"ref": "main"}, "state": {"count": 1},
                "packInstances": [{"state": {}, "pack": {"ref": "ghost"}}]}),
            ),
            "Pack not found in charter: ghost",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"ref": "main"}, "state": {"count": 1},
                "children": [{"id": "r", "node": {"ref": "main"}, "state": {"count": 1}}]}),
            ),
            "Duplicate instance id: r",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "tools": {"t": {"ref": "nope"}}}, "state": {}}),
            ),
            "Unknown tool ref: nope",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "tools": {"t": {"ref": "ghost.add"}}}, "state": {}}),
            ),
            "Unknown node in tool ref: ghost.add",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "tools": {"t": {"ref": "main.nope"}}}, "state": {}}),
            ),
            "Unknown tool on node main: nope",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "commands": {"reset": {"ref": "reset"}}}, "state": {}}),
            ),
            "Command ref must be dotted (node.command): reset",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "commands": {"reset": {"ref": "ghost.reset"}}}, "state": {}}),
            ),
            "Unknown node in command ref: ghost.reset",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "commands": {"reset": {"ref": "main.reset"}}}, "state": {}}),
            ),
            "Unknown command on node main: reset",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "transitions": {"t": {"ref": "nope"}}}, "state": {}}),
            ),
            "Unknown transition ref: nope",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "transitions": {"t": {"ref": "ghost.t"}}}, "state": {}}),
            ),
            "Unknown node in transition ref: ghost.t",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "transitions": {"t": {"type": "code"}}}, "state": {}}),
            ),
            "Invalid serialized machine: Unknown transition type: code",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"instructions": "x", "validator": {},
                "executorConfig": {"model": 3}}, "state": {}}),
            ),
            "executorConfig.model must be a string, got number",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"ref": "main"}, "state": {"count": 1},
                "extra": true}),
            ),
            "Invalid serialized machine: unknown field `extra`",
        ),
        (
            snapshot_json(
                json!({"id": "r", "node": {"ref": "main", "instructions": "x"},
                "state": {}}),
            ),
            "Invalid serialized machine: node ref \"main\" has other fields",
        ),
        (snapshot_json(json!([1, 2])), "Invalid serialized machine"),
        (
            json!({"instance": ok, "history": "no"}),
            "Invalid serialized machine",
        ),
        (
            json!({"formatVersion": 2, "instance": ok, "history": []}),
            "Unsupported formatVersion 2",
        ),
        (json!("just a string"), "Invalid serialized machine"),
    ];
    for (input, expected) in cases {
        let err = load_err(&charter, input.clone());
        assert!(
            err.starts_with(expected),
            "input {input}\n  gave {err:?}\n  expected it to start with {expected:?}"
        );
    }
    assert!(matches!(
        load(&charter, snapshot_json(json!({"id": "r", "node": {"ref": "nope"}, "state": {}}))),
        Err(DeserializeError::Node(SerialError::Config(ConfigError::UnknownNodeRef(r)))) if r == "nope"
    ));
}

#[test]
fn a_too_deep_tree_is_an_error_not_a_crash() {
    let f = fixture();
    let mut instance = json!({"id": "leaf", "node": {"ref": "main"}, "state": {"count": 0}});
    for i in 0..120 {
        instance = json!({"id": format!("n{i}"), "node": {"ref": "main"}, "state": {"count": 0},
            "children": [instance]});
    }
    let err = load_err(&f.charter, snapshot_json(instance));
    assert!(err.starts_with("Max depth (100) exceeded"), "{err}");
}

// ---- properties ----

fn charter_for_props() -> (Charter, Vec<Node>) {
    let main = counter_node();
    let free = Node::builder("Free.").build().expect("node builds");
    let packed = Node::builder("Packed.")
        .pack(todo_pack())
        .build()
        .expect("node builds");
    let charter = Charter::builder("props")
        .node("main", main.clone())
        .node("free", free.clone())
        .node("packed", packed.clone())
        .pack(todo_pack())
        .build()
        .expect("charter builds");
    (charter, vec![main, free, packed])
}

/// A random tree: (node index, state seed, suspended ms, children).
#[derive(Debug, Clone)]
struct Tree {
    node: usize,
    seed: i64,
    suspended_ms: Option<u64>,
    children: Vec<Tree>,
}

fn arb_tree() -> impl Strategy<Value = Tree> {
    let leaf = (
        0..3usize,
        any::<i64>(),
        proptest::option::of(0..4_000_000_000_000u64),
    )
        .prop_map(|(node, seed, suspended_ms)| Tree {
            node,
            seed,
            suspended_ms,
            children: Vec::new(),
        });
    leaf.prop_recursive(3, 12, 3, |inner| {
        (
            0..3usize,
            any::<i64>(),
            proptest::option::of(0..4_000_000_000_000u64),
            proptest::collection::vec(inner, 0..3),
        )
            .prop_map(|(node, seed, suspended_ms, children)| Tree {
                node,
                seed,
                suspended_ms,
                children,
            })
    })
}

fn build(tree: &Tree, nodes: &[Node], next: &mut usize) -> Instance {
    *next += 1;
    let state = match tree.node {
        0 => json!({"count": tree.seed, "label": format!("l{}", tree.seed % 7)}),
        _ => json!({"seed": tree.seed, "nested": {"xs": [tree.seed, null, "s"]}}),
    };
    let mut i = Instance::with_id(
        InstanceId::new(format!("i{next}")),
        nodes[tree.node].clone(),
        state,
    );
    if let Some(ms) = tree.suspended_ms {
        i = i.with_suspended(SuspendInfo {
            suspend_id: format!("s{next}"),
            reason: "r".into(),
            suspended_at: UNIX_EPOCH + Duration::from_millis(ms),
            metadata: (ms % 2 == 0).then(|| json!({"ms": ms})),
        });
    }
    for c in &tree.children {
        i = i.with_child(build(c, nodes, next));
    }
    i
}

fn arb_snapshot_like() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(json!({"ref": "main"})),
        Just(json!({"ref": "nope"})),
        Just(json!({"instructions": "x", "validator": {}})),
        markov_testkit::strategies::arb_json(),
    ];
    (
        leaf,
        markov_testkit::strategies::arb_json(),
        proptest::option::of(markov_testkit::strategies::arb_json()),
        proptest::option::of(markov_testkit::strategies::arb_json()),
        proptest::option::of("[0-9TZ:.-]{0,30}"),
        proptest::option::of(0u32..4),
    )
        .prop_map(|(node, state, children, packs, at, version)| {
            let mut instance = json!({"id": "r", "node": node, "state": state});
            if let Some(c) = children {
                instance["children"] = json!([{"id": "c", "node": {"ref": "free"}, "state": c}]);
            }
            if let Some(p) = packs {
                instance["packInstances"] = json!([{"state": p, "pack": {"ref": "todo"}}]);
            }
            if let Some(at) = at {
                instance["suspended"] = json!({"suspendId": "s", "reason": "r", "suspendedAt": at});
            }
            let mut m = json!({"instance": instance, "history": []});
            if let Some(v) = version {
                m["formatVersion"] = json!(v);
            }
            m
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_json_never_panics(value in markov_testkit::strategies::arb_json()) {
        let (charter, _) = charter_for_props();
        let _ = load(&charter, value.clone());
        let _ = load(&charter, snapshot_json(value));
    }

    #[test]
    fn snapshot_shaped_json_never_panics(value in arb_snapshot_like()) {
        let (charter, _) = charter_for_props();
        let text = value.to_string();
        if let Ok(data) = serde_json::from_str::<SerializedMachine>(&text) {
            let _ = restore_on(charter, executor(), data);
        }
    }

    #[test]
    fn snapshots_of_registered_nodes_are_a_fixed_point(tree in arb_tree()) {
        let (charter, nodes) = charter_for_props();
        let root = build(&tree, &nodes, &mut 0);
        let machine = machine_on(charter.clone(), StandardExecutor::new(ScriptedModel::builder().build()), root)
        .expect("machine builds");
        let first = serialize_machine(&machine).expect("serializes");
        let text = serde_json::to_string(&first).expect("json");
        let restored = restore_on(charter, executor(), serde_json::from_str::<SerializedMachine>(&text).expect("reads"))
        .expect("deserializes");
        let second = serialize_machine(&restored).expect("serializes");
        prop_assert_eq!(&second, &first);
        let all = machine.instance().all().expect("tree");
        let back = restored.instance().all().expect("tree");
        prop_assert_eq!(all.len(), back.len());
        for (a, b) in all.iter().zip(&back) {
            prop_assert_eq!(a.id(), b.id());
            prop_assert_eq!(a.node().id(), b.node().id());
            prop_assert_eq!(a.state(), b.state());
            prop_assert_eq!(a.suspended(), b.suspended());
        }
        prop_assert_eq!(machine.instance().pack_states(), restored.instance().pack_states());
    }
}

/// The snapshot's own reader takes what a derived reader with
/// `deny_unknown_fields` took, and sizes the history from the text.
#[test]
fn snapshot_reader_refuses_what_it_refused_and_sizes_the_history() {
    let instance = json!({"id": "i1", "node": {"ref": "main"}, "state": {}});
    let read = |v: Value| serde_json::from_str::<SerializedMachine>(&v.to_string());
    let ok = read(json!({"instance": instance, "history": []})).expect("reads");
    assert_eq!(ok.format_version, 1, "formatVersion defaults to 1");
    assert!(ok.history.is_empty() && ok.history.capacity() <= 16);
    let unknown = read(json!({"instance": instance, "history": [], "extra": 1})).unwrap_err();
    assert!(
        unknown.to_string().contains("unknown field `extra`"),
        "{unknown}"
    );
    let missing = read(json!({"history": []})).unwrap_err();
    assert!(
        missing.to_string().contains("missing field `instance`"),
        "{missing}"
    );
    let twice =
        r#"{"instance":{"id":"i1","node":{"ref":"main"},"state":{}},"history":[],"history":[]}"#;
    let err = serde_json::from_str::<SerializedMachine>(twice).unwrap_err();
    assert!(
        err.to_string().contains("duplicate field `history`"),
        "{err}"
    );
    assert!(serde_json::from_str::<SerializedMachine>("{} trailing").is_err());

    // A long history is read into a list sized from the text, with no
    // room to spare beyond the guess.
    let history: Vec<Value> = (0..300)
        .map(|i| json!({"role": "user", "items": format!("message {i}")}))
        .collect();
    let text = json!({"instance": instance, "history": history}).to_string();
    let snapshot = serde_json::from_slice::<SerializedMachine>(text.as_bytes()).expect("reads");
    assert_eq!(snapshot.history.len(), 300);
    assert!(snapshot.history.capacity() <= 2 * 300 + 16);
}

/// The snapshot's text reader (its own walk of the object, the history by
/// core's reader) reads what serde's reading of `SerializedMachine` reads,
/// and refuses what it refuses: written, pretty-printed, keys in another
/// order, white space anywhere, and broken forms.
#[test]
fn the_text_reader_agrees_with_serdes_reading() {
    let instance = r#"{"id":"i1","node":{"ref":"main"},"state":{"n":1}}"#;
    let history = r#"[{"role":"user","items":"hi"},{"role":"assistant","items":[{"type":"tool_use","id":"t1","name":"add","input":{"a":1}}],"metadata":{"source":{"instanceId":"i1"}}}]"#;
    let policy = r#"{"approvals":[],"ledger":[]}"#;
    let agree = |text: &str| {
        let fast = serde_json::from_str::<SerializedMachine>(text);
        let serde = serde_json::from_str::<SerializedMachine>(text);
        match (&fast, &serde) {
            (Ok(fast), Ok(serde)) => assert_eq!(fast, serde, "{text}"),
            (Err(_), Err(_)) => {}
            _ => panic!("{text}: the reader says {fast:?}, serde {serde:?}"),
        }
        fast.is_ok()
    };
    let readable = [
        format!(r#"{{"formatVersion":1,"instance":{instance},"history":{history}}}"#),
        format!(r#"{{"history":{history},"instance":{instance},"formatVersion":1}}"#),
        format!(r#"{{"instance":{instance},"history":{history},"policy":{policy}}}"#),
        format!(" {{ \"instance\" : {instance} ,\n\t\"history\" : {history} }} \n"),
        format!(r#"{{"instance":{instance},"history":[]}}"#),
        format!(r#"{{"inst\u0061nce":{instance},"history":[]}}"#),
    ];
    for text in &readable {
        assert!(agree(text), "{text}");
        let value: Value = serde_json::from_str(text).expect("JSON");
        let pretty = serde_json::to_string_pretty(&value).expect("writes");
        assert!(agree(&pretty), "{pretty}");
    }
    let broken = [
        String::new(),
        "[]".to_owned(),
        "{".to_owned(),
        "{}".to_owned(),
        format!(r#"{{"instance":{instance},"history":{history},}}"#),
        format!(r#"{{"instance":{instance} "history":{history}}}"#),
        format!(r#"{{"instance":{instance},"history":{history}}}{{}}"#),
        format!(r#"{{"instance":{instance},"history":{history},"formatVersion":"1"}}"#),
        format!(r#"{{"instance":{instance},"history":{history},"instance":{instance}}}"#),
        format!(r#"{{"instance":{instance},"history":[{{"role":"user"}}]}}"#),
        format!(r#"{{"instance":{instance},"history":{history},"policy":null}}"#),
        format!(r#"{{"instance":{instance},"history":{history},"other":1}}"#),
        format!(r#"{{"instance":{instance}:"history":{history}}}"#),
        format!(r#"{{"instance":{instance},"history":{history}"#),
    ];
    for text in &broken {
        assert!(!agree(text), "{text}");
    }
    // Cut anywhere, a snapshot is refused by both.
    let whole = &readable[2];
    for end in (0..whole.len()).filter(|&end| whole.is_char_boundary(end)) {
        assert!(!agree(&whole[..end]), "{}", &whole[..end]);
    }
}
