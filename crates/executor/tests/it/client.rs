//! Client and display formats and the machine contract: every
//! scenario of upstream's `client.test.ts` (the `[core]` command item guard
//! included), display labels, `find_command` and the contract messages.

use crate::common::{machine_on_shared, restore_on};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use markov_charter::charter::Charter;
use markov_charter::command::{Command, CommandContext, CommandError, CommandResult};
use markov_charter::node::{ExecutorConfig, Node};
use markov_charter::pack::Pack;
use markov_charter::serial::DeclaredSchema;
use markov_charter::transition::{Transition, TransitionResult};
use markov_core::async_trait;
use markov_core::message::Item;
use markov_executor::client::{
    ClientError, CommandHandle, DryClientInstance, DryClientNode, MachineContract, assert_contract,
    display_instance, display_instance_of, display_node, dry_client_instance,
    dry_client_instance_by_id, find_command, is_command_item,
};
use markov_executor::serialize::SerializedMachine;
use markov_executor::{Executor, Instance, Machine, StandardExecutor, SuspendInfo};
use markov_testkit::ScriptedModel;
use markov_testkit::strategies::arb_json;
use proptest::prelude::*;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

// ------------------------------------------------------------------ fixtures

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct Todo {
    id: String,
    text: String,
    completed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct TodoState {
    todos: Vec<Todo>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct CounterState {
    counter: i64,
}

#[derive(Deserialize, JsonSchema)]
struct NoArgs {}

#[derive(Deserialize, JsonSchema)]
struct TextArg {
    text: String,
}

#[derive(Deserialize, JsonSchema)]
struct Amount {
    amount: Option<i64>,
}

/// `clearAll`: empties the list.
struct ClearAll;

#[async_trait]
impl Command for ClearAll {
    const NAME: &'static str = "clearAll";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Clear all todos".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        cx.update_state(json!({"todos": []}))?;
        Ok(CommandResult::with_payload(Value::Null))
    }
}

/// `addTodo`: appends a todo.
struct AddTodo;

#[async_trait]
impl Command for AddTodo {
    const NAME: &'static str = "addTodo";
    type Input = TextArg;
    type Error = CommandError;
    fn description(&self) -> String {
        "Add a new todo".into()
    }
    async fn execute(
        &self,
        input: TextArg,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        let mut s: TodoState = cx.state().map_err(CommandError::failed)?;
        let todo = Todo {
            id: "1".into(),
            text: input.text,
            completed: false,
        };
        s.todos.push(todo.clone());
        cx.update_state(json!({"todos": s.todos}))?;
        Ok(CommandResult::with_payload(json!(todo)))
    }
}

/// `incrementCounter`: a pack command.
struct IncrementCounter;

#[async_trait]
impl Command for IncrementCounter {
    const NAME: &'static str = "incrementCounter";
    type Input = Amount;
    type Error = CommandError;
    fn description(&self) -> String {
        "Increment the counter".into()
    }
    async fn execute(
        &self,
        input: Amount,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        let s: CounterState = cx.state().map_err(CommandError::failed)?;
        cx.update_state(json!({"counter": s.counter + input.amount.unwrap_or(1)}))?;
        Ok(CommandResult::done())
    }
}

/// `resetCounter`: a pack command.
struct ResetCounter;

#[async_trait]
impl Command for ResetCounter {
    const NAME: &'static str = "resetCounter";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Reset the counter to zero".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        cx.update_state(json!({"counter": 0}))?;
        Ok(CommandResult::done())
    }
}

/// `setTheme`: a charter pack's command.
struct SetTheme;

#[async_trait]
impl Command for SetTheme {
    const NAME: &'static str = "setTheme";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Set the theme".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        _: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        Ok(CommandResult::done())
    }
}

fn todo_node() -> markov_charter::node::NodeBuilder {
    Node::builder("Test node").state(TodoState { todos: vec![] })
}

fn test_pack(with_commands: bool) -> Pack {
    let b = Pack::builder("testPack", "Test pack with commands").state(CounterState { counter: 0 });
    let b = if with_commands {
        b.command(IncrementCounter).command(ResetCounter)
    } else {
        b
    };
    b.build().expect("fixture")
}

fn executor() -> Arc<dyn Executor> {
    Arc::new(StandardExecutor::new(ScriptedModel::builder().build()))
}

fn machine(charter: Charter, root: Instance) -> Machine {
    machine_on_shared(charter, executor(), root).expect("fixture")
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<_> = v
        .as_object()
        .expect("fixture")
        .keys()
        .map(String::as_str)
        .collect();
    k.sort_unstable();
    k
}

// ------------------------------------------------------- createDryClientNode

#[test]
fn dry_node_without_commands_copies_instructions_and_schema() {
    let node = Node::builder("Test node instructions")
        .state(TodoState { todos: vec![] })
        .build()
        .unwrap();
    let dry = DryClientNode::from_node(&node);
    assert_eq!(dry.instructions, "Test node instructions");
    assert_eq!(dry.validator, node.schema().json_schema());
    assert_eq!(dry.validator["properties"]["todos"]["type"], "array");
    let wire = serde_json::to_value(&dry).unwrap();
    assert_eq!(wire["commands"], json!({}));
    assert_eq!(keys(&wire), ["commands", "instructions", "validator"]);
}

#[test]
fn dry_node_lists_two_commands_with_metadata() {
    let node = todo_node()
        .command(ClearAll)
        .command(AddTodo)
        .build()
        .unwrap();
    let wire = serde_json::to_value(DryClientNode::from_node(&node)).unwrap();
    let commands = wire["commands"].as_object().unwrap();
    assert_eq!(commands.len(), 2);
    assert_eq!(
        wire["commands"]["clearAll"],
        json!({"name": "clearAll", "description": "Clear all todos",
               "inputSchema": {"type": "object"}})
    );
    assert_eq!(wire["commands"]["addTodo"]["name"], "addTodo");
    assert_eq!(wire["commands"]["addTodo"]["description"], "Add a new todo");
    assert_eq!(
        wire["commands"]["addTodo"]["inputSchema"]["required"],
        json!(["text"])
    );
    // Declaration order is kept on the wire.
    let text = serde_json::to_string(&DryClientNode::from_node(&node)).unwrap();
    assert!(text.find("clearAll").unwrap() < text.find("addTodo").unwrap());
}

#[test]
fn dry_validator_is_unescaped() {
    let schema =
        json!({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object"});
    let node = Node::builder("n")
        .schema(
            Arc::new(DeclaredSchema::new(schema.clone())),
            Some(json!({})),
        )
        .build()
        .unwrap();
    assert_eq!(DryClientNode::from_node(&node).validator, schema);
    let charter = Charter::builder("c").build().unwrap();
    let shown = display_node(&charter, &node).validator;
    assert_eq!(shown["__schema"], schema["$schema"]);
    assert!(shown.get("$schema").is_none());
}

// --------------------------------------------------- createDryClientInstance

#[test]
fn dry_instance_keeps_id_state_and_instructions() {
    let node = todo_node().build().unwrap();
    let state = json!({"todos": [{"id": "1", "text": "Test todo", "completed": false}]});
    let instance = Instance::new(node, state.clone());
    let dry = DryClientInstance::from_instance(&instance);
    assert_eq!(&dry.id, instance.id());
    assert_eq!(dry.state, state);
    assert_eq!(dry.node.instructions, "Test node");
    let wire = serde_json::to_value(&dry).unwrap();
    assert_eq!(keys(&wire), ["id", "node", "state"]);
    assert_eq!(wire["id"], json!(instance.id()));
}

#[test]
fn dry_instance_with_pack_states_lists_packs_and_copies_states() {
    let pack = test_pack(true);
    let node = Node::builder("Test node with pack")
        .state(TodoState { todos: vec![] })
        .pack(pack.clone())
        .build()
        .unwrap();
    let charter = Charter::builder("c")
        .node("main", node)
        .pack(pack)
        .build()
        .unwrap();
    let snapshot = SerializedMachine::from_json_value(json!({
        "instance": {
            "id": "root", "node": {"ref": "main"}, "state": {"todos": []},
            "packInstances": [{"state": {"counter": 42}, "pack": {"ref": "testPack"}}]
        },
        "history": []
    }))
    .unwrap();
    let m = restore_on(charter, executor(), snapshot).unwrap();

    let dry = dry_client_instance(&m);
    let packs = dry.node.packs.as_ref().unwrap();
    assert_eq!(packs.len(), 1);
    let p = &packs[0];
    assert_eq!(p.name, "testPack");
    assert_eq!(p.description, "Test pack with commands");
    assert_eq!(p.validator["properties"]["counter"]["type"], "integer");
    assert_eq!(p.commands.0.len(), 2);
    assert_eq!(
        p.commands.get("incrementCounter").unwrap().description,
        "Increment the counter"
    );
    assert_eq!(p.commands.get("resetCounter").unwrap().name, "resetCounter");
    assert_eq!(
        dry.pack_states.as_ref().unwrap()["testPack"],
        json!({"counter": 42})
    );

    let wire = serde_json::to_value(&dry).unwrap();
    assert_eq!(keys(&wire), ["id", "node", "packStates", "state"]);
    assert_eq!(
        keys(&wire["node"]["packs"][0]),
        ["commands", "description", "name", "validator"]
    );
    assert_eq!(wire["packStates"], json!({"testPack": {"counter": 42}}));

    let by_id = dry_client_instance_by_id(&m, &"root".into()).unwrap();
    assert_eq!(by_id, dry);
    assert!(dry_client_instance_by_id(&m, &"nope".into()).is_none());
}

#[test]
fn dry_instance_without_pack_states_omits_them() {
    let pack = Pack::builder("testPack", "Test pack")
        .state(CounterState { counter: 100 })
        .build()
        .unwrap();
    let node = todo_node().pack(pack).build().unwrap();
    let dry = DryClientInstance::from_instance(&Instance::new(node, json!({"todos": []})));
    assert_eq!(dry.node.packs.as_ref().unwrap().len(), 1);
    assert!(dry.pack_states.is_none());
    let wire = serde_json::to_value(&dry).unwrap();
    assert!(wire.get("packStates").is_none());
    assert_eq!(wire["node"]["packs"][0]["commands"], json!({}));
}

#[test]
fn dry_instance_of_a_machine_is_the_active_instance() {
    let root = todo_node().command(ClearAll).build().unwrap();
    let child = Node::builder("Child.").build().unwrap();
    let charter = Charter::builder("c")
        .node("main", root.clone())
        .build()
        .unwrap();
    let child_instance = Instance::new(child, json!({}));
    let child_id = child_instance.id().clone();
    let m = machine(
        charter,
        Instance::new(root, json!({"todos": []})).with_child(child_instance),
    );
    let dry = dry_client_instance(&m);
    assert_eq!(dry.id, child_id);
    assert_eq!(dry.node.instructions, "Child.");
    assert!(dry.node.commands.is_empty());
}

// ------------------------------------------------------------------ hydration

#[test]
fn hydrated_node_command_returns_a_command_item() {
    let node = todo_node().command(AddTodo).build().unwrap();
    // Through the wire, as a client receives it.
    let text = serde_json::to_string(&DryClientNode::from_node(&node)).unwrap();
    let client: DryClientNode = serde_json::from_str(&text).unwrap();
    assert_eq!(client.instructions, "Test node");

    let item = client
        .command("addTodo", json!({"text": "Buy milk"}))
        .unwrap();
    assert_eq!(
        item,
        Item::Command {
            name: "addTodo".into(),
            input: json!({"text": "Buy milk"}),
            instance_id: None,
            client_id: None,
        }
    );
    let wire = serde_json::to_value(&item).unwrap();
    assert_eq!(
        wire,
        json!({"type": "command", "name": "addTodo", "input": {"text": "Buy milk"}})
    );
    assert!(is_command_item(&wire));
}

#[test]
fn hydration_checks_the_name_and_the_input() {
    let node = todo_node().command(AddTodo).build().unwrap();
    let dry = DryClientNode::from_node(&node);
    let err = dry.command("nope", json!({})).unwrap_err();
    assert_eq!(err, ClientError::CommandNotFound("nope".into()));
    assert_eq!(err.to_string(), "Command not found: nope");
    let err = dry.command("addTodo", json!("milk")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Invalid input: expected an object, got string"
    );
    let err = dry.command("addTodo", json!({})).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Invalid input: missing required property \"text\""
    );
}

#[test]
fn hydrated_instance_keeps_id_and_state_and_builds_items() {
    let node = todo_node().command(ClearAll).build().unwrap();
    let state = json!({"todos": [{"id": "1", "text": "Test", "completed": false}]});
    let instance = Instance::new(node, state.clone());
    let text = serde_json::to_string(&DryClientInstance::from_instance(&instance)).unwrap();
    let client: DryClientInstance = serde_json::from_str(&text).unwrap();
    assert_eq!(&client.id, instance.id());
    assert_eq!(client.state, state);
    let item = client.node.command("clearAll", json!({})).unwrap();
    let wire = serde_json::to_value(&item).unwrap();
    assert!(is_command_item(&wire));
    assert_eq!(wire["name"], "clearAll");
    assert_eq!(client.command("clearAll", json!({})).unwrap(), item);
}

#[test]
fn hydrated_pack_commands_are_callable_and_pack_states_kept() {
    let pack = test_pack(true);
    let node = todo_node().pack(pack.clone()).build().unwrap();
    let charter = Charter::builder("c")
        .node("main", node)
        .pack(pack)
        .build()
        .unwrap();
    let snapshot = SerializedMachine::from_json_value(json!({
        "instance": {
            "id": "root", "node": {"ref": "main"}, "state": {"todos": []},
            "packInstances": [{"state": {"counter": 42}, "pack": {"ref": "testPack"}}]
        },
        "history": []
    }))
    .unwrap();
    let m = restore_on(charter, executor(), snapshot).unwrap();
    let text = serde_json::to_string(&dry_client_instance(&m)).unwrap();
    let client: DryClientInstance = serde_json::from_str(&text).unwrap();

    let pack = client.node.pack("testPack").unwrap();
    assert_eq!(pack.name, "testPack");
    assert!(pack.validator.is_object());
    let item = pack
        .command("incrementCounter", json!({"amount": 5}))
        .unwrap();
    let wire = serde_json::to_value(&item).unwrap();
    assert!(is_command_item(&wire));
    assert_eq!(wire["name"], "incrementCounter");
    assert_eq!(wire["input"], json!({"amount": 5}));
    // `amount` is optional.
    assert!(pack.command("incrementCounter", json!({})).is_ok());
    // The instance finds pack commands after node commands.
    assert_eq!(
        client
            .command("incrementCounter", json!({"amount": 5}))
            .unwrap(),
        item
    );
    assert_eq!(
        client.pack_states.as_ref().unwrap()["testPack"],
        json!({"counter": 42})
    );
}

// ---------------------------------------------------------- [core] isCommand

#[test]
fn command_item_guard() {
    assert!(is_command_item(
        &json!({"type": "command", "name": "test", "input": {}})
    ));
    assert!(is_command_item(
        &json!({"type": "command", "name": "t", "input": 1, "instanceId": "i", "clientId": "c"})
    ));
    assert!(!is_command_item(&Value::Null));
    assert!(!is_command_item(&json!({})));
    assert!(!is_command_item(&json!({"type": "other"})));
    assert!(
        !is_command_item(&json!({"type": "command"})),
        "missing name"
    );
    assert!(!is_command_item(&json!({"name": "test"})), "missing type");
    assert!(!is_command_item(&json!({"type": "command", "name": 3})));
    assert!(!is_command_item(&json!([{"type": "command", "name": "x"}])));
    assert!(!is_command_item(&json!("command")));
}

proptest! {
    #[test]
    fn command_item_guard_never_panics(v in arb_json()) {
        let _ = is_command_item(&v);
    }

    #[test]
    fn command_items_are_accepted(name in "[a-zA-Z]{1,10}", input in arb_json()) {
        let v = json!({"type": "command", "name": name, "input": input});
        prop_assert!(is_command_item(&v));
        prop_assert!(serde_json::from_value::<Item>(v).is_ok());
    }
}

// ------------------------------------------------------------------- display

#[test]
fn display_labels_every_transition_kind() {
    let finish = Transition::code("Finish", |_| async {
        Ok(TransitionResult::Spawn(Vec::new()))
    });
    let unregistered = Transition::code("Elsewhere", |_| async {
        Ok(TransitionResult::Spawn(Vec::new()))
    });
    // A node equal in content to the registered `other`, but another node.
    let lookalike = Node::builder("Other.").build().unwrap();
    let inline_target = Node::builder("Inline.").build().unwrap();
    let main = Node::builder("Main.")
        .transition("byRef", Transition::reference("finish"))
        .transition("byNodeRef", Transition::reference("other.back"))
        .transition("toRef", Transition::to_ref("Go", "other"))
        .transition("toLookalike", Transition::to("Go", lookalike))
        .transition("toInline", Transition::to("Go", inline_target))
        .transition("registeredCode", finish.clone())
        .transition("code", unregistered)
        .transition("registeredGeneral", Transition::general("Anywhere"))
        .transition("general", Transition::general("Somewhere"))
        .build()
        .unwrap();
    let other = Node::builder("Other.")
        .transition("back", Transition::to_ref("Back", "main"))
        .build()
        .unwrap();
    let charter = Charter::builder("c")
        .transition("finish", finish)
        .transition("anywhere", Transition::general("Anywhere"))
        .node("main", main.clone())
        .node("other", other)
        .build()
        .unwrap();
    let shown = display_node(&charter, &main);
    assert_eq!(shown.name, "main");
    let labels: Vec<(&str, &str)> = shown
        .transitions
        .0
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        labels,
        [
            ("byRef", "finish"),
            ("byNodeRef", "other.back"),
            ("toRef", "other"),
            ("toLookalike", "inline"),
            ("toInline", "inline"),
            ("registeredCode", "finish"),
            ("code", "code"),
            ("registeredGeneral", "anywhere"),
            ("general", "code"),
        ]
    );
}

#[test]
fn display_serial_target_registered_in_the_charter_is_named() {
    let other = Node::builder("Other.").build().unwrap();
    let main = Node::builder("Main.")
        .transition("go", Transition::to("Go", other.clone()))
        .build()
        .unwrap();
    let charter = Charter::builder("c")
        .node("main", main.clone())
        .node("other", other)
        .build()
        .unwrap();
    assert_eq!(
        display_node(&charter, &main).transitions.get("go").unwrap(),
        "other"
    );
}

#[test]
fn display_node_names_and_optional_fields() {
    let charter = Charter::builder("c").build().unwrap();
    let named = Node::builder("Help.").name("helper").build().unwrap();
    let unnamed = Node::builder("Anon.").build().unwrap();
    assert_eq!(display_node(&charter, &named).name, "[inline] helper");
    assert_eq!(display_node(&charter, &unnamed).name, "[inline]");

    let wire = serde_json::to_value(display_node(&charter, &unnamed)).unwrap();
    // A node without declared state starts from `{}`.
    assert_eq!(
        keys(&wire),
        [
            "commands",
            "initialState",
            "instructions",
            "name",
            "tools",
            "transitions",
            "validator"
        ]
    );
    assert_eq!(wire["tools"], json!([]));

    let worker = Node::builder("Work.").worker().build().unwrap();
    let wire = serde_json::to_value(display_node(&charter, &worker)).unwrap();
    assert_eq!(wire["worker"], true);

    let configured = Node::builder("Cfg.")
        .pack(test_pack(true))
        .command(ClearAll)
        .executor_config(ExecutorConfig {
            model: Some("m".into()),
            max_tokens: Some(10),
            temperature: None,
        })
        .build()
        .unwrap();
    let wire = serde_json::to_value(display_node(&charter, &configured)).unwrap();
    assert_eq!(wire["packNames"], json!(["testPack"]));
    assert_eq!(
        wire["executorConfig"],
        json!({"model": "m", "maxTokens": 10})
    );
    assert_eq!(
        wire["commands"]["clearAll"],
        json!({"name": "clearAll", "description": "Clear all todos",
               "inputSchema": {"type": "object"}})
    );
    assert!(wire.get("worker").is_none());
}

#[test]
fn display_instance_expands_the_tree_with_packs_and_suspension() {
    let dynamic = Pack::builder("counter", "Counts")
        .state(CounterState { counter: 0 })
        .dynamic_instructions(|s| format!("Count: {}", s["counter"]))
        .command(IncrementCounter)
        .build()
        .unwrap();
    let fixed = Pack::builder("theme", "Theme")
        .instructions("Be dark.")
        .command(SetTheme)
        .build()
        .unwrap();
    let bare = Pack::builder("bare", "No instructions").build().unwrap();
    let main = todo_node()
        .command(ClearAll)
        .pack(dynamic)
        .pack(fixed)
        .pack(bare)
        .build()
        .unwrap();
    let child = Node::builder("Child.")
        .name("kid")
        .command(AddTodo)
        .build()
        .unwrap();
    let charter = Charter::builder("c")
        .node("main", main.clone())
        .build()
        .unwrap();
    let at = UNIX_EPOCH + Duration::from_millis(1_705_314_600_000);
    let child_instance = Instance::new(child, json!({})).with_suspended(SuspendInfo {
        suspend_id: "s1".into(),
        reason: "approval".into(),
        suspended_at: at,
        metadata: None,
    });
    let child_id = child_instance.id().clone();
    let m = machine(
        charter,
        Instance::new(main, json!({"todos": []})).with_child(child_instance),
    );
    let shown = display_instance(&m).unwrap();
    assert_eq!(&shown.id, m.instance().id());
    assert_eq!(shown.node.name, "main");
    assert_eq!(shown.node.pack_names, ["counter", "theme", "bare"]);
    assert_eq!(shown.children.len(), 1);
    assert_eq!(shown.children[0].id, child_id);
    assert_eq!(shown.children[0].node.name, "[inline] kid");

    let wire = serde_json::to_value(&shown).unwrap();
    assert_eq!(
        keys(&wire),
        ["children", "id", "node", "packStates", "packs", "state"]
    );
    assert_eq!(
        wire["packs"][0],
        json!({
            "name": "counter", "description": "Counts",
            "instructions": "Count: 0", "instructionsDynamic": true,
            "state": {"counter": 0},
            "validator": wire["packs"][0]["validator"].clone(),
            "commands": {"incrementCounter": {
                "name": "incrementCounter", "description": "Increment the counter",
                "inputSchema": wire["packs"][0]["commands"]["incrementCounter"]["inputSchema"].clone()
            }}
        })
    );
    assert_eq!(wire["packs"][1]["instructions"], "Be dark.");
    assert!(wire["packs"][1].get("instructionsDynamic").is_none());
    // A pack without initial state is shown with `{}`; the stored value is null.
    assert!(wire["packs"][2].get("instructions").is_none());
    assert_eq!(wire["packs"][2]["state"], json!({}));
    assert_eq!(wire["packStates"]["counter"], json!({"counter": 0}));

    let child = &wire["children"][0];
    assert_eq!(keys(child), ["id", "node", "state", "suspended"]);
    assert_eq!(
        child["suspended"],
        json!({"suspendId": "s1", "reason": "approval",
               "suspendedAt": "2024-01-15T10:30:00.000Z"})
    );

    // Round trip through JSON.
    let back: markov_executor::DisplayInstance = serde_json::from_value(wire).unwrap();
    assert_eq!(back, shown);
}

#[test]
fn display_instance_of_a_plain_instance_has_no_packs() {
    let charter = Charter::builder("c").build().unwrap();
    let node = todo_node().pack(test_pack(true)).build().unwrap();
    let shown = display_instance_of(&charter, &Instance::new(node, json!({"todos": []}))).unwrap();
    assert!(shown.packs.is_empty());
    assert!(shown.pack_states.is_none());
    assert_eq!(shown.node.pack_names, ["testPack"]);
}

// --------------------------------------------------------------- findCommand

#[test]
fn find_command_checks_the_active_node_then_root_packs() {
    let main = todo_node()
        .command(ClearAll)
        .pack(test_pack(true))
        .build()
        .unwrap();
    let child = Node::builder("Child.").command(AddTodo).build().unwrap();
    let charter = Charter::builder("c")
        .node("main", main.clone())
        .build()
        .unwrap();

    let alone = machine(
        charter.clone(),
        Instance::new(main.clone(), json!({"todos": []})),
    );
    let shown = display_instance(&alone).unwrap();
    let found = find_command(&shown, &CommandHandle::new("clearAll")).unwrap();
    assert_eq!(found.description, "Clear all todos");
    assert!(find_command(&shown, &CommandHandle::scoped("testPack", "resetCounter")).is_some());
    assert!(find_command(&shown, &CommandHandle::new("addTodo")).is_none());

    let with_child = machine(
        charter,
        Instance::new(main, json!({"todos": []})).with_child(Instance::new(child, json!({}))),
    );
    let shown = display_instance(&with_child).unwrap();
    // The child is active: the root's node commands are not offered, its packs are.
    assert!(find_command(&shown, &CommandHandle::new("addTodo")).is_some());
    assert!(find_command(&shown, &CommandHandle::new("clearAll")).is_none());
    assert!(find_command(&shown, &CommandHandle::new("incrementCounter")).is_some());
    assert!(find_command(&shown, &CommandHandle::new("nope")).is_none());
}

// ------------------------------------------------------------------ contract

fn contract_charter() -> Charter {
    let main = todo_node()
        .name("Main Node")
        .command(ClearAll)
        .pack(test_pack(true))
        .build()
        .expect("contract fixture");
    let theme = Pack::builder("theme", "Theme")
        .command(SetTheme)
        .build()
        .expect("contract fixture");
    Charter::builder("c")
        .node("main", main)
        .node(
            "other",
            Node::builder("Other.")
                .command(AddTodo)
                .build()
                .expect("contract fixture"),
        )
        .pack(theme)
        .build()
        .expect("contract fixture")
}

#[test]
fn contract_is_satisfied_by_nodes_and_packs() {
    let charter = contract_charter();
    let contract = MachineContract::new()
        .scoped("main", "clearAll")
        .scoped("Main Node", "clearAll")
        .scoped("other", "addTodo")
        .scoped("testPack", "incrementCounter")
        .scoped("theme", "setTheme")
        .command("clearAll")
        .command("addTodo")
        .command("resetCounter")
        .command("setTheme");
    assert_eq!(assert_contract(&charter, &contract), Ok(()));
    assert_eq!(
        contract.handle(Some("theme"), "setTheme"),
        Some(&CommandHandle::scoped("theme", "setTheme"))
    );
    assert_eq!(
        contract.handle(None, "addTodo"),
        Some(&CommandHandle::new("addTodo"))
    );
    assert!(contract.handle(None, "setThem").is_none());
    let m = machine(
        charter.clone(),
        Instance::new(charter.node("main").unwrap().clone(), json!({"todos": []})),
    );
    assert_eq!(assert_contract(&m, &contract), Ok(()));
    assert_eq!(assert_contract(&charter, &MachineContract::new()), Ok(()));
}

#[test]
fn contract_violations_are_listed_in_order() {
    let charter = contract_charter();
    let contract: MachineContract = [
        CommandHandle::scoped("main", "addTodo"),
        CommandHandle::new("clearAll"),
        CommandHandle::new("ping"),
        CommandHandle::scoped("theme", "clearAll"),
    ]
    .into_iter()
    .collect();
    let err = assert_contract(&charter, &contract).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Machine contract violation:\n  - Command \"addTodo\" not found in pack or node \"main\"\n  - Command \"ping\" not found in any node or pack\n  - Command \"clearAll\" not found in pack or node \"theme\""
    );
    assert_eq!(err.missing.len(), 3);

    let one = MachineContract::new().command("ping");
    assert_eq!(
        assert_contract(&charter, &one).unwrap_err().to_string(),
        "Machine contract violation:\n  - Command \"ping\" not found in any node or pack"
    );
    let scoped = MachineContract::new().scoped("nowhere", "clearAll");
    assert_eq!(
        assert_contract(&charter, &scoped).unwrap_err().to_string(),
        "Machine contract violation:\n  - Command \"clearAll\" not found in pack or node \"nowhere\""
    );
}

#[test]
fn contract_wire_form_is_a_list_of_handles() {
    let contract = MachineContract::new()
        .scoped("theme", "setTheme")
        .command("ping");
    let wire = serde_json::to_value(&contract).unwrap();
    assert_eq!(
        wire,
        json!([{"name": "setTheme", "scope": "theme"}, {"name": "ping"}])
    );
    let back: MachineContract = serde_json::from_value(wire).unwrap();
    assert_eq!(back, contract);
}
