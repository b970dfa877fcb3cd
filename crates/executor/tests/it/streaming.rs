//! Streaming vessels and the queue's replacement by `messageId`
//! (upstream streaming.test.ts), run through the standard executor.

use crate::common::{machine_on, restore_on};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::{self, BoxStream};
use markov_charter::charter::Charter;
use markov_charter::node::{Node, OutputConfig};
use markov_core::MessageId;
use markov_core::message::{Item, Message, Metadata, Role, StreamInfo, StreamState};
use markov_core::model::{
    Model, ModelError, ModelRequest, ModelResponse, StopReason, StreamEvent, collect_stream,
};
use markov_executor::{
    Instance, Machine, MachineStep, MessageStreamEvent, RunError, RunOptions, StandardExecutor,
    run_machine, serialize_machine,
};
use markov_testkit::ScriptedModel;
use markov_testkit::fixtures::Add;
use schemars::JsonSchema;
use serde_json::json;

/// What a test saw: every message given to `on_enqueue`, every stream event.
#[derive(Clone, Default)]
struct Seen {
    enqueued: Arc<Mutex<Vec<Message>>>,
    events: Arc<Mutex<Vec<MessageStreamEvent>>>,
}

impl Seen {
    fn enqueued(&self) -> Vec<Message> {
        self.enqueued
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn events(&self) -> Vec<MessageStreamEvent> {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records every message enqueued on `machine` from now on.
    fn watch(&self, machine: &Machine) {
        let enqueued = Arc::clone(&self.enqueued);
        machine.queue().set_on_enqueue(move |m: &Message| {
            enqueued
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(m.clone())
        });
    }

    fn executor(&self, model: impl Model + 'static) -> StandardExecutor {
        let events = Arc::clone(&self.events);
        StandardExecutor::new(model).with_streaming(move |e: &MessageStreamEvent| {
            events
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(e.clone())
        })
    }
}

fn node() -> Node {
    Node::builder("Answer briefly.")
        .tool(Add)
        .build()
        .expect("node builds")
}

fn charter(node: &Node) -> Charter {
    Charter::builder("streaming")
        .node("main", node.clone())
        .build()
        .expect("charter builds")
}

fn machine_with(executor: StandardExecutor, node: Node, seen: &Seen) -> Machine {
    let machine = machine_on(charter(&node), executor, Instance::new(node, json!({})))
        .expect("machine builds");
    seen.watch(&machine);
    machine
}

fn streaming_machine(model: impl Model + 'static, seen: &Seen) -> Machine {
    machine_with(seen.executor(model), node(), seen)
}

async fn run_all(machine: &mut Machine) -> (Vec<MachineStep>, Option<RunError>) {
    let mut steps = Vec::new();
    let mut stream = std::pin::pin!(run_machine(machine, RunOptions::default()));
    while let Some(item) = stream.next().await {
        match item {
            Ok(step) => steps.push(step),
            Err(e) => return (steps, Some(e)),
        }
    }
    (steps, None)
}

fn response(content: Vec<Item>, stop_reason: StopReason) -> ModelResponse {
    ModelResponse::new(content, stop_reason)
}

fn message_id(message: &Message) -> Option<MessageId> {
    message.metadata.as_ref().and_then(|m| m.message_id.clone())
}

fn stream_info(message: &Message) -> Option<StreamInfo> {
    message.metadata.as_ref().and_then(|m| m.stream.clone())
}

fn info(state: StreamState, seq: u64) -> Option<StreamInfo> {
    Some(StreamInfo {
        state,
        seq: Some(seq),
    })
}

/// The kinds and sequence numbers of events, in order.
fn sequence(events: &[MessageStreamEvent]) -> Vec<(&'static str, u64)> {
    events.iter().map(|e| (e.kind(), e.seq())).collect()
}

/// A model whose every call streams one scripted list of events.
#[derive(Debug)]
struct Chunked {
    calls: Mutex<VecDeque<Vec<Result<StreamEvent, ModelError>>>>,
}

impl Chunked {
    fn new(calls: impl IntoIterator<Item = Vec<Result<StreamEvent, ModelError>>>) -> Self {
        Chunked {
            calls: Mutex::new(calls.into_iter().collect()),
        }
    }
}

#[async_trait]
impl Model for Chunked {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        collect_stream(self.stream(request)).await
    }

    fn stream<'a>(
        &'a self,
        _request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        let events = self
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
            .unwrap_or_default();
        stream::iter(events).boxed()
    }
}

fn text_delta(index: usize, text: &str) -> Result<StreamEvent, ModelError> {
    Ok(StreamEvent::TextDelta {
        index,
        text: text.into(),
    })
}

// ---- the queue (streaming.test.ts) -------------------------------------

fn with_id(message: Message, id: &str) -> Message {
    message.with_metadata(Metadata {
        message_id: Some(id.into()),
        ..Metadata::default()
    })
}

fn assert_replaced_in_place(machine: &Machine, seen: &Seen) {
    machine.enqueue([Message::user("before")]);
    machine.enqueue([with_id(Message::assistant("v1"), "m1")]);
    machine.enqueue([Message::user("after")]);
    machine.enqueue([with_id(Message::assistant("v2"), "m1")]);
    let queued: Vec<String> = machine
        .queue()
        .messages()
        .iter()
        .map(Message::text)
        .collect();
    assert_eq!(queued, ["before", "v2", "after"]);
    let told: Vec<String> = seen.enqueued().iter().map(Message::text).collect();
    assert_eq!(told, ["before", "v1", "after", "v2"]);
}

#[test]
fn the_same_message_id_keeps_the_latest_in_the_same_slot_and_reports_both() {
    let seen = Seen::default();
    let machine = streaming_machine(ScriptedModel::new([]), &seen);
    assert_replaced_in_place(&machine, &seen);
}

#[test]
fn replacement_and_callbacks_work_the_same_after_deserialization() {
    let seen = Seen::default();
    let original = streaming_machine(ScriptedModel::new([]), &Seen::default());
    let data = serialize_machine(&original).expect("serializes");
    let node = node();
    let machine = restore_on(
        charter(&node),
        Arc::new(seen.executor(ScriptedModel::new([]))),
        data.into_owned(),
    )
    .expect("deserializes");
    seen.watch(&machine);
    assert_replaced_in_place(&machine, &seen);
}

// ---- the vessel protocol -------------------------------------------------

#[tokio::test]
async fn a_streamed_answer_replaces_its_vessel_in_place() {
    let seen = Seen::default();
    let mut machine = streaming_machine(ScriptedModel::builder().text("Hello!").build(), &seen);
    machine.enqueue_user("hi");
    let (steps, error) = run_all(&mut machine).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(steps.len(), 1);

    // Step history: the user message and one assistant message, the final one.
    let history = &steps[0].history;
    assert_eq!(history.len(), 2);
    let final_message = &history[1];
    assert_eq!(final_message.role, Role::Assistant);
    assert_eq!(final_message.item_list(), [Item::text("Hello!")]);
    let id = message_id(final_message).expect("a messageId");
    assert_eq!(stream_info(final_message), info(StreamState::Complete, 2));
    assert_eq!(machine.history(), history.as_slice());

    // on_enqueue saw the user message, the vessel, then the final version.
    let told = seen.enqueued();
    assert_eq!(told.len(), 3);
    assert_eq!(told[1].item_list(), []);
    assert_eq!(message_id(&told[1]), Some(id.clone()));
    assert_eq!(stream_info(&told[1]), info(StreamState::Streaming, 0));
    assert_eq!(&told[2], final_message);

    // Both carry the leaf as their source.
    let source = told[1].metadata.as_ref().and_then(|m| m.source.clone());
    assert_eq!(
        source.and_then(|s| s.instance_id),
        Some(machine.instance().id().clone())
    );
    assert!(machine.queue().is_empty());
}

#[tokio::test]
async fn events_come_in_order_with_one_seq_per_delta() {
    let seen = Seen::default();
    let model = ScriptedModel::new([response(
        vec![
            Item::Thinking {
                thinking: "hmm".into(),
                signature: None,
            },
            Item::text("Hel"),
            Item::text("lo"),
        ],
        StopReason::EndTurn,
    )]);
    let mut machine = streaming_machine(model, &seen);
    machine.enqueue_user("hi");
    let (steps, error) = run_all(&mut machine).await;
    assert!(error.is_none(), "{error:?}");

    let events = seen.events();
    assert_eq!(
        sequence(&events),
        [
            ("message_start", 0),
            ("message_update", 1),
            ("message_update", 2),
            ("message_update", 3),
            ("message_end", 4),
        ]
    );
    let id = events[0].message_id().clone();
    assert!(events.iter().all(|e| *e.message_id() == id));
    let deltas: Vec<serde_json::Value> = events
        .iter()
        .filter_map(|e| match e {
            MessageStreamEvent::Update { delta, .. } => Some(serde_json::to_value(delta).unwrap()),
            _ => None,
        })
        .collect();
    assert_eq!(
        deltas,
        [
            json!({"kind": "thinking", "contentIndex": 0, "delta": "hmm"}),
            json!({"kind": "text", "contentIndex": 1, "delta": "Hel"}),
            json!({"kind": "text", "contentIndex": 2, "delta": "lo"}),
        ]
    );
    match (&events[0], &events[4]) {
        (
            MessageStreamEvent::Start { message, .. },
            MessageStreamEvent::End {
                message: final_message,
                ..
            },
        ) => {
            assert_eq!(message.item_list(), []);
            assert_eq!(stream_info(message), info(StreamState::Streaming, 0));
            assert_eq!(final_message, &steps[0].history[1]);
            assert_eq!(stream_info(final_message), info(StreamState::Complete, 4));
        }
        other => panic!("unexpected events {other:?}"),
    }
}

#[tokio::test]
async fn fine_grained_deltas_each_raise_seq() {
    let seen = Seen::default();
    let model = Chunked::new([vec![
        text_delta(0, "Hel"),
        text_delta(0, "lo"),
        text_delta(0, "!"),
        Ok(StreamEvent::Done(response(
            vec![Item::text("Hello!")],
            StopReason::EndTurn,
        ))),
    ]]);
    let mut machine = streaming_machine(model, &seen);
    machine.enqueue_user("hi");
    let (steps, error) = run_all(&mut machine).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(
        sequence(&seen.events()),
        [
            ("message_start", 0),
            ("message_update", 1),
            ("message_update", 2),
            ("message_update", 3),
            ("message_end", 4),
        ]
    );
    assert_eq!(steps[0].history[1].text(), "Hello!");
}

#[tokio::test]
async fn a_failing_stream_reports_an_error_and_leaves_the_vessel_in_error() {
    let seen = Seen::default();
    let model = Chunked::new([vec![
        text_delta(0, "Hal"),
        Err(ModelError::Overloaded("busy".into())),
        text_delta(0, "never read"),
    ]]);
    let mut machine = streaming_machine(model, &seen);
    machine.enqueue_user("hi");
    let (steps, error) = run_all(&mut machine).await;
    assert!(steps.is_empty());
    assert_eq!(
        error,
        Some(RunError::Model {
            step: 1,
            source: ModelError::Overloaded("busy".into()),
        })
    );

    let events = seen.events();
    assert_eq!(
        sequence(&events),
        [
            ("message_start", 0),
            ("message_update", 1),
            ("message_error", 2),
        ]
    );
    assert_eq!(
        serde_json::to_value(&events[2]).unwrap()["error"],
        json!({"message": "provider overloaded: busy"})
    );

    // The vessel was enqueued again, in state error with the text so far;
    // it stays queued, as everything enqueued in a failed step does.
    let queued = machine.queue().messages();
    assert_eq!(queued.len(), 1);
    assert_eq!(queued[0].text(), "Hal");
    assert_eq!(message_id(&queued[0]), Some(events[0].message_id().clone()));
    assert_eq!(stream_info(&queued[0]), info(StreamState::Error, 2));
    let states: Vec<_> = seen
        .enqueued()
        .iter()
        .filter_map(stream_info)
        .map(|s| s.state)
        .collect();
    assert_eq!(states, [StreamState::Streaming, StreamState::Error]);
}

#[tokio::test]
async fn a_stream_without_a_final_message_is_an_error() {
    let seen = Seen::default();
    let model = Chunked::new([vec![text_delta(0, "Hal")]]);
    let mut machine = streaming_machine(model, &seen);
    machine.enqueue_user("hi");
    let (_, error) = run_all(&mut machine).await;
    assert!(
        matches!(
            error,
            Some(RunError::Model {
                source: ModelError::InvalidResponse(_),
                ..
            })
        ),
        "{error:?}"
    );
    assert_eq!(
        seen.events().last().map(MessageStreamEvent::kind),
        Some("message_error")
    );
}

#[tokio::test]
async fn each_model_call_streams_its_own_message_before_the_tool_results() {
    let seen = Seen::default();
    let model = ScriptedModel::builder()
        .text_and_tool_calls("Adding.", [("add", json!({"a": 2, "b": 3}))])
        .text("5")
        .build();
    let mut machine = streaming_machine(model, &seen);
    machine.enqueue_user("2 + 3?");
    let (steps, error) = run_all(&mut machine).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(steps.len(), 2);

    let first = &steps[0].history;
    let roles: Vec<Role> = first.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::User, Role::Assistant, Role::User]);
    assert_eq!(first[1].text(), "Adding.");
    assert_eq!(first[1].tool_uses().count(), 1);
    assert_eq!(
        first[2].item_list(),
        [Item::tool_result("call_1", "5", Some(false))]
    );
    assert_eq!(steps[1].history.len(), 1);
    let a = message_id(&first[1]).expect("first id");
    let b = message_id(&steps[1].history[0]).expect("second id");
    assert_ne!(a, b);

    // One text delta per text item: the tool call gives no update.
    assert_eq!(
        sequence(&seen.events()),
        [
            ("message_start", 0),
            ("message_update", 1),
            ("message_end", 2),
            ("message_start", 0),
            ("message_update", 1),
            ("message_end", 2),
        ]
    );
    // The final version was reported before the tool result.
    let told: Vec<(Role, Option<StreamState>)> = seen
        .enqueued()
        .iter()
        .map(|m| (m.role, stream_info(m).map(|s| s.state)))
        .collect();
    assert_eq!(
        told,
        [
            (Role::User, None),
            (Role::Assistant, Some(StreamState::Streaming)),
            (Role::Assistant, Some(StreamState::Complete)),
            (Role::User, None),
            (Role::Assistant, Some(StreamState::Streaming)),
            (Role::Assistant, Some(StreamState::Complete)),
        ]
    );
}

/// Counts `stream` calls; answers `complete` from a script.
#[derive(Debug)]
struct NoStream {
    inner: ScriptedModel,
    streams: Mutex<usize>,
}

#[async_trait]
impl Model for NoStream {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        self.inner.complete(request).await
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        *self.streams.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.inner.stream(request)
    }
}

#[tokio::test]
async fn structured_output_is_not_streamed_but_still_uses_a_vessel() {
    #[derive(JsonSchema)]
    #[allow(dead_code)]
    struct Answer {
        value: i64,
    }
    let node = Node::builder("Answer in JSON.")
        .output(OutputConfig::of::<Answer>())
        .build()
        .expect("node builds");
    let model = Arc::new(NoStream {
        inner: ScriptedModel::builder().text(r#"{"value": 42}"#).build(),
        streams: Mutex::new(0),
    });
    let seen = Seen::default();
    let mut machine = machine_with(seen.executor(Arc::clone(&model)), node, &seen);
    machine.enqueue_user("answer");
    let (steps, error) = run_all(&mut machine).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(
        *model.streams.lock().unwrap_or_else(PoisonError::into_inner),
        0
    );
    assert_eq!(
        sequence(&seen.events()),
        [("message_start", 0), ("message_end", 1)]
    );
    let final_message = &steps[0].history[1];
    assert_eq!(
        final_message.item_list(),
        [Item::Output {
            data: json!({"value": 42})
        }]
    );
    assert_eq!(stream_info(final_message), info(StreamState::Complete, 1));
}

#[tokio::test]
async fn without_streaming_nothing_carries_a_message_id() {
    let seen = Seen::default();
    let node = node();
    let mut machine = machine_with(
        StandardExecutor::new(ScriptedModel::builder().text("Hello!").build()),
        node,
        &seen,
    );
    machine.enqueue_user("hi");
    let (steps, error) = run_all(&mut machine).await;
    assert!(error.is_none(), "{error:?}");
    assert!(steps[0].history.iter().all(|m| message_id(m).is_none()));
    assert_eq!(seen.enqueued().len(), 2);
    assert!(seen.events().is_empty());
}
