//! Contents a store keeps once, however many records repeat them.
//!
//! A step's record repeats what its model call was sent besides the
//! history (the system prompt, the tools, a context view's summary), and
//! these rarely change from one step to the next. A field marked
//! `#[serde(serialize_with = "markov_core::kept::serialize")]` is written
//! as itself, except while [`keep_contents`] runs: then it is written as
//! `{"$content": <hash>}` and its JSON handed to the caller, once per hash.
//! So a store writes a record in one pass of `serde_json`, with no tree of
//! `Value`s built to find and replace those fields afterwards, and every
//! other serialization of the same types (an API's answer, a snapshot) is
//! unchanged. Serialization is synchronous, so the contents kept belong to
//! the one call of [`keep_contents`] running on this thread.

use std::cell::RefCell;

use serde::ser::{Error as _, SerializeMap as _};
use serde::{Serialize, Serializer};

/// The key of a kept content's reference: `{"$content": <hash>}`.
pub const CONTENT_KEY: &str = "$content";

/// The contents kept while [`keep_contents`] runs: their hash function,
/// and each content's hash and JSON, in the order first met.
struct Keeper {
    hash: fn(&str) -> String,
    kept: Vec<(String, String)>,
}

thread_local! {
    static KEEPER: RefCell<Option<Keeper>> = const { RefCell::new(None) };
}

/// Runs `write` (which serializes something), with every field marked
/// for [`serialize`] written as a reference to its content, named by
/// `hash` of its JSON; returns what `write` returned and each content's
/// hash and JSON, once per hash, in the order first met. Calls do not
/// nest: a call inside `write` keeps nothing of its own, and its fields
/// are kept by the outer call.
pub fn keep_contents<R>(
    hash: fn(&str) -> String,
    write: impl FnOnce() -> R,
) -> (R, Vec<(String, String)>) {
    /// Takes the keeper back however `write` ends (a panic included), so
    /// that no later serialization on this thread keeps anything.
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            KEEPER.with(|k| *k.borrow_mut() = None);
        }
    }
    if KEEPER.with(|k| k.borrow().is_some()) {
        return (write(), Vec::new());
    }
    KEEPER.with(|k| {
        *k.borrow_mut() = Some(Keeper {
            hash,
            kept: Vec::new(),
        });
    });
    let restore = Restore;
    let written = write();
    let kept = KEEPER
        .with(|k| k.borrow_mut().take())
        .map(|keeper| keeper.kept)
        .unwrap_or_default();
    drop(restore);
    (written, kept)
}

/// Writes `value` as itself, or, inside [`keep_contents`], as a reference
/// to its content (see the module's documentation). For serde's
/// `serialize_with`.
///
/// # Errors
/// What `serializer` fails with, or a content that is not JSON.
pub fn serialize<T, S>(value: &T, serializer: S) -> Result<S::Ok, S::Error>
where
    T: Serialize + ?Sized,
    S: Serializer,
{
    // Taken out while the content is written, so that the content is
    // written whole (a marked field inside it stays itself) and what is
    // kept reads back as the value it was.
    let Some(mut keeper) = KEEPER.with(|k| k.borrow_mut().take()) else {
        return value.serialize(serializer);
    };
    let hashed = serde_json::to_string(value).map(|text| {
        let hashed = (keeper.hash)(&text);
        if !keeper.kept.iter().any(|(h, _)| *h == hashed) {
            keeper.kept.push((hashed.clone(), text));
        }
        hashed
    });
    KEEPER.with(|k| *k.borrow_mut() = Some(keeper));
    let hashed = hashed.map_err(S::Error::custom)?;
    let mut map = serializer.serialize_map(Some(1))?;
    map.serialize_entry(CONTENT_KEY, &hashed)?;
    map.end()
}

#[cfg(test)]
mod tests {
    use serde::Serialize;

    use super::keep_contents;

    #[derive(Serialize)]
    struct Record {
        step: u32,
        #[serde(serialize_with = "super::serialize")]
        system: String,
        #[serde(serialize_with = "super::serialize")]
        tools: Vec<&'static str>,
    }

    fn length(text: &str) -> String {
        format!("h{}", text.len())
    }

    #[test]
    fn outside_a_keeping_write_a_marked_field_is_itself() {
        let record = Record {
            step: 1,
            system: "Answer.".into(),
            tools: vec!["add"],
        };
        assert_eq!(
            serde_json::to_string(&record).ok().as_deref(),
            Some(r#"{"step":1,"system":"Answer.","tools":["add"]}"#)
        );
    }

    #[test]
    fn inside_one_each_content_is_a_reference_kept_once() {
        let records = [
            Record {
                step: 1,
                system: "Answer.".into(),
                tools: vec!["add"],
            },
            Record {
                step: 2,
                system: "Answer.".into(),
                tools: vec![],
            },
        ];
        let (written, kept) = keep_contents(length, || serde_json::to_string(&records));
        assert_eq!(
            written.ok().as_deref(),
            Some(
                r#"[{"step":1,"system":{"$content":"h9"},"tools":{"$content":"h7"}},{"step":2,"system":{"$content":"h9"},"tools":{"$content":"h2"}}]"#
            )
        );
        assert_eq!(
            kept,
            [
                ("h9".to_owned(), r#""Answer.""#.to_owned()),
                ("h7".to_owned(), r#"["add"]"#.to_owned()),
                ("h2".to_owned(), "[]".to_owned()),
            ]
        );
        // And nothing is kept after it.
        let plain = serde_json::to_string(&records[0]).unwrap_or_default();
        assert!(plain.contains(r#""system":"Answer.""#), "{plain}");
    }

    #[test]
    fn a_kept_content_is_kept_whole_with_the_marked_fields_inside_it() {
        #[derive(Serialize)]
        struct Outer {
            #[serde(serialize_with = "super::serialize")]
            inner: Record,
        }
        let outer = Outer {
            inner: Record {
                step: 4,
                system: "Inner.".into(),
                tools: vec![],
            },
        };
        let (written, kept) = keep_contents(length, || serde_json::to_string(&outer));
        let whole = r#"{"step":4,"system":"Inner.","tools":[]}"#;
        assert_eq!(
            written.ok().as_deref(),
            Some(format!(r#"{{"inner":{{"$content":"h{}"}}}}"#, whole.len()).as_str())
        );
        assert_eq!(kept, [(format!("h{}", whole.len()), whole.to_owned())]);
    }

    #[test]
    fn a_write_that_panics_keeps_nothing_afterwards() {
        let panicked = std::panic::catch_unwind(|| {
            keep_contents(length, || -> u8 { panic!("a failed write") })
        });
        assert!(panicked.is_err());
        let record = Record {
            step: 3,
            system: "S".into(),
            tools: vec![],
        };
        let plain = serde_json::to_string(&record).unwrap_or_default();
        assert_eq!(plain, r#"{"step":3,"system":"S","tools":[]}"#);
    }
}
