//! proptest strategies for messages, items and tool calls.

use markov_core::ids::ToolCallId;
use markov_core::message::{Item, Items, Message, Metadata, Role, Source};
use proptest::prelude::*;
use serde_json::Value;

/// Arbitrary JSON values, a few levels deep.
pub fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "[a-zA-Z0-9 _-]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A valid tool name.
pub fn arb_tool_name() -> impl Strategy<Value = String> {
    "[a-zA-Z_][a-zA-Z0-9_-]{0,20}"
}

/// A tool call id.
pub fn arb_call_id() -> impl Strategy<Value = ToolCallId> {
    "call_[a-z0-9]{1,10}".prop_map(ToolCallId::from)
}

/// A tool call: `(id, name, input)`.
pub fn arb_tool_call() -> impl Strategy<Value = (ToolCallId, String, Value)> {
    (arb_call_id(), arb_tool_name(), arb_json())
}

/// Any item kind except instance payloads (which only instance messages hold).
pub fn arb_item() -> impl Strategy<Value = Item> {
    let text = ".{0,20}";
    prop_oneof![
        text.prop_map(Item::text),
        arb_tool_call().prop_map(|(id, name, input)| Item::ToolUse { id, name, input }),
        (arb_call_id(), text, proptest::option::of(any::<bool>()))
            .prop_map(|(id, content, is_error)| Item::tool_result(id, content, is_error)),
        (text, proptest::option::of("[a-zA-Z0-9]{1,8}")).prop_map(|(thinking, signature)| {
            Item::Thinking {
                thinking,
                signature,
            }
        }),
        ("image/(png|jpeg)", "[A-Za-z0-9+/]{0,16}").prop_map(|(mime_type, data)| {
            Item::Image {
                mime_type,
                data,
                detail: None,
            }
        }),
        (
            "https://x\\.test/[a-z]{1,5}",
            "application/pdf",
            proptest::option::of("[a-z]{1,5}\\.pdf"),
            proptest::option::of(any::<u64>())
        )
            .prop_map(|(url, media_type, filename, byte_size)| Item::File {
                url,
                media_type,
                filename,
                byte_size,
                storage_id: None,
            }),
        arb_json().prop_map(|data| Item::Output { data }),
        arb_tool_call().prop_map(|(id, name, input)| Item::ProviderToolUse { id, name, input }),
        (arb_call_id(), "[a-z_]{1,12}_tool_result", arb_json()).prop_map(
            |(tool_use_id, kind, content)| Item::ProviderToolResult {
                tool_use_id,
                kind,
                content,
            }
        ),
    ]
}

/// Any conversation role (not `instance`).
pub fn arb_role() -> impl Strategy<Value = Role> {
    prop_oneof![
        Just(Role::User),
        Just(Role::Assistant),
        Just(Role::System),
        Just(Role::Command),
        Just(Role::Ephemeral),
    ]
}

/// Optional metadata.
pub fn arb_metadata() -> impl Strategy<Value = Option<Metadata>> {
    proptest::option::of(
        (
            proptest::option::of(any::<bool>()),
            proptest::option::of("[a-z0-9-]{1,8}"),
            proptest::option::of(any::<bool>()),
        )
            .prop_map(|(silent, instance, primary)| Metadata {
                silent,
                source: instance.map(|id| Source {
                    instance_id: Some(id.into()),
                    is_primary: primary,
                    external: None,
                }),
                ..Metadata::default()
            }),
    )
}

/// A conversation message: string or item-list content.
pub fn arb_message() -> impl Strategy<Value = Message> {
    (
        arb_role(),
        prop_oneof![
            ".{0,20}".prop_map(Items::Text),
            prop::collection::vec(arb_item(), 0..5).prop_map(Items::List),
        ],
        arb_metadata(),
    )
        .prop_map(|(role, items, metadata)| {
            Message::from(markov_core::message::MessageData {
                role,
                items,
                metadata,
            })
        })
}
