//! Reading items without serde's buffering.
//!
//! `Item` is internally tagged by `type` and `Items` is a string, a list or
//! an object. Derived, both would first copy every item into serde's
//! private buffer and then read it again (twice for an item inside
//! `items`), which made reading a history three to five times slower than
//! writing it. Here an item whose first key is `type` (how markov and
//! upstream write them) is read in one pass: the tag picks the variant and
//! the rest of the object goes straight to that variant's fields (through
//! [`crate::tagged`], the reader the providers' stream events use too). What
//! is accepted and refused is what the derived reading accepted and
//! refused: unknown keys are ignored, missing ones are errors.

use std::fmt;

use serde::Deserialize;
use serde::de::value::MapAccessDeserializer;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::{
    ImageData, InstancePayload, Item, Items, Message, MessageData, MessageShapeError, Metadata,
    NativeItems, Role,
};
use crate::ids::{InstanceId, ToolCallId};

/// The values of `type`.
#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum ItemType {
    Text,
    Image,
    File,
    ToolUse,
    ToolResult,
    ProviderToolUse,
    ProviderToolResult,
    Thinking,
    Output,
    Command,
    Summary,
    Native,
    Resume,
}

// The fields of each variant, with the attributes of `Item`'s variants.

#[derive(Deserialize)]
struct TextFields {
    text: String,
}

#[derive(Deserialize)]
struct ImageFields {
    #[serde(rename = "mimeType")]
    mime_type: String,
    data: String,
    #[serde(default)]
    detail: Option<String>,
}

#[derive(Deserialize)]
struct FileFields {
    url: String,
    #[serde(rename = "mediaType")]
    media_type: String,
    #[serde(default)]
    filename: Option<String>,
    #[serde(rename = "byteSize", default)]
    byte_size: Option<u64>,
    #[serde(rename = "storageId", default)]
    storage_id: Option<String>,
}

#[derive(Deserialize)]
struct CallFields {
    id: ToolCallId,
    name: String,
    input: Value,
}

#[derive(Deserialize)]
struct ResultFields {
    tool_use_id: ToolCallId,
    content: String,
    #[serde(default)]
    is_error: Option<bool>,
    // Absent in every result without images, and in all stored before
    // tool results could carry them.
    #[serde(default)]
    images: Vec<ImageData>,
}

#[derive(Deserialize)]
struct ProviderResultFields {
    tool_use_id: ToolCallId,
    kind: String,
    content: Value,
}

#[derive(Deserialize)]
struct ThinkingFields {
    thinking: String,
    #[serde(default)]
    signature: Option<String>,
}

#[derive(Deserialize)]
struct OutputFields {
    data: Value,
}

#[derive(Deserialize)]
struct CommandFields {
    name: String,
    input: Value,
    #[serde(rename = "instanceId", default)]
    instance_id: Option<InstanceId>,
    #[serde(rename = "clientId", default)]
    client_id: Option<String>,
}

#[derive(Deserialize)]
struct SummaryFields {
    text: String,
    start: u64,
    end: u64,
    // Absent in every summary stored before native compaction.
    #[serde(default)]
    native: Option<NativeItems>,
}

#[derive(Deserialize)]
struct NativeFields {
    vendor: String,
    items: Vec<String>,
}

#[derive(Deserialize)]
struct ResumeFields {
    #[serde(rename = "instanceId")]
    instance_id: InstanceId,
    #[serde(rename = "suspendId")]
    suspend_id: String,
}

/// The item of type `tag` whose other fields `fields` holds.
fn item<'de, D: Deserializer<'de>>(tag: ItemType, fields: D) -> Result<Item, D::Error> {
    Ok(match tag {
        ItemType::Text => Item::Text {
            text: TextFields::deserialize(fields)?.text,
        },
        ItemType::Image => {
            let f = ImageFields::deserialize(fields)?;
            Item::Image {
                mime_type: f.mime_type,
                data: f.data,
                detail: f.detail,
            }
        }
        ItemType::File => {
            let f = FileFields::deserialize(fields)?;
            Item::File {
                url: f.url,
                media_type: f.media_type,
                filename: f.filename,
                byte_size: f.byte_size,
                storage_id: f.storage_id,
            }
        }
        ItemType::ToolUse => {
            let f = CallFields::deserialize(fields)?;
            Item::ToolUse {
                id: f.id,
                name: f.name,
                input: f.input,
            }
        }
        ItemType::ProviderToolUse => {
            let f = CallFields::deserialize(fields)?;
            Item::ProviderToolUse {
                id: f.id,
                name: f.name,
                input: f.input,
            }
        }
        ItemType::ToolResult => {
            let f = ResultFields::deserialize(fields)?;
            Item::ToolResult {
                tool_use_id: f.tool_use_id,
                content: f.content,
                is_error: f.is_error,
                images: f.images,
            }
        }
        ItemType::ProviderToolResult => {
            let f = ProviderResultFields::deserialize(fields)?;
            Item::ProviderToolResult {
                tool_use_id: f.tool_use_id,
                kind: f.kind,
                content: f.content,
            }
        }
        ItemType::Thinking => {
            let f = ThinkingFields::deserialize(fields)?;
            Item::Thinking {
                thinking: f.thinking,
                signature: f.signature,
            }
        }
        ItemType::Output => Item::Output {
            data: OutputFields::deserialize(fields)?.data,
        },
        ItemType::Command => {
            let f = CommandFields::deserialize(fields)?;
            Item::Command {
                name: f.name,
                input: f.input,
                instance_id: f.instance_id,
                client_id: f.client_id,
            }
        }
        ItemType::Summary => {
            let f = SummaryFields::deserialize(fields)?;
            Item::Summary {
                text: f.text,
                start: f.start,
                end: f.end,
                native: f.native,
            }
        }
        ItemType::Native => {
            let f = NativeFields::deserialize(fields)?;
            Item::Native {
                vendor: f.vendor,
                items: f.items,
            }
        }
        ItemType::Resume => {
            let f = ResumeFields::deserialize(fields)?;
            Item::Resume {
                instance_id: f.instance_id,
                suspend_id: f.suspend_id,
            }
        }
    })
}

/// An item read as a tagged object (a type of this module, so that the tag
/// table stays private).
struct TaggedItem(Item);

impl crate::tagged::Tagged for TaggedItem {
    type Tag = ItemType;

    fn from_fields<'de, D: Deserializer<'de>>(tag: ItemType, fields: D) -> Result<Self, D::Error> {
        item(tag, fields).map(TaggedItem)
    }
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::tagged::deserialize::<TaggedItem, D>(deserializer).map(|t| t.0)
    }
}

/// The keys of a message.
#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "lowercase")]
enum MessageKey {
    Role,
    Items,
    Metadata,
    #[serde(other)]
    Other,
}

impl<'de> Deserialize<'de> for Message {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_struct("Message", &["role", "items", "metadata"], MessageVisitor)
    }
}

/// Reads the fields straight into the message (no intermediate value to
/// move: a message is some 150 bytes, and a history holds thousands).
struct MessageVisitor;

impl<'de> Visitor<'de> for MessageVisitor {
    type Value = Message;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Message, A::Error> {
        let mut role = None;
        let mut items = None;
        let mut metadata = None;
        while let Some(key) = map.next_key()? {
            match key {
                MessageKey::Role if role.is_some() => {
                    return Err(de::Error::duplicate_field("role"));
                }
                MessageKey::Role => role = Some(map.next_value()?),
                MessageKey::Items if items.is_some() => {
                    return Err(de::Error::duplicate_field("items"));
                }
                MessageKey::Items => items = Some(map.next_value()?),
                MessageKey::Metadata if metadata.is_some() => {
                    return Err(de::Error::duplicate_field("metadata"));
                }
                MessageKey::Metadata => metadata = Some(map.next_value::<Option<Metadata>>()?),
                MessageKey::Other => {
                    map.next_value::<de::IgnoredAny>()?;
                }
            }
        }
        let role: Role = role.ok_or_else(|| de::Error::missing_field("role"))?;
        let items: Items = items.ok_or_else(|| de::Error::missing_field("items"))?;
        MessageShapeError::check(role, &items).map_err(de::Error::custom)?;
        Ok(MessageData {
            role,
            items,
            metadata: metadata.flatten(),
        }
        .into())
    }
}

impl<'de> Deserialize<'de> for Items {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ItemsVisitor)
    }
}

struct ItemsVisitor;

impl<'de> Visitor<'de> for ItemsVisitor {
    type Value = Items;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string, a list of items or an instance payload")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Items, E> {
        Ok(Items::Text(text.to_owned()))
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<Items, E> {
        Ok(Items::Text(text))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Items, A::Error> {
        // The hint comes from the input: trusted only as far as a small
        // first allocation.
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(16));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Items::List(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Items, A::Error> {
        let payload = InstancePayload::deserialize(MapAccessDeserializer::new(map))?;
        Ok(Items::Instance(Box::new(payload)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(value: Value) -> Result<Item, String> {
        // Through text, as a snapshot is read (the fast path needs a
        // streaming deserializer), and through a `Value`.
        let text = value.to_string();
        let from_text = serde_json::from_str::<Item>(&text).map_err(|e| e.to_string());
        let from_value = serde_json::from_value::<Item>(value).map_err(|e| e.to_string());
        assert_eq!(from_text.is_ok(), from_value.is_ok(), "{text}");
        from_text
    }

    #[test]
    fn type_first_or_later_reads_the_same_item() {
        let first = json!({"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}});
        let later = serde_json::from_str::<Value>(
            r#"{"id": "t1", "name": "add", "input": {"a": 1}, "type": "tool_use"}"#,
        )
        .unwrap();
        let expected = Item::tool_use("t1", "add", json!({"a": 1}));
        assert_eq!(read(first).unwrap(), expected);
        assert_eq!(read(later).unwrap(), expected);
        let text = r#"{"content":"3","type":"tool_result","tool_use_id":"t1"}"#;
        assert_eq!(
            serde_json::from_str::<Item>(text).unwrap(),
            Item::tool_result("t1", "3", None)
        );
    }

    #[test]
    fn unknown_keys_are_ignored_and_missing_ones_refused() {
        assert_eq!(
            read(json!({"type": "text", "text": "hi", "extra": [1, {"x": 2}]})).unwrap(),
            Item::text("hi")
        );
        let missing = read(json!({"type": "tool_use", "id": "t1", "input": {}})).unwrap_err();
        assert!(missing.contains("missing field `name`"), "{missing}");
        let no_type = read(json!({"text": "hi"})).unwrap_err();
        assert!(no_type.contains("missing field `type`"), "{no_type}");
        let unknown = read(json!({"type": "nope"})).unwrap_err();
        assert!(unknown.contains("unknown variant `nope`"), "{unknown}");
        let wrong = read(json!({"type": "tool_result", "tool_use_id": "t", "content": 3}));
        assert!(wrong.is_err());
        assert!(read(json!("text")).is_err());
        assert!(read(json!({})).is_err());
    }

    #[test]
    fn every_variant_reads_back() {
        let items = vec![
            Item::text("a"),
            Item::Image {
                mime_type: "image/png".into(),
                data: "AAA".into(),
                detail: Some("low".into()),
            },
            Item::File {
                url: "https://x/a.pdf".into(),
                media_type: "application/pdf".into(),
                filename: Some("a.pdf".into()),
                byte_size: Some(3),
                storage_id: None,
            },
            Item::tool_use("t1", "add", json!({"a": [1, 2]})),
            Item::tool_result("t1", "3", Some(false)),
            Item::tool_result_with_images(
                "t2",
                "[image image/png, 3 bytes]",
                None,
                vec![ImageData::new("image/png", "AAAA")],
            ),
            Item::provider_tool_use("s1", "web_search", json!({"q": "x"})),
            Item::provider_tool_result("s1", "web_search_tool_result", json!([{"u": 1}])),
            Item::Thinking {
                thinking: "hm".into(),
                signature: Some("sig".into()),
            },
            Item::Output {
                data: json!({"answer": 4}),
            },
            Item::Command {
                name: "reset".into(),
                input: json!({}),
                instance_id: Some("i1".into()),
                client_id: None,
            },
            Item::Resume {
                instance_id: "i1".into(),
                suspend_id: "s".into(),
            },
            Item::Summary {
                text: "earlier".into(),
                start: 0,
                end: 12,
                native: None,
            },
            Item::Summary {
                text: String::new(),
                start: 12,
                end: 20,
                native: Some(NativeItems::new(
                    "openai.responses",
                    vec![r#"{"type":"compaction","id":"cmp_1"}"#.into()],
                )),
            },
            Item::Native {
                vendor: "openai.responses".into(),
                items: vec![r#"{"z":1,"a":[1.50]}"#.into()],
            },
        ];
        for item in items {
            let value = serde_json::to_value(&item).unwrap();
            assert_eq!(read(value).unwrap(), item);
        }
    }

    #[test]
    fn items_are_a_string_a_list_or_a_payload() {
        let text: Message = serde_json::from_str(r#"{"role":"user","items":"hi"}"#).unwrap();
        assert_eq!(text.items, Items::Text("hi".into()));
        let list: Message =
            serde_json::from_str(r#"{"role":"user","items":[{"type":"text","text":"hi"}]}"#)
                .unwrap();
        assert_eq!(list.items, Items::List(vec![Item::text("hi")]));
        let payload: Message = serde_json::from_str(
            r#"{"role":"instance","items":{"instanceId":"i","kind":"state","patch":{}}}"#,
        )
        .unwrap();
        assert!(matches!(payload.items, Items::Instance(_)));
        for bad in [
            r#"{"role":"user","items":3}"#,
            r#"{"role":"user","items":null}"#,
            r#"{"role":"user","items":[3]}"#,
            r#"{"role":"instance","items":{"kind":"nope"}}"#,
        ] {
            assert!(serde_json::from_str::<Message>(bad).is_err(), "{bad}");
        }
    }

    mod properties {
        use super::super::super::{Message, Metadata, Role, Source};
        use super::*;
        use proptest::prelude::*;

        fn json_value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(|n| json!(n)),
                "[a-z\"\\\\é ]{0,8}".prop_map(Value::String),
            ];
            leaf.prop_recursive(3, 16, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                    prop::collection::btree_map("[a-z]{1,4}", inner, 0..4)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        fn item() -> impl Strategy<Value = Item> {
            let text = "[a-z\"\\\\é ]{0,8}";
            prop_oneof![
                text.prop_map(Item::text),
                (text, json_value()).prop_map(|(id, input)| Item::tool_use(id, "add", input)),
                (text, text, proptest::option::of(any::<bool>()))
                    .prop_map(|(id, content, e)| Item::tool_result(id, content, e)),
                (
                    text,
                    text,
                    prop::collection::vec("[A-Za-z0-9+/]{0,8}", 1..3)
                )
                    .prop_map(|(id, content, data)| Item::tool_result_with_images(
                        id,
                        content,
                        None,
                        data.into_iter()
                            .map(|d| ImageData::new("image/png", d))
                            .collect()
                    )),
                (text, json_value())
                    .prop_map(|(id, input)| Item::provider_tool_use(id, "s", input)),
                (text, json_value()).prop_map(|(id, c)| Item::provider_tool_result(
                    id,
                    "web_search_tool_result",
                    c
                )),
                (text, proptest::option::of(text)).prop_map(|(thinking, signature)| {
                    Item::Thinking {
                        thinking,
                        signature,
                    }
                }),
                json_value().prop_map(|data| Item::Output { data }),
            ]
        }

        fn message() -> impl Strategy<Value = Message> {
            let role = prop_oneof![
                Just(Role::User),
                Just(Role::Assistant),
                Just(Role::System),
                Just(Role::Ephemeral),
                Just(Role::Summary),
            ];
            (
                role,
                prop_oneof![
                    "[a-z ]{0,8}".prop_map(Items::Text),
                    prop::collection::vec(item(), 0..4).prop_map(Items::List),
                ],
                proptest::option::of("[a-z]{1,6}"),
            )
                .prop_map(|(role, items, source)| {
                    Message::from(MessageData {
                        role,
                        items,
                        metadata: source.map(|id| {
                            Metadata::with_source(Source {
                                instance_id: Some(id.into()),
                                ..Source::default()
                            })
                        }),
                    })
                })
        }

        proptest! {
            /// What is written reads back equal, from text and from a `Value`.
            #[test]
            fn messages_round_trip(messages in prop::collection::vec(message(), 0..6)) {
                let text = serde_json::to_string(&messages).unwrap();
                let back: Vec<Message> = serde_json::from_str(&text).unwrap();
                prop_assert_eq!(&back, &messages);
                let value = serde_json::to_value(&messages).unwrap();
                let back: Vec<Message> = serde_json::from_value(value).unwrap();
                prop_assert_eq!(back, messages);
            }

            /// Pretty-printed (white space everywhere) reads the same.
            #[test]
            fn white_space_does_not_matter(messages in prop::collection::vec(message(), 0..6)) {
                let pretty = serde_json::to_string_pretty(&messages).unwrap();
                prop_assert_eq!(serde_json::from_str::<Vec<Message>>(&pretty).unwrap(), messages);
            }

            /// Cut anywhere, the written bytes are refused.
            #[test]
            fn a_cut_history_is_refused(
                messages in prop::collection::vec(message(), 1..4),
                cut in any::<prop::sample::Index>(),
            ) {
                let text = serde_json::to_string(&messages).unwrap();
                let mut end = cut.index(text.len());
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                prop_assert!(serde_json::from_str::<Vec<Message>>(&text[..end]).is_err());
            }

            /// Keys in any order read the same item as keys in the written order.
            #[test]
            fn key_order_does_not_matter(item in item(), rotate in 0usize..6) {
                let Value::Object(map) = serde_json::to_value(&item).unwrap() else {
                    panic!("an item is an object");
                };
                let mut entries: Vec<(String, Value)> = map.into_iter().collect();
                let n = entries.len();
                entries.rotate_left(rotate % n);
                let text = format!(
                    "{{{}}}",
                    entries
                        .iter()
                        .map(|(k, v)| format!("{}:{}", Value::String(k.clone()), v))
                        .collect::<Vec<_>>()
                        .join(",")
                );
                let back: Item = serde_json::from_str(&text).unwrap();
                prop_assert_eq!(back, item);
            }
        }
    }
}
