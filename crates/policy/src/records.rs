//! [`CallRecords`]: one call's part of its conversation's journal, the
//! [`CallJournal`] the idempotency stage hands a call when the
//! conversation has a journal (a stored session).
//!
//! A record is a ledger entry ([`LedgerEntry::record`]) keyed by the call's
//! namespace — its ledger key (escaped, so that it holds no `>` and no
//! `@`) and the length of the history its answer was asked over — then
//! `>` and the record's name. It is written through the
//! conversation's [`Journal`] like an answered call, read back with the
//! conversation's ledger while the answer that made the call may be
//! replayed, and forgotten with it. Since a record is itself a ledger
//! entry, a call inside a sub-agent that keeps records (a nested
//! sub-agent) writes them through the sub-agent's journal, which keeps
//! them in its caller's namespace: the keys nest.

use std::sync::Arc;
use std::time::SystemTime;

use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::tool::CallJournal;
use serde_json::Value;

use crate::ledger::{LedgerEntry, RECORD_SEPARATOR, StoredResult, unix_millis};
use crate::state::{Journal, PolicyState};

/// One call's records in its conversation's journal.
pub struct CallRecords {
    journal: Arc<dyn Journal>,
    namespace: String,
    call_id: ToolCallId,
    turn: u64,
    recorded: Vec<(String, Value)>,
}

impl std::fmt::Debug for CallRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallRecords")
            .field("namespace", &self.namespace)
            .field("recorded", &self.recorded.len())
            .finish_non_exhaustive()
    }
}

impl CallRecords {
    /// The records of the call `call_id` whose ledger key is `key`, in the
    /// conversation `policy` writing through `journal`, with what earlier
    /// runs of the call recorded.
    pub fn new(
        journal: Arc<dyn Journal>,
        policy: &PolicyState,
        key: &str,
        instance: Option<&markov_core::ids::InstanceId>,
        call_id: &ToolCallId,
    ) -> Self {
        let answer = instance.and_then(|i| policy.answers().history_len_of(i));
        let namespace = crate::IdempotencyLedger::namespace_of(key, answer);
        let recorded = policy.ledger().records_under(&namespace);
        CallRecords {
            journal,
            namespace,
            call_id: call_id.clone(),
            turn: policy.turn(),
            recorded,
        }
    }

    /// The namespace its records are kept under.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
}

#[async_trait]
impl CallJournal for CallRecords {
    fn recorded(&self) -> Vec<(String, Value)> {
        self.recorded.clone()
    }

    async fn write(&self, name: &str, record: Value) -> Result<(), String> {
        let entry = LedgerEntry {
            key: format!("{}{RECORD_SEPARATOR}{name}", self.namespace),
            tool: String::new(),
            args: Value::Null,
            result: StoredResult {
                content: String::new(),
                is_error: false,
                is_terminal: false,
                terminate: None,
                user_message: None,
            },
            error: None,
            intents: Vec::new(),
            recorded_at: unix_millis(SystemTime::now()),
            turn: self.turn,
            args_digest: None,
            state_updates: Vec::new(),
            started: false,
            record: Some(record),
        };
        self.journal.write(&entry).await
    }

    fn check(&self) -> Result<(), String> {
        self.journal.check()
    }

    fn keep_step(&self, calls: &[ToolCallId], step: Value) {
        let mut path = Vec::with_capacity(calls.len() + 1);
        path.push(self.call_id.clone());
        path.extend_from_slice(calls);
        self.journal.keep_step(&path, step);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RecordedAnswer;
    use markov_core::ids::InstanceId;
    use markov_core::model::{ModelResponse, StopReason};
    use std::sync::Mutex;

    /// Keeps what is written and kept.
    #[derive(Default)]
    struct Kept {
        entries: Mutex<Vec<LedgerEntry>>,
        steps: Mutex<Vec<(Vec<ToolCallId>, Value)>>,
    }

    #[async_trait]
    impl Journal for Kept {
        async fn write(&self, entry: &LedgerEntry) -> Result<(), String> {
            self.entries
                .lock()
                .map_err(|e| e.to_string())?
                .push(entry.clone());
            Ok(())
        }

        async fn write_answers(&self, _: &[RecordedAnswer]) -> Result<(), String> {
            Ok(())
        }

        fn keep_step(&self, calls: &[ToolCallId], step: Value) {
            if let Ok(mut steps) = self.steps.lock() {
                steps.push((calls.to_vec(), step));
            }
        }
    }

    #[tokio::test]
    async fn a_calls_records_are_ledger_entries_in_its_namespace_and_read_back_with_the_ledger() {
        let kept = Arc::new(Kept::default());
        let policy = PolicyState::new();
        let root = InstanceId::from("root");
        let call = ToolCallId::from("c1");
        // The answer that made the call, asked over three messages.
        policy
            .record_answer(RecordedAnswer {
                instance: root.clone(),
                history_len: 3,
                response: ModelResponse::new(
                    vec![markov_core::Item::tool_use(
                        "c1",
                        "clerk",
                        serde_json::json!({}),
                    )],
                    StopReason::ToolUse,
                ),
                paused: false,
            })
            .await
            .expect("recorded");
        let key = crate::IdempotencyLedger::key_of(policy.turn(), Some(&root), &call);
        let records = CallRecords::new(kept.clone(), &policy, &key, Some(&root), &call);
        assert_eq!(records.namespace(), "t0:root:c1@3");
        assert!(records.recorded().is_empty(), "a first run");
        records
            .write("answer:a:1", serde_json::json!({"n": 1}))
            .await
            .expect("written");
        records.keep_step(&[ToolCallId::from("inner")], serde_json::json!("a step"));
        let written = kept.entries.lock().expect("lock").clone();
        assert_eq!(written.len(), 1);
        assert_eq!(written[0].key, "t0:root:c1@3>answer:a:1");
        assert!(written[0].tool.is_empty(), "no call matches a record");
        assert_eq!(
            kept.steps.lock().expect("lock").clone(),
            [(
                vec![call.clone(), ToolCallId::from("inner")],
                serde_json::json!("a step")
            )]
        );
        // Read back with the conversation (its answer still to replay):
        // the call, run again, finds its record.
        let mut snapshot = policy.snapshot();
        snapshot.ledger = written;
        let restored = PolicyState::restored(snapshot, &Default::default());
        let again = CallRecords::new(kept, &restored, &key, Some(&root), &call);
        assert_eq!(
            again.recorded(),
            [("answer:a:1".to_owned(), serde_json::json!({"n": 1}))]
        );
    }
}
