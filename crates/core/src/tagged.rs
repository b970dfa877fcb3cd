//! Reading JSON objects tagged by a `type` key in one pass: the one reader
//! of tagged objects, for markov's message items and for the events of the
//! providers' streams.
//!
//! serde's derived internally tagged enums copy every object into a private
//! buffer before reading it again, and a tagged enum inside another one
//! does it twice. Here, when `type` is the object's first key (how markov
//! writes its items and how the APIs write their events), the tag picks
//! the variant and the rest of the object goes straight to its fields; a
//! later `type` falls back to collecting the object into a JSON value first.
//! Either way what is accepted and refused is what the derived reading
//! would accept and refuse: unknown keys are ignored, missing ones are
//! errors.

use serde::Deserialize;
use serde::de::value::MapAccessDeserializer;
use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, Visitor};
use serde_json::Value;

/// A type read from an object tagged by `type`.
pub trait Tagged: Sized {
    /// The values of `type` (with a catch-all for unknown ones, if the
    /// type accepts those).
    type Tag: DeserializeOwned;

    /// The value of type `tag` whose other fields `fields` holds (unknown
    /// fields ignored).
    fn from_fields<'de, D: Deserializer<'de>>(tag: Self::Tag, fields: D) -> Result<Self, D::Error>;
}

/// Reads a `T` from `deserializer` (use it in `T`'s `Deserialize` impl).
pub fn deserialize<'de, T: Tagged, D: Deserializer<'de>>(deserializer: D) -> Result<T, D::Error> {
    deserializer.deserialize_map(TaggedVisitor(std::marker::PhantomData))
}

struct TaggedVisitor<T>(std::marker::PhantomData<T>);

impl<'de, T: Tagged> Visitor<'de> for TaggedVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object with a \"type\"")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
        let first = match map.next_key::<FirstKey>()? {
            None => return Err(de::Error::missing_field("type")),
            Some(FirstKey(None)) => {
                let tag: T::Tag = map.next_value()?;
                return T::from_fields(tag, MapAccessDeserializer::new(map));
            }
            Some(FirstKey(Some(key))) => key,
        };
        let mut object = serde_json::Map::new();
        object.insert(first, map.next_value()?);
        while let Some((key, value)) = map.next_entry::<String, Value>()? {
            object.insert(key, value);
        }
        let tag = object
            .get("type")
            .ok_or_else(|| de::Error::missing_field("type"))
            .and_then(|tag| T::Tag::deserialize(tag).map_err(de::Error::custom))?;
        T::from_fields(tag, Value::Object(object)).map_err(de::Error::custom)
    }
}

/// A map key: `None` for `type`, else the key.
struct FirstKey(Option<String>);

impl<'de> Deserialize<'de> for FirstKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl Visitor<'_> for KeyVisitor {
            type Value = FirstKey;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a key")
            }

            fn visit_str<E: de::Error>(self, key: &str) -> Result<FirstKey, E> {
                Ok(FirstKey((key != "type").then(|| key.to_owned())))
            }
        }
        deserializer.deserialize_identifier(KeyVisitor)
    }
}
