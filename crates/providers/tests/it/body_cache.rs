//! Bodies built from the clients' cache of encoded messages are the bytes
//! `serde_json::to_vec` of the whole request writes, at every step of a
//! growing history, for both vendors.

use markov_core::model::HistoryId;
use markov_core::{Item, Items, Message, ModelRequest, ModelSettings, Role, ToolChoice};
use markov_providers::{Anthropic, OpenAi};
use proptest::prelude::*;
use serde_json::json;

/// One message of any role and shape the wire renders differently.
pub(crate) fn message() -> impl Strategy<Value = Message> {
    let text = "[a-z \"\\\\é\n\u{1}😀]{0,12}";
    prop_oneof![
        text.prop_map(Message::user),
        text.prop_map(Message::assistant),
        text.prop_map(Message::system),
        (0u8..4).prop_map(|n| Message::assistant_items(vec![
            Item::text("calling"),
            Item::tool_use(format!("t{n}"), "add", json!({"a": n, "b": [1, 2]})),
        ])),
        // Reasoning as the Responses client records it, before its call.
        (0u8..4).prop_map(|n| Message::assistant_items(vec![
            Item::Thinking {
                thinking: "why".into(),
                signature: Some(format!("rs_{n}|enc")),
            },
            Item::tool_use(format!("t{n}"), "add", json!({"a": n})),
        ])),
        (0u8..4, proptest::option::of(any::<bool>()), text).prop_map(|(n, error, out)| {
            Message::user_items(vec![
                Item::text("and"),
                Item::tool_result(format!("t{n}"), out, error),
            ])
        }),
        text.prop_map(|t| Message::from(markov_core::message::MessageData {
            role: Role::Ephemeral,
            items: Items::Text(t),
            metadata: None,
        })),
        Just(Message::from(markov_core::message::MessageData {
            role: Role::Command,
            items: Items::List(vec![Item::text("ignored")]),
            metadata: None,
        })),
        Just(Message::user("")),
    ]
}

fn anthropic() -> Anthropic {
    Anthropic::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .expect("client builds")
}

#[cfg(feature = "responses")]
fn responses() -> markov_providers::Responses {
    markov_providers::Responses::builder()
        .base_url("http://127.0.0.1:1/v1")
        .build()
        .expect("client builds")
}

fn openai() -> OpenAi {
    OpenAi::builder()
        .base_url("http://127.0.0.1:1")
        .build()
        .expect("client builds")
}

/// Grows a history message by message; every request (with and without
/// streaming, each with its history id) must equal the uncached body, and
/// errors must agree. `frames[len]` picks what surrounds the messages of the
/// request at `len` (system prompt, tools, tool choice, settings), so the
/// parts around the messages change between some requests and not others.
fn check_growing<E>(messages: &[Message], frames: &[u8], encode: E)
where
    E: Fn(&ModelRequest<'_>, bool) -> (Result<Vec<u8>, String>, Result<Vec<u8>, String>),
{
    let tool = |name: &str, schema| {
        markov_core::ToolDefinition::new(name, "Adds.", schema).expect("valid name")
    };
    let add = tool(
        "add",
        json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
    );
    let tool_lists = [
        vec![],
        vec![add.clone()],
        vec![
            tool(
                "add",
                json!({"type": "object", "properties": {"a": {"type": "number"}}}),
            ),
            tool("echo", json!({"type": "object"})),
        ],
        vec![add],
    ];
    let warm = ModelSettings {
        temperature: Some(0.5),
        ..ModelSettings::default()
    };
    let thinking = ModelSettings {
        thinking: Some(markov_core::model::Thinking::Enabled {
            budget_tokens: 1024,
        }),
        ..ModelSettings::default()
    };
    let settings = [ModelSettings::default(), warm, thinking];
    let choices = [ToolChoice::Auto, ToolChoice::Any];
    // Streaming is part of what surrounds the messages: each pass keeps one
    // setting, so that the parts around the messages are reused.
    for stream in [false, true] {
        let id = HistoryId::fresh();
        for len in 0..=messages.len() {
            let history = &messages[..len];
            let frame = usize::from(frames.get(len).copied().unwrap_or(0));
            let system = ["", "Be brief.", "Be brief!"][frame % 3];
            let request = ModelRequest::new(system, history, &settings[frame / 3 % 3])
                .with_tools(&tool_lists[frame / 9 % 4])
                .with_tool_choice(&choices[frame / 36 % 2])
                .with_history_id(id);
            let (cached, plain) = encode(&request, stream);
            match (&cached, &plain) {
                (Ok(c), Ok(p)) => assert_eq!(
                    String::from_utf8_lossy(c),
                    String::from_utf8_lossy(p),
                    "history of {len}"
                ),
                (Err(c), Err(p)) => assert_eq!(c, p),
                _ => panic!("cached {cached:?} but plain {plain:?} at {len}"),
            }
        }
    }
}

/// Mostly one frame, sometimes another: runs of reuse and changes.
fn frames() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(prop_oneof![3 => Just(10u8), 1 => 0u8..72], 0..25)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn anthropic_bodies_from_the_cache_are_the_plain_bodies(
        messages in prop::collection::vec(message(), 0..24),
        frames in frames(),
    ) {
        let client = anthropic();
        check_growing(&messages, &frames, |request, stream| {
            (
                client.request_body(request, stream).map_err(|e| e.to_string()),
                client.request_body_uncached(request, stream).map_err(|e| e.to_string()),
            )
        });
    }

    #[cfg(feature = "responses")]
    #[test]
    fn responses_bodies_from_the_cache_are_the_plain_bodies(
        messages in prop::collection::vec(message(), 0..24),
        frames in frames(),
    ) {
        let client = responses();
        check_growing(&messages, &frames, |request, stream| {
            (
                client.request_body(request, stream).map_err(|e| e.to_string()),
                client.request_body_uncached(request, stream).map_err(|e| e.to_string()),
            )
        });
    }

    #[test]
    fn openai_bodies_from_the_cache_are_the_plain_bodies(
        messages in prop::collection::vec(message(), 0..24),
        frames in frames(),
    ) {
        let client = openai();
        check_growing(&messages, &frames, |request, stream| {
            (
                client.request_body(request, stream).map_err(|e| e.to_string()),
                client.request_body_uncached(request, stream).map_err(|e| e.to_string()),
            )
        });
    }
}

/// A request that breaks its id's promise with a shorter history is encoded
/// afresh, never from the longer history's bytes.
#[test]
fn a_shorter_history_under_one_id_is_encoded_afresh() {
    let settings = ModelSettings::default();
    let long = [
        Message::user("first"),
        Message::assistant("second"),
        Message::user("third"),
    ];
    let id = HistoryId::fresh();
    for client_body in [
        Box::new(|r: &ModelRequest<'_>| {
            let c = anthropic();
            let _ = c.request_body(&r.with_messages(&long).with_history_id(id), false);
            (
                c.request_body(r, false).unwrap(),
                c.request_body_uncached(r, false).unwrap(),
            )
        }) as Box<dyn Fn(&ModelRequest<'_>) -> (Vec<u8>, Vec<u8>)>,
        Box::new(|r: &ModelRequest<'_>| {
            let c = openai();
            let _ = c.request_body(&r.with_messages(&long).with_history_id(id), false);
            (
                c.request_body(r, false).unwrap(),
                c.request_body_uncached(r, false).unwrap(),
            )
        }),
    ] {
        let short = [Message::user("other")];
        let request = ModelRequest::new("", &short, &settings).with_history_id(id);
        let (cached, plain) = client_body(&request);
        assert_eq!(cached, plain);
        assert!(!String::from_utf8_lossy(&cached).contains("first"));
    }
}

/// Without a history id nothing is kept, and a rewritten message list drops
/// the id it was given with.
#[test]
fn requests_without_a_history_id_stand_alone() {
    let settings = ModelSettings::default();
    let one = [Message::user("one")];
    let two = [Message::user("two")];
    let id = HistoryId::fresh();
    let request = ModelRequest::new("", &one, &settings).with_history_id(id);
    assert_eq!(request.with_messages(&two).history_id(), None);
    let client = anthropic();
    client.request_body(&request, false).unwrap();
    let rewritten = request.with_messages(&two);
    let body = client.request_body(&rewritten, false).unwrap();
    assert!(String::from_utf8_lossy(&body).contains("two"));
    assert!(!String::from_utf8_lossy(&body).contains("one"));
}

/// A history rewritten under its id (a broken promise, which only a caller
/// that set the id by hand can make) is caught in debug and test builds:
/// the cached body is checked against the body encoded afresh, so every
/// test of the workspace would fail on a cache that sent stale messages.
#[cfg(debug_assertions)]
#[test]
fn a_cached_body_that_differs_from_a_fresh_one_is_caught() {
    let (anthropic, openai) = (anthropic(), openai());
    let anthropic_client = || &anthropic;
    let openai_client = || &openai;
    let settings = ModelSettings::default();
    let id = HistoryId::fresh();
    let kept = [
        Message::user("first"),
        Message::assistant("kept"),
        Message::user("more"),
    ];
    let rewritten = [
        Message::user("first"),
        Message::assistant("changed"),
        Message::user("more"),
    ];
    let extra = Message::assistant("next");
    for vendor in ["anthropic", "openai"] {
        let body = |history: &[Message]| {
            let request = ModelRequest::new("", history, &settings).with_history_id(id);
            match vendor {
                "anthropic" => anthropic_client().request_body(&request, false),
                _ => openai_client().request_body(&request, false),
            }
        };
        let _ = body(&kept);
        let mut broken = rewritten.to_vec();
        broken.push(extra.clone());
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&broken)));
        assert!(
            caught.is_err(),
            "{vendor}: the stale cached messages were sent unchecked"
        );
    }
}
