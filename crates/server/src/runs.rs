//! The turns running in this process: one event log per session, which the
//! request that started the run streams, a client that lost its stream
//! reads again from where it stopped, and a cancel reaches.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::sse::Event;
use futures::Stream;
use markov_store::SessionId;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How long the log of a finished run stays, for a client that reconnects
/// just after its end.
pub(crate) const KEEP_FINISHED: Duration = Duration::from_secs(60);

/// The most bytes of `delta` and `thinking` events a log keeps: past it, they are
/// dropped (each step's event still carries its whole messages), so a
/// long answer cannot grow a log without bound.
const MAX_DELTA_BYTES: usize = 4 * 1024 * 1024;

tokio::task_local! {
    /// The event log of the run the current task performs.
    pub(crate) static RUN_LOG: Arc<RunLog>;
}

/// Logs a model call's text delta as a `delta` event (`{"text": ...}`) of
/// the run that asked, and its thinking delta as a `thinking` event; notes
/// the thinking of the stream's final message, as shown, for the step that
/// records it (see [`RunLog::show_thinking`]). One agent serves every
/// session: the deltas find their run through the task that performs it.
pub(crate) fn send_delta(event: &markov_executor::MessageStreamEvent) {
    use markov_executor::MessageStreamEvent;
    use markov_executor::stream::DeltaKind;
    match event {
        MessageStreamEvent::Update { delta, .. } => {
            let piece = crate::wire::DeltaEvent {
                text: delta.delta.clone(),
            };
            let event = match delta.kind {
                DeltaKind::Text => crate::wire::RunEvent::Delta(piece),
                DeltaKind::Thinking => crate::wire::RunEvent::Thinking(piece),
                _ => return,
            };
            let _ = RUN_LOG.try_with(|log| log.record(event));
        }
        MessageStreamEvent::End {
            message_id,
            message,
            ..
        } => {
            let thinking: Vec<serde_json::Value> = message
                .item_list()
                .iter()
                .filter_map(|item| match item {
                    markov_core::message::Item::Thinking { thinking, .. } => {
                        // Shown without the provider's signature.
                        Some(serde_json::json!({"type": "thinking", "thinking": thinking}))
                    }
                    _ => None,
                })
                .collect();
            if !thinking.is_empty() {
                let id = serde_json::to_value(message_id).unwrap_or_default();
                let _ = RUN_LOG.try_with(|log| log.state().thinking.push((id, thinking)));
            }
        }
        _ => {}
    }
}

/// Why a run was stopped from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StopCause {
    /// A user asked (`POST /sessions/{id}/cancel`).
    Cancelled,
    /// The run's deadline passed.
    Deadline,
}

impl StopCause {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StopCause::Cancelled => "cancelled",
            StopCause::Deadline => "deadline",
        }
    }
}

/// One event as logged.
#[derive(Debug, Clone)]
struct Logged {
    seq: u64,
    name: &'static str,
    data: String,
}

#[derive(Debug, Default)]
struct LogState {
    events: Vec<Logged>,
    delta_bytes: usize,
    /// When the run ended; `None` while it runs.
    finished: Option<Instant>,
    cancel: Option<CancellationToken>,
    cause: Option<StopCause>,
    /// How many messages the session's history held when the run started.
    history_len: usize,
    /// The user's text that started the run, if a message did.
    message: Option<String>,
    /// The thinking of streamed answers as their final messages show it,
    /// by message id, until the step that records them is logged.
    thinking: Vec<(serde_json::Value, Vec<serde_json::Value>)>,
}

/// The events of one run, in order, and how to stop it.
#[derive(Debug)]
pub(crate) struct RunLog {
    /// The run's number in this process (event ids are `<run>-<seq>`, so an
    /// id from an earlier run never skips events of this one).
    run: u64,
    state: Mutex<LogState>,
    changed: Notify,
}

impl RunLog {
    fn state(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends an event (`data` is JSON) and wakes the readers.
    pub(crate) fn push(&self, name: &'static str, data: String) {
        {
            let mut state = self.state();
            if state.finished.is_some() {
                return;
            }
            if name == "delta" || name == "thinking" {
                if state.delta_bytes + data.len() > MAX_DELTA_BYTES {
                    return;
                }
                state.delta_bytes += data.len();
            }
            let seq = state.events.len() as u64 + 1;
            state.events.push(Logged { seq, name, data });
        }
        self.changed.notify_waiters();
    }

    /// Puts into the assistant messages of `messages` (a step's, as shown,
    /// its stored thinking left out) the thinking their streams' final
    /// messages showed, when `insert`: what the output guards let through,
    /// a part blocked partway ending with the mark that the rest was
    /// withheld. The history keeps the thinking as the provider signed it,
    /// never shown. Either way the notes end here: a step's messages were
    /// all streamed before it is logged.
    pub(crate) fn show_thinking(&self, messages: &mut serde_json::Value, insert: bool) {
        let mut noted = std::mem::take(&mut self.state().thinking);
        if noted.is_empty() || !insert {
            return;
        }
        let Some(messages) = messages.as_array_mut() else {
            return;
        };
        for message in messages {
            let id = &message["metadata"]["messageId"];
            let Some(at) = noted.iter().position(|(shown, _)| shown == id) else {
                continue;
            };
            let (_, thinking) = noted.swap_remove(at);
            if let Some(items) = message
                .get_mut("items")
                .and_then(serde_json::Value::as_array_mut)
            {
                items.splice(0..0, thinking);
            }
        }
    }

    /// Appends `event`.
    pub(crate) fn record(&self, event: crate::wire::RunEvent) {
        let (name, data) = event.into_logged();
        self.push(name, data);
    }

    /// Lets [`RunLog::stop`] reach the run, and records how many messages
    /// the history held before it (what the run adds arrives as its
    /// events) and the message that started it.
    pub(crate) fn start(
        &self,
        token: CancellationToken,
        history_len: usize,
        message: Option<String>,
    ) {
        let mut state = self.state();
        if state.cause.is_some() {
            token.cancel();
        }
        state.cancel = Some(token);
        state.history_len = history_len;
        state.message = message;
    }

    /// Where a client that shows a session's history joins the run: the
    /// first `history_len` messages were stored before the run started,
    /// and the rest arrive as the events after the returned event id (the
    /// run's first event on); and the user's text that started the run,
    /// which its first step records (a page shows it until then).
    pub(crate) fn join(&self) -> (String, usize, Option<String>) {
        let state = self.state();
        (
            format!("{}-0", self.run),
            state.history_len,
            state.message.clone(),
        )
    }

    /// Stops the run (the first cause is the one reported); `false` when
    /// it is over already.
    pub(crate) fn stop(&self, cause: StopCause) -> bool {
        let mut state = self.state();
        if state.finished.is_some() {
            return false;
        }
        state.cause.get_or_insert(cause);
        if let Some(token) = &state.cancel {
            token.cancel();
        }
        true
    }

    /// Why the run was stopped, if it was.
    pub(crate) fn cause(&self) -> Option<StopCause> {
        self.state().cause
    }

    /// Whether the run is over.
    pub(crate) fn is_finished(&self) -> bool {
        self.state().finished.is_some()
    }

    /// When the run ended, if it has.
    fn finished_at(&self) -> Option<Instant> {
        self.state().finished
    }

    fn finish(&self) {
        self.state().finished.get_or_insert_with(Instant::now);
        self.changed.notify_waiters();
    }

    /// The events after `after` (the `Last-Event-ID` a client saw, if it
    /// is of this run), then the rest as they come, until the run ends.
    pub(crate) fn events(
        self: &Arc<Self>,
        after: Option<&str>,
    ) -> impl Stream<Item = Result<Event, Infallible>> + use<> {
        let from = after
            .and_then(|id| id.split_once('-'))
            .filter(|(run, _)| run.parse::<u64>().ok() == Some(self.run))
            .and_then(|(_, seq)| seq.parse::<usize>().ok())
            .unwrap_or(0);
        futures::stream::unfold((Arc::clone(self), from), |(log, next)| async move {
            loop {
                let waker = Arc::clone(&log);
                let notified = waker.changed.notified();
                futures::pin_mut!(notified);
                notified.as_mut().enable();
                let (event, finished) = {
                    let state = log.state();
                    (state.events.get(next).cloned(), state.finished.is_some())
                };
                if let Some(event) = event {
                    let sse = Event::default()
                        .id(format!("{}-{}", log.run, event.seq))
                        .event(event.name)
                        .data(event.data);
                    return Some((Ok(sse), (log, next + 1)));
                }
                if finished {
                    return None;
                }
                notified.await;
            }
        })
    }
}

/// Marks a session as running in this process until dropped; then its
/// log is finished, and forgotten a little later (see [`Runs`]).
#[derive(Debug)]
pub(crate) struct RunGuard {
    runs: Arc<Runs>,
    session: SessionId,
    log: Arc<RunLog>,
    /// The session's last run before this claim: kept, not replaced, if
    /// the claim ends without a run (a refused decision or message), so
    /// a client can still read what it missed of it.
    previous: Option<Arc<RunLog>>,
}

impl RunGuard {
    pub(crate) fn log(&self) -> &Arc<RunLog> {
        &self.log
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        self.log.finish();
        if self.log.state().events.is_empty()
            && let Some(previous) = self.previous.take()
        {
            let mut logs = self.runs.logs();
            if let Some(entry) = logs.by_session.get_mut(&self.session)
                && Arc::ptr_eq(entry, &self.log)
            {
                *entry = previous;
            }
        }
        self.runs.finished();
    }
}

/// The runs of this process, by session.
///
/// A session's entry is its run in progress or its last run: the next run
/// replaces it, so a busy session keeps one finished log, not one per turn
/// of the last minute. A finished run's log is forgotten once it has been
/// kept for [`KEEP_FINISHED`], by a sweep over the sessions at most every
/// half of that (when a run starts or finishes, or [`Runs::sweep`] is
/// called): no task or timer per run.
#[derive(Debug, Default)]
pub(crate) struct Runs {
    logs: Mutex<Logs>,
    next: AtomicU64,
}

#[derive(Debug, Default)]
struct Logs {
    by_session: HashMap<SessionId, Arc<RunLog>>,
    swept: Option<Instant>,
}

impl Logs {
    /// Whether session `id` has a run in progress.
    fn runs(&self, id: &SessionId) -> bool {
        self.by_session
            .get(id)
            .is_some_and(|log| !log.is_finished())
    }

    /// Forgets the runs that finished [`KEEP_FINISHED`] or more before
    /// `now`, if the last sweep was half of that ago.
    fn sweep(&mut self, now: Instant) {
        if self
            .swept
            .is_some_and(|at| now.duration_since(at) < KEEP_FINISHED / 2)
        {
            return;
        }
        self.swept = Some(now);
        self.by_session.retain(|_, log| {
            log.finished_at()
                .is_none_or(|at| now.duration_since(at) < KEEP_FINISHED)
        });
    }
}

impl Runs {
    fn logs(&self) -> std::sync::MutexGuard<'_, Logs> {
        self.logs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims session `id` for a run: `None` while another runs.
    pub(crate) fn claim(self: &Arc<Self>, id: &SessionId) -> Option<RunGuard> {
        let mut logs = self.logs();
        logs.sweep(Instant::now());
        if logs.runs(id) {
            return None;
        }
        let log = Arc::new(RunLog {
            run: self.next.fetch_add(1, Ordering::Relaxed) + 1,
            state: Mutex::default(),
            changed: Notify::new(),
        });
        let previous = logs.by_session.insert(id.clone(), Arc::clone(&log));
        Some(RunGuard {
            runs: Arc::clone(self),
            session: id.clone(),
            log,
            previous,
        })
    }

    /// Whether session `id` runs here.
    pub(crate) fn is_running(&self, id: &SessionId) -> bool {
        self.logs().runs(id)
    }

    /// The log of session `id`'s run in progress, or of its last run if it
    /// ended moments ago.
    pub(crate) fn get(&self, id: &SessionId) -> Option<Arc<RunLog>> {
        self.logs().by_session.get(id).cloned()
    }

    /// How many runs are in progress.
    pub(crate) fn running(&self) -> usize {
        self.logs()
            .by_session
            .values()
            .filter(|l| !l.is_finished())
            .count()
    }

    /// Waits until no run is in progress, or `limit` passed; `true` if none is.
    pub(crate) async fn drained(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while self.running() > 0 {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    fn finished(&self) {
        self.logs().sweep(Instant::now());
    }

    /// Forgets the finished runs kept long enough; the server calls it
    /// now and then, so an idle server lets go of them too.
    pub(crate) fn sweep(&self) {
        self.logs().sweep(Instant::now());
    }

    /// How many sessions' logs are kept.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.logs().by_session.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn a_reader_that_reconnects_gets_what_it_missed_then_the_rest_live() {
        let runs = Arc::new(Runs::default());
        let id = SessionId::new("s");
        let guard = runs.claim(&id).expect("free");
        assert!(runs.claim(&id).is_none(), "one run per session");
        let log = Arc::clone(guard.log());
        log.push("step", "1".into());
        log.push("step", "2".into());
        let first: Vec<String> = log
            .events(None)
            .take(1)
            .map(|e| format!("{:?}", e.expect("event")))
            .collect()
            .await;
        assert!(first[0].contains("id: 1-1"), "{first:?}");
        let rest = tokio::spawn({
            let log = Arc::clone(&log);
            async move {
                log.events(Some("1-1"))
                    .map(|e| format!("{:?}", e.expect("event")))
                    .collect::<Vec<_>>()
                    .await
            }
        });
        tokio::task::yield_now().await;
        log.push("done", "3".into());
        drop(guard);
        let rest = rest.await.expect("joins");
        assert_eq!(rest.len(), 2, "{rest:?}");
        assert!(
            rest[0].contains("id: 1-2") && rest[1].contains("id: 1-3"),
            "{rest:?}"
        );
        // An id of another run reads this run from its start.
        let all: Vec<_> = log.events(Some("7-40")).collect().await;
        assert_eq!(all.len(), 3);
        assert!(runs.claim(&id).is_some(), "free once finished");
    }

    #[tokio::test]
    async fn a_session_keeps_one_finished_log_and_forgets_it_after_a_while() {
        let runs = Arc::new(Runs::default());
        let (busy, idle) = (SessionId::new("busy"), SessionId::new("idle"));
        let first = runs.claim(&busy).expect("free");
        let first_log = Arc::downgrade(first.log());
        first.log().push("step", "a long step event".into());
        drop(first);
        assert!(
            runs.get(&busy).is_some(),
            "kept for a client that reconnects"
        );
        // The session's next run replaces its finished log once it ends:
        // a busy session does not hold a log per turn of the last minute.
        let second = runs.claim(&busy).expect("free once finished");
        second.log().push("step", "the next run's".into());
        drop(second);
        assert!(first_log.upgrade().is_none(), "the replaced log is dropped");
        drop(runs.claim(&idle).expect("free"));
        assert_eq!(runs.kept(), 2);
        // A sweep before the logs were kept long enough forgets nothing; one
        // after forgets both, and is not repeated within half the time.
        let now = Instant::now();
        runs.logs().swept = None;
        runs.logs().sweep(now);
        assert_eq!(runs.kept(), 2);
        runs.logs().swept = None;
        runs.logs().sweep(now + KEEP_FINISHED);
        assert_eq!(runs.kept(), 0);
        let running = runs.claim(&busy).expect("free");
        runs.logs().swept = None;
        runs.logs().sweep(now + KEEP_FINISHED * 10);
        assert_eq!(runs.kept(), 1, "a run in progress is never forgotten");
        drop(running);
    }

    #[test]
    fn a_claim_that_ends_without_a_run_keeps_the_last_run() {
        let runs = Arc::new(Runs::default());
        let id = SessionId::new("s");
        let guard = runs.claim(&id).expect("free");
        let ran = Arc::clone(guard.log());
        ran.push("done", "{}".into());
        drop(guard);
        let refused = runs.claim(&id).expect("free again");
        assert!(!Arc::ptr_eq(refused.log(), &ran));
        drop(refused);
        let kept = runs.get(&id).expect("a log");
        assert!(Arc::ptr_eq(&kept, &ran), "the run that ran is still there");
        let next = runs.claim(&id).expect("free again");
        next.log().push("step", "{}".into());
        let next_log = Arc::clone(next.log());
        drop(next);
        assert!(Arc::ptr_eq(&runs.get(&id).expect("a log"), &next_log));
    }
}
