//! Ephemeral messages through the run loop (upstream's
//! ephemeral.test.ts): they never wake waiters, collapse by singleton key,
//! stay queued when enqueued mid-run, and reach the model as silent user
//! messages ([`Message::ephemeral_view`]).

use crate::common::machine_on;
use std::pin::pin;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use futures::poll;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_core::message::{Item, Items, Message, Metadata, Role};
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse};
use markov_executor::{
    Instance, Machine, Queue, RunOptions, StandardExecutor, YieldReason, run_to_completion,
};
use markov_testkit::ScriptedModel;
use serde_json::json;

const PREAMBLE: &str = "[Camera frame] This is a snapshot from the user's live camera (not an uploaded file). Frames since last turn: ";

fn frame(data: &str) -> Item {
    Item::Image {
        mime_type: "image/jpeg".into(),
        data: data.into(),
        detail: None,
    }
}

fn camera(data: &str) -> Message {
    Message::from(markov_core::message::MessageData {
        role: Role::Ephemeral,
        items: Items::List(vec![frame(data)]),
        metadata: Some(Metadata {
            singleton: Some("camera".into()),
            ..Metadata::default()
        }),
    })
}

/// The silent user message a camera frame is shown as.
fn shown_frame(data: &str, frames: u64) -> Message {
    Message::user_items(vec![
        Item::text(format!("{PREAMBLE}{frames}.")),
        frame(data),
    ])
    .with_metadata(Metadata {
        silent: Some(true),
        ..Metadata::default()
    })
}

fn machine(model: impl Model + 'static) -> Machine {
    let node = Node::builder("Describe what you see.")
        .build()
        .expect("node builds");
    let charter = Charter::builder("camera")
        .node("main", node.clone())
        .build()
        .expect("charter builds");
    machine_on(
        charter,
        StandardExecutor::new(model),
        Instance::new(node, json!({})),
    )
    .expect("machine builds")
}

/// The conversation a model was sent, as it sees it (ephemerals rendered).
fn as_seen(messages: &[Message]) -> Vec<Message> {
    messages.iter().flat_map(Message::ephemeral_view).collect()
}

#[tokio::test]
async fn waiting_ignores_ephemerals_and_wakes_on_a_user_message() {
    let told = Arc::new(Mutex::new(0_usize));
    let counter = Arc::clone(&told);
    let machine = machine(ScriptedModel::new([]));
    machine.queue().set_on_enqueue(move |_: &Message| {
        *counter.lock().unwrap_or_else(PoisonError::into_inner) += 1;
    });
    let queue = machine.queue().clone();
    let mut wait = pin!(queue.wait());
    assert!(poll!(wait.as_mut()).is_pending());
    machine.enqueue([camera("A")]);
    assert!(
        poll!(wait.as_mut()).is_pending(),
        "an ephemeral woke a waiter"
    );
    assert_eq!(*told.lock().unwrap_or_else(PoisonError::into_inner), 0);
    machine.enqueue_user("hello");
    assert!(poll!(wait.as_mut()).is_ready());
    assert_eq!(*told.lock().unwrap_or_else(PoisonError::into_inner), 1);
}

#[tokio::test]
async fn camera_frames_sharing_a_key_collapse_to_the_last_with_their_count() {
    let model = Arc::new(ScriptedModel::builder().text("A cat.").build());
    let mut machine = machine(Arc::clone(&model));
    machine.enqueue([camera("A"), camera("B")]);
    machine.enqueue_user("What do you see?");
    let last = run_to_completion(&mut machine, RunOptions::default())
        .await
        .expect("the run ends");
    assert!(last.done);

    let sent = &model.requests()[0].messages;
    assert_eq!(
        as_seen(sent),
        [shown_frame("B", 2), Message::user("What do you see?")]
    );

    let ephemerals: Vec<&Message> = machine
        .history()
        .iter()
        .filter(|m| m.role == Role::Ephemeral)
        .collect();
    assert_eq!(ephemerals.len(), 1);
    assert_eq!(ephemerals[0].item_list(), [frame("B")]);
    assert_eq!(
        ephemerals[0]
            .metadata
            .as_ref()
            .and_then(|m| m.singleton_frame_count),
        Some(2)
    );
}

#[tokio::test]
async fn ephemerals_alone_run_no_inference() {
    let model = Arc::new(ScriptedModel::new([]));
    let mut machine = machine(Arc::clone(&model));
    machine.enqueue([camera("A")]);
    let last = run_to_completion(&mut machine, RunOptions::default())
        .await
        .expect("the run ends");
    assert_eq!(last.yield_reason, YieldReason::EndTurn);
    assert!(last.done);
    assert_eq!(model.calls(), 0);
    assert_eq!(machine.history().len(), 1);
}

/// A model that enqueues a camera frame into the machine's queue while it answers.
#[derive(Debug)]
struct FrameDuringCall {
    inner: ScriptedModel,
    queue: Mutex<Option<Queue>>,
}

#[async_trait]
impl markov_core::ModelLayer for FrameDuringCall {
    type Inner = ScriptedModel;

    fn inner(&self) -> &ScriptedModel {
        &self.inner
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let queue = self
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(queue) = queue {
            queue.enqueue([camera("LIVE")]);
        }
        self.inner.complete(request).await
    }
}

#[tokio::test]
async fn an_ephemeral_enqueued_mid_run_waits_for_the_next_run() {
    let model = Arc::new(FrameDuringCall {
        inner: ScriptedModel::builder().text("Hi.").text("A dog.").build(),
        queue: Mutex::new(None),
    });
    let mut machine = machine(Arc::clone(&model));
    *model.queue.lock().unwrap_or_else(PoisonError::into_inner) = Some(machine.queue().clone());

    machine.enqueue_user("Hello");
    let first = run_to_completion(&mut machine, RunOptions::default())
        .await
        .expect("the first run ends");
    assert!(first.done);
    assert!(first.history.iter().all(|m| m.role != Role::Ephemeral));
    let queued = machine.queue().messages();
    assert_eq!(queued, [camera("LIVE")]);

    machine.enqueue_user("What now?");
    run_to_completion(&mut machine, RunOptions::default())
        .await
        .expect("the second run ends");
    let requests = model.inner.requests();
    assert_eq!(
        as_seen(&requests[1].messages),
        [
            Message::user("Hello"),
            requests[1].messages[1].clone(),
            shown_frame("LIVE", 1),
            Message::user("What now?"),
        ]
    );
    assert_eq!(requests[1].messages[1].text(), "Hi.");
    assert!(machine.queue().is_empty());
}
