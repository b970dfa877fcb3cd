//! [`Team`]: several agents and the handoffs between them. One agent has
//! the conversation at a time; its model hands it to another by calling a
//! handoff tool ([`Handoff::tool`]), and the other continues with its own
//! instructions and tools, shown the conversation as the handoff says
//! ([`HistoryFilter`]), until it hands back ([`Handoff::back`]) or on.
//!
//! A [`TeamSession`] holds one machine per agent that has had the
//! conversation; [`TeamSession::send`] runs the user's turn, following
//! the handoffs it makes (at most [`MAX_HANDOFFS_PER_TURN`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use markov_core::async_trait;
use markov_core::message::{Message, Role};
use markov_core::model::{Model, ModelRequest, ModelSettings};
use markov_core::tool::{
    DynTool, SharedTool, TerminateResponse, ToolCallError, ToolContext, ToolDefinition, ToolOutcome,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::agent::Agent;
use crate::error::RunError;
use crate::machine::Machine;
use crate::step::MachineStep;

/// The most handoffs one user turn follows: the agent that holds the
/// conversation after them answers, and a further handoff is refused with
/// a log line.
pub const MAX_HANDOFFS_PER_TURN: usize = 4;

/// The name of the hand-back tool.
pub const HAND_BACK: &str = "hand_back";

/// The prefix of a handoff tool's name (`transfer_to_<agent>`).
pub const TRANSFER_PREFIX: &str = "transfer_to_";

/// What the agent taking over is shown of the conversation so far.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum HistoryFilter {
    /// Every user and assistant text of the conversation (tool calls and
    /// their results stay with the agent that made them).
    #[default]
    Everything,
    /// The texts of the last `n` user turns (at least the current one).
    LastTurns(usize),
    /// A summary of the conversation, written by this model, as one
    /// message.
    Summary(Arc<dyn Model>),
}

impl std::fmt::Debug for HistoryFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HistoryFilter::Everything => f.write_str("Everything"),
            HistoryFilter::LastTurns(n) => write!(f, "LastTurns({n})"),
            HistoryFilter::Summary(_) => f.write_str("Summary"),
        }
    }
}

/// The handoff tools an agent's builder is given.
#[derive(Debug, Clone, Copy)]
pub struct Handoff;

impl Handoff {
    /// The tool that hands the conversation to the team's agent `agent`
    /// (`transfer_to_<agent>`); `when` tells the model when to use it. The
    /// agent's run ends with the call: the other continues.
    ///
    /// # Errors
    /// `agent` makes no valid tool name.
    pub fn tool(
        agent: &str,
        when: impl Into<String>,
    ) -> Result<SharedTool, markov_core::tool::InvalidToolName> {
        let definition = ToolDefinition::new(
            format!("{TRANSFER_PREFIX}{agent}"),
            format!(
                "Hand the conversation to the {agent} agent. {}",
                when.into()
            ),
            reason_schema(),
        )?;
        Ok(Arc::new(HandoffTool { definition }))
    }

    /// The tool that hands the conversation back to the agent that handed
    /// it over (`hand_back`), for an agent others hand to.
    ///
    /// # Errors
    /// Never in practice: the name is a constant.
    pub fn back() -> Result<SharedTool, markov_core::tool::InvalidToolName> {
        let definition = ToolDefinition::new(
            HAND_BACK,
            "Hand the conversation back to the agent that handed it to you, once your part is done.",
            reason_schema(),
        )?;
        Ok(Arc::new(HandoffTool { definition }))
    }
}

fn reason_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "reason": {"type": "string", "description": "Why, in a sentence, for the agent taking over."}
        },
        "required": ["reason"],
        "additionalProperties": false
    })
}

/// A handoff tool: ends the run; the team reads the call.
#[derive(Debug)]
struct HandoffTool {
    definition: ToolDefinition,
}

#[async_trait]
impl DynTool for HandoffTool {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn may_terminate(&self) -> bool {
        true
    }

    async fn call_json(
        &self,
        _input: &Value,
        _cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        Ok(ToolOutcome::Terminate(TerminateResponse::new(Some(
            "Handed over.".to_owned(),
        ))))
    }
}

/// A team that could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TeamError {
    /// No agent was added.
    #[error("a team needs at least one agent")]
    Empty,
    /// Two agents share a name.
    #[error("agent {0:?} is added twice")]
    Duplicate(String),
    /// A handoff names an agent the team does not have.
    #[error("a handoff from {from:?} goes to {to:?}, which is not in the team")]
    UnknownAgent {
        /// The agent handing over.
        from: String,
        /// The agent it names.
        to: String,
    },
}

/// Several agents, keyed by name, the first the entry, with the filter of
/// each handoff.
#[derive(Clone, Debug)]
pub struct Team {
    agents: Arc<BTreeMap<String, Agent>>,
    entry: String,
    /// The team's own name, if it was given one ([`Team::named`]).
    name: Option<String>,
    /// The filter of a handoff to each agent (default: everything).
    filters: Arc<BTreeMap<String, HistoryFilter>>,
}

/// Builds a [`Team`].
#[derive(Debug, Default)]
pub struct TeamBuilder {
    agents: Vec<(String, Agent)>,
    filters: BTreeMap<String, HistoryFilter>,
}

impl TeamBuilder {
    /// Adds `agent` as `name`; the first added has the conversation first.
    #[must_use]
    pub fn agent(mut self, name: impl Into<String>, agent: Agent) -> Self {
        self.agents.push((name.into(), agent));
        self
    }

    /// What an agent taking the conversation over is shown of it
    /// (default: [`HistoryFilter::Everything`]).
    #[must_use]
    pub fn history(mut self, agent: impl Into<String>, filter: HistoryFilter) -> Self {
        self.filters.insert(agent.into(), filter);
        self
    }

    /// The team: checks that names are unique, and that every
    /// `transfer_to_<agent>` tool an agent offers names an agent of the
    /// team.
    ///
    /// # Errors
    /// A [`TeamError`].
    pub fn build(self) -> Result<Team, TeamError> {
        let entry = self.agents.first().ok_or(TeamError::Empty)?.0.clone();
        let mut agents = BTreeMap::new();
        for (name, agent) in self.agents {
            if agents.insert(name.clone(), agent).is_some() {
                return Err(TeamError::Duplicate(name));
            }
        }
        for (name, agent) in &agents {
            for def in agent.start_node().tools().definitions() {
                if let Some(to) = def.name.as_str().strip_prefix(TRANSFER_PREFIX)
                    && !agents.contains_key(to)
                {
                    return Err(TeamError::UnknownAgent {
                        from: name.clone(),
                        to: to.to_owned(),
                    });
                }
            }
        }
        if let Some(unknown) = self.filters.keys().find(|k| !agents.contains_key(*k)) {
            return Err(TeamError::UnknownAgent {
                from: String::new(),
                to: unknown.clone(),
            });
        }
        Ok(Team {
            agents: Arc::new(agents),
            entry,
            name: None,
            filters: Arc::new(self.filters),
        })
    }
}

impl Team {
    /// A builder.
    pub fn builder() -> TeamBuilder {
        TeamBuilder::default()
    }

    /// The agent `name`.
    pub fn agent(&self, name: &str) -> Option<&Agent> {
        self.agents.get(name)
    }

    /// The agents' names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.agents.keys().map(String::as_str)
    }

    /// The team with each agent replaced by what `f` makes of it (a
    /// server streams each agent's text, say), under the same names, with
    /// the same entry and filters. `f` should keep each agent's name and
    /// tools: a store restores each agent's machine by its name.
    #[must_use]
    pub fn map_agents(&self, mut f: impl FnMut(Agent) -> Agent) -> Team {
        Team {
            agents: Arc::new(
                self.agents
                    .iter()
                    .map(|(name, agent)| (name.clone(), f(agent.clone())))
                    .collect(),
            ),
            entry: self.entry.clone(),
            name: self.name.clone(),
            filters: Arc::clone(&self.filters),
        }
    }

    /// The team named `name`: a store keeps the name with each of its
    /// conversations, so that two teams whose entry agents share a name
    /// still know their own conversations (a server names each team it
    /// serves by the name it serves it as).
    #[must_use]
    pub fn named(mut self, name: impl Into<String>) -> Team {
        self.name = Some(name.into());
        self
    }

    /// The team's own name, if it was given one ([`Team::named`]).
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The entry agent's name: the one that has a new conversation.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// A new conversation, held by the entry agent.
    pub fn session(&self) -> TeamSession {
        TeamSession {
            team: self.clone(),
            state: self.start(),
            machines: BTreeMap::new(),
        }
    }

    /// The state of a new conversation (held by the entry agent), for a
    /// session kept elsewhere than in a [`TeamSession`] (a store's).
    pub fn start(&self) -> TeamState {
        TeamState {
            current: self.entry.clone(),
            handed_by: Vec::new(),
            transcript: Vec::new(),
            seen: BTreeMap::new(),
            handoffs: Vec::new(),
            handoff_at: Vec::new(),
        }
    }

    /// After the current agent's run, which added `added` to its history:
    /// the handoff it made, if any, applied to `state` (the agent taking
    /// over is current from then on), with what that agent is to be given
    /// (see [`HistoryFilter`]). `None` when the run made none, when it
    /// handed back with nobody to hand back to, or when `allowed` is false
    /// (the turn made [`MAX_HANDOFFS_PER_TURN`] already): those two are
    /// logged, and the current agent keeps the conversation.
    ///
    /// # Errors
    /// The summary a [`HistoryFilter::Summary`] asks for failed, or the
    /// handoff names an agent the team does not have.
    pub async fn follow(
        &self,
        state: &mut TeamState,
        added: &[Message],
        allowed: bool,
    ) -> Result<Option<(HandoffRecord, Vec<Message>)>, RunError> {
        let name = state.current.clone();
        state.seen.insert(name.clone(), state.transcript.len());
        let Some((tool, reason)) = handoff_of(added) else {
            return Ok(None);
        };
        if !allowed {
            tracing::warn!(
                agent = %name,
                max = MAX_HANDOFFS_PER_TURN,
                "too many handoffs in one turn: the last is not followed"
            );
            return Ok(None);
        }
        let to = if tool == HAND_BACK {
            match state.handed_by.last() {
                Some(to) => to.clone(),
                None => {
                    tracing::warn!(agent = %name, "hand_back with nobody to hand back to: ignored");
                    return Ok(None);
                }
            }
        } else {
            tool[TRANSFER_PREFIX.len()..].to_owned()
        };
        if !self.agents.contains_key(&to) {
            return Err(RunError::Executor(format!(
                "agent {name:?} handed the conversation to {to:?}, which is not in the team"
            )));
        }
        let context = self.context_for(state, &to, &name, &reason).await?;
        if tool == HAND_BACK {
            state.handed_by.pop();
        } else {
            state.handed_by.push(name.clone());
        }
        tracing::info!(from = %name, to = %to, "handoff");
        let record = HandoffRecord {
            from: name,
            to: to.clone(),
            reason,
        };
        state.handoffs.push(record.clone());
        state.handoff_at.push(state.transcript.len());
        state.current = to;
        Ok(Some((record, context)))
    }

    /// What agent `to` is given when `from` hands it the conversation:
    /// the transcript filtered as the team says for `to` (an agent that
    /// had the conversation before: what it has not seen), then a note of
    /// the handoff and its reason.
    async fn context_for(
        &self,
        state: &TeamState,
        to: &str,
        from: &str,
        reason: &str,
    ) -> Result<Vec<Message>, RunError> {
        let transcript = &state.transcript;
        let mut messages = match state.seen.get(to) {
            // An agent that had the conversation before gets what came
            // after its part.
            Some(&seen) => transcript.get(seen..).unwrap_or_default().to_vec(),
            None => match self.filters.get(to).cloned().unwrap_or_default() {
                HistoryFilter::Everything => transcript.clone(),
                HistoryFilter::LastTurns(n) => last_turns(transcript, n.max(1)),
                HistoryFilter::Summary(model) => vec![Message::user(format!(
                    "A summary of the conversation so far:\n{}",
                    summarize(model.as_ref(), transcript).await?
                ))],
            },
        };
        // The current user message is enqueued by the turn only for the
        // first agent; the one taking over reads it here.
        messages.push(Message::user(format!(
            "[The {from} agent handed the conversation to you: {reason}] Continue it: answer the user's last message."
        )));
        Ok(merge_roles(messages))
    }
}

/// One handoff a turn made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoffRecord {
    /// The agent that handed over.
    pub from: String,
    /// The agent that took over.
    pub to: String,
    /// The reason its model gave.
    pub reason: String,
}

/// What [`TeamSession::send`] ended with.
#[derive(Debug)]
pub struct TeamTurn {
    /// The agent holding the conversation now (the one that answered).
    pub agent: String,
    /// Its last step.
    pub step: MachineStep,
    /// The handoffs of the turn, in order.
    pub handoffs: Vec<HandoffRecord>,
}

/// Where a conversation with a [`Team`] is, apart from the agents'
/// machines: which agent holds it, where `hand_back` goes, the
/// conversation's texts and the handoffs so far. Serializable, for a
/// store to keep beside the machines (see `markov_store::DurableTeam`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamState {
    current: String,
    /// The agents that handed over, most recent last: where `hand_back`
    /// goes.
    handed_by: Vec<String>,
    /// The conversation's texts, as every agent of the team saw them.
    transcript: Vec<Message>,
    /// How much of the transcript each agent has seen.
    seen: BTreeMap<String, usize>,
    /// Every handoff of the conversation, in order.
    #[serde(default)]
    handoffs: Vec<HandoffRecord>,
    /// Where each handoff happened: the transcript's length then.
    #[serde(default)]
    handoff_at: Vec<usize>,
}

impl TeamState {
    /// The agent holding the conversation.
    pub fn current(&self) -> &str {
        &self.current
    }

    /// The conversation's texts (users' and agents'), in order.
    pub fn transcript(&self) -> &[Message] {
        &self.transcript
    }

    /// Every handoff of the conversation, in order.
    pub fn handoffs(&self) -> &[HandoffRecord] {
        &self.handoffs
    }

    /// Every handoff of the conversation with where it happened: the
    /// number of transcript messages before it.
    pub fn handoffs_at(&self) -> impl Iterator<Item = (usize, &HandoffRecord)> {
        // A state written before positions were kept puts them at the end.
        self.handoffs.iter().enumerate().map(|(i, record)| {
            (
                self.handoff_at
                    .get(i)
                    .copied()
                    .unwrap_or(self.transcript.len()),
                record,
            )
        })
    }

    /// Who wrote each transcript message: `None` for the user's, the
    /// agent's name for an answer (the agent that held the conversation
    /// then).
    pub fn speakers(&self) -> Vec<Option<&str>> {
        let handoffs: Vec<(usize, &HandoffRecord)> = self.handoffs_at().collect();
        self.transcript
            .iter()
            .enumerate()
            .map(|(i, message)| {
                if message.role != Role::Assistant {
                    return None;
                }
                let holder = match handoffs.iter().rev().find(|(at, _)| *at <= i) {
                    Some((_, record)) => record.to.as_str(),
                    None => handoffs
                        .first()
                        .map_or(self.current.as_str(), |(_, record)| record.from.as_str()),
                };
                Some(holder)
            })
            .collect()
    }

    /// Records the user's message `text` in the transcript (a turn's
    /// start).
    pub fn user(&mut self, text: impl Into<String>) {
        self.transcript.push(Message::user(text.into()));
    }

    /// Records the current agent's answer of the turn, if it gave one, in
    /// the transcript (a turn's end).
    pub fn answered(&mut self, answer: Option<String>) {
        if let Some(answer) = answer {
            self.transcript.push(Message::assistant(answer));
            self.seen
                .insert(self.current.clone(), self.transcript.len());
        }
    }
}

/// One conversation with a [`Team`], in memory.
pub struct TeamSession {
    team: Team,
    state: TeamState,
    machines: BTreeMap<String, Machine>,
}

impl std::fmt::Debug for TeamSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TeamSession")
            .field("current", &self.state.current)
            .field("handed_by", &self.state.handed_by)
            .field("transcript", &self.state.transcript.len())
            .finish_non_exhaustive()
    }
}

impl TeamSession {
    /// The agent holding the conversation.
    pub fn current(&self) -> &str {
        &self.state.current
    }

    /// The machine of agent `name`, if it has had the conversation.
    pub fn machine(&self, name: &str) -> Option<&Machine> {
        self.machines.get(name)
    }

    /// The conversation's texts (users' and agents'), in order.
    pub fn transcript(&self) -> &[Message] {
        &self.state.transcript
    }

    /// The conversation's state (current agent, transcript, handoffs).
    pub fn state(&self) -> &TeamState {
        &self.state
    }

    /// Runs the user's turn: the agent holding the conversation answers,
    /// or hands it over and the next one answers, and so on.
    ///
    /// # Errors
    /// A run's [`RunError`].
    pub async fn send(&mut self, text: impl Into<String>) -> Result<TeamTurn, RunError> {
        let text = text.into();
        self.state.user(text.clone());
        let mut handoffs = Vec::new();
        let mut pending: Option<Vec<Message>> = None;
        loop {
            let name = self.state.current.clone();
            let agent = self
                .team
                .agents
                .get(&name)
                .cloned()
                .ok_or_else(|| RunError::Executor(format!("no agent {name:?} in the team")))?;
            let machine = self
                .machines
                .entry(name.clone())
                .or_insert_with(|| agent.machine());
            let start = machine.history().len();
            match pending.take() {
                Some(context) => {
                    machine.enqueue(context);
                }
                None => {
                    machine.enqueue_user(text.clone());
                }
            }
            let step = machine.run().await?;
            let added = &machine.history()[start..];
            let allowed = handoffs.len() < MAX_HANDOFFS_PER_TURN;
            match self.team.follow(&mut self.state, added, allowed).await? {
                Some((record, context)) => {
                    handoffs.push(record);
                    pending = Some(context);
                }
                None => {
                    self.state.answered(step.output());
                    return Ok(TeamTurn {
                        agent: name,
                        step,
                        handoffs,
                    });
                }
            }
        }
    }
}

/// The index in `transcript` where its `n`-th user turn (from 0) starts.
fn user_turn_start(transcript: &[Message], n: usize) -> usize {
    transcript
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == Role::User)
        .nth(n)
        .map_or(transcript.len(), |(i, _)| i)
}

/// The texts of the last `n` user turns of `transcript`.
fn last_turns(transcript: &[Message], n: usize) -> Vec<Message> {
    let users = transcript.iter().filter(|m| m.role == Role::User).count();
    transcript[user_turn_start(transcript, users.saturating_sub(n))..].to_vec()
}

/// Consecutive messages of one role as one (what every provider takes).
fn merge_roles(messages: Vec<Message>) -> Vec<Message> {
    let mut out: Vec<(Role, String)> = Vec::new();
    for m in messages {
        let text = m.text();
        match out.last_mut() {
            Some((role, acc)) if *role == m.role => {
                acc.push_str("\n\n");
                acc.push_str(&text);
            }
            _ => out.push((m.role, text)),
        }
    }
    out.into_iter()
        .map(|(role, text)| match role {
            Role::Assistant => Message::assistant(text),
            _ => Message::user(text),
        })
        .collect()
}

/// A summary of `transcript` by `model`.
async fn summarize(model: &dyn Model, transcript: &[Message]) -> Result<String, RunError> {
    let mut text = String::new();
    for m in transcript {
        let who = if m.role == Role::Assistant {
            "Agent"
        } else {
            "User"
        };
        text.push_str(&format!("{who}: {}\n", m.text()));
    }
    let messages = [Message::user(text)];
    let settings = ModelSettings::default();
    let request = ModelRequest::new(
        "Summarize this conversation for the agent taking it over: what the user wants, what was done, what is open. Be brief.",
        &messages,
        &settings,
    );
    let answer = model
        .complete(request)
        .await
        .map_err(|e| RunError::Executor(format!("the handoff's summary failed: {e}")))?;
    Ok(answer
        .content
        .iter()
        .filter_map(|i| match i {
            markov_core::Item::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join(""))
}

/// The handoff tool `messages` called successfully, with its reason.
fn handoff_of(messages: &[Message]) -> Option<(String, String)> {
    let mut calls: Vec<(&markov_core::ids::ToolCallId, &str, &Value)> = Vec::new();
    for m in messages {
        calls.extend(
            m.tool_uses()
                .filter(|(_, name, _)| *name == HAND_BACK || name.starts_with(TRANSFER_PREFIX)),
        );
    }
    calls.into_iter().rev().find_map(|(id, name, input)| {
        let ok = messages.iter().flat_map(|m| m.item_list()).any(|item| {
            matches!(item, markov_core::Item::ToolResult { tool_use_id, is_error, .. }
                if tool_use_id == id && *is_error != Some(true))
        });
        ok.then(|| {
            (
                name.to_owned(),
                input
                    .get("reason")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
    })
}
