//! [`ActivityRecords`]: the [`CallJournal`] of a tool call that resumes
//! from its journal (a sub-agent), kept as the activity's heartbeat
//! details.
//!
//! Temporal hands an activity's next attempt the details of the last
//! heartbeat the server recorded: where a retried call continues from.
//! Each write sends every record so far as the details of a heartbeat
//! made with the service's `RecordActivityTaskHeartbeat` call itself,
//! which the server answers only once it has persisted them, so a record
//! is durable when `write` returns (the SDK's own heartbeats are queued
//! and sent later, which is not). The call's periodic heartbeats go the
//! same way, one at a time, so the details never go back to an older
//! list. Records are kept for as long as the activity may be retried: a
//! new activity (the call scheduled again) starts without them.

use std::sync::Mutex;

use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::tool::CallJournal;
use serde_json::Value;
use temporalio_client::{ActivityIdentifier, AsyncActivityHandle, Client, RpcOptions};
use temporalio_sdk::activities::ActivityContext;

/// One activity's records.
pub(crate) struct ActivityRecords {
    handle: AsyncActivityHandle<Client>,
    /// What earlier attempts recorded, `(name, record)`.
    recorded: Vec<(String, Value)>,
    /// Every record so far, sent whole with each heartbeat; held across
    /// the heartbeat so that heartbeats go one at a time.
    records: tokio::sync::Mutex<Vec<(String, Value)>>,
    /// Why this attempt may write no more, once it may not.
    stopped: Mutex<Option<String>>,
}

impl std::fmt::Debug for ActivityRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActivityRecords")
            .field("recorded", &self.recorded.len())
            .finish_non_exhaustive()
    }
}

impl ActivityRecords {
    /// The records of the activity `ctx` runs, with what its earlier
    /// attempts recorded.
    pub(crate) fn new(ctx: &ActivityContext) -> Self {
        let token = ctx.info().task_token.clone();
        let handle = ctx
            .client()
            .get_async_activity_handle(ActivityIdentifier::from_task_token(token.into()));
        let mut stopped = None;
        let recorded = match ctx
            .heartbeat_details()
            .deserialize::<Vec<(String, Value)>>()
        {
            Ok(recorded) => recorded.unwrap_or_default(),
            Err(error) => {
                tracing::error!(%error, "the records of an earlier attempt of this call do not read back: it writes nothing");
                stopped = Some(format!(
                    "the records of an earlier attempt do not read back: {error}"
                ));
                Vec::new()
            }
        };
        if !recorded.is_empty() {
            tracing::info!(
                records = recorded.len(),
                "the call continues from what an earlier attempt recorded"
            );
        }
        ActivityRecords {
            handle,
            records: tokio::sync::Mutex::new(recorded.clone()),
            recorded,
            stopped: Mutex::new(stopped),
        }
    }

    /// Sends every record so far as the heartbeat's details, and answers
    /// once the server has recorded them.
    pub(crate) async fn beat(&self) -> Result<(), String> {
        let records = self.records.lock().await;
        self.send(&records).await
    }

    async fn send(&self, records: &[(String, Value)]) -> Result<(), String> {
        let sent = self
            .handle
            .heartbeat(Some(records.to_vec()), RpcOptions::default())
            .await;
        let why = match sent {
            Ok(response) if !response.cancel_requested && !response.activity_reset => {
                return Ok(());
            }
            Ok(_) => "the activity was cancelled or reset".to_owned(),
            Err(error) => format!("the heartbeat was not recorded: {error}"),
        };
        self.stopped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_or_insert_with(|| why.clone());
        Err(why)
    }
}

/// Keeps `value` under `name`: in the place of an earlier record of that
/// name, else last.
fn keep(records: &mut Vec<(String, Value)>, name: &str, value: Value) {
    match records.iter_mut().find(|(n, _)| n == name) {
        Some(slot) => slot.1 = value,
        None => records.push((name.to_owned(), value)),
    }
}

#[async_trait]
impl CallJournal for ActivityRecords {
    fn recorded(&self) -> Vec<(String, Value)> {
        self.recorded.clone()
    }

    async fn write(&self, name: &str, record: Value) -> Result<(), String> {
        self.check()?;
        let mut records = self.records.lock().await;
        keep(&mut records, name, record);
        self.send(&records).await
    }

    /// This attempt may write while the server takes its heartbeats: not
    /// once one was refused (a later attempt may be running the call, or
    /// it was cancelled).
    fn check(&self) -> Result<(), String> {
        match &*self
            .stopped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(why) => Err(format!("the call may not go on: {why}")),
            None => Ok(()),
        }
    }

    /// Keeps nothing: an activity has no step trace to add it to (the
    /// workflow's history holds the caller's steps, not a tool's).
    fn keep_step(&self, _calls: &[ToolCallId], _step: Value) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_name_recorded_twice_is_kept_once_in_its_first_place_with_its_last_record() {
        let mut records = Vec::new();
        keep(&mut records, "a", json!(1));
        keep(&mut records, "b", json!(2));
        keep(&mut records, "a", json!(3));
        assert_eq!(
            records,
            [("a".to_owned(), json!(3)), ("b".to_owned(), json!(2))]
        );
    }
}
