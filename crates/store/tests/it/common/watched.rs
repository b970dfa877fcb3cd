//! A store that sees every call before the SQLite store under it does:
//! to count the calls, to fail one as a worker that died before it would
//! leave the database, or to hang in one until the process is killed.

use std::sync::Mutex;
use std::time::Duration;

use markov_core::async_trait;
use markov_core::message::Message;
use markov_executor::SerializedMachine;
use markov_policy::{LedgerEntry, RecordedAnswer};
use markov_store::{
    Lease, Owner, RepairReport, Revision, SessionId, SessionInfo, SqliteStore, StepRecord,
    StepRetention, StepTrace, Store, StoreError, StoredSession, TeamRecord, WorkerId,
};

/// A store call as a [`Watched`] store's hook sees it.
pub enum Call<'a> {
    /// A ledger entry written (`journal`).
    Journal(&'a LedgerEntry),
    /// A team state written (`write_team_state`).
    WriteTeamState(&'a TeamRecord),
    /// Any other call, by its method's name.
    Other(&'static str),
}

impl Call<'_> {
    /// The name of the store method called.
    pub fn name(&self) -> &'static str {
        match self {
            Call::Journal(_) => "journal",
            Call::WriteTeamState(_) => "write_team_state",
            Call::Other(name) => name,
        }
    }
}

/// What a [`Watched`] store does with a call once its hook saw it.
pub enum Then {
    /// Passes it on to the SQLite store.
    Pass,
    /// Fails it, writing nothing.
    Fail(StoreError),
    /// Never answers it: the process is killed there.
    Hang,
}

type Hook = Box<dyn Fn(&Call<'_>) -> Then + Send + Sync>;

/// A SQLite store whose hook sees every call first, and which keeps the
/// names of the calls it saw.
pub struct Watched {
    inner: SqliteStore,
    hook: Hook,
    calls: Mutex<Vec<&'static str>>,
}

impl std::fmt::Debug for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("inner", &self.inner)
            .finish()
    }
}

impl Watched {
    /// `inner`, each call first shown to `hook`.
    pub fn new(
        inner: SqliteStore,
        hook: impl Fn(&Call<'_>) -> Then + Send + Sync + 'static,
    ) -> Self {
        Watched {
            inner,
            hook: Box::new(hook),
            calls: Mutex::default(),
        }
    }

    /// The names of the calls since the last time they were taken.
    pub fn take_calls(&self) -> Vec<&'static str> {
        std::mem::take(&mut *self.calls.lock().expect("the calls"))
    }

    async fn before(&self, call: Call<'_>) -> Result<(), StoreError> {
        self.calls.lock().expect("the calls").push(call.name());
        match (self.hook)(&call) {
            Then::Pass => Ok(()),
            Then::Fail(error) => Err(error),
            Then::Hang => std::future::pending().await,
        }
    }
}

#[async_trait]
impl Store for Watched {
    async fn create(
        &self,
        id: &SessionId,
        owner: Option<&Owner>,
        charter: &str,
        snapshot: &SerializedMachine<&[Message]>,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        self.before(Call::Other("create")).await?;
        self.inner
            .create(id, owner, charter, snapshot, holder, ttl)
            .await
    }

    async fn append(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        step: StepRecord<'_>,
    ) -> Result<(), StoreError> {
        self.before(Call::Other("append")).await?;
        self.inner.append(id, holder, step).await
    }

    async fn append_and_release(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        step: StepRecord<'_>,
    ) -> Result<Option<Revision>, StoreError> {
        self.before(Call::Other("append_and_release")).await?;
        self.inner.append_and_release(id, holder, step).await
    }

    async fn journal(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        entry: &LedgerEntry,
    ) -> Result<(), StoreError> {
        self.before(Call::Journal(entry)).await?;
        self.inner.journal(id, holder, entry).await
    }

    async fn journal_answers(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        answers: &[RecordedAnswer],
    ) -> Result<(), StoreError> {
        self.before(Call::Other("journal_answers")).await?;
        self.inner.journal_answers(id, holder, answers).await
    }

    async fn steps(
        &self,
        id: &SessionId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<StepTrace>, StoreError> {
        self.before(Call::Other("steps")).await?;
        self.inner.steps(id, from, limit).await
    }

    async fn messages(
        &self,
        id: &SessionId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError> {
        self.before(Call::Other("messages")).await?;
        self.inner.messages(id, from, limit).await
    }

    async fn team_state(&self, id: &SessionId) -> Result<Option<TeamRecord>, StoreError> {
        self.before(Call::Other("team_state")).await?;
        self.inner.team_state(id).await
    }

    async fn write_team_state(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        state: &TeamRecord,
    ) -> Result<(), StoreError> {
        self.before(Call::WriteTeamState(state)).await?;
        self.inner.write_team_state(id, holder, state).await
    }

    async fn prune_steps(&self, retention: &StepRetention) -> Result<u64, StoreError> {
        self.before(Call::Other("prune_steps")).await?;
        self.inner.prune_steps(retention).await
    }

    async fn load(&self, id: &SessionId) -> Result<StoredSession, StoreError> {
        self.before(Call::Other("load")).await?;
        self.inner.load(id).await
    }

    async fn repair(&self, id: &SessionId, holder: &WorkerId) -> Result<RepairReport, StoreError> {
        self.before(Call::Other("repair")).await?;
        self.inner.repair(id, holder).await
    }

    async fn list(&self, owner: Option<&Owner>) -> Result<Vec<SessionInfo>, StoreError> {
        self.before(Call::Other("list")).await?;
        self.inner.list(owner).await
    }

    async fn info(&self, id: &SessionId) -> Result<SessionInfo, StoreError> {
        self.before(Call::Other("info")).await?;
        self.inner.info(id).await
    }

    async fn delete(&self, id: &SessionId) -> Result<bool, StoreError> {
        self.before(Call::Other("delete")).await?;
        self.inner.delete(id).await
    }

    async fn acquire(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        self.before(Call::Other("acquire")).await?;
        self.inner.acquire(id, holder, ttl).await
    }

    async fn acquire_owned(
        &self,
        id: &SessionId,
        owner: &Owner,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        self.before(Call::Other("acquire_owned")).await?;
        self.inner.acquire_owned(id, owner, holder, ttl).await
    }

    async fn release(
        &self,
        id: &SessionId,
        holder: &WorkerId,
    ) -> Result<Option<Revision>, StoreError> {
        self.before(Call::Other("release")).await?;
        self.inner.release(id, holder).await
    }

    async fn claim_interrupted(
        &self,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        self.before(Call::Other("claim_interrupted")).await?;
        self.inner.claim_interrupted(holder, ttl).await
    }
}
