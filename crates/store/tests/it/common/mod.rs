//! Machines for the store's tests: a payments node whose tools go through a
//! registry, so answered calls land in the idempotency ledger.

#![allow(dead_code, unreachable_pub)]

use std::convert::Infallible;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use markov_core::Item;
use markov_core::model::{ModelResponse, StopReason, Usage};
use markov_core::tool::{Tool, ToolContext};
use markov_executor::{Instance, Machine, StandardExecutor};
use markov_runtime::charter::Charter;
use markov_runtime::node::Node;
use markov_runtime::registry::{Budget, Category, Mode, PolicyConfig, ToolMetadata, ToolRegistry};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

#[derive(Debug, Deserialize, JsonSchema)]
pub struct PayArgs {
    pub amount: u32,
}

/// Pays: appends one line per execution to a file (a side effect another
/// process can count).
pub struct Pay(pub PathBuf);

impl Tool for Pay {
    const NAME: &'static str = "pay";
    type Args = PayArgs;
    type Output = String;
    type Error = std::io::Error;
    fn description(&self) -> String {
        "Pay an amount".into()
    }
    async fn call(&self, args: PayArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.0)?;
        writeln!(file, "paid {}", args.amount)?;
        file.sync_all()?;
        Ok(format!("paid {}", args.amount))
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct NoArgs {}

/// Writes a marker file, then never finishes: the moment to kill a process.
pub struct Hang(pub PathBuf);

impl Tool for Hang {
    const NAME: &'static str = "hang";
    type Args = NoArgs;
    type Output = String;
    type Error = Infallible;
    fn description(&self) -> String {
        "Wait".into()
    }
    async fn call(&self, _: NoArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        let _ = std::fs::write(&self.0, "hanging");
        std::future::pending::<()>().await;
        Ok(String::new())
    }
}

/// The node's state.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct Ledger {
    pub notes: u32,
}

/// Counts notes in its state (so the tree changes).
pub struct Note;

impl Tool for Note {
    const NAME: &'static str = "note";
    type Args = NoArgs;
    type Output = String;
    type Error = markov_core::tool::StateUpdateError;
    fn description(&self) -> String {
        "Take a note".into()
    }
    async fn call(&self, _: NoArgs, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        let n = cx.state_json()["notes"].as_u64().unwrap_or(0) + 1;
        cx.update_state(json!({ "notes": n }))?;
        Ok(format!("{n} notes"))
    }
}

/// Files a test writes to, in a fresh temporary directory.
pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "markov-store-{name}-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Dir(dir)
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn charter() -> (Charter, Node) {
    let node = Node::builder("Handle payments.")
        .name("main")
        .state(Ledger { notes: 0 })
        .build()
        .expect("node builds");
    let charter = Charter::builder("payments")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    (charter, node)
}

pub fn executor(model: Arc<ScriptedModel>, effects: PathBuf, marker: PathBuf) -> StandardExecutor {
    let registry = ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
        .register(Pay(effects), ToolMetadata::new(Category::Action))
        .register(Hang(marker), ToolMetadata::new(Category::Other))
        .register(Note, ToolMetadata::new(Category::Other))
        .lock()
        .expect("the registry locks");
    StandardExecutor::shared(model).with_registry(Arc::new(registry), Mode::TEXT)
}

pub fn machine(model: Arc<ScriptedModel>, dir: &Dir) -> Machine {
    let (charter, node) = charter();
    Machine::new(
        charter,
        executor(model, dir.path("effects"), dir.path("marker")),
        Instance::new(node, json!({"notes": 0})),
    )
    .expect("machine builds")
}

/// A response calling tools with the given ids.
pub fn calls(list: &[(&str, &str, Value)]) -> ModelResponse {
    ModelResponse {
        content: list
            .iter()
            .map(|(id, name, input)| Item::tool_use(*id, *name, input.clone()))
            .collect(),
        stop_reason: StopReason::ToolUse,
        usage: Usage::default(),
    }
}

/// Lines in a file (0 when it does not exist).
pub fn lines(path: &PathBuf) -> usize {
    std::fs::read_to_string(path).map_or(0, |s| s.lines().count())
}

/// The lease contract every store keeps, seen from two workers' handles on
/// one database (`first` and `second` may be the same store): a live lease
/// refuses the other worker's lease and writes, an expired one passes to
/// it, and the old holder is fenced out.
pub async fn lease_contract(first: &dyn markov_store::Store, second: &dyn markov_store::Store) {
    use markov_store::{SessionId, StepRecord, StoreError, WorkerId};
    use std::time::Duration;

    let dir = Dir::new("leases");
    let id = SessionId::new("leased");
    let (a, b) = (WorkerId::new("a"), WorkerId::new("b"));
    let model = Arc::new(ScriptedModel::builder().build());
    let snapshot = markov_executor::serialize_machine(&machine(model, &dir)).expect("serializes");
    first
        .create(&id, "payments", &snapshot, &a, Duration::from_millis(400))
        .await
        .expect("created");
    assert!(matches!(
        second.acquire(&id, &b, Duration::from_secs(60)).await,
        Err(StoreError::Leased { holder, .. }) if holder == a
    ));
    let empty = StepRecord {
        messages: &[],
        tree: None,
        approvals: None,
        repeats: None,
        run: None,
    };
    assert!(matches!(
        second.append(&id, &b, empty).await,
        Err(StoreError::LeaseLost { .. })
    ));
    first
        .append(&id, &a, empty)
        .await
        .expect("the holder writes");

    // a dies; its lease expires; b takes over, and a is fenced out.
    tokio::time::sleep(Duration::from_millis(450)).await;
    second
        .acquire(&id, &b, Duration::from_secs(60))
        .await
        .expect("b takes the expired lease");
    assert!(matches!(
        first.append(&id, &a, empty).await,
        Err(StoreError::LeaseLost { .. })
    ));
    second.release(&id, &b).await.expect("released");
    first
        .acquire(&id, &a, Duration::from_secs(60))
        .await
        .expect("free again");
}
