//! [`ObjectRecords`]: the [`CallJournal`] of a call that resumes from its
//! journal (a sub-agent), kept as steps of the invocation's own journal.
//!
//! Restate replays an invocation's journal in order, and a replayed
//! `ctx.run` answers what it journaled without running its closure again.
//! So a call's records are slots: `ctx.run` steps, all of the same name,
//! each journaling one record, read back in the order they were written.
//! When the call starts, slots are read until one runs its closure (no
//! earlier attempt journaled it): what came before are the records of the
//! call's earlier attempts, and that fresh slot journals an end mark, which
//! a later attempt reading past it skips. Each write journals a new slot,
//! durable when `ctx.run` answers. A retried invocation, replaying the
//! same steps in the same order, reads the slots its earlier attempt
//! wrote, its own end marks among them, and only then goes on live.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::tool::CallJournal;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::{Op, journal_through};

/// The most slots read when a call starts: a journal holding more is
/// read no further (a log line says so).
const MAX_SLOTS: usize = 100_000;

/// One call's records, journaled through its handler.
pub(crate) struct ObjectRecords {
    ops: mpsc::UnboundedSender<Op>,
    /// The name every slot of the call is journaled under.
    slot: String,
    /// What earlier attempts of the call recorded, `(name, record)`.
    recorded: Vec<(String, Value)>,
    /// Set once a write could not be journaled: the call must not go on
    /// as if it had been.
    broken: Mutex<Option<String>>,
}

impl std::fmt::Debug for ObjectRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectRecords")
            .field("slot", &self.slot)
            .field("recorded", &self.recorded.len())
            .finish_non_exhaustive()
    }
}

/// What a slot journaled, as its step's value.
enum Slot {
    /// A record.
    Record(String, Value),
    /// An end mark: a call started here and read no further.
    End,
    /// The step failed, or the handler is gone.
    Failed(String),
}

impl Slot {
    fn read(value: Value) -> Slot {
        if value.get("end").is_some() {
            return Slot::End;
        }
        if let Some(record) = value.get("record") {
            return match (
                record.get("name").and_then(Value::as_str),
                record.get("value"),
            ) {
                (Some(name), Some(value)) => Slot::Record(name.to_owned(), value.clone()),
                _ => Slot::Failed(format!("a journaled record does not read back: {record}")),
            };
        }
        let why = value
            .get("error")
            .or_else(|| value.get("interrupted"))
            .and_then(Value::as_str)
            .unwrap_or("the handler did not journal the record");
        Slot::Failed(why.to_owned())
    }
}

impl ObjectRecords {
    /// The records of the call `call`, read back from the slots earlier
    /// attempts of the invocation journaled, through the handler's `ops`.
    pub(crate) async fn open(
        ops: mpsc::UnboundedSender<Op>,
        call: &ToolCallId,
    ) -> Arc<ObjectRecords> {
        let slot = format!("record {call}");
        let mut recorded: Vec<(String, Value)> = Vec::new();
        let mut broken = None;
        for read in 0.. {
            if read == MAX_SLOTS {
                tracing::warn!(call = %call, "a call's journal holds too many records: read no further");
                broken = Some("too many records in the call's journal".to_owned());
                break;
            }
            let fresh = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&fresh);
            // Runs only when no earlier attempt journaled this slot.
            let work: BoxFuture<'_, Value> = Box::pin(async move {
                flag.store(true, Ordering::SeqCst);
                json!({ "end": true })
            });
            let value = journal_through(&ops, slot.clone(), false, work, interrupted()).await;
            if fresh.load(Ordering::SeqCst) {
                break;
            }
            match Slot::read(value) {
                Slot::Record(name, value) => keep(&mut recorded, name, value),
                Slot::End => {}
                Slot::Failed(why) => {
                    tracing::error!(call = %call, %why, "a call's journal could not be read back");
                    broken = Some(why);
                    break;
                }
            }
        }
        if !recorded.is_empty() {
            tracing::info!(call = %call, records = recorded.len(), "the call continues from what an earlier attempt recorded");
        }
        Arc::new(ObjectRecords {
            ops,
            slot,
            recorded,
            broken: Mutex::new(broken),
        })
    }
}

/// Keeps `value` under `name`: in the place of an earlier record of that
/// name, else last.
fn keep(recorded: &mut Vec<(String, Value)>, name: String, value: Value) {
    match recorded.iter_mut().find(|(n, _)| *n == name) {
        Some(slot) => slot.1 = value,
        None => recorded.push((name, value)),
    }
}

fn interrupted() -> Value {
    json!({ "interrupted": "the session handler ended before the record was journaled" })
}

#[async_trait]
impl CallJournal for ObjectRecords {
    fn recorded(&self) -> Vec<(String, Value)> {
        self.recorded.clone()
    }

    /// Journals a slot holding the record: durable when Restate
    /// acknowledged the step.
    async fn write(&self, name: &str, record: Value) -> Result<(), String> {
        self.check()?;
        let value = json!({ "record": { "name": name, "value": record } });
        let work: BoxFuture<'_, Value> = Box::pin(async move { value });
        let journaled =
            journal_through(&self.ops, self.slot.clone(), false, work, interrupted()).await;
        match Slot::read(journaled) {
            Slot::Record(..) => Ok(()),
            Slot::End => Err("the journal answered an end mark for a record".to_owned()),
            Slot::Failed(why) => {
                let mut broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
                broken.get_or_insert_with(|| why.clone());
                Err(why)
            }
        }
    }

    /// The invocation may still write while its handler runs and no record
    /// failed to be journaled.
    fn check(&self) -> Result<(), String> {
        if self.ops.is_closed() {
            return Err("the invocation's handler ended".to_owned());
        }
        match &*self.broken.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(why) => Err(format!("the call's journal failed: {why}")),
            None => Ok(()),
        }
    }

    /// Keeps nothing: a Restate invocation has no step trace to add it to
    /// (the object's state holds the machine, not its steps).
    fn keep_step(&self, _calls: &[ToolCallId], _step: Value) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpEvent;

    /// Serves ops as a Restate handler replaying `journal` would: a step
    /// already in it answers its value without running; the next runs
    /// and is appended. Answers the journal when the ops end.
    fn replaying(
        journal: Vec<Value>,
    ) -> (
        mpsc::UnboundedSender<Op>,
        tokio::task::JoinHandle<Vec<Value>>,
    ) {
        let (ops, mut rx) = mpsc::unbounded_channel::<Op>();
        let handler = tokio::spawn(async move {
            let mut journal = journal;
            let mut at = 0;
            while let Some(op) = rx.recv().await {
                assert!(op.name.starts_with("record "), "{}", op.name);
                let value = match journal.get(at) {
                    Some(value) => value.clone(),
                    None => {
                        let (reply, value) = tokio::sync::oneshot::channel();
                        let _ = op.events.send(OpEvent::RunNow(reply));
                        let value = value.await.expect("the step's value");
                        journal.push(value.clone());
                        value
                    }
                };
                at += 1;
                let _ = op.events.send(OpEvent::Done(value));
            }
            journal
        });
        (ops, handler)
    }

    /// One attempt of a call: opens its records, writes `writes`, and
    /// answers what it read back and the journal after it.
    async fn attempt(journal: Vec<Value>, writes: &[&str]) -> (Vec<(String, Value)>, Vec<Value>) {
        let (ops, handler) = replaying(journal);
        let records = ObjectRecords::open(ops, &ToolCallId::from("c1")).await;
        let read = records.recorded();
        for name in writes {
            records.write(name, json!(name)).await.expect("journaled");
        }
        drop(records);
        (read, handler.await.expect("the handler"))
    }

    #[tokio::test]
    async fn each_attempt_reads_back_every_record_earlier_attempts_journaled_past_their_end_marks()
    {
        let (read, journal) = attempt(Vec::new(), &["a", "b"]).await;
        assert!(read.is_empty(), "a first attempt");
        let (read, journal) = attempt(journal, &["c"]).await;
        assert_eq!(
            read,
            [("a".to_owned(), json!("a")), ("b".to_owned(), json!("b"))]
        );
        let (read, journal) = attempt(journal, &[]).await;
        assert_eq!(
            read.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            ["a", "b", "c"]
        );
        // An end mark where each attempt stopped reading, then its writes.
        assert_eq!(journal.len(), 3 + 3);
        assert_eq!(journal[0], json!({"end": true}));
        assert_eq!(journal[3], json!({"end": true}));
        assert_eq!(journal[5], json!({"end": true}));
    }

    #[tokio::test]
    async fn a_call_whose_handler_is_gone_may_not_write() {
        let (ops, handler) = replaying(Vec::new());
        let records = ObjectRecords::open(ops.clone(), &ToolCallId::from("c1")).await;
        drop(ops);
        handler.abort();
        let _ = handler.await;
        assert!(records.check().is_err());
        assert!(records.write("a", json!(1)).await.is_err());
    }

    #[test]
    fn a_slot_reads_as_a_record_an_end_mark_or_why_it_failed() {
        let record = Slot::read(json!({"record": {"name": "answer:a:1", "value": {"n": 1}}}));
        assert!(
            matches!(record, Slot::Record(name, value) if name == "answer:a:1" && value == json!({"n": 1}))
        );
        assert!(matches!(Slot::read(json!({"end": true})), Slot::End));
        assert!(matches!(Slot::read(json!({"error": "gone"})), Slot::Failed(why) if why == "gone"));
        assert!(matches!(
            Slot::read(json!({"record": {"value": 1}})),
            Slot::Failed(why) if why.contains("does not read back")
        ));
    }

    #[test]
    fn a_name_recorded_twice_is_read_once_in_its_first_place_with_its_last_record() {
        let mut recorded = Vec::new();
        keep(&mut recorded, "a".to_owned(), json!(1));
        keep(&mut recorded, "b".to_owned(), json!(2));
        keep(&mut recorded, "a".to_owned(), json!(3));
        assert_eq!(
            recorded,
            [("a".to_owned(), json!(3)), ("b".to_owned(), json!(2))]
        );
    }
}
