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
//! One store holds one connection, used by one transaction at a time (a
//! `tokio::sync::Mutex`): open one store per worker task that writes
//! concurrently, or put a pool in front of several.

use std::time::Duration;

use async_trait::async_trait;
use markov_executor::{FORMAT_VERSION, SerializedMachine};
use markov_runtime::registry::{LedgerEntry, PolicySnapshot};
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls, Statement, Transaction};

use crate::{
    Lease, SessionId, SessionInfo, StepRecord, Store, StoreError, StoredSession, WorkerId,
    from_json, message_from_json, ms, now_ms, to_json,
};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    charter TEXT NOT NULL,
    tree TEXT NOT NULL,
    approvals TEXT NOT NULL,
    repeats TEXT NOT NULL DEFAULT '[]',
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
";

/// Statements every step uses, prepared once per connection.
struct Prepared {
    lock: Statement,
    insert_messages: Statement,
    update: Statement,
    journal: Statement,
}

/// Sessions in PostgreSQL.
pub struct PostgresStore {
    client: Mutex<Client>,
    prepared: Prepared,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore").finish_non_exhaustive()
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
    /// Connects to `url` (a `postgres://` URL or `key=value` pairs; no TLS,
    /// for a database on the same host or network) and creates the tables
    /// when missing.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await.map_err(backend)?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::error!(%error, "the PostgreSQL connection ended");
            }
        });
        // Workers starting together must not race on CREATE TABLE.
        client
            .batch_execute(&format!(
                "BEGIN; SELECT pg_advisory_xact_lock(7270102); {SCHEMA} COMMIT;"
            ))
            .await
            .map_err(backend)?;
        let prepared = Prepared {
            lock: client
                .prepare(
                    "SELECT lease_holder, lease_expires, messages FROM sessions WHERE id = $1 FOR UPDATE",
                )
                .await
                .map_err(backend)?,
            insert_messages: client
                .prepare(
                    "INSERT INTO messages (session_id, seq, body)
                     SELECT $1, $2 + t.ord - 1, t.body
                     FROM unnest($3::text[]) WITH ORDINALITY AS t(body, ord)",
                )
                .await
                .map_err(backend)?,
            update: client
                .prepare(
                    "UPDATE sessions SET
                        tree = COALESCE($2, tree),
                        approvals = COALESCE($3, approvals),
                        repeats = COALESCE($4, repeats),
                        run_state = $5,
                        steps = steps + 1,
                        messages = messages + $6,
                        updated_at = $7
                     WHERE id = $1",
                )
                .await
                .map_err(backend)?,
            journal: client
                .prepare(
                    "INSERT INTO ledger (session_id, key, recorded_at, body) VALUES ($1, $2, $3, $4)
                     ON CONFLICT (session_id, key) DO UPDATE SET recorded_at = EXCLUDED.recorded_at, body = EXCLUDED.body",
                )
                .await
                .map_err(backend)?,
        };
        Ok(PostgresStore {
            client: Mutex::new(client),
            prepared,
        })
    }

    /// Locks the session row and checks that `holder` holds its lease.
    /// Returns the session's message count.
    async fn locked(
        &self,
        tx: &Transaction<'_>,
        id: &SessionId,
        holder: &WorkerId,
    ) -> Result<i64, StoreError> {
        let row = tx
            .query_opt(&self.prepared.lock, &[&id.as_str()])
            .await
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
}

/// Leases the locked row `id` to `holder`, or says who holds it.
async fn lease(
    tx: &Transaction<'_>,
    id: &SessionId,
    holder: &WorkerId,
    ttl: Duration,
) -> Result<Lease, StoreError> {
    let now = now_ms();
    let row = tx
        .query_opt(
            "SELECT lease_holder, lease_expires FROM sessions WHERE id = $1 FOR UPDATE",
            &[&id.as_str()],
        )
        .await
        .map_err(backend)?
        .ok_or_else(|| StoreError::NotFound(id.clone()))?;
    let current: Option<String> = row.get(0);
    let until: i64 = row.get(1);
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
    })
}

fn info_of(row: &tokio_postgres::Row) -> SessionInfo {
    SessionInfo {
        id: SessionId::new(row.get::<_, String>(0)),
        charter: row.get(1),
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
        charter: &str,
        snapshot: &SerializedMachine,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        let tree = to_json(&snapshot.instance)?;
        let approvals = to_json(&snapshot.policy.approvals)?;
        let repeats = to_json(&snapshot.policy.repeats)?;
        let messages: Vec<String> = snapshot
            .history
            .iter()
            .map(to_json)
            .collect::<Result<_, _>>()?;
        let now = now_ms();
        let expires = now.saturating_add(ms(ttl));
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.map_err(backend)?;
        let inserted = tx
            .execute(
                "INSERT INTO sessions (id, charter, tree, approvals, repeats, messages, created_at, updated_at, lease_holder, lease_expires)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $7, $8, $9) ON CONFLICT (id) DO NOTHING",
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
                ],
            )
            .await
            .map_err(backend)?;
        if inserted == 0 {
            return Err(StoreError::AlreadyExists(id.clone()));
        }
        if !messages.is_empty() {
            tx.execute(
                &self.prepared.insert_messages,
                &[&id.as_str(), &0i64, &messages],
            )
            .await
            .map_err(backend)?;
        }
        for entry in &snapshot.policy.ledger {
            tx.execute(
                &self.prepared.journal,
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
        let run = step.run.map(to_json).transpose()?;
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.map_err(backend)?;
        let count = self.locked(&tx, id, holder).await?;
        if !messages.is_empty() {
            tx.execute(
                &self.prepared.insert_messages,
                &[&id.as_str(), &count, &messages],
            )
            .await
            .map_err(backend)?;
        }
        tx.execute(
            &self.prepared.update,
            &[
                &id.as_str(),
                &tree,
                &approvals,
                &repeats,
                &run,
                &to_i64(messages.len() as u64),
                &to_i64(now_ms()),
            ],
        )
        .await
        .map_err(backend)?;
        tx.commit().await.map_err(backend)
    }

    async fn journal(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        entry: &LedgerEntry,
    ) -> Result<(), StoreError> {
        let body = to_json(entry)?;
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.map_err(backend)?;
        self.locked(&tx, id, holder).await?;
        tx.execute(
            &self.prepared.journal,
            &[&id.as_str(), &entry.key, &to_i64(entry.recorded_at), &body],
        )
        .await
        .map_err(backend)?;
        tx.commit().await.map_err(backend)
    }

    async fn load(&self, id: &SessionId) -> Result<StoredSession, StoreError> {
        let mut client = self.client.lock().await;
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
                "SELECT id, charter, steps, messages, run_state, created_at, updated_at, tree, approvals, repeats
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
                policy: PolicySnapshot {
                    approvals: from_json(id, "the approvals", &approvals)?,
                    ledger,
                    repeats: from_json(id, "the loop guard's counts", &repeats)?,
                },
            },
            run: run
                .map(|text| from_json(id, "the run state", &text))
                .transpose()?,
        })
    }

    async fn list(&self) -> Result<Vec<SessionInfo>, StoreError> {
        let client = self.client.lock().await;
        let rows = client
            .query(
                "SELECT id, charter, steps, messages, run_state, created_at, updated_at
                 FROM sessions ORDER BY updated_at DESC, id",
                &[],
            )
            .await
            .map_err(backend)?;
        Ok(rows.iter().map(info_of).collect())
    }

    async fn delete(&self, id: &SessionId) -> Result<bool, StoreError> {
        let mut client = self.client.lock().await;
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
        let mut client = self.client.lock().await;
        let tx = client.transaction().await.map_err(backend)?;
        let lease = lease(&tx, id, holder, ttl).await?;
        tx.commit().await.map_err(backend)?;
        Ok(lease)
    }

    async fn release(&self, id: &SessionId, holder: &WorkerId) -> Result<(), StoreError> {
        let client = self.client.lock().await;
        client
            .execute(
                "UPDATE sessions SET lease_holder = NULL, lease_expires = 0 WHERE id = $1 AND lease_holder = $2",
                &[&id.as_str(), &holder.as_str()],
            )
            .await
            .map_err(backend)?;
        Ok(())
    }

    async fn claim_interrupted(
        &self,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let now = now_ms();
        let mut client = self.client.lock().await;
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
        let lease = lease(&tx, &id, holder, ttl).await?;
        tx.commit().await.map_err(backend)?;
        Ok(Some(lease))
    }
}
