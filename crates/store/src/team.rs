//! [`DurableTeam`]: a conversation with a [`Team`] kept in a [`Store`], so
//! that a process that restarts continues it with the agent that held it.
//!
//! The entry agent's machine is the session itself (its id is the team
//! conversation's); each other agent's machine is a session of its own,
//! [`agent_session`], created when the agent first takes the conversation,
//! with the same owner. Beside the entry agent's session the store keeps
//! the [`TeamRecord`]: the team's state (which agent holds the
//! conversation, where `hand_back` goes, the conversation's texts, the
//! handoffs) and the user turn in progress, written before each agent is
//! given its input. Each agent's run is a [`DurableMachine`] run, so the
//! store's exactly-once machinery covers its tool calls; a turn that a
//! crash interrupted is finished on the next [`DurableTeam::send`] or
//! [`DurableTeam::resume`]: an agent's run that was in progress continues,
//! an agent that was not given its input yet is given it, and a handoff
//! that was made but not followed is followed — the user's message is
//! never lost and no tool runs twice.
//!
//! A tool call that needs approval pauses the turn with the agent that
//! made it: the turn stays in progress ([`TeamReply::awaiting_approval`]),
//! the call is decided on the conversation ([`DurableTeam::decide_by`],
//! written before it returns), and once no call waits
//! [`DurableTeam::resume`] goes on with that agent's run, then with any
//! handoff it makes. The decisions are the agent's machine's, stored with
//! it, so a restart between the pause and the decision loses nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use markov_core::message::{Message, Role};
use markov_executor::team::MAX_HANDOFFS_PER_TURN;
use markov_executor::{HandoffRecord, MachineStep, RunError, Team, TeamState};
use markov_policy::{ApprovalId, ConfirmationRequest, Decision};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::{
    CreateOptions, DEFAULT_LEASE, DurableError, DurableMachine, OpenOptions, Owner, SessionId,
    Store, StoreError, WorkerId,
};

/// The session that keeps agent `agent`'s machine in the team conversation
/// `team` (for an agent other than the entry agent, whose machine is
/// `team` itself): `<team>~<agent>`.
pub fn agent_session(team: &SessionId, agent: &str) -> SessionId {
    SessionId::new(format!("{team}~{agent}"))
}

/// The session that keeps agent `agent`'s machine in the conversation
/// `conversation` with `team`: the conversation itself for the entry
/// agent, [`agent_session`] for any other.
pub fn member_session(conversation: &SessionId, team: &Team, agent: &str) -> SessionId {
    if agent == team.entry() {
        conversation.clone()
    } else {
        agent_session(conversation, agent)
    }
}

/// A team conversation as a store keeps it beside the entry agent's
/// session (see [`Store::team_state`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamRecord {
    /// The name of the team the conversation is with ([`Team::name`]);
    /// `None` in a conversation stored before teams were named, or with a
    /// team that has no name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    team: Option<String>,
    state: TeamState,
    /// The user turn in progress, if one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    turn: Option<PendingTurn>,
}

impl TeamRecord {
    /// The name of the team the conversation is with, if it was stored
    /// with one ([`Team::named`]).
    pub fn team(&self) -> Option<&str> {
        self.team.as_deref()
    }

    /// The team's state: the agent holding the conversation, its texts,
    /// the handoffs.
    pub fn state(&self) -> &TeamState {
        &self.state
    }

    /// Whether a user turn was in progress at the last write: a restart
    /// interrupted it, or the agent holding the conversation waits for a
    /// decision on one of its tool calls (its machine says which).
    pub fn is_turn_pending(&self) -> bool {
        self.turn.is_some()
    }
}

/// A user turn in progress: the current agent was (or is to be) given
/// `input` over a history of `start` messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct PendingTurn {
    /// The user's message.
    text: String,
    /// The handoffs of the turn so far.
    handoffs: Vec<HandoffRecord>,
    /// The current agent's history length before it was given its input.
    start: usize,
    /// What the current agent is given: the handoff's context, or (`None`)
    /// the user's message.
    input: Option<Vec<Message>>,
}

/// What happens in a team turn, as it happens.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum TeamEvent<'a> {
    /// Agent `agent` made a step (stored before this is said).
    Step {
        /// The agent.
        agent: &'a str,
        /// Its step.
        step: &'a MachineStep,
    },
    /// A handoff was followed (stored before this is said).
    Handoff {
        /// The handoff.
        handoff: &'a HandoffRecord,
        /// What the agent taking over is given (see
        /// `markov_executor::HistoryFilter`): the first messages of its
        /// next step.
        context: &'a [Message],
    },
}

/// What a team turn ended with.
#[derive(Debug)]
#[non_exhaustive]
pub struct TeamReply {
    /// The agent holding the conversation now (the one that answered).
    pub agent: String,
    /// Its answer, if it gave one.
    pub answer: Option<String>,
    /// The handoffs of the turn, in order.
    pub handoffs: Vec<HandoffRecord>,
    /// The answering agent's last step; `None` when its run had ended
    /// before a restart and the turn was finished from what was stored.
    pub step: Option<MachineStep>,
    /// Whether the turn was interrupted after a stored step (see
    /// [`DurableTeam::interrupt_when`]): the next [`DurableTeam::send`] or
    /// [`DurableTeam::resume`] finishes it.
    pub interrupted: bool,
    /// Whether the turn is paused: the agent holding the conversation
    /// waits for decisions on its tool calls ([`DurableTeam::pending`]).
    /// Once they are decided ([`DurableTeam::decide_by`]),
    /// [`DurableTeam::resume`] goes on with it.
    pub awaiting_approval: bool,
}

/// A conversation with a [`Team`] in a [`Store`], leased to one worker:
/// every agent's machine is a [`DurableMachine`] and the team's state is
/// written before each agent is given its input (see the module's
/// documentation).
pub struct DurableTeam<S: Store + ?Sized> {
    store: Arc<S>,
    id: SessionId,
    holder: WorkerId,
    team: Team,
    lease: Duration,
    owner: Option<Owner>,
    record: TeamRecord,
    /// The machines of the agents opened so far (the entry agent's always).
    machines: BTreeMap<String, DurableMachine<S>>,
    /// Stops the turn in progress (see [`DurableTeam::cancel_token`]).
    cancel: CancellationToken,
    /// Interrupts the turn in progress after a stored step.
    interrupt: CancellationToken,
}

impl<S: Store + ?Sized> std::fmt::Debug for DurableTeam<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableTeam")
            .field("session", &self.id)
            .field("holder", &self.holder)
            .field("current", &self.record.state.current())
            .field("turn_pending", &self.record.turn.is_some())
            .finish_non_exhaustive()
    }
}

impl<S: Store + ?Sized + 'static> DurableTeam<S> {
    /// Stores a new conversation with `team` as session `id` (held by the
    /// entry agent), leased to `holder` for [`DEFAULT_LEASE`], with no
    /// owner.
    pub async fn create(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        team: Team,
    ) -> Result<Self, DurableError> {
        Self::create_with(store, id, holder, team, CreateOptions::default()).await
    }

    /// [`create`](Self::create) with `options`: the lease's length (of
    /// each of the conversation's sessions) and the owner (of each).
    pub async fn create_with(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        team: Team,
        options: CreateOptions,
    ) -> Result<Self, DurableError> {
        let entry = team.entry().to_owned();
        let agent = entry_agent(&team)?;
        let lease = options.lease;
        let owner = options.owner.clone();
        let machine = DurableMachine::create_with(
            Arc::clone(&store),
            id.clone(),
            holder.clone(),
            agent.machine(),
            options,
        )
        .await?;
        let record = TeamRecord {
            team: team.name().map(str::to_owned),
            state: team.start(),
            turn: None,
        };
        store.write_team_state(&id, &holder, &record).await?;
        Ok(Self::bind(
            store, id, holder, team, lease, owner, record, entry, machine,
        ))
    }

    /// Leases the team conversation `id` to `holder` for
    /// [`DEFAULT_LEASE`] and restores it over `team`, with the turn a
    /// restart interrupted, if any (finished by the next
    /// [`send`](Self::send) or [`resume`](Self::resume)).
    pub async fn open(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        team: Team,
    ) -> Result<Self, DurableError> {
        Self::open_with(store, id, holder, team, DEFAULT_LEASE).await
    }

    /// [`open`](Self::open) with a lease of `lease` on each of the
    /// conversation's sessions.
    pub async fn open_with(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        team: Team,
        lease: Duration,
    ) -> Result<Self, DurableError> {
        let entry = team.entry().to_owned();
        let agent = entry_agent(&team)?;
        let machine = DurableMachine::open_with(
            Arc::clone(&store),
            id.clone(),
            holder.clone(),
            agent,
            OpenOptions::default().lease(lease),
        )
        .await?;
        let owner = store.info(&id).await?.owner;
        let mut record = match store.team_state(&id).await? {
            Some(record) => record,
            None => {
                // Created, and the process stopped before the team's state
                // was first written: nothing happened in it yet.
                tracing::warn!(session = %id, "a team conversation without a team state: it starts with the entry agent");
                TeamRecord {
                    team: team.name().map(str::to_owned),
                    state: team.start(),
                    turn: None,
                }
            }
        };
        match (record.team.as_deref(), team.name()) {
            (Some(stored), Some(name)) if stored != name => {
                return Err(RunError::Executor(format!(
                    "session {id} is a conversation with team {stored:?}, not with team {name:?}"
                ))
                .into());
            }
            (None, Some(name)) => {
                tracing::info!(
                    session = %id,
                    team = name,
                    "a team conversation stored without its team's name was matched by its entry agent: the name is stored with it from its next write"
                );
                record.team = Some(name.to_owned());
            }
            _ => {}
        }
        if team.agent(record.state.current()).is_none() {
            return Err(StoreError::Corrupt {
                session: id,
                detail: format!(
                    "the conversation is held by agent {:?}, which the team does not have",
                    record.state.current()
                ),
            }
            .into());
        }
        let mut session = Self::bind(
            store, id, holder, team, lease, owner, record, entry, machine,
        );
        // The agent holding the conversation is opened at once: its
        // pending decisions are the conversation's.
        let current = session.current().to_owned();
        session.open_agent(&current).await?;
        Ok(session)
    }

    #[allow(clippy::too_many_arguments)]
    fn bind(
        store: Arc<S>,
        id: SessionId,
        holder: WorkerId,
        team: Team,
        lease: Duration,
        owner: Option<Owner>,
        record: TeamRecord,
        entry: String,
        machine: DurableMachine<S>,
    ) -> Self {
        let mut machines = BTreeMap::new();
        machines.insert(entry, machine);
        DurableTeam {
            store,
            id,
            holder,
            team,
            lease,
            owner,
            record,
            machines,
            cancel: CancellationToken::new(),
            interrupt: CancellationToken::new(),
        }
    }

    /// The conversation's id (the entry agent's session).
    pub fn id(&self) -> &SessionId {
        &self.id
    }

    /// The team.
    pub fn team(&self) -> &Team {
        &self.team
    }

    /// The agent holding the conversation.
    pub fn current(&self) -> &str {
        self.record.state.current()
    }

    /// The team's state: the conversation's texts, the handoffs.
    pub fn state(&self) -> &TeamState {
        &self.record.state
    }

    /// Whether a user turn waits to be finished (a restart or
    /// [`interrupt_when`](Self::interrupt_when) interrupted it, or it is
    /// paused for approval: see [`is_awaiting_approval`](Self::is_awaiting_approval)).
    pub fn is_turn_pending(&self) -> bool {
        self.record.turn.is_some()
    }

    /// Whether the turn is paused because the agent holding the
    /// conversation waits for decisions on its tool calls (some may be
    /// decided or expired already: [`pending`](Self::pending) lists the
    /// rest).
    pub fn is_awaiting_approval(&self) -> bool {
        self.record.turn.is_some()
            && self
                .machines
                .get(self.current())
                .is_some_and(|m| !m.is_interrupted() && m.machine().is_awaiting_approval())
    }

    /// The paused turn's calls still waiting for a decision (undecided,
    /// unexpired), oldest first: the agent holding the conversation's.
    pub fn pending(&self) -> Vec<ConfirmationRequest> {
        if !self.is_awaiting_approval() {
            return Vec::new();
        }
        self.machines
            .get(self.current())
            .map(|m| m.machine().approvals().held_pending_at(SystemTime::now()))
            .unwrap_or_default()
    }

    /// The tool whose call request `id` asks about, if the agent holding
    /// the conversation has that request.
    pub fn approval_tool(&self, id: &ApprovalId) -> Option<String> {
        self.machines
            .get(self.current())
            .and_then(|m| m.machine().approvals().get(id))
            .map(|record| record.request.tool)
    }

    /// Records the decision of `by` (a principal's id) on request `id` of
    /// the agent holding the conversation, and writes it before returning
    /// (see [`DurableMachine::decide_by`]). The turn goes on with
    /// [`resume`](Self::resume) once no call waits.
    ///
    /// # Errors
    /// The request is unknown, decided or expired
    /// ([`DurableError::Approval`]), or the write failed.
    pub async fn decide_by(
        &mut self,
        id: &ApprovalId,
        decision: Decision,
        by: &str,
    ) -> Result<ConfirmationRequest, DurableError> {
        let current = self.current().to_owned();
        self.open_agent(&current)
            .await?
            .decide_by(id, decision, by)
            .await
    }

    /// The machine of agent `name`, if it was opened here (the entry
    /// agent's always is; another's once it had the conversation since
    /// the session was opened).
    pub fn machine(&self, name: &str) -> Option<&DurableMachine<S>> {
        self.machines.get(name)
    }

    /// A token that stops the turn in progress (see
    /// [`DurableMachine::cancel_token`]): the agent running stops where it
    /// is, its step is recorded with one result per call, and the turn
    /// ends with that agent holding the conversation. Once a turn has
    /// stopped, later turns use a new token.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Interrupts the turn in progress once `token` is cancelled (a server
    /// shutting down): the step the running agent is in finishes and is
    /// stored, then the turn returns, still recorded as in progress.
    pub fn interrupt_when(&mut self, token: CancellationToken) {
        for machine in self.machines.values_mut() {
            machine.interrupt_when(token.clone());
        }
        self.interrupt = token;
    }

    /// Runs the user's turn (after finishing one a restart interrupted):
    /// the agent holding the conversation answers, or hands it over and
    /// the next one answers, and so on (at most
    /// [`MAX_HANDOFFS_PER_TURN`] handoffs).
    pub async fn send(&mut self, text: impl Into<String>) -> Result<TeamReply, DurableError> {
        self.send_each(text, |_| {}).await
    }

    /// [`send`](Self::send), telling `on_event` each step and handoff once
    /// it is stored.
    pub async fn send_each(
        &mut self,
        text: impl Into<String>,
        mut on_event: impl FnMut(TeamEvent<'_>),
    ) -> Result<TeamReply, DurableError> {
        if self.record.turn.is_some() {
            tracing::info!(session = %self.id, "finishing the turn a restart interrupted (or a decision unpaused) before the new one");
            let reply = self.finish(&mut on_event).await?;
            if reply.interrupted || reply.awaiting_approval {
                // The new message is not taken: the turn before it is
                // still in progress.
                return Ok(reply);
            }
        }
        let text = text.into();
        let current = self.record.state.current().to_owned();
        let start = self.open_agent(&current).await?.machine().history().len();
        self.record.state.user(text.clone());
        self.record.turn = Some(PendingTurn {
            text,
            handoffs: Vec::new(),
            start,
            input: None,
        });
        self.write().await?;
        self.finish(&mut on_event).await
    }

    /// Finishes the turn a restart interrupted or a pause for approval
    /// held, if there is one (`None` if not): a paused turn goes on once
    /// no call waits for a decision (an expired request counts as denied),
    /// and ends paused again otherwise.
    pub async fn resume(&mut self) -> Result<Option<TeamReply>, DurableError> {
        self.resume_each(|_| {}).await
    }

    /// [`resume`](Self::resume), telling `on_event` each step and handoff
    /// once it is stored.
    pub async fn resume_each(
        &mut self,
        mut on_event: impl FnMut(TeamEvent<'_>),
    ) -> Result<Option<TeamReply>, DurableError> {
        if self.record.turn.is_none() {
            return Ok(None);
        }
        self.finish(&mut on_event).await.map(Some)
    }

    /// Gives up the leases of every session of the conversation opened
    /// here.
    pub async fn release(self) -> Result<(), DurableError> {
        for machine in self.machines.into_values() {
            machine.release().await?;
        }
        Ok(())
    }

    /// Drives the pending turn to its end.
    async fn finish(
        &mut self,
        on_event: &mut impl FnMut(TeamEvent<'_>),
    ) -> Result<TeamReply, DurableError> {
        loop {
            let Some(turn) = self.record.turn.clone() else {
                return Err(RunError::Executor("no team turn in progress".to_owned()).into());
            };
            let name = self.record.state.current().to_owned();
            let cancel = self.cancel.clone();
            let machine = self.open_agent(&name).await?;
            let given = machine.machine().history().len() > turn.start;
            let paused = !machine.is_interrupted() && machine.machine().is_awaiting_approval();
            if paused
                && !machine
                    .machine()
                    .approvals()
                    .held_pending_at(SystemTime::now())
                    .is_empty()
            {
                return Ok(paused_reply(name, turn.handoffs, None));
            }
            let step = if paused {
                tracing::info!(agent = %name, "every paused call is decided: the agent's run goes on");
                let token = machine.cancel_token();
                let run = machine.resume_each_step(|step| {
                    on_event(TeamEvent::Step { agent: &name, step });
                });
                let watch = async {
                    cancel.cancelled().await;
                    token.cancel();
                };
                futures::pin_mut!(run, watch);
                let step = match futures::future::select(run, watch).await {
                    futures::future::Either::Left((step, _)) => step?,
                    futures::future::Either::Right(((), run)) => run.await?,
                };
                Some(step)
            } else if machine.is_interrupted() || !given {
                if !machine.is_interrupted() {
                    match &turn.input {
                        Some(context) => machine.machine().enqueue(context.iter().cloned()),
                        None => machine.machine().enqueue_user(turn.text.clone()),
                    }
                }
                let token = machine.cancel_token();
                let run = machine.run_each_step(|step| {
                    on_event(TeamEvent::Step { agent: &name, step });
                });
                let watch = async {
                    cancel.cancelled().await;
                    token.cancel();
                };
                futures::pin_mut!(run, watch);
                let step = match futures::future::select(run, watch).await {
                    futures::future::Either::Left((step, _)) => step?,
                    futures::future::Either::Right(((), run)) => run.await?,
                };
                Some(step)
            } else {
                tracing::info!(agent = %name, "the agent's run ended before a restart: the turn goes on from what was stored");
                None
            };
            if self.cancel.is_cancelled() {
                self.cancel = CancellationToken::new();
            }
            let machine = self.open_agent(&name).await?;
            if machine.is_interrupted() {
                return Ok(TeamReply {
                    agent: name,
                    answer: None,
                    handoffs: turn.handoffs,
                    step,
                    interrupted: true,
                    awaiting_approval: false,
                });
            }
            if machine.machine().is_awaiting_approval() {
                tracing::info!(agent = %name, "a tool call waits for approval: the turn is paused");
                return Ok(paused_reply(name, turn.handoffs, step));
            }
            if paused && !given {
                // The pause came before this turn's input was given (a
                // pause stored with no turn kept for it): now that its run
                // is over, the turn's input is given as usual.
                tracing::warn!(agent = %name, "a pause older than the turn was resumed first: the turn's input is given now");
                let start = machine.machine().history().len();
                if let Some(pending) = self.record.turn.as_mut() {
                    pending.start = start;
                }
                self.write().await?;
                continue;
            }
            let added = machine
                .machine()
                .history()
                .get(turn.start..)
                .unwrap_or_default()
                .to_vec();
            let allowed = turn.handoffs.len() < MAX_HANDOFFS_PER_TURN;
            let followed = self
                .team
                .follow(&mut self.record.state, &added, allowed)
                .await?;
            match followed {
                Some((handoff, context)) => {
                    let next = self.record.state.current().to_owned();
                    let start = self.open_agent(&next).await?.machine().history().len();
                    let mut handoffs = turn.handoffs;
                    handoffs.push(handoff.clone());
                    self.record.turn = Some(PendingTurn {
                        text: turn.text,
                        handoffs,
                        start,
                        input: Some(context.clone()),
                    });
                    self.write().await?;
                    on_event(TeamEvent::Handoff {
                        handoff: &handoff,
                        context: &context,
                    });
                }
                None => {
                    let answer = match &step {
                        Some(step) => step.output(),
                        None => last_text(&added),
                    };
                    self.record.state.answered(answer.clone());
                    self.record.turn = None;
                    self.write().await?;
                    return Ok(TeamReply {
                        agent: name,
                        answer,
                        handoffs: turn.handoffs,
                        step,
                        interrupted: false,
                        awaiting_approval: false,
                    });
                }
            }
        }
    }

    /// The machine of agent `name`, opened (or created, the first time the
    /// agent has the conversation) and leased here.
    async fn open_agent(&mut self, name: &str) -> Result<&mut DurableMachine<S>, DurableError> {
        if !self.machines.contains_key(name) {
            let agent = self
                .team
                .agent(name)
                .ok_or_else(|| RunError::Executor(format!("no agent {name:?} in the team")))?;
            let id = agent_session(&self.id, name);
            let opened = DurableMachine::open_with(
                Arc::clone(&self.store),
                id.clone(),
                self.holder.clone(),
                agent,
                OpenOptions::default().lease(self.lease),
            )
            .await;
            let mut machine = match opened {
                Ok(machine) => machine,
                Err(DurableError::Store(StoreError::NotFound(_))) => {
                    let mut options = CreateOptions::default().lease(self.lease);
                    if let Some(owner) = &self.owner {
                        options = options.owner(owner.clone());
                    }
                    DurableMachine::create_with(
                        Arc::clone(&self.store),
                        id,
                        self.holder.clone(),
                        agent.machine(),
                        options,
                    )
                    .await?
                }
                Err(error) => return Err(error),
            };
            machine.interrupt_when(self.interrupt.clone());
            self.machines.insert(name.to_owned(), machine);
        }
        self.machines.get_mut(name).ok_or_else(|| {
            DurableError::Run(RunError::Executor(format!("agent {name:?} is not open")))
        })
    }

    /// Writes the team's record, fenced by the lease of the entry agent's
    /// session (renewed first: another agent's run may have outlasted it).
    async fn write(&mut self) -> Result<(), DurableError> {
        let entry = self.team.entry().to_owned();
        self.open_agent(&entry).await?.renew().await?;
        self.store
            .write_team_state(&self.id, &self.holder, &self.record)
            .await?;
        Ok(())
    }
}

/// The reply of a turn paused for approval by agent `agent`'s calls.
fn paused_reply(
    agent: String,
    handoffs: Vec<HandoffRecord>,
    step: Option<MachineStep>,
) -> TeamReply {
    TeamReply {
        agent,
        answer: None,
        handoffs,
        step,
        interrupted: false,
        awaiting_approval: true,
    }
}

/// The entry agent of `team`.
fn entry_agent(team: &Team) -> Result<&markov_executor::Agent, DurableError> {
    team.agent(team.entry()).ok_or_else(|| {
        DurableError::Run(RunError::Executor("the team has no entry agent".to_owned()))
    })
}

/// The text of the last assistant message of `messages` that has one.
fn last_text(messages: &[Message]) -> Option<String> {
    messages
        .iter()
        .rev()
        .filter(|m| m.role == Role::Assistant)
        .map(Message::text)
        .find(|text| !text.is_empty())
}
