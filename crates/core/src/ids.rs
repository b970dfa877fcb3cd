//! Newtype identifiers, so that a tool call id is never mistaken for an instance id.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

/// Reads an id straight into its shared string: one allocation, where
/// reading a `String` first and converting it would make two; none when the
/// id is the one this thread read last for the same kind of id.
///
/// A history repeats its ids (every message of an instance names it, every
/// tool result echoes its call's id), so a one-entry cache per kind makes
/// most of them shared strings, as they were before the history was written.
struct IdVisitor(&'static std::thread::LocalKey<RefCell<Option<Arc<str>>>>);

impl Visitor<'_> for IdVisitor {
    type Value = Arc<str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string id")
    }

    fn visit_str<E: de::Error>(self, id: &str) -> Result<Arc<str>, E> {
        Ok(self.0.with(|last| {
            let mut last = last.borrow_mut();
            match &*last {
                Some(seen) if **seen == *id => Arc::clone(seen),
                _ => {
                    let fresh: Arc<str> = Arc::from(id);
                    *last = Some(Arc::clone(&fresh));
                    fresh
                }
            }
        }))
    }
}

macro_rules! string_id {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
        #[serde(transparent)]
        pub struct $name(Arc<str>);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                thread_local! {
                    static LAST: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
                }
                deserializer.deserialize_str(IdVisitor(&LAST)).map(Self)
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
