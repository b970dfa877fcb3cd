//! Forking a session at one of its recorded steps (time travel): a new
//! session whose next request is the request that step sent.

use std::sync::Arc;

use markov_core::{InstanceId, Message, Role};
use markov_executor::{Agent, FORMAT_VERSION, RunState, SerializedInstance, SerializedMachine};
use markov_policy::PolicySnapshot;

use crate::durable::{CreateOptions, DurableError, DurableMachine};
use crate::{SessionId, StepTrace, Store, StoreError, WorkerId};

/// How [`DurableMachine::fork`] forks a session.
#[derive(Debug, Clone, Default)]
pub struct ForkOptions {
    /// The new session's lease and owner (whoever forks).
    pub create: CreateOptions,
    /// Replaces the text of the user message the forked step answered (the
    /// last one before it): the fork then asks the model something else.
    pub edit_user: Option<String>,
}

impl<S: Store + ?Sized + 'static> DurableMachine<S> {
    /// Forks session `source` at its recorded step `step` into the new
    /// session `id`, over `agent`, leased to `holder`: the history, the
    /// instance tree, the turn, budget and loop-guard counters and the
    /// policy state the step before it left ([`StepTrace::waiting`]: open
    /// confirmation requests, a paused answer and its answered calls in
    /// the idempotency ledger) as they were before that step, and the
    /// step's input waiting to be run. Its next [`run`](Self::run) sends
    /// the model the request the step sent, byte for byte, when `agent` is
    /// the one the source ran on and nothing was edited.
    ///
    /// A step that resumed an answer paused for approval is forked into a
    /// session that waits for approval as the source did after the pause:
    /// its requests pending (a decision made before the resume is not
    /// carried: the fork is decided anew), the calls of the answer that ran
    /// answered from the ledger when it is resumed, never run again.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] when there is no such session or step, and
    /// [`StoreError::Corrupt`] when the step made no model call or what it
    /// started from was not recorded.
    pub async fn fork(
        store: Arc<S>,
        source: &SessionId,
        step: u64,
        id: SessionId,
        holder: WorkerId,
        agent: &Agent,
        options: ForkOptions,
    ) -> Result<Self, DurableError> {
        // The step and the one before it: what a fork needs of the
        // recording, however long the session (but the tree, below).
        let window = store.steps(source, step.saturating_sub(1), 2).await?;
        let corrupt = |detail: String| StoreError::Corrupt {
            session: source.clone(),
            detail,
        };
        let trace = window
            .iter()
            .find(|s| s.index == step)
            .ok_or_else(|| StoreError::NotFound(SessionId::new(format!("{source} step {step}"))))?;
        let previous = window.iter().find(|s| s.index.saturating_add(1) == step);
        let call = trace
            .calls
            .first()
            .ok_or_else(|| corrupt(format!("step {step} made no model call to fork at")))?;
        let tree = tree_before(&*store, source, trace, previous)
            .await?
            .ok_or_else(|| {
                corrupt(format!(
                    "the tree step {step} started from was not recorded"
                ))
            })?;
        let from = usize::try_from(trace.history_from).unwrap_or(usize::MAX);
        let sent = usize::try_from(call.history_len).unwrap_or(usize::MAX);
        // The history the step's request was sent, and no more.
        let history = store.messages(source, 0, sent).await?;
        if sent > history.len() || from > sent {
            return Err(corrupt(format!(
                "step {step} names history the session does not have"
            ))
            .into());
        }
        let mut kept: Vec<Message> = history[..from].to_vec();
        // The input the step's run drained before its model call.
        let mut input: Vec<Message> = history[from..sent].to_vec();
        let edited = options.edit_user.is_some();
        if let Some(text) = options.edit_user {
            let last = input
                .iter_mut()
                .rev()
                .chain(kept.iter_mut().rev())
                .find(|m| m.role == Role::User && !m.is_silent() && !m.text().is_empty());
            match last {
                Some(message) => *message = Message::user(text),
                None => {
                    return Err(
                        corrupt(format!("step {step} answered no user message to edit")).into(),
                    );
                }
            }
        }
        // The summary the step's view showed, when the step made it: the
        // history before the step does not hold it, and a fork without it
        // would summarize again (another text, another request). It goes
        // where the step recorded it, after the step's input.
        let made = call
            .view
            .as_ref()
            .and_then(|view| view.summary.as_deref())
            .filter(|summary| {
                let shown = summary.as_summary_item();
                shown.is_some() && !history[..sent].iter().any(|m| m.as_summary_item() == shown)
            })
            .cloned();
        let counters = trace.counters_before.clone();
        let waiting = waiting_before(previous, step);
        // A resumed paused answer: the fork waits where the source waited
        // (unless the question is edited: then the model is asked again).
        let resumes = call.replayed && !waiting.answers.is_empty() && !edited;
        if resumes {
            // The history the paused answer was given.
            kept.append(&mut input);
        }
        if let Some(summary) = made {
            if input.is_empty() {
                kept.push(summary);
            } else {
                input.push(summary);
            }
        }
        let crate::Waiting {
            mut approvals,
            answers,
            ledger,
        } = waiting;
        let (answers, ledger) = if resumes {
            // Pending again: the fork is decided anew.
            for record in &mut approvals {
                if record.held.is_some() {
                    record.status = markov_policy::ApprovalStatus::Pending;
                    record.decision = None;
                    record.decided_by = None;
                }
            }
            (answers, ledger)
        } else {
            // No paused answer goes on: its calls' requests go with it.
            approvals.retain(|r| r.held.is_none());
            (Vec::new(), Vec::new())
        };
        let snapshot = SerializedMachine {
            format_version: FORMAT_VERSION,
            instance: tree,
            history: std::mem::take(&mut kept),
            policy: PolicySnapshot {
                conversation: Some(id.as_str().to_owned()),
                turn: counters.turn,
                approvals,
                ledger,
                repeats: trace.repeats_before.clone(),
                budgets: counters.budgets,
                answers,
                found: counters.found,
            },
            usage: trace.usage_before,
        };
        let machine = agent.restore(snapshot)?;
        let (store_ref, owner, ttl) = (&store, options.create.owner.clone(), options.create.lease);
        let written = markov_executor::serialize_machine(&machine)?;
        let lease = store_ref
            .create(
                &id,
                owner.as_ref(),
                machine.charter().name(),
                &written,
                &holder,
                ttl,
            )
            .await?;
        let run = if resumes {
            // Nothing runs until the fork's requests are decided and it is
            // resumed.
            None
        } else if input.is_empty() {
            // A step inside a run: the run goes on from it, the leaf's turn
            // as it stood.
            Some(RunState::continuing(
                machine.run_options().clone(),
                [(InstanceId::new(call.instance.as_str()), call.turn)],
            ))
        } else {
            machine.enqueue(input);
            None
        };
        let mut session = Self::bind(store, lease, machine, run, ttl);
        // The run state and the queued input are this process's until the
        // first step writes them.
        session.persist().await?;
        Ok(session)
    }
}

/// How many steps a fork reads at a time, looking back for the tree its
/// step started from.
const TREE_PAGE: usize = 64;

/// The tree `trace` started from: its own record of it, else the tree the
/// latest step before it left (`previous` first, then earlier steps, read
/// backwards a page at a time: as far back as the tree last changed), else
/// the one the first recorded step started from.
async fn tree_before<S: Store + ?Sized>(
    store: &S,
    source: &SessionId,
    trace: &StepTrace,
    previous: Option<&StepTrace>,
) -> Result<Option<SerializedInstance>, StoreError> {
    if let Some(tree) = &trace.tree_before {
        return Ok(Some(tree.clone()));
    }
    let left = |step: &StepTrace| step.tree.clone().or_else(|| step.tree_before.clone());
    if let Some(tree) = previous.and_then(left) {
        return Ok(Some(tree));
    }
    // Steps before `end` not looked at yet.
    let mut end = previous.map_or(trace.index, |p| p.index);
    while end > 0 {
        let start = end.saturating_sub(TREE_PAGE as u64);
        let page = store.steps(source, start, TREE_PAGE).await?;
        if let Some(tree) = page.iter().rev().filter(|s| s.index < end).find_map(left) {
            return Ok(Some(tree));
        }
        end = start;
    }
    Ok(None)
}

/// The policy state the step before step `step` (`previous`, when it is
/// recorded) left: none when step `step` was the session's first, or the
/// one before it is no longer kept (said in the log).
fn waiting_before(previous: Option<&StepTrace>, step: u64) -> crate::Waiting {
    match previous {
        Some(previous) => previous.waiting.clone(),
        _ if step == 0 => crate::Waiting::default(),
        _ => {
            tracing::warn!(
                step,
                "the step before the forked one is not recorded: the fork starts with no open requests and an empty ledger"
            );
            crate::Waiting::default()
        }
    }
}
