//! Commands: the `[core]` scenarios of upstream's `commands.test.ts`,
//! `pack-command-patch.test.ts` and the command lines of `suspend-resume.test.ts`.

use crate::common::{machine_on, machine_with_history};
use std::sync::Arc;

use markov_charter::ConfigError;
use markov_charter::charter::Charter;
use markov_charter::command::{
    Command, CommandContext, CommandError, CommandResult, ErasedCommand, command_resume,
};
use markov_charter::node::Node;
use markov_charter::pack::Pack;
use markov_charter::transition::{CedeContent, TransitionResult, cede, spawn, transition_to};
use markov_core::InstanceId;
use markov_core::async_trait;
use markov_core::message::{InstancePayload, Item, Items, Message, Metadata, Role};
use markov_executor::{
    CommandOptions, Instance, Machine, RunOptions, StandardExecutor, SuspendInfo, YieldReason,
    available_commands, run_command,
};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::common::{Counter, NoArgs};

// ---------------------------------------------------------------- commands

/// `increment`: adds `by` to the count, returns the new count.
struct Increment;

#[derive(Deserialize, JsonSchema)]
struct By {
    by: i64,
}

#[async_trait]
impl Command for Increment {
    const NAME: &'static str = "increment";
    type Input = By;
    type Error = CommandError;
    fn description(&self) -> String {
        "Increment the counter".into()
    }
    async fn execute(
        &self,
        input: By,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        let c: Counter = cx.state().map_err(CommandError::failed)?;
        cx.update_state(json!({"count": c.count + input.by}))?;
        Ok(CommandResult::with_payload(
            json!({"newCount": c.count + input.by}),
        ))
    }
}

/// `reset`: sets the count to zero.
struct Reset;

#[async_trait]
impl Command for Reset {
    const NAME: &'static str = "reset";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Reset the counter".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        cx.update_state(json!({"count": 0}))?;
        Ok(CommandResult::done())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct Todos {
    items: Vec<String>,
}

/// `clear`: empties the list, returns how many items there were (from the snapshot).
struct Clear;

#[async_trait]
impl Command for Clear {
    const NAME: &'static str = "clear";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Clear the list".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        let before: Todos = cx.state().map_err(CommandError::failed)?;
        cx.update_state(json!({"items": []}))?;
        // The snapshot is not changed by the update.
        let after: Todos = cx.state().map_err(CommandError::failed)?;
        assert_eq!(after.items.len(), before.items.len());
        Ok(CommandResult::with_payload(
            json!({"cleared": before.items.len()}),
        ))
    }
}

/// `slow_increment`: the async variant (yields to the runtime first).
struct SlowIncrement;

#[async_trait]
impl Command for SlowIncrement {
    const NAME: &'static str = "slow_increment";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Increment, later".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        tokio::task::yield_now().await;
        let c: Counter = cx.state().map_err(CommandError::failed)?;
        cx.update_state(json!({"count": c.count + 1}))?;
        Ok(CommandResult::with_payload(json!(c.count + 1)))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("Something went wrong")]
struct Boom;

/// `explode`: writes the state, then fails with its own error.
struct Explode;

#[async_trait]
impl Command for Explode {
    const NAME: &'static str = "explode";
    type Input = NoArgs;
    type Error = Boom;
    fn description(&self) -> String {
        "Fails".into()
    }
    async fn execute(&self, _: NoArgs, cx: &CommandContext<'_>) -> Result<CommandResult, Boom> {
        cx.update_state(json!({"count": 41})).map_err(|_| Boom)?;
        Err(Boom)
    }
}

/// `bad_write`: writes a value the state type refuses.
struct BadWrite;

#[async_trait]
impl Command for BadWrite {
    const NAME: &'static str = "bad_write";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Writes a string into count".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        cx.update_state(json!({"count": "lots"}))?;
        Ok(CommandResult::done())
    }
}

/// Returns a fixed result (tree-changing results).
struct Returns {
    result: fn() -> CommandResult,
}

macro_rules! returning {
    ($ty:ident, $name:literal) => {
        struct $ty(Returns);
        #[async_trait]
        impl Command for $ty {
            const NAME: &'static str = $name;
            type Input = NoArgs;
            type Error = CommandError;
            fn description(&self) -> String {
                $name.into()
            }
            async fn execute(
                &self,
                _: NoArgs,
                _cx: &CommandContext<'_>,
            ) -> Result<CommandResult, CommandError> {
                Ok((self.0.result)())
            }
        }
    };
}

returning!(CedeCmd, "finish");
returning!(SuspendCmd, "pause");

fn no_model() -> Arc<ScriptedModel> {
    // Calling it fails the run: these tests prove inference does not happen.
    Arc::new(ScriptedModel::builder().build())
}

fn counter_node() -> Node {
    Node::builder("Count.")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .command(Increment)
        .command(Reset)
        .command(SlowIncrement)
        .command(Explode)
        .command(BadWrite)
        .build()
        .expect("builds")
}

fn counter_machine(count: i64) -> Machine {
    crate::common::machine(
        |c| c,
        counter_node(),
        json!({"count": count, "label": ""}),
        no_model(),
    )
}

fn opts() -> CommandOptions {
    CommandOptions::default()
}

/// The instance payloads queued, in order.
fn queued_payloads(machine: &Machine) -> Vec<InstancePayload> {
    machine
        .queue()
        .messages()
        .into_iter()
        .filter_map(|m| match m.into_data().items {
            Items::Instance(p) => Some(*p),
            _ => None,
        })
        .collect()
}

fn is_command_record(m: &Message, name: &str) -> bool {
    m.role == Role::Command && matches!(m.item_list(), [Item::Command { name: n, .. }] if n == name)
}

#[test]
fn no_node_commands_means_none_available() {
    let node = Node::builder("Plain.").build().expect("builds");
    let machine = crate::common::machine(|c| c, node, json!({}), no_model());
    assert!(available_commands(&machine).is_empty());
}

#[test]
fn two_node_commands_are_listed_with_names_and_descriptions() {
    let node = Node::builder("Count.")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .command(Increment)
        .command(Reset)
        .build()
        .expect("builds");
    let machine = crate::common::machine(|c| c, node, json!({"count": 0}), no_model());
    let commands = available_commands(&machine);
    let listed: Vec<_> = commands
        .iter()
        .map(|c| (c.name.as_str(), c.description.as_str()))
        .collect();
    assert_eq!(
        listed,
        [
            ("increment", "Increment the counter"),
            ("reset", "Reset the counter")
        ]
    );
    assert_eq!(
        commands[0].input_schema["properties"]["by"]["type"],
        "integer"
    );
    let wire = serde_json::to_value(&commands[0]).unwrap();
    assert!(wire.get("inputSchema").is_some(), "{wire}");
}

#[tokio::test]
async fn an_unknown_command_fails_with_command_not_found() {
    let mut machine = counter_machine(0);
    let out = run_command(&mut machine, "nope", json!({}), opts()).await;
    assert!(!out.result.success);
    assert_eq!(out.result.error.as_deref(), Some("Command not found: nope"));
    assert_eq!(out.result.value, None);
}

#[tokio::test]
async fn invalid_input_fails_with_invalid_input() {
    let mut machine = counter_machine(0);
    let out = run_command(&mut machine, "increment", json!({"by": "two"}), opts()).await;
    assert!(!out.result.success);
    let error = out.result.error.unwrap();
    assert!(error.starts_with("Invalid input: "), "{error}");
    assert_eq!(machine.instance().state()["count"], 0);
    // Only the command record was queued.
    assert_eq!(machine.queue().len(), 1);
}

#[tokio::test]
async fn a_command_updates_state_and_returns_its_payload() {
    let mut machine = counter_machine(0);
    let out = run_command(&mut machine, "increment", json!({"by": 1}), opts()).await;
    assert!(out.result.success, "{:?}", out.result);
    assert_eq!(out.result.value, Some(json!({"newCount": 1})));
    assert_eq!(out.result.error, None);
    // Written to the tree at once.
    assert_eq!(
        machine.instance().state(),
        &json!({"count": 1, "label": ""})
    );
    // Queued: the command record, then exactly one `state` message.
    let queued = machine.queue().messages();
    assert_eq!(queued.len(), 2);
    assert!(is_command_record(&queued[0], "increment"));
    match &queued[0].item_list()[0] {
        Item::Command {
            input,
            instance_id,
            client_id,
            ..
        } => {
            assert_eq!(input, &json!({"by": 1}));
            assert_eq!(instance_id, &None);
            assert_eq!(client_id, &None);
        }
        other => panic!("not a command item: {other:?}"),
    }
    let id = machine.instance().id().clone();
    assert_eq!(
        queued_payloads(&machine),
        [InstancePayload::State {
            instance_id: id,
            patch: json!({"count": 1}),
        }]
    );
}

#[tokio::test]
async fn a_command_returns_the_old_count_from_the_snapshot_and_empties_the_list() {
    let node = Node::builder("Todos.")
        .state(Todos { items: Vec::new() })
        .command(Clear)
        .build()
        .expect("builds");
    let mut machine = crate::common::machine(|c| c, node, json!({"items": ["a", "b"]}), no_model());
    let out = run_command(&mut machine, "clear", json!({}), opts()).await;
    assert!(out.result.success, "{:?}", out.result);
    assert_eq!(out.result.value, Some(json!({"cleared": 2})));
    assert_eq!(machine.instance().state(), &json!({"items": []}));
}

#[tokio::test]
async fn an_async_command_behaves_like_a_synchronous_one() {
    let mut machine = counter_machine(4);
    let out = run_command(&mut machine, "slow_increment", json!({}), opts()).await;
    assert!(out.result.success);
    assert_eq!(out.result.value, Some(json!(5)));
    assert_eq!(machine.instance().state()["count"], 5);
}

#[tokio::test]
async fn a_failing_command_reports_its_own_message() {
    let mut machine = counter_machine(0);
    let out = run_command(&mut machine, "explode", json!({}), opts()).await;
    assert!(!out.result.success);
    assert_eq!(out.result.error.as_deref(), Some("Something went wrong"));
    // The tree keeps the old state…
    assert_eq!(machine.instance().state()["count"], 0);
    // …but the update made before the failure was enqueued at once (upstream).
    let id = machine.instance().id().clone();
    assert_eq!(
        queued_payloads(&machine),
        [InstancePayload::State {
            instance_id: id,
            patch: json!({"count": 41}),
        }]
    );
}

#[tokio::test]
async fn an_invalid_node_state_update_fails_the_command() {
    let mut machine = counter_machine(0);
    let out = run_command(&mut machine, "bad_write", json!({}), opts()).await;
    assert!(!out.result.success);
    let error = out.result.error.unwrap();
    assert!(
        error.starts_with("Command state update validation failed: "),
        "{error}"
    );
    assert!(queued_payloads(&machine).is_empty());
    assert_eq!(machine.instance().state()["count"], 0);
}

#[tokio::test]
async fn the_command_record_comes_first_even_when_the_command_fails() {
    let mut machine = counter_machine(0);
    let options = CommandOptions::default().client("web-1");
    let out = run_command(&mut machine, "missing", json!({"x": 1}), options).await;
    assert!(!out.result.success);
    let queued = machine.queue().messages();
    assert_eq!(queued.len(), 1);
    assert_eq!(
        serde_json::to_value(&queued[0]).unwrap(),
        json!({"role": "command", "items": [{"type": "command", "name": "missing", "input": {"x": 1}, "clientId": "web-1"}]})
    );
}

#[tokio::test]
async fn an_unknown_instance_id_fails_with_instance_not_found() {
    let mut machine = counter_machine(0);
    let options = CommandOptions::default().instance(InstanceId::new("ghost"));
    let out = run_command(&mut machine, "increment", json!({"by": 1}), options).await;
    assert_eq!(
        out.result.error.as_deref(),
        Some("Instance not found: ghost")
    );
    // Recorded first all the same, with the id it named.
    let queued = machine.queue().messages();
    assert!(matches!(
        queued[0].item_list(),
        [Item::Command { instance_id: Some(id), .. }] if id.as_str() == "ghost"
    ));
}

#[tokio::test]
async fn queued_command_messages_are_recorded_by_the_run_without_inference() {
    let model = no_model();
    let mut machine = crate::common::machine(
        |c| c,
        counter_node(),
        json!({"count": 0, "label": ""}),
        Arc::clone(&model),
    );
    run_command(&mut machine, "increment", json!({"by": 2}), opts()).await;
    run_command(&mut machine, "missing", json!({}), opts()).await;
    let (steps, error) = crate::common::run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(model.calls(), 0);
    assert_eq!(steps.len(), 1);
    assert!(steps[0].done);
    assert_eq!(steps[0].yield_reason, YieldReason::EndTurn);
    let history = machine.history();
    assert_eq!(history.len(), 3);
    assert!(is_command_record(&history[0], "increment"));
    assert_eq!(history[1].role, Role::Instance);
    assert!(is_command_record(&history[2], "missing"));
    assert_eq!(machine.instance().state()["count"], 2);
}

// --------------------------------------------------------------- packs

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
struct Settings {
    theme: String,
    volume: i64,
}

#[derive(Deserialize, JsonSchema)]
struct Theme {
    theme: String,
}

/// `set_theme`: one field.
struct SetTheme;

#[async_trait]
impl Command for SetTheme {
    const NAME: &'static str = "set_theme";
    type Input = Theme;
    type Error = CommandError;
    fn description(&self) -> String {
        "Set the theme".into()
    }
    async fn execute(
        &self,
        input: Theme,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        cx.update_state(json!({"theme": input.theme}))?;
        Ok(CommandResult::with_payload(json!("ok")))
    }
}

/// `set_both`: two updates, returns nothing.
struct SetBoth;

#[async_trait]
impl Command for SetBoth {
    const NAME: &'static str = "set_both";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Set theme and volume".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        assert_eq!(cx.pack_name(), Some("settings"));
        assert_eq!(cx.instance_id(), None);
        cx.update_state(json!({"theme": "dark"}))?;
        cx.update_state(json!({"volume": 7}))?;
        Ok(CommandResult::done())
    }
}

/// `set_volume_badly`: a string volume.
struct SetVolumeBadly;

#[async_trait]
impl Command for SetVolumeBadly {
    const NAME: &'static str = "set_volume_badly";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Sets an invalid volume".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        cx.update_state(json!({"volume": "loud"}))?;
        Ok(CommandResult::done())
    }
}

/// A pack command named like a node command.
struct PackReset;

#[async_trait]
impl Command for PackReset {
    const NAME: &'static str = "reset";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "The pack's reset".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        _cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        Ok(CommandResult::with_payload(json!("pack")))
    }
}

fn settings_pack() -> Pack {
    Pack::builder("settings", "User settings")
        .state(Settings {
            theme: "light".into(),
            volume: 3,
        })
        .command(SetTheme)
        .command(SetBoth)
        .command(SetVolumeBadly)
        .command(PackReset)
        .build()
        .expect("builds")
}

fn pack_machine() -> Machine {
    let node = Node::builder("With settings.")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .command(Reset)
        .pack(settings_pack())
        .build()
        .expect("builds");
    crate::common::machine(|c| c, node, json!({"count": 5}), no_model())
}

#[test]
fn pack_commands_are_listed_after_node_commands() {
    let machine = pack_machine();
    let names: Vec<_> = available_commands(&machine)
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(
        names,
        [
            "reset",
            "set_theme",
            "set_both",
            "set_volume_badly",
            "reset"
        ]
    );
}

#[tokio::test]
async fn an_invalid_pack_state_update_fails_and_queues_no_pack_state() {
    let mut machine = pack_machine();
    let out = run_command(&mut machine, "set_volume_badly", json!({}), opts()).await;
    assert!(!out.result.success);
    let error = out.result.error.unwrap();
    assert!(
        error.starts_with("Pack state update validation failed: "),
        "{error}"
    );
    assert!(queued_payloads(&machine).is_empty());
}

#[tokio::test]
async fn a_pack_command_queues_a_pack_state_with_only_the_field_it_changed() {
    let mut machine = pack_machine();
    let out = run_command(&mut machine, "set_theme", json!({"theme": "dark"}), opts()).await;
    assert!(out.result.success);
    assert_eq!(out.result.value, Some(json!("ok")));
    assert_eq!(
        queued_payloads(&machine),
        [InstancePayload::PackState {
            pack_name: "settings".into(),
            patch: json!({"theme": "dark"}),
        }]
    );
    // The tree's pack state changes only when the next run applies the message.
    assert_eq!(
        machine.instance().pack_states()["settings"],
        json!({"theme": "light", "volume": 3})
    );
    let (_, error) = crate::common::run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(
        machine.instance().pack_states()["settings"],
        json!({"theme": "dark", "volume": 3})
    );
}

#[tokio::test]
async fn two_pack_updates_queue_one_merged_pack_state_and_returning_nothing_succeeds() {
    let mut machine = pack_machine();
    let out = run_command(&mut machine, "set_both", json!({}), opts()).await;
    assert!(out.result.success, "{:?}", out.result);
    assert_eq!(out.result.value, None);
    assert_eq!(
        queued_payloads(&machine),
        [InstancePayload::PackState {
            pack_name: "settings".into(),
            patch: json!({"theme": "dark", "volume": 7}),
        }]
    );
}

#[tokio::test]
async fn node_commands_win_over_pack_commands_of_the_same_name() {
    let mut machine = pack_machine();
    let out = run_command(&mut machine, "reset", json!({}), opts()).await;
    assert!(out.result.success);
    assert_eq!(
        out.result.value, None,
        "the node's reset returns no payload"
    );
    assert_eq!(machine.instance().state()["count"], 0);
}

// ------------------------------------------------------ tree changes

fn child_node() -> Node {
    Node::builder("Child.")
        .name("child")
        .command(CedeCmd(Returns {
            result: || cede(Some(CedeContent::Text("child result".into()))).into(),
        }))
        .build()
        .expect("builds")
}

/// `spawn_child`: spawns one `child` (a charter node) with a given state.
struct SpawnChildCmd;

#[async_trait]
impl Command for SpawnChildCmd {
    const NAME: &'static str = "spawn_child";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Spawn a child".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        _cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        Ok(spawn(
            markov_charter::transition::NodeTarget::Ref("child".into()),
            Some(json!({"task": "research"})),
        )
        .into())
    }
}

fn parent_machine(child: Option<Node>) -> Machine {
    let parent = Node::builder("Parent.")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .command(SpawnChildCmd)
        .command(Increment)
        .command(CedeCmd(Returns {
            result: || cede(None).into(),
        }))
        .build()
        .expect("builds");
    let charter = Charter::builder("test")
        .node("main", parent.clone())
        .node("child", child_node())
        .build()
        .expect("builds");
    let mut root = Instance::new(parent, json!({"count": 0, "label": ""}));
    if let Some(child) = child {
        root = root.with_child(Instance::new(child, json!({"task": "t"})));
    }
    machine_on(charter, StandardExecutor::shared(no_model()), root).expect("machine builds")
}

#[tokio::test]
async fn a_command_spawns_a_child() {
    let mut machine = parent_machine(None);
    let out = run_command(&mut machine, "spawn_child", json!({}), opts()).await;
    assert!(out.result.success, "{:?}", out.result);
    let children = machine.instance().children();
    assert_eq!(children.len(), 1);
    assert_eq!(children[0].node().name(), Some("child"));
    assert_eq!(children[0].state(), &json!({"task": "research"}));
    // Applied directly: no instance message recorded.
    assert!(queued_payloads(&machine).is_empty());
    // A second spawn replaces the children rather than appending.
    let options = CommandOptions::default().instance(machine.instance().id().clone());
    run_command(&mut machine, "spawn_child", json!({}), options).await;
    assert_eq!(machine.instance().children().len(), 1);
}

#[tokio::test]
async fn a_child_cedes_with_content() {
    let mut machine = parent_machine(Some(child_node()));
    let out = run_command(&mut machine, "finish", json!({}), opts()).await;
    assert!(out.result.success, "{:?}", out.result);
    assert_eq!(out.result.value, Some(json!("child result")));
    assert!(machine.instance().children().is_empty());
    assert!(queued_payloads(&machine).is_empty());
}

#[tokio::test]
async fn the_root_cannot_cede() {
    let mut machine = parent_machine(None);
    let out = run_command(&mut machine, "finish", json!({}), opts()).await;
    assert!(!out.result.success);
    assert_eq!(
        out.result.error.as_deref(),
        Some("Cannot cede from root instance")
    );
}

#[test]
fn a_command_key_that_differs_from_its_name_is_refused() {
    let err = Node::builder("Count.")
        .shared_command("plus", ErasedCommand::shared(Increment))
        .build()
        .unwrap_err();
    assert!(matches!(err, ConfigError::CommandNameMismatch { .. }));
    assert!(
        err.to_string().starts_with("Node command name mismatch"),
        "{err}"
    );
    let err = Node::builder("Count.")
        .command(Increment)
        .command(Increment)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConfigError::DuplicateCommand { .. }), "{err}");
}

/// `go`: transitions to the charter node `child`.
struct Go;

#[async_trait]
impl Command for Go {
    const NAME: &'static str = "go";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Go elsewhere".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        _cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        Ok(transition_to(
            markov_charter::transition::NodeTarget::Ref("child".into()),
            Some(json!({"task": "new"})),
        )
        .into())
    }
}

#[tokio::test]
async fn a_transition_replaces_the_target_by_a_new_instance_keeping_pack_states_only() {
    let node = Node::builder("Start.")
        .command(Go)
        .pack(settings_pack())
        .build()
        .expect("builds");
    let charter = Charter::builder("test")
        .node("main", node.clone())
        .node("child", child_node())
        .build()
        .expect("builds");
    let info = SuspendInfo {
        suspend_id: "s1".into(),
        reason: "wait".into(),
        suspended_at: std::time::SystemTime::now(),
        metadata: None,
    };
    let root = Instance::new(node, json!({})).with_suspended(info);
    let mut machine = machine_on(charter, StandardExecutor::shared(no_model()), root).unwrap();
    let old_id = machine.instance().id().clone();
    let out = run_command(&mut machine, "go", json!({}), opts()).await;
    assert!(out.result.success, "{:?}", out.result);
    let root = machine.instance();
    // Quirk kept: a new id, the pack states but not the packs, no suspension.
    assert_ne!(root.id(), &old_id);
    assert_eq!(root.node().name(), Some("child"));
    assert_eq!(root.state(), &json!({"task": "new"}));
    assert!(root.suspended().is_none());
    assert!(root.packs().is_empty());
    assert_eq!(
        root.pack_states()["settings"],
        json!({"theme": "light", "volume": 3})
    );
    assert!(queued_payloads(&machine).is_empty());
}

/// `history`: counts the target's messages and replies with a text message.
struct HistoryCmd;

#[async_trait]
impl Command for HistoryCmd {
    const NAME: &'static str = "history";
    type Input = NoArgs;
    type Error = CommandError;
    fn description(&self) -> String {
        "Count my messages".into()
    }
    async fn execute(
        &self,
        _: NoArgs,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        let n = cx.instance_messages().count();
        Ok(CommandResult::with_payload(json!(n)).message(cx.user_message(format!("{n} messages"))))
    }
}

#[tokio::test]
async fn result_messages_are_enqueued_and_returned() {
    let node = Node::builder("Talk.")
        .command(HistoryCmd)
        .build()
        .expect("builds");
    let root = Instance::new(node.clone(), json!({}));
    let id = root.id().clone();
    let mine = Message::assistant("hello").with_metadata(Metadata::with_source(
        markov_core::message::Source {
            instance_id: Some(id.clone()),
            ..Default::default()
        },
    ));
    let charter = Charter::builder("test")
        .node("main", node)
        .build()
        .expect("builds");
    let mut machine = machine_with_history(
        charter,
        Arc::new(StandardExecutor::shared(no_model())),
        root,
        vec![Message::user("hi"), mine],
    );
    let out = run_command(&mut machine, "history", json!({}), opts()).await;
    assert_eq!(out.result.value, Some(json!(1)));
    assert_eq!(out.messages.len(), 1);
    assert_eq!(out.messages[0].text(), "1 messages");
    assert_eq!(out.messages[0].source_instance(), Some(&id));
    let queued = machine.queue().messages();
    assert_eq!(queued.len(), 2);
    assert_eq!(queued[1], out.messages[0]);
}

// ------------------------------------------------------ suspend / resume

/// `resume_with`: updates the state and resumes.
struct ResumeWith;

#[derive(Deserialize, JsonSchema)]
struct Answer {
    answer: String,
}

#[async_trait]
impl Command for ResumeWith {
    const NAME: &'static str = "resume_with";
    type Input = Answer;
    type Error = CommandError;
    fn description(&self) -> String {
        "Answer and resume".into()
    }
    async fn execute(
        &self,
        input: Answer,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        cx.update_state(json!({"label": input.answer}))?;
        Ok(command_resume())
    }
}

fn suspendable() -> Node {
    Node::builder("Ask for approval.")
        .state(Counter {
            count: 0,
            label: String::new(),
        })
        .command(SuspendCmd(Returns {
            result: || {
                TransitionResult::Suspend {
                    suspend_id: "approval-1".into(),
                    reason: "needs approval".into(),
                    metadata: Some(json!({"amount": 100})),
                }
                .into()
            },
        }))
        .command(ResumeWith)
        .command(Increment)
        .build()
        .expect("builds")
}

#[tokio::test]
async fn a_command_suspends_with_metadata() {
    let mut machine = crate::common::machine(|c| c, suspendable(), json!({"count": 0}), no_model());
    let out = run_command(&mut machine, "pause", json!({}), opts()).await;
    assert!(out.result.success, "{:?}", out.result);
    let info = machine.instance().suspended().expect("suspended").clone();
    assert_eq!(info.suspend_id, "approval-1");
    assert_eq!(info.reason, "needs approval");
    assert_eq!(info.metadata, Some(json!({"amount": 100})));
    assert!(machine.instance().active_leaves().is_empty());
}

#[tokio::test]
async fn a_command_on_a_suspended_root_updates_state_and_resumes() {
    let info = SuspendInfo {
        suspend_id: "s1".into(),
        reason: "waiting".into(),
        suspended_at: std::time::SystemTime::now(),
        metadata: None,
    };
    let node = suspendable();
    let charter = Charter::builder("test")
        .node("main", node.clone())
        .build()
        .expect("builds");
    let root = Instance::new(node, json!({"count": 0, "label": ""})).with_suspended(info);
    let mut machine = machine_on(charter, StandardExecutor::shared(no_model()), root).unwrap();
    let out = run_command(
        &mut machine,
        "resume_with",
        json!({"answer": "yes"}),
        opts(),
    )
    .await;
    assert!(out.result.success, "{:?}", out.result);
    assert!(machine.instance().suspended().is_none());
    assert_eq!(
        machine.instance().state(),
        &json!({"count": 0, "label": "yes"})
    );
}

#[tokio::test]
async fn a_command_targeted_at_the_parent_by_id_changes_the_parent_only() {
    let node = suspendable();
    let charter = Charter::builder("test")
        .node("main", node.clone())
        .build()
        .expect("builds");
    let root = Instance::new(node.clone(), json!({"count": 0, "label": ""}))
        .with_child(Instance::new(node, json!({"count": 10, "label": "child"})));
    let mut machine = machine_on(charter, StandardExecutor::shared(no_model()), root).unwrap();
    let parent = machine.instance().id().clone();
    let options = CommandOptions::default().instance(parent.clone());
    let out = run_command(&mut machine, "increment", json!({"by": 5}), options).await;
    assert!(out.result.success, "{:?}", out.result);
    assert_eq!(machine.instance().state()["count"], 5);
    assert_eq!(
        machine.instance().children()[0].state(),
        &json!({"count": 10, "label": "child"})
    );
    assert_eq!(
        queued_payloads(&machine),
        [InstancePayload::State {
            instance_id: parent,
            patch: json!({"count": 5}),
        }]
    );
}

// ------------------------------------------- silent messages (commands.test.ts)

fn silent(text: &str) -> Message {
    Message::user(text).with_metadata(Metadata {
        silent: Some(true),
        ..Metadata::default()
    })
}

#[tokio::test]
async fn only_a_silent_user_message_does_not_call_the_executor() {
    let model = no_model();
    let node = Node::builder("Talk.").build().expect("builds");
    let mut machine = crate::common::machine(|c| c, node, json!({}), Arc::clone(&model));
    machine.enqueue([silent("psst")]);
    let (steps, error) = crate::common::run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(model.calls(), 0);
    assert_eq!(steps.len(), 1);
    assert!(steps[0].done);
    assert_eq!(steps[0].yield_reason, YieldReason::EndTurn);
    assert_eq!(steps[0].history, [silent("psst")]);
    assert_eq!(machine.history(), [silent("psst")]);
}

#[tokio::test]
async fn a_non_silent_user_message_calls_the_executor() {
    let model = Arc::new(ScriptedModel::builder().text("hello").build());
    let node = Node::builder("Talk.").build().expect("builds");
    let mut machine = crate::common::machine(|c| c, node, json!({}), Arc::clone(&model));
    machine.enqueue_user("hi");
    let (_, error) = crate::common::run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(model.calls(), 1);
}

#[tokio::test]
async fn silent_and_non_silent_messages_call_the_executor_and_both_are_recorded() {
    let model = Arc::new(ScriptedModel::builder().text("hello").build());
    let node = Node::builder("Talk.").build().expect("builds");
    let mut machine = crate::common::machine(|c| c, node, json!({}), Arc::clone(&model));
    machine.enqueue([silent("context"), Message::user("question")]);
    let (_, error) = crate::common::run_all(&mut machine, RunOptions::default()).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(model.calls(), 1);
    let users: Vec<_> = machine
        .history()
        .iter()
        .filter(|m| m.role == Role::User)
        .map(Message::text)
        .collect();
    assert_eq!(users, ["context", "question"]);
}

#[test]
fn run_command_futures_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    let mut machine = counter_machine(0);
    let future = run_command(&mut machine, "increment", json!({"by": 1}), opts());
    assert_send(&future);
}
