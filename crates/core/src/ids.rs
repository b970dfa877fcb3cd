//! Newtype identifiers, so that a tool call id is never mistaken for an instance id.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Reads an id straight into its shared string: one allocation, where
/// serde's `Arc<str>` reads a `Box<str>` first and copies it (two). A
/// history holds an id in nearly every message.
struct IdVisitor;

impl serde::de::Visitor<'_> for IdVisitor {
    type Value = Arc<str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string id")
    }

    fn visit_str<E: serde::de::Error>(self, id: &str) -> Result<Arc<str>, E> {
        Ok(Arc::from(id))
    }
}

macro_rules! string_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(Arc<str>);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                deserializer.deserialize_str(IdVisitor).map(Self)
            }
        }

        impl $name {
            /// Wraps a string as this id. Ids are opaque: any string is accepted.
            pub fn new(id: impl Into<Arc<str>>) -> Self {
                Self(id.into())
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                Self::new(s)
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                Self::new(s)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

string_id!(
    /// The id a model gives one tool call (`tool_use.id`), echoed by its result (`tool_use_id`).
    ToolCallId
);
string_id!(
    /// The id of one instance in a machine's instance tree (a uuid unless given).
    InstanceId
);
string_id!(
    /// The identity of a node definition; serialization and tool ownership compare it.
    NodeId
);
string_id!(
    /// A stable id for a message across streaming updates (`metadata.messageId`).
    MessageId
);
string_id!(
    /// The id of one run, for tracing and logs.
    RunId
);

/// Lower-case hex of `bytes`, two digits a byte: how markov writes a
/// digest or a secret as text (a digit table, not the formatter: keys and
/// digests are made on every tool call and every request).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

#[cfg(test)]
mod hex_tests {
    #[test]
    fn hex_is_lower_case_two_digits_a_byte() {
        assert_eq!(super::hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
        assert_eq!(super::hex(&[]), "");
    }
}
