//! A stored session as a case: its user turns become the input, its
//! model answers the script that plays them back offline, and what it did
//! the expectations.

use std::ops::Range;

use markov_core::{Item, Message, Role};
use markov_store::{SessionId, Store, StoreError};

use crate::dataset::{Answer, Call, Case, Dataset};
use crate::expect::{Expect, ExpectedCall, TrajectoryMode};

/// Why a session could not become a case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// The session could not be loaded.
    #[error("cannot load the session: {0}")]
    Store(#[from] StoreError),
    /// The session has no user turn to replay.
    #[error("session {0} has no user turn")]
    NoInput(SessionId),
    /// The steps asked for were not recorded (the session ran before steps
    /// were recorded, retention dropped them, or the range is past the end).
    #[error("session {session} has no recorded steps {steps:?}")]
    NoSteps {
        /// The session.
        session: SessionId,
        /// The steps asked for.
        steps: Range<u64>,
    },
}

/// The case a stored session makes: each user message with text is a
/// turn of `input`; each assistant message is an answer of `script`, its
/// tool calls with their recorded ids; the expectations are the recorded
/// tool calls exactly (`trajectory`, mode `exact`) and the last answer's
/// text (`output_equals`). Replayed with [`crate::ModelChoice::Scripted`],
/// the case plays the recorded answers; edit its expectations to what
/// must hold when the agent changes.
///
/// An assistant message a tool wrote (a user-facing reply) is played as a
/// model answer too: remove it from the script if the tool writes it again.
///
/// # Errors
/// The session cannot be loaded, or has no user turn.
pub async fn export_session(store: &dyn Store, id: &SessionId) -> Result<Case, ExportError> {
    let session = store.load(id).await?;
    case_of(id, &session.snapshot.history)
}

/// The case a range of a stored session's recorded steps makes (see
/// [`Store::steps`]), as [`export_session`] makes one of a whole session:
/// the user turns those steps belong to, from the start of the turn of the
/// first step to the end of the last step, with their recorded answers as
/// the script. The turns before it are not part of the case: it starts
/// from the agent's initial state, so the model is shown that turn without
/// the conversation before it.
///
/// # Errors
/// The session cannot be loaded, the steps were not recorded, or they
/// hold no user turn.
pub async fn export_steps(
    store: &dyn Store,
    id: &SessionId,
    steps: Range<u64>,
) -> Result<Case, ExportError> {
    let no_steps = || ExportError::NoSteps {
        session: id.clone(),
        steps: steps.clone(),
    };
    let count = usize::try_from(steps.end.saturating_sub(steps.start)).unwrap_or(usize::MAX);
    let traces = store.steps(id, steps.start, count).await?;
    let (Some(first), Some(last)) = (traces.first(), traces.last()) else {
        return Err(no_steps());
    };
    if first.index != steps.start {
        return Err(no_steps());
    }
    let session = store.load(id).await?;
    let history = &session.snapshot.history;
    let to = usize::try_from(last.history_to)
        .unwrap_or(usize::MAX)
        .min(history.len());
    let from = usize::try_from(first.history_from)
        .unwrap_or(usize::MAX)
        .min(to);
    // Back to the user message that began the first step's turn.
    let start = history[..from]
        .iter()
        .rposition(is_user_input)
        .filter(|_| !history[from..to].iter().take(1).any(is_user_input))
        .unwrap_or(from);
    let mut case = case_of(id, &history[start..to])?;
    // The steps it holds: an open range ends at the last recorded step.
    case.id = format!(
        "{id}-steps-{}-{}",
        steps.start,
        last.index.saturating_add(1)
    );
    Ok(case)
}

/// A case file of one case: session `id` ([`export_session`]), or the
/// steps in `steps` of it ([`export_steps`]; an end past the last step
/// takes the steps to the end; the case's id names the steps it holds), as
/// a [`Dataset`] named `exported` that says where it came from. [`Dataset::to_toml`] writes it as the file
/// [`Dataset::load`] reads back.
///
/// # Errors
/// As [`export_session`] and [`export_steps`].
pub async fn export_dataset(
    store: &dyn Store,
    id: &SessionId,
    steps: Option<Range<u64>>,
) -> Result<Dataset, ExportError> {
    let case = match steps {
        None => export_session(store, id).await?,
        Some(steps) => export_steps(store, id, steps).await?,
    };
    Ok(Dataset {
        name: "exported".to_owned(),
        description: Some(format!("exported from the recorded session {id}")),
        repeat: None,
        cases: vec![case],
    })
}

/// Whether `message` is text a user typed (not an instance's hand-back).
fn is_user_input(message: &Message) -> bool {
    message.role == Role::User
        && message.source_instance().is_none()
        && message
            .item_list()
            .iter()
            .any(|item| matches!(item, Item::Text { text } if !text.is_empty()))
}

/// The case `history` of session `id` makes (see [`export_session`]).
fn case_of(id: &SessionId, history: &[Message]) -> Result<Case, ExportError> {
    let mut input = Vec::new();
    let mut script = Vec::new();
    let mut calls = Vec::new();
    let mut last_text = None;
    for message in history {
        match message.role {
            // Text an agent instance handed back (a cede, a command's
            // result) is not the user's input: the replay makes it again.
            Role::User if message.source_instance().is_some() => {}
            Role::User => {
                let text: String = message
                    .item_list()
                    .iter()
                    .filter_map(|item| match item {
                        Item::Text { text } => Some(text.as_str()),
                        _ => None,
                    })
                    .collect();
                if !text.is_empty() {
                    input.push(text);
                }
            }
            Role::Assistant => {
                let mut answer = Answer {
                    text: None,
                    calls: Vec::new(),
                };
                for item in message.item_list() {
                    match item {
                        Item::Text { text } => {
                            answer.text = Some(match answer.text.take() {
                                Some(before) => before + text,
                                None => text.clone(),
                            });
                        }
                        Item::Output { data } => {
                            let text = match data {
                                serde_json::Value::String(s) => s.clone(),
                                other => other.to_string(),
                            };
                            answer.text = Some(answer.text.take().unwrap_or_default() + &text);
                        }
                        Item::ToolUse { id, name, input } => {
                            answer.calls.push(Call {
                                id: Some(id.to_string()),
                                tool: name.clone(),
                                args: input.clone(),
                            });
                            calls.push(ExpectedCall {
                                tool: name.clone(),
                                args: Some(input.clone()),
                            });
                        }
                        _ => {}
                    }
                }
                if answer.text.is_none() && answer.calls.is_empty() {
                    continue;
                }
                last_text = answer.text.clone().or(last_text);
                if !answer.calls.is_empty() {
                    last_text = None;
                }
                script.push(answer);
            }
            _ => {}
        }
    }
    if input.is_empty() {
        return Err(ExportError::NoInput(id.clone()));
    }
    let mut expect = Vec::new();
    if !calls.is_empty() {
        expect.push(Expect::Trajectory {
            mode: TrajectoryMode::Exact,
            calls,
        });
    }
    if let Some(value) = last_text {
        expect.push(Expect::OutputEquals { value });
    }
    Ok(Case {
        id: id.to_string(),
        tags: vec!["exported".to_owned()],
        input,
        state: None,
        repeat: None,
        script,
        judge_script: Vec::new(),
        expect,
    })
}
