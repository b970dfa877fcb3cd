//! Replays: a call whose idempotency key was already answered gets the stored
//! result, and the tool does not run again. The state patches the call wrote
//! are written again, so a replayed step applies them as the first run did.
//!
//! The key is `t<turn>:<instance>:<tool_call_id>`: the conversation's user
//! turn, the leaf instance the call runs for, and the provider's call id. A
//! resumed step answers the very calls the recorded model answer made, so
//! their ids are the same and a completed call is answered from here. An
//! entry lives only while its answer may be replayed: once a step is
//! recorded its results are in the history, and the ledger keeps only the
//! calls of answers still waiting (a paused step's, or the step in
//! flight's; [`IdempotencyLedger::retain_only`](crate::IdempotencyLedger::retain_only)). So a provider that reuses
//! an id in a later step or turn makes a new call, never an earlier
//! answer's (stale) result. An entry binds the key to the tool and its
//! exact arguments: a replayed call that reuses a key for another tool or
//! other arguments is answered `IDEMPOTENCY_CONFLICT`, never with another
//! call's result, and does not run.
//!
//! The tool itself gets a key for the outside world in its context
//! ([`ToolContext::idempotency_key`](markov_core::tool::ToolContext::idempotency_key)),
//! derived from the conversation, the turn, the instance, the answer and
//! the call id: the same on every retry and resume of that call, so a
//! payment provider's idempotency header makes even a crash inside the tool
//! repeat nothing, and different for a later call that reuses the id.
//!
//! The ledger belongs to one conversation (a machine's
//! [`PolicyState`](crate::PolicyState)) and travels with it: it is part of
//! the machine's snapshot, so a call replayed after a restore in a fresh
//! process is answered from the ledger. A key in flight makes a second
//! concurrent call wait for the first one's result (if the first is
//! cancelled, the second runs). Entries of earlier turns expire after
//! [`IdempotencyLimits::ttl`] and are bounded in entries and in bytes
//! (oldest first out); entries of the current turn are never evicted, since
//! a resumed step may still need them. A result too large to keep whole
//! (over a quarter of [`IdempotencyLimits::max_bytes`]) is kept as a stub:
//! the key, the tool, a digest of the arguments and a note that the call
//! completed, which is what a replay then answers.
//!
//! A tool's [`Delivery`] contract decides what happens to a call that
//! started and whose result was never recorded (the process died between
//! the tool's side effect and the write of its entry). At least once (the
//! default, but for tools that need approval): nothing records the start,
//! so a resumed step runs the call again, with the same key for the
//! outside world. At most once (the default for tools that need approval):
//! before the tool runs, an entry that says the call started is written —
//! through the journal, durably, when there is one; the call does not run
//! if that write fails — whose result is the `INTERRUPTED` error. The
//! call's real entry replaces it when the tool returns. So a resumed step
//! that finds only the start answers the call `INTERRUPTED` (its outcome is
//! unknown, and it was not run again), and the call is named to the
//! application ([`PolicyState::take_interrupted`](crate::PolicyState::take_interrupted))
//! so that a person can reconcile it. Without a journal the same holds
//! within the process: a call whose future was dropped while its tool ran
//! leaves the start in the ledger. One exception, where there is a
//! journal: a tool that keeps its side effects in its call's journal
//! ([`DynTool::resumes_from_journal`](markov_core::tool::DynTool::resumes_from_journal),
//! a sub-agent) is run again from that journal instead of answered
//! `INTERRUPTED`, since running it again repeats nothing.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use markov_core::async_trait;
use markov_core::tool::{
    CallJournal, Delivery, StateAccess, StateUpdateError, ToolExecutionResult,
};
use serde_json::Value;

use crate::error::Rejection;
use crate::kind::ToolErrorKind;
use crate::ledger::{
    Begin, IdempotencyLimits, InterruptedCall, LedgerEntry, StoredResult, unix_millis,
};
use crate::metadata::ToolMetadata;
use crate::records::CallRecords;
use crate::service::{ToolLayer, ToolRequest, ToolService};
/// The entry an at-most-once call writes before its tool runs: it started,
/// and until its real entry replaces it, its result is `INTERRUPTED`.
fn started_entry(req: &ToolRequest<'_>, key: &str, turn: u64) -> LedgerEntry {
    let rejection = Rejection::new(ToolErrorKind::Interrupted).with_detail(format!(
        "{} was running when the conversation was interrupted, and its result was never recorded: it may or may not have taken effect. Tell the user; do not assume either",
        req.name
    ));
    LedgerEntry {
        key: key.to_owned(),
        tool: req.name.to_owned(),
        args: req.input.clone().into_owned(),
        result: StoredResult {
            content: rejection.to_envelope(),
            is_error: true,
            is_terminal: false,
            terminate: None,
            user_message: None,
        },
        error: Some(ToolErrorKind::Interrupted.as_str().to_owned()),
        intents: Vec::new(),
        recorded_at: unix_millis(SystemTime::now()),
        turn,
        args_digest: None,
        state_updates: Vec::new(),
        started: true,
        record: None,
    }
}

/// The [`Delivery`] contract of a request's call: the registry's metadata,
/// else the tool's definition, else the default for its approval.
pub(crate) fn delivery_of(req: &ToolRequest<'_>) -> Delivery {
    req.metadata
        .and_then(ToolMetadata::delivery)
        .or_else(|| req.tool.and_then(|t| t.definition().delivery))
        .unwrap_or_else(|| Delivery::default_for(req.needs_approval()))
}

/// The state a call writes through, recording each patch for its ledger
/// entry.
struct Recording<'a> {
    inner: &'a dyn StateAccess,
    updates: Mutex<Vec<Value>>,
}

impl StateAccess for Recording<'_> {
    fn state(&self) -> &Value {
        self.inner.state()
    }

    fn update_state(&self, patch: Value) -> Result<(), StateUpdateError> {
        self.updates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(patch.clone());
        self.inner.update_state(patch)
    }
}

/// The idempotency stage's layer.
#[derive(Debug, Clone, Copy)]
pub struct IdempotencyLayer {
    limits: IdempotencyLimits,
}

impl IdempotencyLayer {
    /// A layer keeping answers within `limits`.
    pub fn new(limits: IdempotencyLimits) -> Self {
        IdempotencyLayer { limits }
    }
}

impl<S> ToolLayer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            inner,
            limits: self.limits,
        }
    }
}

/// A service behind the idempotency stage.
#[derive(Debug, Clone)]
pub struct Idempotency<S> {
    inner: S,
    limits: IdempotencyLimits,
}

#[async_trait]
impl<S: ToolService> ToolService for Idempotency<S> {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        let key = req.ledger_key();
        let ledger = req.policy.ledger();
        let turn = req.policy.turn();
        // The key the tool hands to the outside world: the same on every
        // retry and resume of this call.
        let (policy, instance, call_id) = (req.policy, req.cx.instance_id(), req.call_id);
        let make_key = move || policy.tool_key(instance, call_id);
        let tool_key = markov_core::tool::IdempotencyKey::new(&make_key);
        // An at-most-once call found interrupted runs again when its tool
        // keeps its side effects in its call's journal and there is one.
        let journaled = req.tool.is_some_and(|t| t.resumes_from_journal());
        let resumes = journaled && req.policy.journal().is_some();
        let mut claim = loop {
            match ledger.begin(
                &key,
                req.name,
                &req.input,
                &self.limits,
                SystemTime::now(),
                turn,
            ) {
                Begin::Replay(entry) => {
                    if entry.started && resumes {
                        // Its side effects are in its journal: it resumes
                        // from there, and repeats none of them.
                        if let Some(claim) = ledger.resume_started(&key) {
                            tracing::info!(
                                key = %key,
                                tool = %entry.tool,
                                call_id = %req.call_id,
                                "an at-most-once call was interrupted: its tool resumes from its journal"
                            );
                            break claim;
                        }
                        continue;
                    }
                    if entry.started {
                        tracing::warn!(
                            key = %key,
                            tool = %entry.tool,
                            call_id = %req.call_id,
                            "an at-most-once call was interrupted: its outcome is unknown; answered INTERRUPTED, not run again"
                        );
                        req.policy.note_interrupted(InterruptedCall {
                            call_id: req.call_id.clone(),
                            tool: entry.tool.clone(),
                            args: entry.args.clone(),
                            instance: req.cx.instance_id().cloned(),
                            key: entry.key.clone(),
                            started_at: entry.recorded_at,
                        });
                    } else {
                        tracing::debug!(key = %key, "idempotent replay: the stored result is returned");
                    }
                    for patch in &entry.state_updates {
                        // Refused now as then: the running state is the
                        // same, and the result already says so.
                        let _ = req.cx.state_access().update_state(patch.clone());
                    }
                    if let Some(kind) = entry.error.as_deref().and_then(ToolErrorKind::from_wire) {
                        req.report.set_error(kind);
                    }
                    req.report.set_intents(entry.intents);
                    req.report.set_replayed();
                    return entry.result.to_result(req.call_id);
                }
                Begin::Conflict => {
                    req.report.set_stage("idempotency");
                    return Rejection::new(ToolErrorKind::IdempotencyConflict)
                        .with_detail(format!(
                            "the call id {} was already used by a call with another tool or other arguments; it was not run",
                            req.call_id
                        ))
                        .respond(&req);
                }
                Begin::Wait(done) => {
                    // Either the result is stored now, or the first call was
                    // cancelled and the key is free: look again.
                    let _ = done.await;
                }
                Begin::Run(claim) => break claim,
            }
        };
        let report = req.report;
        let call_id = req.call_id;
        let journal = req.policy.journal();
        // A worker that lost its session runs nothing more:
        // another one may be running this very call.
        if let Some(journal) = &journal
            && let Err(reason) = journal.check()
        {
            drop(claim);
            req.report.set_stage("idempotency");
            return Rejection::new(ToolErrorKind::ExecutionFailed)
                .with_detail(format!("not run: {reason}"))
                .respond(&req);
        }
        if delivery_of(&req) == Delivery::AtMostOnce {
            // The start is recorded before anything can happen:
            // a resumed step finds it and does not run the call
            // again.
            let started = started_entry(&req, &key, turn).within(&self.limits);
            if let Some(journal) = &journal
                && let Err(error) = journal.write(&started).await
            {
                tracing::error!(key = %key, %error, "the start of an at-most-once call could not be journaled: it does not run");
                drop(claim);
                req.report.set_stage("idempotency");
                return Rejection::new(ToolErrorKind::ExecutionFailed)
                        .with_detail(
                            "not run: its start could not be recorded, and this tool must never run twice",
                        )
                        .respond(&req);
            }
            claim.started = Some(Box::new((started, self.limits)));
        }
        let recording = Recording {
            inner: req.cx.state_access(),
            updates: Mutex::new(Vec::new()),
        };
        // The call's part of the journal, made only if the tool
        // asks for it (a sub-agent does).
        let key_ref = key.as_str();
        let make_records = |journal: &Arc<dyn crate::Journal>| {
            let journal = Arc::clone(journal);
            move || -> Arc<dyn CallJournal> {
                Arc::new(CallRecords::new(
                    Arc::clone(&journal),
                    policy,
                    key_ref,
                    instance,
                    call_id,
                ))
            }
        };
        let records = journal.as_ref().map(make_records);
        let mut cx = req
            .cx
            .with_idempotency_key(&tool_key)
            .with_state(&recording);
        if let Some(records) = &records {
            cx = cx.with_journal(records);
        }
        let req = ToolRequest { cx, ..req };
        let result = self.inner.call(req).await;
        if report.awaiting().is_some() {
            // The call asked for a decision while it ran: the
            // step pauses and the call runs again on resume,
            // so nothing of it is answered yet.
            if journaled {
                // Its side effects are kept where its run again finds
                // them (a sub-agent waits with its ledger): the key is
                // freed for that run, not left started.
                claim.started = None;
            }
            drop(claim);
            return result;
        }
        let state_updates = recording
            .updates
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        // The tool and arguments the claim recorded move into
        // the entry: no second copy of the arguments.
        let (tool, args) = claim.take_call();
        let entry = LedgerEntry {
            key,
            tool,
            args,
            result: StoredResult::of(&result),
            error: report.error_kind().map(|k| k.as_str().to_owned()),
            intents: report.intents(),
            recorded_at: unix_millis(SystemTime::now()),
            turn,
            args_digest: None,
            state_updates,
            started: false,
            record: None,
        }
        .within(&self.limits);
        // Written ahead: durable before anyone uses the result.
        if let Some(journal) = journal
            && let Err(error) = journal.write(&entry).await
        {
            tracing::error!(key = %entry.key, %error, "the ledger entry could not be journaled");
        }
        claim.complete(entry, &self.limits);
        debug_assert_eq!(&result.call_id, call_id);
        result
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("idempotency");
        self.inner.stages(out);
    }
}
