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
//!
//! A content shared behind an [`Arc`] (a node's tool list, which every
//! step and every session of the node offers) is marked with
//! [`serialize_shared`] instead: its JSON and hash are worked out once per
//! allocation and remembered, so a long tool list is not written and hashed
//! again at every step.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

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
        keeper.keep(&hashed, || text);
        hashed
    });
    KEEPER.with(|k| *k.borrow_mut() = Some(keeper));
    reference(hashed, serializer)
}

/// [`serialize`] for a value shared behind an [`Arc`] that cannot change
/// while it is shared (no interior mutability: a prompt, a tool list).
/// Inside [`keep_contents`], its JSON and hash are worked out once per
/// allocation and hash function, and remembered with a clone of the `Arc`
/// (so the allocation cannot be another value's while it is remembered);
/// at most [`SHARED_REMEMBERED`] of them, after which the memory starts
/// again empty. For serde's `serialize_with`.
///
/// # Errors
/// What `serializer` fails with, or a content that is not JSON.
pub fn serialize_shared<T, S>(value: &Arc<T>, serializer: S) -> Result<S::Ok, S::Error>
where
    T: Serialize + ?Sized + Send + Sync + 'static,
    S: Serializer,
{
    let Some(mut keeper) = KEEPER.with(|k| k.borrow_mut().take()) else {
        return value.serialize(serializer);
    };
    let hashed = shared_content(value, keeper.hash).map(|(hashed, text)| {
        keeper.keep(&hashed, || text.as_ref().to_owned());
        hashed
    });
    KEEPER.with(|k| *k.borrow_mut() = Some(keeper));
    reference(hashed, serializer)
}

/// Writes the reference `{"$content": <hash>}`.
fn reference<S: Serializer>(
    hashed: Result<String, serde_json::Error>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let hashed = hashed.map_err(S::Error::custom)?;
    let mut map = serializer.serialize_map(Some(1))?;
    map.serialize_entry(CONTENT_KEY, &hashed)?;
    map.end()
}

impl Keeper {
    /// Keeps the content hashed `hashed` (its JSON made by `text`) unless
    /// this write kept it already.
    fn keep(&mut self, hashed: &str, text: impl FnOnce() -> String) {
        if !self.kept.iter().any(|(h, _)| h == hashed) {
            self.kept.push((hashed.to_owned(), text()));
        }
    }
}

/// How many shared contents [`serialize_shared`] remembers. Each holds
/// its value alive: the bound keeps that to a few megabytes however many
/// prompts a process makes.
pub const SHARED_REMEMBERED: usize = 256;

/// A shared content as [`serialize_shared`] remembers it.
struct Remembered {
    /// The `Arc` the content was read from, held so that its allocation
    /// is not freed and given to another value while remembered.
    _alive: Box<dyn std::any::Any + Send + Sync>,
    hash: String,
    text: Arc<str>,
}

/// Shared contents by (allocation, hash function).
static SHARED: LazyLock<Mutex<HashMap<(usize, usize), Remembered>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// `value`'s hash by `hash` and its JSON, remembered (see
/// [`serialize_shared`]).
fn shared_content<T>(
    value: &Arc<T>,
    hash: fn(&str) -> String,
) -> Result<(String, Arc<str>), serde_json::Error>
where
    T: Serialize + ?Sized + Send + Sync + 'static,
{
    let key = (Arc::as_ptr(value).cast::<()>() as usize, hash as usize);
    let lock = || SHARED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(found) = lock().get(&key) {
        return Ok((found.hash.clone(), Arc::clone(&found.text)));
    }
    // Written and hashed outside the lock: another thread may do the same
    // for the same value at once, and both find the same answer.
    let text: Arc<str> = serde_json::to_string(&**value)?.into();
    let hashed = hash(&text);
    let mut shared = lock();
    if shared.len() >= SHARED_REMEMBERED {
        // Forgetting costs only the work remembering saved.
        shared.clear();
    }
    shared.insert(
        key,
        Remembered {
            _alive: Box::new(Arc::clone(value)),
            hash: hashed.clone(),
            text: Arc::clone(&text),
        },
    );
    Ok((hashed, text))
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

    /// A tool list that counts how often it is written.
    struct Counted {
        name: &'static str,
        writes: std::sync::atomic::AtomicUsize,
    }

    impl Serialize for Counted {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            self.writes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            [self.name].serialize(serializer)
        }
    }

    #[derive(Serialize)]
    struct SharedRecord {
        step: u32,
        #[serde(serialize_with = "super::serialize_shared")]
        tools: std::sync::Arc<Counted>,
    }

    fn counted(name: &'static str) -> std::sync::Arc<Counted> {
        std::sync::Arc::new(Counted {
            name,
            writes: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    fn writes(tools: &Counted) -> usize {
        tools.writes.load(std::sync::atomic::Ordering::Relaxed)
    }

    #[test]
    fn a_shared_content_is_kept_as_a_marked_one_is() {
        let tools = counted("shared_add");
        let record = SharedRecord {
            step: 1,
            tools: std::sync::Arc::clone(&tools),
        };
        let (written, kept) = keep_contents(length, || serde_json::to_string(&record));
        assert_eq!(
            written.ok().as_deref(),
            Some(r#"{"step":1,"tools":{"$content":"h14"}}"#)
        );
        assert_eq!(kept, [("h14".to_owned(), r#"["shared_add"]"#.to_owned())]);
        // Outside a keeping write it is itself.
        assert_eq!(
            serde_json::to_string(&record).ok().as_deref(),
            Some(r#"{"step":1,"tools":["shared_add"]}"#)
        );
    }

    #[test]
    fn a_shared_content_is_written_once_however_many_records_repeat_it() {
        let tools = counted("once");
        let records: Vec<SharedRecord> = (0..3)
            .map(|step| SharedRecord {
                step,
                tools: std::sync::Arc::clone(&tools),
            })
            .collect();
        for record in &records {
            let (written, kept) = keep_contents(length, || serde_json::to_string(record));
            assert!(written.is_ok());
            // Each write is handed the content: a store keeps it once
            // whichever write is the first to reach it.
            assert_eq!(kept, [("h8".to_owned(), r#"["once"]"#.to_owned())]);
        }
        assert_eq!(writes(&tools), 1);
        // Another allocation of equal content is its own: written once
        // too, under the same hash.
        let again = counted("once");
        let record = SharedRecord {
            step: 4,
            tools: std::sync::Arc::clone(&again),
        };
        let (_, kept) = keep_contents(length, || serde_json::to_string(&record));
        assert_eq!(kept, [("h8".to_owned(), r#"["once"]"#.to_owned())]);
        assert_eq!(writes(&again), 1);
        // A different hash function is asked for its own hash.
        let (written, kept) = keep_contents(
            |text| format!("x{}", text.len()),
            || serde_json::to_string(&record),
        );
        assert_eq!(
            written.ok().as_deref(),
            Some(r#"{"step":4,"tools":{"$content":"x8"}}"#)
        );
        assert_eq!(kept, [("x8".to_owned(), r#"["once"]"#.to_owned())]);
        assert_eq!(writes(&again), 2);
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
