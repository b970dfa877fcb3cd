//! [`PostgresStore`]: sessions in PostgreSQL, shared by several worker
//! processes, each session leased by one of them at a time.
//!
//! The tables are SQLite's (`sessions`, `messages`, `ledger`); JSON is kept
//! as `TEXT`, so what is read back is byte for byte what was written. Every
//! method is one transaction; writes lock the session row (`FOR UPDATE`) and
//! check the writer's lease under that lock, and [`Store::claim_interrupted`]
//! picks with `FOR UPDATE SKIP LOCKED`, so two workers never take the same
//! session. A step is one multi-row insert of its messages and one update
//! of the session row, whatever the history's length.
//!
//! A store is a bounded pool of connections (deadpool-postgres,
//! [`PostgresStore::DEFAULT_POOL_SIZE`] unless told otherwise): concurrent
//! calls run each on a connection of its own. A pooled connection is
//! checked (an empty query) before each use, and one that died with its
//! server is dropped and replaced, so after a restart or a failover the
//! same store works again without being rebuilt. Every call waits for its
//! connection at most the store's wait, then fails with
//! [`StoreError::Backend`]; while the server is down a call fails as soon
//! as the connection is refused. A call whose connection breaks inside its
//! transaction is not retried, since its commit may have happened: it
//! returns the error, and the next call gets another connection.

use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Transaction};
use markov_core::Message;
use markov_executor::{FORMAT_VERSION, SerializedMachine};
use markov_policy::{LedgerEntry, RecordedAnswer};
use tokio_postgres::NoTls;

use crate::repair::{self, RawSession, RepairReport};
use crate::{
    ApiKeyRecord, KeyStore, Lease, NewSessionColumns, Owner, Revision, SessionId, SessionInfo,
    StepRecord, StepTrace, Store, StoreError, StoredSession, TeamRecord, WorkerId, from_json,
    message_from_json, ms, now_ms, policy_snapshot, to_json, usage_totals,
};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    charter TEXT NOT NULL,
    tree TEXT NOT NULL,
    approvals TEXT NOT NULL,
    repeats TEXT NOT NULL DEFAULT '[]',
    counters TEXT NOT NULL DEFAULT '{}',
    answers TEXT,
    run_state TEXT,
    steps BIGINT NOT NULL DEFAULT 0,
    messages BIGINT NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    lease_holder TEXT,
    lease_expires BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS ledger (
    session_id TEXT NOT NULL,
    key TEXT NOT NULL,
    seq BIGSERIAL,
    recorded_at BIGINT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session_id, key)
);
CREATE INDEX IF NOT EXISTS sessions_interrupted ON sessions (updated_at)
    WHERE run_state IS NOT NULL;
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS counters TEXT NOT NULL DEFAULT '{}';
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS answers TEXT;
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS owner TEXT;
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS revision BIGINT NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS usage TEXT;
CREATE INDEX IF NOT EXISTS sessions_owner ON sessions (owner, updated_at);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    principal TEXT NOT NULL,
    roles TEXT NOT NULL,
    hash TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);
CREATE TABLE IF NOT EXISTS ended_sign_ins (
    id TEXT PRIMARY KEY,
    expires_at BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS key_generation (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    generation BIGINT NOT NULL
);
INSERT INTO key_generation (id, generation) VALUES (0, 0) ON CONFLICT (id) DO NOTHING;
CREATE INDEX IF NOT EXISTS ended_sign_ins_expiry ON ended_sign_ins (expires_at);
CREATE TABLE IF NOT EXISTS step_traces (
    session_id TEXT NOT NULL,
    idx BIGINT NOT NULL,
    recorded_at BIGINT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session_id, idx)
);
CREATE INDEX IF NOT EXISTS step_traces_age ON step_traces (recorded_at);
CREATE TABLE IF NOT EXISTS step_contents (
    hash TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS team_states (
    session_id TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
";

// The statements every step uses, prepared once per connection through the
// pool's statement cache: a connection opened after a restart prepares
// them again on its first use.
// Locks the row like `SELECT ... FOR UPDATE` and counts the write in the
// session's revision (undone with the transaction when the lease check
// that follows fails).
const LOCK: &str = "UPDATE sessions SET revision = revision + 1 WHERE id = $1
     RETURNING lease_holder, lease_expires, messages";
const INSERT_MESSAGES: &str = "INSERT INTO messages (session_id, seq, body)
     SELECT $1, $2 + t.ord - 1, t.body
     FROM unnest($3::text[]) WITH ORDINALITY AS t(body, ord)";
// A step's messages after those the session has: the count is read in the
// statement, so it can be sent with the lock before the lock's answer is
// back (it runs after the lock, which holds the row).
const APPEND_MESSAGES: &str = "INSERT INTO messages (session_id, seq, body)
     SELECT $1, s.messages + t.ord - 1, t.body
     FROM sessions s, unnest($2::text[]) WITH ORDINALITY AS t(body, ord)
     WHERE s.id = $1";
const UPDATE: &str = "UPDATE sessions SET
        tree = COALESCE($2, tree),
        approvals = COALESCE($3, approvals),
        repeats = COALESCE($4, repeats),
        run_state = $5,
        steps = steps + 1,
        messages = messages + $6,
        updated_at = $7,
        counters = COALESCE($8, counters),
        answers = $9,
        usage = COALESCE($10, usage)
     WHERE id = $1";
// A step's contents (system prompts, tool lists), once each.
const KEEP_CONTENTS: &str = "INSERT INTO step_contents (hash, body)
     SELECT * FROM unnest($1::text[], $2::text[]) ON CONFLICT (hash) DO NOTHING";
// A step's trace under the session's next index (the session row is
// locked, so no other write numbers it meanwhile).
const INSERT_TRACE: &str = "INSERT INTO step_traces (session_id, idx, recorded_at, body)
     SELECT $1, COALESCE(MAX(idx) + 1, 0), $2, $3 FROM step_traces WHERE session_id = $1";
const CLEAR_LEDGER: &str = "DELETE FROM ledger WHERE session_id = $1 AND key NOT LIKE $2";
const WRITE_TEAM: &str = "INSERT INTO team_states (session_id, body) VALUES ($1, $2)
     ON CONFLICT (session_id) DO UPDATE SET body = EXCLUDED.body";
const SET_ANSWERS: &str = "UPDATE sessions SET answers = $2 WHERE id = $1";
const JOURNAL: &str = "INSERT INTO ledger (session_id, key, recorded_at, body) VALUES ($1, $2, $3, $4)
     ON CONFLICT (session_id, key) DO UPDATE SET recorded_at = EXCLUDED.recorded_at, body = EXCLUDED.body";

/// Sessions in PostgreSQL, over a bounded pool of connections that replaces
/// the dead ones.
pub struct PostgresStore {
    pool: Pool,
    wait: Duration,
    /// The step contents committed through this store.
    kept: crate::KeptContents,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("pool_size", &self.pool.status().max_size)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

fn backend(e: tokio_postgres::Error) -> StoreError {
    match e.as_db_error() {
        Some(db) => StoreError::Backend(format!("{}: {}", db.code().code(), db.message())),
        None => StoreError::Backend(e.to_string()),
    }
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl PostgresStore {
    /// How many connections a store made by [`connect`](Self::connect)
    /// opens at most: enough for a worker's concurrent sessions, few enough
    /// that a dozen workers stay under PostgreSQL's default
    /// `max_connections` (100).
    pub const DEFAULT_POOL_SIZE: usize = 8;

    /// How long a call of a store made by [`connect`](Self::connect) waits
    /// for a connection (a free one of the pool, checked, or a new one)
    /// before it fails.
    pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);

    /// Connects to `url` (a `postgres://` URL or `key=value` pairs; no TLS,
    /// for a database on the same host or network) and creates the tables
    /// when missing; the store opens at most
    /// [`DEFAULT_POOL_SIZE`](Self::DEFAULT_POOL_SIZE) connections, and each
    /// call waits at most [`DEFAULT_WAIT`](Self::DEFAULT_WAIT) for one.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, Self::DEFAULT_POOL_SIZE, Self::DEFAULT_WAIT).await
    }

    /// Like [`connect`](Self::connect), with at most `pool_size` connections
    /// (at least one), each call waiting at most `wait` for one before it
    /// fails with a [`StoreError::Backend`] that names the wait.
    pub async fn connect_with(
        url: &str,
        pool_size: usize,
        wait: Duration,
    ) -> Result<Self, StoreError> {
        if pool_size == 0 {
            return Err(StoreError::Backend(
                "a PostgreSQL pool of 0 connections can serve no call".into(),
            ));
        }
        let config: tokio_postgres::Config = url.parse().map_err(backend)?;
        // Verified: a pooled connection answers an empty query before it is
        // handed out, so one its server closed (a restart) is dropped and
        // replaced instead of failing the caller's transaction.
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Verified,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size)
            .build()
            .map_err(|e| StoreError::Backend(format!("the PostgreSQL pool: {e}")))?;
        let store = PostgresStore {
            pool,
            wait,
            kept: crate::KeptContents::default(),
        };
        // One connection now, so that a wrong URL or an absent server is an
        // error of `connect`, not of the first call.
        let client = store.client().await?;
        // Workers starting together must not race on CREATE TABLE.
        client
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock(7270102); {SCHEMA} COMMIT;"
            ))
            .await
            .map_err(backend)?;
        // Prepared now, so that a statement that does not prepare against
        // this schema is an error of `connect`.
        for statement in [LOCK, INSERT_MESSAGES, APPEND_MESSAGES, UPDATE, JOURNAL] {
            client.prepare_cached(statement).await.map_err(backend)?;
        }
        Ok(store)
    }

    /// A connection: a pooled one that answers, or a new one; within the
    /// store's wait.
    async fn client(&self) -> Result<deadpool_postgres::Client, StoreError> {
        // One bound over all of it (waiting for a free slot, checking pooled
        // connections, opening a new one), so that no part of it hangs, not
        // even on a server that accepts connections and never answers.
        match tokio::time::timeout(self.wait, self.pool.get()).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(PoolError::Backend(e))) => Err(backend(e)),
            Ok(Err(e)) => Err(StoreError::Backend(format!(
                "no PostgreSQL connection: {e}"
            ))),
            Err(_) => Err(StoreError::Backend(format!(
                "timed out after {:?} waiting for a PostgreSQL connection (pool of {})",
                self.wait,
                self.pool.status().max_size
            ))),
        }
    }

    /// Locks the session row and checks that `holder` holds its lease.
    /// Returns the session's message count.
    async fn locked(
        &self,
        tx: &Transaction<'_>,
        id: &SessionId,
        holder: &WorkerId,
    ) -> Result<i64, StoreError> {
        let lock = tx.prepare_cached(LOCK).await.map_err(backend)?;
        holds(tx.query_opt(&lock, &[&id.as_str()]).await, id, holder)
    }

    /// Runs `writes` in one transaction after the lock of [`Self::locked`],
    /// all sent at once (tokio-postgres pipelines the statements of futures
    /// polled together), and commits only if `holder` holds the lease: three
    /// round trips (begin, the statements, commit) whatever their number.
    async fn fenced_pipeline(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        writes: &[(&str, &[&(dyn tokio_postgres::types::ToSql + Sync)])],
    ) -> Result<(), StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(backend)?;
        let mut statements = Vec::with_capacity(writes.len() + 1);
        for statement in std::iter::once(LOCK).chain(writes.iter().map(|(sql, _)| *sql)) {
            statements.push(tx.prepare_cached(statement).await.map_err(backend)?);
        }
        let id_text = id.as_str();
        let lock_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&id_text];
        let lock = tx.query_opt(&statements[0], &lock_params);
        let rest = futures::future::join_all(
            writes
                .iter()
                .zip(&statements[1..])
                .map(|((_, params), statement)| tx.execute(statement, params)),
        );
        let (locked, written) = futures::join!(lock, rest);
        // The lease first: a write that failed because another worker
        // changed the session is reported as the lost lease it is.
        holds(locked, id, holder)?;
        for result in written {
            result.map_err(backend)?;
        }
        tx.commit().await.map_err(backend)
    }
}

/// The lock's answer: the session's message count, if `holder` holds its
/// lease.
fn holds(
    row: Result<Option<tokio_postgres::Row>, tokio_postgres::Error>,
    id: &SessionId,
    holder: &WorkerId,
) -> Result<i64, StoreError> {
    let row = row
        .map_err(backend)?
        .ok_or_else(|| StoreError::NotFound(id.clone()))?;
    let lease_holder: Option<String> = row.get(0);
    let expires: i64 = row.get(1);
    let holds = lease_holder.as_deref() == Some(holder.as_str()) && to_u64(expires) > now_ms();
    if !holds {
        return Err(StoreError::LeaseLost {
            session: id.clone(),
            worker: holder.clone(),
        });
    }
    Ok(row.get(2))
}

/// Leases the locked row `id` to `holder`, or says who holds it; when
/// `only_for` is set, a session that is not that owner's is not found and
/// keeps its lease.
async fn lease(
    tx: &tokio_postgres::Transaction<'_>,
    id: &SessionId,
    only_for: Option<&Owner>,
    holder: &WorkerId,
    ttl: Duration,
) -> Result<Lease, StoreError> {
    let now = now_ms();
    let row = tx
        .query_opt(
            "SELECT lease_holder, lease_expires, revision, charter, owner
             FROM sessions WHERE id = $1 FOR UPDATE",
            &[&id.as_str()],
        )
        .await
        .map_err(backend)?
        .ok_or_else(|| StoreError::NotFound(id.clone()))?;
    let owner: Option<&str> = row.get(4);
    if only_for.is_some_and(|only| owner != Some(only.as_str())) {
        return Err(StoreError::NotFound(id.clone()));
    }
    let current: Option<String> = row.get(0);
    let until: i64 = row.get(1);
    let revision = Revision::new(to_u64(row.get(2)));
    if let Some(current) = current
        && current != holder.as_str()
        && to_u64(until) > now
    {
        return Err(StoreError::Leased {
            session: id.clone(),
            holder: WorkerId::new(current),
            expires_at: to_u64(until),
        });
    }
    let expires = now.saturating_add(ms(ttl));
    tx.execute(
        "UPDATE sessions SET lease_holder = $2, lease_expires = $3 WHERE id = $1",
        &[&id.as_str(), &holder.as_str(), &to_i64(expires)],
    )
    .await
    .map_err(backend)?;
    Ok(Lease {
        session: id.clone(),
        holder: holder.clone(),
        expires_at: expires,
        revision,
        charter: row.get(3),
    })
}

fn info_of(row: &tokio_postgres::Row) -> SessionInfo {
    SessionInfo {
        id: SessionId::new(row.get::<_, String>(0)),
        charter: row.get(1),
        owner: row.get::<_, Option<String>>("owner").map(Owner::new),
        steps: to_u64(row.get(2)),
        messages: to_u64(row.get(3)),
        running: row.get::<_, Option<String>>(4).is_some(),
        created_at: to_u64(row.get(5)),
        updated_at: to_u64(row.get(6)),
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn create(
        &self,
        id: &SessionId,
        owner: Option<&Owner>,
        charter: &str,
        snapshot: &SerializedMachine<&[Message]>,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        let NewSessionColumns {
            tree,
            approvals,
            repeats,
            counters,
            answers,
            usage,
            messages,
        } = NewSessionColumns::of(snapshot)?;
        let now = now_ms();
        let expires = now.saturating_add(ms(ttl));
        let revision = Revision::first();
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(backend)?;
        let inserted = tx
            .execute(
                "INSERT INTO sessions (id, charter, tree, approvals, repeats, messages, created_at, updated_at, lease_holder, lease_expires, counters, answers, owner, revision, usage)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8, $9, $10, $11, $12, $13, $14) ON CONFLICT (id) DO NOTHING",
                &[
                    &id.as_str(),
                    &charter,
                    &tree,
                    &approvals,
                    &repeats,
                    &to_i64(messages.len() as u64),
                    &to_i64(now),
                    &holder.as_str(),
                    &to_i64(expires),
                    &counters,
                    &answers,
                    &owner.map(Owner::as_str),
                    &to_i64(revision.get()),
                    &usage,
                ],
            )
            .await
            .map_err(backend)?;
        if inserted == 0 {
            return Err(StoreError::AlreadyExists(id.clone()));
        }
        if !messages.is_empty() {
            let insert = tx.prepare_cached(INSERT_MESSAGES).await.map_err(backend)?;
            tx.execute(&insert, &[&id.as_str(), &0i64, &messages])
                .await
                .map_err(backend)?;
        }
        for entry in &snapshot.policy.ledger {
            let journal = tx.prepare_cached(JOURNAL).await.map_err(backend)?;
            tx.execute(
                &journal,
                &[
                    &id.as_str(),
                    &entry.key,
                    &to_i64(entry.recorded_at),
                    &to_json(entry)?,
                ],
            )
            .await
            .map_err(backend)?;
        }
        tx.commit().await.map_err(backend)?;
        Ok(Lease {
            session: id.clone(),
            holder: holder.clone(),
            expires_at: expires,
            revision,
            charter: charter.to_owned(),
        })
    }

    async fn append(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        step: StepRecord<'_>,
    ) -> Result<(), StoreError> {
        let messages: Vec<String> = step
            .messages
            .iter()
            .map(to_json)
            .collect::<Result<_, _>>()?;
        let tree = step.tree.map(to_json).transpose()?;
        let approvals = step.approvals.map(to_json).transpose()?;
        let repeats = step.repeats.map(to_json).transpose()?;
        let counters = step.counters.map(to_json).transpose()?;
        let turn = step.counters.map(|c| c.turn);
        let answers = (!step.answers.is_empty())
            .then(|| to_json(step.answers))
            .transpose()?;
        let run = step.run.map(to_json).transpose()?;
        let usage = step.usage.map(to_json).transpose()?;
        let mut trace = step.trace.map(crate::encode_trace).transpose()?;
        let offered = self.kept.offer(trace.as_mut());
        let (id_text, count, now) = (id.as_str(), to_i64(messages.len() as u64), to_i64(now_ms()));
        let stale = turn.map(|turn| format!("t{turn}:%"));
        let mut writes: Vec<(&str, &[&(dyn tokio_postgres::types::ToSql + Sync)])> =
            Vec::with_capacity(5);
        let (hashes, contents): (Vec<&str>, Vec<&str>) = trace
            .iter()
            .flat_map(|t| t.blobs.iter())
            .map(|(h, b)| (h.as_str(), b.as_str()))
            .unzip();
        let trace_body = trace.as_ref().map(|t| t.body.as_str());
        let keep: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&hashes, &contents];
        let record: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&id_text, &now, &trace_body];
        if trace.is_some() {
            if !hashes.is_empty() {
                writes.push((KEEP_CONTENTS, &keep));
            }
            writes.push((INSERT_TRACE, &record));
        }
        let insert: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&id_text, &messages];
        if !messages.is_empty() {
            writes.push((APPEND_MESSAGES, &insert));
        }
        let update: [&(dyn tokio_postgres::types::ToSql + Sync); 10] = [
            &id_text, &tree, &approvals, &repeats, &run, &count, &now, &counters, &answers, &usage,
        ];
        writes.push((UPDATE, &update));
        // A new user turn: the earlier turns' answers can never match again
        // (their keys name their turn).
        let clear: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&id_text, &stale];
        if stale.is_some() {
            writes.push((CLEAR_LEDGER, &clear));
        }
        self.fenced_pipeline(id, holder, &writes).await?;
        self.kept.committed(offered);
        Ok(())
    }

    async fn journal(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        entry: &LedgerEntry,
    ) -> Result<(), StoreError> {
        let body = to_json(entry)?;
        let (id_text, at) = (id.as_str(), to_i64(entry.recorded_at));
        let journal: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&id_text, &entry.key, &at, &body];
        self.fenced_pipeline(id, holder, &[(JOURNAL, &journal)])
            .await
    }

    async fn journal_answers(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        answers: &[RecordedAnswer],
    ) -> Result<(), StoreError> {
        let body = (!answers.is_empty())
            .then(|| to_json(answers))
            .transpose()?;
        let id_text = id.as_str();
        let answers: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&id_text, &body];
        self.fenced_pipeline(id, holder, &[(SET_ANSWERS, &answers)])
            .await
    }

    async fn repair(&self, id: &SessionId, holder: &WorkerId) -> Result<RepairReport, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(backend)?;
        self.locked(&tx, id, holder).await?;
        let row = tx
            .query_one(
                "SELECT tree, approvals, repeats, counters, answers, run_state, usage FROM sessions WHERE id = $1",
                &[&id.as_str()],
            )
            .await
            .map_err(backend)?;
        let messages: Vec<String> = tx
            .query(
                "SELECT body FROM messages WHERE session_id = $1 ORDER BY seq",
                &[&id.as_str()],
            )
            .await
            .map_err(backend)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let ledger: Vec<(String, String)> = tx
            .query(
                "SELECT key, body FROM ledger WHERE session_id = $1 ORDER BY seq",
                &[&id.as_str()],
            )
            .await
            .map_err(backend)?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let raw = RawSession {
            tree: row.get(0),
            approvals: row.get(1),
            repeats: row.get(2),
            counters: row.get(3),
            answers: row.get(4),
            run: row.get(5),
            usage: row.get(6),
            messages,
            ledger,
        };
        let plan = repair::plan(id, &raw)?;
        if plan.report.is_clean() {
            return Ok(plan.report);
        }
        let keep = to_i64(plan.keep_messages as u64);
        tx.execute(
            "DELETE FROM messages WHERE session_id = $1 AND seq >= $2",
            &[&id.as_str(), &keep],
        )
        .await
        .map_err(backend)?;
        for key in &plan.drop_ledger {
            tx.execute(
                "DELETE FROM ledger WHERE session_id = $1 AND key = $2",
                &[&id.as_str(), key],
            )
            .await
            .map_err(backend)?;
        }
        tx.execute(
            "UPDATE sessions SET
                messages = $2,
                approvals = CASE WHEN $3 THEN '[]' ELSE approvals END,
                repeats = CASE WHEN $4 THEN '[]' ELSE repeats END,
                counters = CASE WHEN $5 THEN '{}' ELSE counters END,
                answers = CASE WHEN $6 THEN NULL ELSE answers END,
                run_state = CASE WHEN $7 THEN NULL ELSE run_state END,
                updated_at = $8,
                usage = CASE WHEN $9 THEN NULL ELSE usage END
             WHERE id = $1",
            &[
                &id.as_str(),
                &keep,
                &plan.reset_approvals,
                &plan.reset_repeats,
                &plan.reset_counters,
                &plan.clear_answers,
                &plan.clear_run,
                &to_i64(now_ms()),
                &plan.clear_usage,
            ],
        )
        .await
        .map_err(backend)?;
        tx.commit().await.map_err(backend)?;
        tracing::warn!(report = %plan.report, "a corrupt session was repaired");
        Ok(plan.report)
    }

    async fn steps(
        &self,
        id: &SessionId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<StepTrace>, StoreError> {
        let mut client = self.client().await?;
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(backend)?;
        let exists = tx
            .query_opt("SELECT 1 FROM sessions WHERE id = $1", &[&id.as_str()])
            .await
            .map_err(backend)?
            .is_some();
        if !exists {
            return Err(StoreError::NotFound(id.clone()));
        }
        let rows = tx
            .query(
                "SELECT idx, recorded_at, body FROM step_traces
                 WHERE session_id = $1 AND idx >= $2 ORDER BY idx LIMIT $3",
                &[&id.as_str(), &to_i64(from), &to_i64(limit as u64)],
            )
            .await
            .map_err(backend)?;
        let mut values = Vec::with_capacity(rows.len());
        let mut hashes: Vec<String> = Vec::new();
        for row in &rows {
            let mut value: serde_json::Value =
                crate::from_json(id, "a step trace", row.get::<_, &str>(2))?;
            for hash in crate::trace_blob_hashes(&value) {
                if !hashes.contains(&hash) {
                    hashes.push(hash);
                }
            }
            value["index"] = serde_json::json!(to_u64(row.get::<_, i64>(0)));
            value["recorded_at"] = serde_json::json!(to_u64(row.get::<_, i64>(1)));
            values.push(value);
        }
        let blobs: std::collections::HashMap<String, String> = tx
            .query(
                "SELECT hash, body FROM step_contents WHERE hash = ANY($1)",
                &[&hashes],
            )
            .await
            .map_err(backend)?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        values
            .into_iter()
            .map(|value| crate::decode_trace(id, value, &blobs))
            .collect()
    }

    async fn messages(
        &self,
        id: &SessionId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError> {
        let mut client = self.client().await?;
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(backend)?;
        let exists = tx
            .query_opt("SELECT 1 FROM sessions WHERE id = $1", &[&id.as_str()])
            .await
            .map_err(backend)?
            .is_some();
        if !exists {
            return Err(StoreError::NotFound(id.clone()));
        }
        tx.query(
            "SELECT body FROM messages WHERE session_id = $1 AND seq >= $2 ORDER BY seq LIMIT $3",
            &[&id.as_str(), &to_i64(from), &to_i64(limit as u64)],
        )
        .await
        .map_err(backend)?
        .iter()
        .map(|row| crate::message_from_json(id, row.get::<_, &str>(0)))
        .collect()
    }

    async fn prune_steps(&self, retention: &crate::StepRetention) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let mut dropped = 0;
        if let Some(days) = retention.days {
            let cutoff = to_i64(now_ms().saturating_sub(u64::from(days) * 86_400_000));
            dropped += client
                .execute("DELETE FROM step_traces WHERE recorded_at < $1", &[&cutoff])
                .await
                .map_err(backend)?;
        }
        if let Some(n) = retention.sessions {
            dropped += client
                .execute(
                    "DELETE FROM step_traces WHERE session_id NOT IN
                     (SELECT id FROM sessions ORDER BY updated_at DESC, id LIMIT $1)",
                    &[&i64::from(n)],
                )
                .await
                .map_err(backend)?;
        }
        Ok(dropped)
    }

    async fn load(&self, id: &SessionId) -> Result<StoredSession, StoreError> {
        let mut client = self.client().await?;
        // One snapshot of the database for the three reads.
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(backend)?;
        let row = tx
            .query_opt(
                "SELECT id, charter, steps, messages, run_state, created_at, updated_at, tree, approvals, repeats, counters, answers, owner, usage
                 FROM sessions WHERE id = $1",
                &[&id.as_str()],
            )
            .await
            .map_err(backend)?
            .ok_or_else(|| StoreError::NotFound(id.clone()))?;
        let info = info_of(&row);
        let tree: String = row.get(7);
        let approvals: String = row.get(8);
        let repeats: String = row.get(9);
        let counters: String = row.get(10);
        let answers: Option<String> = row.get(11);
        let usage: Option<String> = row.get(13);
        let run: Option<String> = row.get(4);
        let history = tx
            .query(
                "SELECT body FROM messages WHERE session_id = $1 ORDER BY seq",
                &[&id.as_str()],
            )
            .await
            .map_err(backend)?
            .iter()
            .map(|r| message_from_json(id, r.get::<_, &str>(0)))
            .collect::<Result<Vec<_>, _>>()?;
        let ledger = tx
            .query(
                "SELECT body FROM ledger WHERE session_id = $1 ORDER BY seq",
                &[&id.as_str()],
            )
            .await
            .map_err(backend)?
            .iter()
            .map(|r| from_json::<LedgerEntry>(id, "a ledger entry", r.get::<_, &str>(0)))
            .collect::<Result<Vec<_>, _>>()?;
        tx.commit().await.map_err(backend)?;
        Ok(StoredSession {
            info,
            snapshot: SerializedMachine {
                format_version: FORMAT_VERSION,
                instance: from_json(id, "the tree", &tree)?,
                history,
                policy: policy_snapshot(
                    id,
                    &approvals,
                    &repeats,
                    &counters,
                    answers.as_deref(),
                    ledger,
                )?,
                usage: usage_totals(id, usage.as_deref())?,
            },
            run: run
                .map(|text| from_json(id, "the run state", &text))
                .transpose()?,
        })
    }

    async fn list(&self, owner: Option<&Owner>) -> Result<Vec<SessionInfo>, StoreError> {
        let client = self.client().await?;
        let owner = owner.map(Owner::as_str);
        let rows = client
            .query(
                "SELECT id, charter, steps, messages, run_state, created_at, updated_at, owner
                 FROM sessions WHERE $1::text IS NULL OR owner = $1
                 ORDER BY updated_at DESC, id",
                &[&owner],
            )
            .await
            .map_err(backend)?;
        Ok(rows.iter().map(info_of).collect())
    }

    async fn info(&self, id: &SessionId) -> Result<SessionInfo, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT id, charter, steps, messages, run_state, created_at, updated_at, owner
                 FROM sessions WHERE id = $1",
                &[&id.as_str()],
            )
            .await
            .map_err(backend)?;
        row.as_ref()
            .map(info_of)
            .ok_or_else(|| StoreError::NotFound(id.clone()))
    }

    async fn delete(&self, id: &SessionId) -> Result<bool, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(backend)?;
        tx.execute(
            "DELETE FROM messages WHERE session_id = $1",
            &[&id.as_str()],
        )
        .await
        .map_err(backend)?;
        tx.execute("DELETE FROM ledger WHERE session_id = $1", &[&id.as_str()])
            .await
            .map_err(backend)?;
        tx.execute(
            "DELETE FROM step_traces WHERE session_id = $1",
            &[&id.as_str()],
        )
        .await
        .map_err(backend)?;
        tx.execute(
            "DELETE FROM team_states WHERE session_id = $1",
            &[&id.as_str()],
        )
        .await
        .map_err(backend)?;
        let deleted = tx
            .execute("DELETE FROM sessions WHERE id = $1", &[&id.as_str()])
            .await
            .map_err(backend)?;
        tx.commit().await.map_err(backend)?;
        Ok(deleted > 0)
    }

    async fn acquire(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(backend)?;
        let lease = lease(&tx, id, None, holder, ttl).await?;
        tx.commit().await.map_err(backend)?;
        Ok(lease)
    }

    async fn acquire_owned(
        &self,
        id: &SessionId,
        owner: &Owner,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(backend)?;
        let lease = lease(&tx, id, Some(owner), holder, ttl).await?;
        tx.commit().await.map_err(backend)?;
        Ok(lease)
    }

    async fn release(
        &self,
        id: &SessionId,
        holder: &WorkerId,
    ) -> Result<Option<Revision>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "UPDATE sessions SET lease_holder = NULL, lease_expires = 0
                 WHERE id = $1 AND lease_holder = $2 RETURNING revision",
                &[&id.as_str(), &holder.as_str()],
            )
            .await
            .map_err(backend)?;
        Ok(row.map(|r| Revision::new(to_u64(r.get(0)))))
    }

    async fn team_state(&self, id: &SessionId) -> Result<Option<TeamRecord>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT body FROM team_states WHERE session_id = $1",
                &[&id.as_str()],
            )
            .await
            .map_err(backend)?;
        row.map(|row| from_json(id, "the team state", row.get::<_, &str>(0)))
            .transpose()
    }

    async fn write_team_state(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        state: &TeamRecord,
    ) -> Result<(), StoreError> {
        let body = to_json(state)?;
        let id_text = id.as_str();
        let write: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&id_text, &body];
        self.fenced_pipeline(id, holder, &[(WRITE_TEAM, &write)])
            .await
    }

    async fn claim_interrupted(
        &self,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let now = now_ms();
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(backend)?;
        // SKIP LOCKED: a row another worker is claiming right now is passed
        // over, never waited for, never claimed twice.
        let row = tx
            .query_opt(
                "SELECT id FROM sessions
                 WHERE run_state IS NOT NULL AND (lease_holder IS NULL OR lease_expires <= $1)
                 ORDER BY updated_at LIMIT 1 FOR UPDATE SKIP LOCKED",
                &[&to_i64(now)],
            )
            .await
            .map_err(backend)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let id = SessionId::new(row.get::<_, String>(0));
        let lease = lease(&tx, &id, None, holder, ttl).await?;
        tx.commit().await.map_err(backend)?;
        Ok(Some(lease))
    }
}

#[async_trait]
impl KeyStore for PostgresStore {
    async fn add_key(&self, key: &ApiKeyRecord) -> Result<(), StoreError> {
        let roles = to_json(&key.roles)?;
        let client = self.client().await?;
        client
            .execute(
                "INSERT INTO api_keys (id, principal, roles, hash, created_at, revoked_at)
                 VALUES ($1, $2, $3, $4, $5, $6)",
                &[
                    &key.id,
                    &key.principal,
                    &roles,
                    &key.hash,
                    &to_i64(key.created_at),
                    &key.revoked_at.map(to_i64),
                ],
            )
            .await
            .map_err(backend)?;
        Ok(())
    }

    async fn key(&self, id: &str) -> Result<Option<ApiKeyRecord>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_opt(
                "SELECT id, principal, roles, hash, created_at, revoked_at FROM api_keys WHERE id = $1",
                &[&id],
            )
            .await
            .map_err(backend)?;
        row.as_ref().map(key_of).transpose()
    }

    async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
        let client = self.client().await?;
        // One statement, so one transaction: no cache of keys can see the
        // revocation committed and the generation not yet raised.
        let row = client
            .query_one(
                "WITH revoked AS (
                     UPDATE api_keys SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL
                     RETURNING id
                 ), raised AS (
                     UPDATE key_generation SET generation = generation + 1
                     WHERE id = 0 AND EXISTS (SELECT 1 FROM revoked)
                     RETURNING generation
                 )
                 SELECT count(*) FROM revoked",
                &[&id, &to_i64(now_ms())],
            )
            .await
            .map_err(backend)?;
        Ok(row.get::<_, i64>(0) > 0)
    }

    async fn key_generation(&self) -> Result<u64, StoreError> {
        let client = self.client().await?;
        // Asked on every request: prepared once per connection.
        let statement = client
            .prepare_cached("SELECT generation FROM key_generation WHERE id = 0")
            .await
            .map_err(backend)?;
        let row = client.query_one(&statement, &[]).await.map_err(backend)?;
        Ok(to_u64(row.get(0)))
    }

    async fn keys(&self) -> Result<Vec<ApiKeyRecord>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT id, principal, roles, hash, created_at, revoked_at FROM api_keys ORDER BY created_at, id",
                &[],
            )
            .await
            .map_err(backend)?;
        rows.iter().map(key_of).collect()
    }

    async fn end_sign_in(&self, id: &str, expires_at: u64) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(
                "DELETE FROM ended_sign_ins WHERE id IN
                 (SELECT id FROM ended_sign_ins WHERE expires_at < $1 LIMIT $2)",
                &[&to_i64(now_ms() / 1000), &crate::ENDED_SIGN_INS_SWEPT],
            )
            .await
            .map_err(backend)?;
        client
            .execute(
                "INSERT INTO ended_sign_ins (id, expires_at) VALUES ($1, $2)
                 ON CONFLICT (id) DO UPDATE
                 SET expires_at = GREATEST(ended_sign_ins.expires_at, EXCLUDED.expires_at)",
                &[&id, &to_i64(expires_at)],
            )
            .await
            .map_err(backend)?;
        Ok(())
    }

    async fn sign_in_ended(&self, id: &str) -> Result<bool, StoreError> {
        let client = self.client().await?;
        // Asked on every request a browser makes: prepared once per
        // connection.
        let statement = client
            .prepare_cached("SELECT 1 FROM ended_sign_ins WHERE id = $1")
            .await
            .map_err(backend)?;
        let row = client
            .query_opt(&statement, &[&id])
            .await
            .map_err(backend)?;
        Ok(row.is_some())
    }
}

fn key_of(row: &tokio_postgres::Row) -> Result<ApiKeyRecord, StoreError> {
    let id: String = row.get(0);
    let roles: Vec<String> = serde_json::from_str(row.get::<_, &str>(2))
        .map_err(|e| StoreError::Backend(format!("the roles of key {id} do not read back: {e}")))?;
    Ok(ApiKeyRecord {
        principal: row.get(1),
        roles,
        hash: row.get(3),
        created_at: to_u64(row.get(4)),
        revoked_at: row.get::<_, Option<i64>>(5).map(to_u64),
        id,
    })
}
