//! [`SqliteStore`]: sessions in an embedded SQLite database (compiled in),
//! a file in WAL mode or in memory.
//!
//! Tables: `sessions` (one row: charter, tree, approvals, run state,
//! counters, lease), `messages` (the history, one row per message, keyed by
//! session and position) and `ledger` (answered calls, keyed by session and
//! idempotency key, in the order they were answered). A step is one transaction: its new message rows and one
//! update of the session row — its cost does not depend on the history's
//! length.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use markov_core::Message;
use markov_executor::{FORMAT_VERSION, SerializedMachine};
use markov_policy::{LedgerEntry, RecordedAnswer};
use rusqlite::{Connection, OptionalExtension, params};

mod readers;
mod writer;

use readers::Readers;
use writer::Writer;

use crate::repair::{self, RawSession, RepairReport};
use crate::{
    ApiKeyRecord, KeyStore, Lease, NewSessionColumns, Owner, Revision, SessionId, SessionInfo,
    StepRecord, StepTrace, Store, StoreError, StoredSession, TeamRecord, WorkerId, from_json,
    message_from_json, ms, now_ms, policy_snapshot, to_json, usage_totals,
};

/// How hard a commit waits for the disk.
///
/// The writes that come before a side effect — the model's answer before
/// its tools run, a tool's ledger entry before its result is used — are
/// what keeps a resumed session from repeating a payment, so by default
/// every commit of a session's data is synced ([`Durability::PowerLoss`]).
/// Choosing
/// [`Durability::ProcessCrash`] trades that for speed: the last commits
/// before an OS crash or a power cut can vanish, and with them the record
/// that a tool ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Durability {
    /// `synchronous=NORMAL` in WAL mode: a commit survives the process
    /// being killed, not the machine losing power or crashing. An explicit
    /// choice for speed.
    ProcessCrash,
    /// `synchronous=FULL` in WAL mode: a commit is synced to disk before it
    /// returns, so it survives a power loss. The default. A commit that
    /// changes nothing but leases (taken, renewed, given up) is not synced:
    /// a lease matters only while its holder runs, every holder of a lease
    /// on this file runs on the machine a power loss stops, and the next
    /// synced commit (the log is synced in order) makes it durable too.
    #[default]
    PowerLoss,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    charter TEXT NOT NULL,
    tree TEXT NOT NULL,
    approvals TEXT NOT NULL,
    repeats TEXT NOT NULL DEFAULT '[]',
    counters TEXT NOT NULL DEFAULT '{}',
    answers TEXT,
    usage TEXT,
    run_state TEXT,
    steps INTEGER NOT NULL DEFAULT 0,
    messages INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    lease_holder TEXT,
    lease_expires INTEGER NOT NULL DEFAULT 0,
    revision INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS ledger (
    session_id TEXT NOT NULL,
    key TEXT NOT NULL,
    recorded_at INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (session_id, key)
);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    principal TEXT NOT NULL,
    roles TEXT NOT NULL,
    hash TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);
CREATE TABLE IF NOT EXISTS ended_sign_ins (
    id TEXT PRIMARY KEY,
    expires_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS key_generation (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    generation INTEGER NOT NULL
);
INSERT OR IGNORE INTO key_generation (id, generation) VALUES (0, 0);
CREATE INDEX IF NOT EXISTS ended_sign_ins_expiry ON ended_sign_ins (expires_at);
CREATE TABLE IF NOT EXISTS step_traces (
    session_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    recorded_at INTEGER NOT NULL,
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

/// Sessions in SQLite. Cheap to clone (one shared connection).
///
/// One thread owns the connection: the writes of many sessions that wait
/// together are committed in one transaction (one sync of the disk), each
/// answered only once it is committed, and a write that fails is rolled
/// back alone. Calls beyond a bounded queue wait for room.
#[derive(Clone)]
pub struct SqliteStore {
    writer: Writer,
    /// A file's read connections (none in memory, where the writer's
    /// connection is the only one that sees the database).
    readers: Option<Arc<Readers>>,
    /// The revocations made through this store, raised once each has
    /// committed: the key generation of a database in memory, which no
    /// other store can reach.
    revocations: Arc<std::sync::atomic::AtomicU64>,
    /// The step contents committed through this store.
    kept: crate::KeptContents,
    label: Arc<str>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("database", &self.label)
            .finish()
    }
}

fn backend(e: rusqlite::Error) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl SqliteStore {
    /// Opens (or creates) the database file at `path`, in WAL mode, with
    /// [`Durability::PowerLoss`] (every commit of a session's data synced).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(path, Durability::default())
    }

    /// Opens (or creates) the database file at `path` with `durability`.
    pub fn open_with(path: impl AsRef<Path>, durability: Durability) -> Result<Self, StoreError> {
        let path = path.as_ref();
        let conn = Connection::open(path).map_err(backend)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(backend)?;
        let sync = match durability {
            Durability::ProcessCrash => "NORMAL",
            Durability::PowerLoss => "FULL",
        };
        conn.pragma_update(None, "synchronous", sync)
            .map_err(backend)?;
        // Another process writing the same file waits rather than failing.
        conn.busy_timeout(Duration::from_secs(5)).map_err(backend)?;
        let mut store = Self::with_connection(conn, &path.display().to_string())?;
        store.readers = Some(Arc::new(Readers::new(path.to_path_buf())));
        Ok(store)
    }

    /// A database in memory, gone with the store.
    pub fn in_memory() -> Result<Self, StoreError> {
        let conn = Connection::open_in_memory().map_err(backend)?;
        Self::with_connection(conn, ":memory:")
    }

    fn with_connection(conn: Connection, label: &str) -> Result<Self, StoreError> {
        conn.execute_batch(SCHEMA).map_err(backend)?;
        with_rowids(&conn)?;
        // A database written by an earlier version lacks the newer columns.
        for (column, definition) in [
            ("counters", "TEXT NOT NULL DEFAULT '{}'"),
            ("answers", "TEXT"),
            ("owner", "TEXT"),
            ("revision", "INTEGER NOT NULL DEFAULT 0"),
            // A session stored before usage was kept has none (NULL).
            ("usage", "TEXT"),
        ] {
            let present: bool = conn
                .query_row(
                    "SELECT COUNT(*) FROM pragma_table_info('sessions') WHERE name = ?1",
                    params![column],
                    |r| r.get::<_, i64>(0),
                )
                .map_err(backend)?
                > 0;
            if !present {
                conn.execute_batch(&format!(
                    "ALTER TABLE sessions ADD COLUMN {column} {definition}"
                ))
                .map_err(backend)?;
            }
        }
        conn.execute_batch(
            "CREATE INDEX IF NOT EXISTS sessions_owner ON sessions (owner, updated_at)",
        )
        .map_err(backend)?;
        keep_prepared(&conn)?;
        Ok(SqliteStore {
            writer: Writer::start(conn)?,
            readers: None,
            revocations: Arc::default(),
            kept: crate::KeptContents::default(),
            label: Arc::from(label),
        })
    }

    /// Runs the read `f`: on a read connection of a file, beside the
    /// writer's batches; in memory, on the writer's thread between them.
    async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        match &self.readers {
            Some(readers) => readers.read(f).await,
            None => self.writer.read(f).await,
        }
    }
}

/// The tables whose rows hold a body of any length.
const BODY_TABLES: &[&str] = &["messages", "step_traces", "step_contents", "team_states"];

/// Rebuilds as ordinary (rowid) tables those of [`BODY_TABLES`] an earlier
/// version created `WITHOUT ROWID`, in one transaction, once.
///
/// A `WITHOUT ROWID` table keeps each whole row in its primary key's
/// b-tree, whose cells hold about a thousand bytes on a 4 KB page; a
/// longer row (a step's trace, any message of a few paragraphs) spills
/// into an overflow page of its own. Inserting a 1.2 KB trace cost 9-11 us
/// that way against about 3 us in a rowid table (SQLite in memory, 5 000
/// rows); a 6 KB message 11-17 us against 4 us. Short rows cost the same
/// either way. The rebuild copies the table, so the first open of a large
/// database by this version takes as long as that copy.
fn with_rowids(conn: &Connection) -> Result<(), StoreError> {
    if old_tables(conn)?.is_empty() {
        return Ok(());
    }
    // Looked at again under the write lock: another process opening the
    // same file may have rebuilt them meanwhile.
    conn.execute_batch("BEGIN IMMEDIATE").map_err(backend)?;
    let rebuilt = old_tables(conn).and_then(|old| {
        for table in &old {
            rebuild(conn, table)?;
        }
        // A table dropped took its indexes with it: the schema makes them
        // again (everything else in it exists already).
        conn.execute_batch(SCHEMA).map_err(backend)?;
        conn.execute_batch("COMMIT").map_err(backend)?;
        Ok(old)
    });
    match rebuilt {
        Ok(old) => {
            if !old.is_empty() {
                tracing::info!(tables = %old.join(", "), "rebuilt as rowid tables, once");
            }
            Ok(())
        }
        Err(e) => {
            if !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
            Err(StoreError::Backend(format!(
                "rebuilding the tables an earlier version made WITHOUT ROWID failed, nothing changed: {e}"
            )))
        }
    }
}

/// The tables of [`BODY_TABLES`] that are `WITHOUT ROWID`.
fn old_tables(conn: &Connection) -> Result<Vec<&'static str>, StoreError> {
    let mut old = Vec::new();
    for table in BODY_TABLES {
        let without_rowid: bool = conn
            .query_row(
                "SELECT wr FROM pragma_table_list WHERE schema = 'main' AND name = ?1",
                params![table],
                |r| r.get(0),
            )
            .map_err(backend)?;
        if without_rowid {
            old.push(*table);
        }
    }
    Ok(old)
}

/// Copies `table` into a rowid table of the same columns and keys, which
/// takes its place (inside the caller's transaction; its indexes are the
/// caller's to make again).
fn rebuild(conn: &Connection, table: &str) -> Result<(), StoreError> {
    let create: String = conn
        .query_row(
            "SELECT sql FROM sqlite_schema WHERE type = 'table' AND name = ?1",
            params![table],
            |r| r.get(0),
        )
        .map_err(backend)?;
    // The columns and keys as they were, from the first parenthesis on
    // (the name before it may be quoted or not).
    let columns = create
        .trim_end()
        .strip_suffix("WITHOUT ROWID")
        .and_then(|c| c.find('(').map(|at| c[at..].trim_end()));
    let Some(columns) = columns else {
        return Err(StoreError::Backend(format!(
            "table {table} is WITHOUT ROWID but its definition is not one this store wrote: {create}"
        )));
    };
    conn.execute_batch(&format!(
        "CREATE TABLE {table}_rebuilt {columns};
         INSERT INTO {table}_rebuilt SELECT * FROM {table};
         DROP TABLE {table};
         ALTER TABLE {table}_rebuilt RENAME TO {table};"
    ))
    .map_err(backend)
}

/// Keeps every statement the store runs on `conn` prepared: parsing SQL
/// was a tenth of a busy worker's database time.
///
/// A cache of prepared statements is not enough by itself. SQLite marks a
/// statement to be prepared again when a value bound to it might change
/// its plan — with an `ORDER BY` (a `MAX` is one), an equality on a bound
/// parameter counts — and the cache clears a statement's bindings when it
/// takes it back, which counts as such a change: the session's history
/// and ledger read back and the step trace's insert were prepared again
/// on every use, about three times per message. The query planner
/// stability guarantee makes plans independent of bound values, so a
/// cached statement stays prepared; no plan here gains from the values
/// (no statistics are gathered, and the one `LIKE` is a `NOT LIKE`,
/// which never uses an index).
pub(super) fn keep_prepared(conn: &Connection) -> Result<(), StoreError> {
    conn.set_prepared_statement_cache_capacity(64);
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )
    .map_err(backend)?;
    Ok(())
}

/// A session's history, in order.
const HISTORY: &str = "SELECT body FROM messages WHERE session_id = ?1 ORDER BY seq";

/// A session's ledger, in the order it was answered.
const LEDGER: &str = "SELECT body FROM ledger WHERE session_id = ?1 ORDER BY rowid";

/// A step's trace, under the session's next step index.
const NEXT_TRACE: &str = "INSERT INTO step_traces (session_id, idx, recorded_at, body)
     VALUES (?1, (SELECT COALESCE(MAX(idx) + 1, 0) FROM step_traces WHERE session_id = ?1), ?2, ?3)";

/// Checks that `holder` holds `id`'s unexpired lease, counting the write in
/// the session's [`Revision`].
fn fence(conn: &Connection, id: &SessionId, holder: &WorkerId, now: u64) -> Result<(), StoreError> {
    // The write counts in the session's revision; when the lease check
    // fails, the write's savepoint is rolled back and the count with it.
    // (A plain update: one with `RETURNING` costs SQLite a temporary table
    // of the rows it returns.)
    let changed = conn
        .prepare_cached(
            "UPDATE sessions SET revision = revision + 1
             WHERE id = ?1 AND lease_holder = ?2 AND lease_expires > ?3",
        )
        .map_err(backend)?
        .execute(params![id.as_str(), holder.as_str(), to_i64(now)])
        .map_err(backend)?;
    if changed == 0 {
        return Err(unfenced(conn, id, holder));
    }
    Ok(())
}

/// Why a write fenced by `holder`'s lease on `id` changed no row: there is
/// no such session, or the lease is not (or no longer) `holder`'s.
fn unfenced(conn: &Connection, id: &SessionId, holder: &WorkerId) -> StoreError {
    let exists = conn
        .prepare_cached("SELECT 1 FROM sessions WHERE id = ?1")
        .and_then(|mut s| s.exists(params![id.as_str()]));
    match exists {
        Ok(true) => StoreError::LeaseLost {
            session: id.clone(),
            worker: holder.clone(),
        },
        Ok(false) => StoreError::NotFound(id.clone()),
        Err(e) => backend(e),
    }
}

/// Writes a step's trace: its contents once each, the trace under the
/// session's next step index.
fn write_trace(
    conn: &Connection,
    id: &SessionId,
    trace: &crate::EncodedTrace,
    now: u64,
) -> Result<(), StoreError> {
    {
        let mut keep = conn
            .prepare_cached("INSERT OR IGNORE INTO step_contents (hash, body) VALUES (?1, ?2)")
            .map_err(backend)?;
        for (hash, body) in &trace.blobs {
            keep.execute(params![hash, body]).map_err(backend)?;
        }
    }
    conn.prepare_cached(NEXT_TRACE)
        .map_err(backend)?
        .execute(params![id.as_str(), to_i64(now), trace.body])
        .map_err(backend)?;
    Ok(())
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn info_of(row: &rusqlite::Row<'_>) -> rusqlite::Result<SessionInfo> {
    Ok(SessionInfo {
        id: SessionId::new(row.get::<_, String>(0)?),
        charter: row.get(1)?,
        owner: row.get::<_, Option<String>>("owner")?.map(Owner::new),
        steps: to_u64(row.get(2)?),
        messages: to_u64(row.get(3)?),
        running: row.get::<_, Option<String>>(4)?.is_some(),
        created_at: to_u64(row.get(5)?),
        updated_at: to_u64(row.get(6)?),
    })
}

/// The JSON columns of a session row, as text.
struct RawColumns {
    tree: String,
    approvals: String,
    repeats: String,
    counters: String,
    answers: Option<String>,
    usage: Option<String>,
    run: Option<String>,
}

/// Reads the columns of `SELECT id, charter, steps, messages, run_state,
/// created_at, updated_at, tree, approvals, repeats, counters, answers,
/// owner, usage`.
fn raw_columns(row: &rusqlite::Row<'_>) -> rusqlite::Result<RawColumns> {
    Ok(RawColumns {
        run: row.get(4)?,
        tree: row.get(7)?,
        approvals: row.get(8)?,
        repeats: row.get(9)?,
        counters: row.get(10)?,
        answers: row.get(11)?,
        usage: row.get(13)?,
    })
}

/// Leases session `id` to `holder` for `ttl` (see [`Store::acquire`]); when
/// `only_for` is set, a session that is not that owner's is not found and
/// keeps its lease.
fn lease(
    conn: &Connection,
    id: &SessionId,
    only_for: Option<&Owner>,
    holder: &WorkerId,
    ttl: Duration,
) -> Result<Lease, StoreError> {
    let now = now_ms();
    let expires = now.saturating_add(ms(ttl));
    type Row = (Option<String>, i64, i64, String, Option<String>);
    let row: Option<Row> = conn
        .prepare_cached(
            "SELECT lease_holder, lease_expires, revision, charter, owner
             FROM sessions WHERE id = ?1",
        )
        .map_err(backend)?
        .query_row(params![id.as_str()], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .optional()
        .map_err(backend)?;
    let Some((current, until, revision, charter, owner)) = row else {
        return Err(StoreError::NotFound(id.clone()));
    };
    if only_for.is_some_and(|only| owner.as_deref() != Some(only.as_str())) {
        return Err(StoreError::NotFound(id.clone()));
    }
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
    conn.prepare_cached("UPDATE sessions SET lease_holder = ?2, lease_expires = ?3 WHERE id = ?1")
        .map_err(backend)?
        .execute(params![id.as_str(), holder.as_str(), to_i64(expires)])
        .map_err(backend)?;
    Ok(Lease {
        session: id.clone(),
        holder: holder.clone(),
        expires_at: expires,
        revision: Revision::new(to_u64(revision)),
        charter,
    })
}

/// A step as the database keeps it: its JSON text, made before it reaches
/// the writer thread (the thread only writes).
struct EncodedStep {
    messages: Vec<String>,
    tree: Option<String>,
    approvals: Option<String>,
    repeats: Option<String>,
    counters: Option<String>,
    turn: Option<u64>,
    answers: Option<String>,
    run: Option<String>,
    usage: Option<String>,
    trace: Option<crate::EncodedTrace>,
}

impl EncodedStep {
    fn of(step: &StepRecord<'_>) -> Result<Self, StoreError> {
        Ok(EncodedStep {
            messages: step
                .messages
                .iter()
                .map(to_json)
                .collect::<Result<_, _>>()?,
            tree: step.tree.map(to_json).transpose()?,
            approvals: step.approvals.map(to_json).transpose()?,
            repeats: step.repeats.map(to_json).transpose()?,
            counters: step.counters.map(to_json).transpose()?,
            turn: step.counters.map(|c| c.turn),
            answers: (!step.answers.is_empty())
                .then(|| to_json(step.answers))
                .transpose()?,
            run: step.run.map(to_json).transpose()?,
            usage: step.usage.map(to_json).transpose()?,
            trace: step.trace.map(crate::encode_trace).transpose()?,
        })
    }

    /// Appends the step to session `id`, fenced by `holder`'s lease, and
    /// gives the lease up with it when `release` is set; the session's
    /// revision after the write.
    fn write(
        &self,
        conn: &Connection,
        id: &SessionId,
        holder: &WorkerId,
        release: bool,
    ) -> Result<Revision, StoreError> {
        let EncodedStep {
            messages,
            tree,
            approvals,
            repeats,
            counters,
            turn,
            answers,
            run,
            usage,
            trace,
        } = self;

        let now = now_ms();
        // The session row is rewritten once per step: the step's columns,
        // the write counted in the revision, the lease checked (the
        // savepoint is rolled back when it is not `holder`'s) and given up
        // when asked.
        let changed = conn
            .prepare_cached(
                "UPDATE sessions SET
                    tree = COALESCE(?2, tree),
                    approvals = COALESCE(?3, approvals),
                    run_state = ?4,
                    steps = steps + 1,
                    messages = messages + ?5,
                    updated_at = ?6,
                    repeats = COALESCE(?7, repeats),
                    counters = COALESCE(?8, counters),
                    answers = ?9,
                    usage = COALESCE(?10, usage),
                    revision = revision + 1,
                    lease_holder = CASE WHEN ?13 THEN NULL ELSE lease_holder END,
                    lease_expires = CASE WHEN ?13 THEN 0 ELSE lease_expires END
                 WHERE id = ?1 AND lease_holder = ?11 AND lease_expires > ?12",
            )
            .map_err(backend)?
            .execute(params![
                id.as_str(),
                tree,
                approvals,
                run,
                to_i64(messages.len() as u64),
                to_i64(now),
                repeats,
                counters,
                answers,
                usage,
                holder.as_str(),
                to_i64(now),
                release
            ])
            .map_err(backend)?;
        if changed == 0 {
            return Err(unfenced(conn, id, holder));
        }
        if let Some(trace) = trace {
            write_trace(conn, id, trace, now)?;
        }
        let (count, revision): (i64, i64) = conn
            .prepare_cached("SELECT messages, revision FROM sessions WHERE id = ?1")
            .map_err(backend)?
            .query_row(params![id.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(backend)?;
        {
            // The messages go after those the session had before the step.
            let first = count - to_i64(messages.len() as u64);
            let mut insert = conn
                .prepare_cached("INSERT INTO messages (session_id, seq, body) VALUES (?1, ?2, ?3)")
                .map_err(backend)?;
            for (i, body) in messages.iter().enumerate() {
                insert
                    .execute(params![id.as_str(), first + to_i64(i as u64), body])
                    .map_err(backend)?;
            }
        }
        if let Some(turn) = turn {
            // A new user turn: the earlier turns' answers can never
            // match again (their keys name their turn).
            conn.prepare_cached("DELETE FROM ledger WHERE session_id = ?1 AND key NOT LIKE ?2")
                .map_err(backend)?
                .execute(params![id.as_str(), format!("t{turn}:%")])
                .map_err(backend)?;
        }
        Ok(Revision::new(to_u64(revision)))
    }
}

/// Gives up `holder`'s lease on `id`, returning the session's revision, or
/// `None` (and nothing changes) if `holder` does not hold it.
fn give_up(
    conn: &Connection,
    id: &SessionId,
    holder: &WorkerId,
) -> Result<Option<Revision>, StoreError> {
    let changed = conn
        .prepare_cached(
            "UPDATE sessions SET lease_holder = NULL, lease_expires = 0
             WHERE id = ?1 AND lease_holder = ?2",
        )
        .map_err(backend)?
        .execute(params![id.as_str(), holder.as_str()])
        .map_err(backend)?;
    if changed == 0 {
        return Ok(None);
    }
    let revision: i64 = conn
        .prepare_cached("SELECT revision FROM sessions WHERE id = ?1")
        .map_err(backend)?
        .query_row(params![id.as_str()], |r| r.get(0))
        .map_err(backend)?;
    Ok(Some(Revision::new(to_u64(revision))))
}

impl SqliteStore {
    /// `step` as the writer thread writes it, with its trace's contents
    /// known kept left out; the hashes of those it offers, to remember once
    /// the write has committed.
    fn encode(&self, step: &StepRecord<'_>) -> Result<(EncodedStep, Vec<String>), StoreError> {
        let mut step = EncodedStep::of(step)?;
        let offered = self.kept.offer(step.trace.as_mut());
        Ok((step, offered))
    }
}

#[async_trait]
impl Store for SqliteStore {
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
        let ledger: Vec<(String, u64, String)> = snapshot
            .policy
            .ledger
            .iter()
            .map(|e| Ok((e.key.clone(), e.recorded_at, to_json(e)?)))
            .collect::<Result<_, StoreError>>()?;
        let (id, charter, holder) = (id.clone(), charter.to_owned(), holder.clone());
        let owner = owner.map(|o| o.as_str().to_owned());
        let revision = Revision::first();
        self.writer.write(move |conn| {
            let now = now_ms();
            let expires = now.saturating_add(ms(ttl));
            let inserted = conn
                .execute(
                    "INSERT OR IGNORE INTO sessions (id, charter, tree, approvals, messages, created_at, updated_at, lease_holder, lease_expires, repeats, counters, answers, owner, revision, usage)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
                    params![
                        id.as_str(),
                        charter,
                        tree,
                        approvals,
                        to_i64(messages.len() as u64),
                        to_i64(now),
                        holder.as_str(),
                        to_i64(expires),
                        repeats,
                        counters,
                        answers,
                        owner,
                        to_i64(revision.get()),
                        usage
                    ],
                )
                .map_err(backend)?;
            if inserted == 0 {
                return Err(StoreError::AlreadyExists(id));
            }
            {
                let mut insert = conn
                    .prepare_cached("INSERT INTO messages (session_id, seq, body) VALUES (?1, ?2, ?3)")
                    .map_err(backend)?;
                for (seq, body) in messages.iter().enumerate() {
                    insert
                        .execute(params![id.as_str(), to_i64(seq as u64), body])
                        .map_err(backend)?;
                }
                let mut insert = conn
                    .prepare_cached(
                        "INSERT OR REPLACE INTO ledger (session_id, key, recorded_at, body) VALUES (?1, ?2, ?3, ?4)",
                    )
                    .map_err(backend)?;
                for (key, at, body) in &ledger {
                    insert
                        .execute(params![id.as_str(), key, to_i64(*at), body])
                        .map_err(backend)?;
                }
            }
            Ok(Lease {
                session: id,
                holder,
                expires_at: expires,
                revision,
                charter,
            })
        })
        .await
    }

    async fn append(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        step: StepRecord<'_>,
    ) -> Result<(), StoreError> {
        let (step, offered) = self.encode(&step)?;
        let (id, holder) = (id.clone(), holder.clone());
        self.writer
            .write(move |conn| step.write(conn, &id, &holder, false).map(drop))
            .await?;
        self.kept.committed(offered);
        Ok(())
    }

    async fn append_and_release(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        step: StepRecord<'_>,
    ) -> Result<Option<Revision>, StoreError> {
        let (step, offered) = self.encode(&step)?;
        let (id, holder) = (id.clone(), holder.clone());
        // One job for the writer thread, in one savepoint, one update of
        // the session row: the step and the lease given up are committed
        // together or not at all.
        let revision = self
            .writer
            .write(move |conn| step.write(conn, &id, &holder, true).map(Some))
            .await?;
        self.kept.committed(offered);
        Ok(revision)
    }

    async fn journal(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        entry: &LedgerEntry,
    ) -> Result<(), StoreError> {
        let body = to_json(entry)?;
        let (id, holder, key, at) = (
            id.clone(),
            holder.clone(),
            entry.key.clone(),
            entry.recorded_at,
        );
        self.writer.write(move |conn| {
            fence(conn, &id, &holder, now_ms())?;
            conn.prepare_cached(
                "INSERT OR REPLACE INTO ledger (session_id, key, recorded_at, body) VALUES (?1, ?2, ?3, ?4)",
            )
            .map_err(backend)?
            .execute(params![id.as_str(), key, to_i64(at), body])
            .map_err(backend)?;
            Ok(())
        })
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
        let (id, holder) = (id.clone(), holder.clone());
        self.writer
            .write(move |conn| {
                fence(conn, &id, &holder, now_ms())?;
                conn.prepare_cached("UPDATE sessions SET answers = ?2 WHERE id = ?1")
                    .map_err(backend)?
                    .execute(params![id.as_str(), body])
                    .map_err(backend)?;
                Ok(())
            })
            .await
    }

    async fn steps(
        &self,
        id: &SessionId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<StepTrace>, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            let tx = conn.transaction().map_err(backend)?;
            let exists = tx
                .prepare_cached("SELECT 1 FROM sessions WHERE id = ?1")
                .map_err(backend)?
                .exists(params![id.as_str()])
                .map_err(backend)?;
            if !exists {
                return Err(StoreError::NotFound(id));
            }
            let rows: Vec<(i64, i64, String)> = tx
                .prepare_cached(
                    "SELECT idx, recorded_at, body FROM step_traces
                     WHERE session_id = ?1 AND idx >= ?2 ORDER BY idx LIMIT ?3",
                )
                .map_err(backend)?
                .query_map(
                    params![id.as_str(), to_i64(from), to_i64(limit as u64)],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )
                .map_err(backend)?
                .collect::<Result<_, _>>()
                .map_err(backend)?;
            let mut blobs = std::collections::HashMap::new();
            let mut traces = Vec::with_capacity(rows.len());
            for (idx, at, body) in rows {
                let mut value: serde_json::Value = from_json(&id, "a step trace", &body)?;
                for hash in crate::trace_blob_hashes(&value) {
                    if blobs.contains_key(&hash) {
                        continue;
                    }
                    let text: Option<String> = tx
                        .prepare_cached("SELECT body FROM step_contents WHERE hash = ?1")
                        .map_err(backend)?
                        .query_row(params![hash], |r| r.get(0))
                        .optional()
                        .map_err(backend)?;
                    if let Some(text) = text {
                        blobs.insert(hash, text);
                    }
                }
                value["index"] = serde_json::json!(to_u64(idx));
                value["recorded_at"] = serde_json::json!(to_u64(at));
                traces.push(crate::decode_trace(&id, value, &blobs)?);
            }
            Ok(traces)
        })
        .await
    }

    async fn messages(
        &self,
        id: &SessionId,
        from: u64,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            let tx = conn.transaction().map_err(backend)?;
            let exists = tx
                .prepare_cached("SELECT 1 FROM sessions WHERE id = ?1")
                .map_err(backend)?
                .exists(params![id.as_str()])
                .map_err(backend)?;
            if !exists {
                return Err(StoreError::NotFound(id));
            }
            let mut rows = tx
                .prepare_cached(
                    "SELECT body FROM messages WHERE session_id = ?1 AND seq >= ?2 ORDER BY seq LIMIT ?3",
                )
                .map_err(backend)?;
            let bodies = rows
                .query_map(
                    params![id.as_str(), to_i64(from), to_i64(limit as u64)],
                    |r| r.get::<_, String>(0),
                )
                .map_err(backend)?;
            let mut messages = Vec::new();
            for body in bodies {
                messages.push(message_from_json(&id, &body.map_err(backend)?)?);
            }
            Ok(messages)
        })
        .await
    }

    async fn prune_steps(&self, retention: &crate::StepRetention) -> Result<u64, StoreError> {
        let cutoff = retention
            .days
            .map(|days| to_i64(now_ms().saturating_sub(u64::from(days) * 86_400_000)));
        let sessions = retention.sessions.map(i64::from);
        self.writer
            .write(move |conn| {
                let mut dropped = 0;
                if let Some(cutoff) = cutoff {
                    dropped += conn
                        .execute(
                            "DELETE FROM step_traces WHERE recorded_at < ?1",
                            params![cutoff],
                        )
                        .map_err(backend)?;
                }
                if let Some(n) = sessions {
                    dropped += conn
                        .execute(
                            "DELETE FROM step_traces WHERE session_id NOT IN
                             (SELECT id FROM sessions ORDER BY updated_at DESC, id LIMIT ?1)",
                            params![n],
                        )
                        .map_err(backend)?;
                }
                Ok(dropped as u64)
            })
            .await
    }

    async fn load(&self, id: &SessionId) -> Result<StoredSession, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            let tx = conn.transaction().map_err(backend)?;
            let row: Option<(SessionInfo, RawColumns)> = tx
                .prepare_cached(
                    "SELECT id, charter, steps, messages, run_state, created_at, updated_at, tree, approvals, repeats, counters, answers, owner, usage
                     FROM sessions WHERE id = ?1",
                )
                .map_err(backend)?
                .query_row(params![id.as_str()], |r| Ok((info_of(r)?, raw_columns(r)?)))
                .optional()
                .map_err(backend)?;
            let Some((info, columns)) = row else {
                return Err(StoreError::NotFound(id));
            };
            let RawColumns { tree, approvals, repeats, counters, answers, usage, run } = columns;
            let mut history: Vec<Message> = Vec::with_capacity(usize::try_from(info.messages).unwrap_or(0));
            {
                let mut rows = tx
                    .prepare_cached(HISTORY)
                    .map_err(backend)?;
                let bodies = rows
                    .query_map(params![id.as_str()], |r| r.get::<_, String>(0))
                    .map_err(backend)?;
                for body in bodies {
                    history.push(message_from_json(&id, &body.map_err(backend)?)?);
                }
            }
            let mut ledger: Vec<LedgerEntry> = Vec::new();
            {
                let mut rows = tx
                    .prepare_cached(LEDGER)
                    .map_err(backend)?;
                let bodies = rows
                    .query_map(params![id.as_str()], |r| r.get::<_, String>(0))
                    .map_err(backend)?;
                for body in bodies {
                    ledger.push(from_json(&id, "a ledger entry", &body.map_err(backend)?)?);
                }
            }
            let snapshot = SerializedMachine {
                format_version: FORMAT_VERSION,
                instance: from_json(&id, "the tree", &tree)?,
                history,
                policy: policy_snapshot(&id, &approvals, &repeats, &counters, answers.as_deref(), ledger)?,
                usage: usage_totals(&id, usage.as_deref())?,
            };
            let run = run
                .map(|text| from_json(&id, "the run state", &text))
                .transpose()?;
            Ok(StoredSession {
                info,
                snapshot,
                run,
            })
        })
        .await
    }

    async fn repair(&self, id: &SessionId, holder: &WorkerId) -> Result<RepairReport, StoreError> {
        let (id, holder) = (id.clone(), holder.clone());
        self.writer.write(move |conn| {
            fence(conn, &id, &holder, now_ms())?;
            let columns = conn
                .query_row(
                    "SELECT id, charter, steps, messages, run_state, created_at, updated_at, tree, approvals, repeats, counters, answers, owner, usage
                     FROM sessions WHERE id = ?1",
                    params![id.as_str()],
                    raw_columns,
                )
                .map_err(backend)?;
            let messages: Vec<String> = {
                let mut rows = conn
                    .prepare_cached(HISTORY)
                    .map_err(backend)?;
                let bodies = rows
                    .query_map(params![id.as_str()], |r| r.get::<_, String>(0))
                    .map_err(backend)?;
                bodies.collect::<Result<_, _>>().map_err(backend)?
            };
            let ledger: Vec<(String, String)> = {
                let mut rows = conn
                    .prepare_cached("SELECT key, body FROM ledger WHERE session_id = ?1 ORDER BY rowid")
                    .map_err(backend)?;
                let entries = rows
                    .query_map(params![id.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))
                    .map_err(backend)?;
                entries.collect::<Result<_, _>>().map_err(backend)?
            };
            let RawColumns { tree, approvals, repeats, counters, answers, usage, run } = columns;
            let raw = RawSession { tree, approvals, repeats, counters, answers, usage, run, messages, ledger };
            let plan = repair::plan(&id, &raw)?;
            if plan.report.is_clean() {
                return Ok(plan.report);
            }
            conn.execute(
                "DELETE FROM messages WHERE session_id = ?1 AND seq >= ?2",
                params![id.as_str(), to_i64(plan.keep_messages as u64)],
            )
            .map_err(backend)?;
            for key in &plan.drop_ledger {
                conn.execute(
                    "DELETE FROM ledger WHERE session_id = ?1 AND key = ?2",
                    params![id.as_str(), key],
                )
                .map_err(backend)?;
            }
            conn.execute(
                "UPDATE sessions SET
                    messages = ?2,
                    approvals = CASE WHEN ?3 THEN '[]' ELSE approvals END,
                    repeats = CASE WHEN ?4 THEN '[]' ELSE repeats END,
                    counters = CASE WHEN ?5 THEN '{}' ELSE counters END,
                    answers = CASE WHEN ?6 THEN NULL ELSE answers END,
                    run_state = CASE WHEN ?7 THEN NULL ELSE run_state END,
                    updated_at = ?8,
                    usage = CASE WHEN ?9 THEN NULL ELSE usage END
                 WHERE id = ?1",
                params![
                    id.as_str(),
                    to_i64(plan.keep_messages as u64),
                    plan.reset_approvals,
                    plan.reset_repeats,
                    plan.reset_counters,
                    plan.clear_answers,
                    plan.clear_run,
                    to_i64(now_ms()),
                    plan.clear_usage
                ],
            )
            .map_err(backend)?;
            Ok(plan.report)
        })
        .await
        .inspect(|report| {
            if !report.is_clean() {
                tracing::warn!(%report, "a corrupt session was repaired");
            }
        })
    }

    async fn list(&self, owner: Option<&Owner>) -> Result<Vec<SessionInfo>, StoreError> {
        let owner = owner.map(|o| o.as_str().to_owned());
        self.read(move |conn| {
            let mut rows = conn
                .prepare_cached(
                    "SELECT id, charter, steps, messages, run_state, created_at, updated_at, owner
                     FROM sessions WHERE ?1 IS NULL OR owner = ?1
                     ORDER BY updated_at DESC, id",
                )
                .map_err(backend)?;
            let infos = rows.query_map(params![owner], info_of).map_err(backend)?;
            infos.map(|i| i.map_err(backend)).collect()
        })
        .await
    }

    async fn info(&self, id: &SessionId) -> Result<SessionInfo, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            conn.prepare_cached(
                "SELECT id, charter, steps, messages, run_state, created_at, updated_at, owner
                 FROM sessions WHERE id = ?1",
            )
            .map_err(backend)?
            .query_row(params![id.as_str()], info_of)
            .optional()
            .map_err(backend)?
            .ok_or(StoreError::NotFound(id))
        })
        .await
    }

    async fn delete(&self, id: &SessionId) -> Result<bool, StoreError> {
        let id = id.clone();
        self.writer
            .write(move |conn| {
                conn.execute(
                    "DELETE FROM messages WHERE session_id = ?1",
                    params![id.as_str()],
                )
                .map_err(backend)?;
                conn.execute(
                    "DELETE FROM ledger WHERE session_id = ?1",
                    params![id.as_str()],
                )
                .map_err(backend)?;
                conn.execute(
                    "DELETE FROM step_traces WHERE session_id = ?1",
                    params![id.as_str()],
                )
                .map_err(backend)?;
                conn.execute(
                    "DELETE FROM team_states WHERE session_id = ?1",
                    params![id.as_str()],
                )
                .map_err(backend)?;
                let deleted = conn
                    .execute("DELETE FROM sessions WHERE id = ?1", params![id.as_str()])
                    .map_err(backend)?;
                Ok(deleted > 0)
            })
            .await
    }

    async fn acquire(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        let (id, holder) = (id.clone(), holder.clone());
        self.writer
            .write_lease(move |conn| lease(conn, &id, None, &holder, ttl))
            .await
    }

    async fn acquire_owned(
        &self,
        id: &SessionId,
        owner: &Owner,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, StoreError> {
        let (id, owner, holder) = (id.clone(), owner.clone(), holder.clone());
        self.writer
            .write_lease(move |conn| lease(conn, &id, Some(&owner), &holder, ttl))
            .await
    }

    async fn release(
        &self,
        id: &SessionId,
        holder: &WorkerId,
    ) -> Result<Option<Revision>, StoreError> {
        let (id, holder) = (id.clone(), holder.clone());
        self.writer
            .write_lease(move |conn| give_up(conn, &id, &holder))
            .await
    }

    async fn team_state(&self, id: &SessionId) -> Result<Option<TeamRecord>, StoreError> {
        let id = id.clone();
        self.read(move |conn| {
            let body: Option<String> = conn
                .prepare_cached("SELECT body FROM team_states WHERE session_id = ?1")
                .map_err(backend)?
                .query_row(params![id.as_str()], |r| r.get(0))
                .optional()
                .map_err(backend)?;
            body.map(|text| from_json(&id, "the team state", &text))
                .transpose()
        })
        .await
    }

    async fn write_team_state(
        &self,
        id: &SessionId,
        holder: &WorkerId,
        state: &TeamRecord,
    ) -> Result<(), StoreError> {
        let body = to_json(state)?;
        let (id, holder) = (id.clone(), holder.clone());
        self.writer
            .write(move |conn| {
                fence(conn, &id, &holder, now_ms())?;
                conn.prepare_cached(
                    "INSERT OR REPLACE INTO team_states (session_id, body) VALUES (?1, ?2)",
                )
                .map_err(backend)?
                .execute(params![id.as_str(), body])
                .map_err(backend)?;
                Ok(())
            })
            .await
    }

    async fn claim_interrupted(
        &self,
        holder: &WorkerId,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let holder = holder.clone();
        self.writer
            .write_lease(move |conn| {
                let now = now_ms();
                let id: Option<String> = conn
                    .prepare_cached(
                        "SELECT id FROM sessions
                     WHERE run_state IS NOT NULL AND (lease_holder IS NULL OR lease_expires <= ?1)
                     ORDER BY updated_at LIMIT 1",
                    )
                    .map_err(backend)?
                    .query_row(params![to_i64(now)], |r| r.get(0))
                    .optional()
                    .map_err(backend)?;
                let Some(id) = id else { return Ok(None) };
                let lease = lease(conn, &SessionId::new(id), None, &holder, ttl)?;
                Ok(Some(lease))
            })
            .await
    }
}

#[async_trait]
impl KeyStore for SqliteStore {
    async fn add_key(&self, key: &ApiKeyRecord) -> Result<(), StoreError> {
        let key = key.clone();
        let roles = to_json(&key.roles)?;
        self.writer
            .write(move |conn| {
                conn.execute(
                    "INSERT INTO api_keys (id, principal, roles, hash, created_at, revoked_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    params![
                        key.id,
                        key.principal,
                        roles,
                        key.hash,
                        to_i64(key.created_at),
                        key.revoked_at.map(to_i64)
                    ],
                )
                .map_err(backend)?;
                Ok(())
            })
            .await
    }

    async fn key(&self, id: &str) -> Result<Option<ApiKeyRecord>, StoreError> {
        let id = id.to_owned();
        self.read(move |conn| {
            let row = conn
                .prepare_cached(
                    "SELECT id, principal, roles, hash, created_at, revoked_at FROM api_keys WHERE id = ?1",
                )
                .map_err(backend)?
                .query_row(params![id], key_of)
                .optional()
                .map_err(backend)?;
            row.map(key_from_row).transpose()
        })
        .await
    }

    async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        let revoked = self
            .writer
            .write(move |conn| {
                let changed = conn
                    .execute(
                        "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
                        params![id, to_i64(now_ms())],
                    )
                    .map_err(backend)?;
                // In the revocation's own savepoint: no cache of keys can
                // see the revocation committed and the generation not yet
                // raised.
                if changed > 0 {
                    conn.execute(
                        "UPDATE key_generation SET generation = generation + 1 WHERE id = 0",
                        [],
                    )
                    .map_err(backend)?;
                }
                Ok(changed > 0)
            })
            .await?;
        if revoked {
            // After the commit: a key read again under the new value is
            // read revoked.
            self.revocations
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
        Ok(revoked)
    }

    async fn key_generation(&self) -> Result<u64, StoreError> {
        fn generation(conn: &Connection) -> Result<i64, rusqlite::Error> {
            conn.prepare_cached("SELECT generation FROM key_generation WHERE id = 0")?
                .query_row([], |r| r.get(0))
        }
        // Asked on every request. A database in memory is this store's
        // alone: its revocations are counted here, with no read at all.
        let Some(readers) = &self.readers else {
            return Ok(self.revocations.load(std::sync::atomic::Ordering::Acquire));
        };
        // A file may be shared with other processes: a read of one row in
        // the page cache, done where it is asked when a read connection is
        // idle.
        if let Some(read) = readers.try_now(generation) {
            return read.map(to_u64);
        }
        self.read(|conn| generation(conn).map(to_u64).map_err(backend))
            .await
    }

    async fn keys(&self) -> Result<Vec<ApiKeyRecord>, StoreError> {
        self.read(|conn| {
            let mut rows = conn
                .prepare_cached(
                    "SELECT id, principal, roles, hash, created_at, revoked_at FROM api_keys ORDER BY created_at, id",
                )
                .map_err(backend)?;
            let keys = rows.query_map([], key_of).map_err(backend)?;
            keys.map(|k| key_from_row(k.map_err(backend)?)).collect()
        })
        .await
    }

    async fn end_sign_in(&self, id: &str, expires_at: u64) -> Result<(), StoreError> {
        let id = id.to_owned();
        self.writer
            .write(move |conn| {
                conn.prepare_cached(
                    "DELETE FROM ended_sign_ins WHERE id IN
                     (SELECT id FROM ended_sign_ins WHERE expires_at < ?1 LIMIT ?2)",
                )
                .map_err(backend)?
                .execute(params![
                    to_i64(now_ms() / 1000),
                    crate::ENDED_SIGN_INS_SWEPT
                ])
                .map_err(backend)?;
                conn.prepare_cached(
                    "INSERT INTO ended_sign_ins (id, expires_at) VALUES (?1, ?2)
                     ON CONFLICT (id) DO UPDATE
                     SET expires_at = max(expires_at, excluded.expires_at)",
                )
                .map_err(backend)?
                .execute(params![id, to_i64(expires_at)])
                .map_err(backend)?;
                Ok(())
            })
            .await
    }

    async fn sign_in_ended(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.read(move |conn| {
            conn.prepare_cached("SELECT 1 FROM ended_sign_ins WHERE id = ?1")
                .map_err(backend)?
                .query_row(params![id], |_| Ok(()))
                .optional()
                .map(|row| row.is_some())
                .map_err(backend)
        })
        .await
    }
}

/// A row of `api_keys`, its roles still JSON.
type KeyRow = (String, String, String, String, i64, Option<i64>);

fn key_of(row: &rusqlite::Row<'_>) -> rusqlite::Result<KeyRow> {
    Ok((
        row.get(0)?,
        row.get(1)?,
        row.get(2)?,
        row.get(3)?,
        row.get(4)?,
        row.get(5)?,
    ))
}

fn key_from_row(
    (id, principal, roles, hash, created_at, revoked_at): KeyRow,
) -> Result<ApiKeyRecord, StoreError> {
    let roles: Vec<String> = serde_json::from_str(&roles)
        .map_err(|e| StoreError::Backend(format!("the roles of key {id} do not read back: {e}")))?;
    Ok(ApiKeyRecord {
        id,
        principal,
        roles,
        hash,
        created_at: to_u64(created_at),
        revoked_at: revoked_at.map(to_u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn synchronous(store: &SqliteStore) -> i64 {
        store
            .writer
            .read(|conn| {
                conn.pragma_query_value(None, "synchronous", |r| r.get(0))
                    .map_err(backend)
            })
            .await
            .expect("the pragma reads")
    }

    #[tokio::test]
    async fn every_commit_is_synced_unless_speed_is_chosen() {
        let dir =
            std::env::temp_dir().join(format!("markov-sync-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let synced = SqliteStore::open(dir.join("default.db")).expect("opens");
        assert_eq!(
            synchronous(&synced).await,
            2,
            "FULL: a commit survives a power loss"
        );
        let fast =
            SqliteStore::open_with(dir.join("fast.db"), Durability::ProcessCrash).expect("opens");
        assert_eq!(synchronous(&fast).await, 1, "NORMAL, when asked for");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A write that holds the writer's thread for `held`, answered when it
    /// lets go.
    fn hold_the_writer(store: &SqliteStore, held: Duration) -> tokio::task::JoinHandle<()> {
        let writer = store.writer.clone();
        tokio::spawn(async move {
            let _ = writer
                .write(move |_| {
                    std::thread::sleep(held);
                    Ok(())
                })
                .await;
        })
    }

    #[tokio::test]
    async fn a_file_s_reads_do_not_wait_behind_the_writer_and_see_what_it_committed() {
        let dir =
            std::env::temp_dir().join(format!("markov-readers-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let store = SqliteStore::open(dir.join("sessions.db")).expect("opens");
        let key = ApiKeyRecord {
            id: "k1".into(),
            principal: "alice".into(),
            roles: Vec::new(),
            hash: "h".into(),
            created_at: 1,
            revoked_at: None,
        };
        store.add_key(&key).await.expect("the key is written");
        let created = key.id;

        let held = hold_the_writer(&store, Duration::from_millis(1500));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let read = tokio::time::timeout(Duration::from_millis(700), store.key(&created))
            .await
            .expect("the read ran beside the held writer")
            .expect("reads");
        assert!(read.is_some(), "the committed key is seen");
        held.await.expect("the write ends");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_message_s_statements_are_prepared_once_not_on_every_use() {
        use rusqlite::StatementStatus;
        let store = Arc::new(SqliteStore::in_memory().expect("opens"));
        let model = markov_testkit::ScriptedModel::builder()
            .text("one")
            .text("two")
            .text("three")
            .build();
        let agent = markov_executor::Agent::builder("a")
            .instructions("Answer.")
            .model(model)
            .build()
            .expect("an agent");
        let (id, worker) = (SessionId::new("s"), WorkerId::new("w"));
        crate::DurableMachine::create(store.clone(), id.clone(), worker.clone(), agent.machine())
            .await
            .expect("created")
            .release()
            .await
            .expect("released");
        // Each message reads the session back (no session cache) and
        // records its step's trace.
        for text in ["first", "second", "third"] {
            let mut session =
                crate::DurableMachine::open(store.clone(), id.clone(), worker.clone(), &agent)
                    .await
                    .expect("opened");
            session.machine().enqueue_user(text);
            session.release_with_run();
            session.run().await.expect("the turn runs");
            session.release().await.expect("released");
        }
        let counts = store
            .writer
            .read(|conn| {
                [HISTORY, LEDGER, NEXT_TRACE]
                    .into_iter()
                    .map(|sql| {
                        let statement = conn.prepare_cached(sql).map_err(backend)?;
                        Ok((
                            statement.get_status(StatementStatus::Run),
                            statement.get_status(StatementStatus::RePrepare),
                        ))
                    })
                    .collect::<Result<Vec<_>, StoreError>>()
            })
            .await
            .expect("the statements' counts read");
        for ((runs, prepared_again), sql) in counts.into_iter().zip([HISTORY, LEDGER, NEXT_TRACE]) {
            assert!(runs >= 3, "used by every message: {sql}");
            assert_eq!(prepared_again, 0, "prepared again: {sql}");
        }
    }

    #[tokio::test]
    async fn a_step_given_up_with_its_write_is_fenced_and_counted_once() {
        let store = Arc::new(SqliteStore::in_memory().expect("opens"));
        let agent = markov_executor::Agent::builder("a")
            .instructions("Answer.")
            .model(markov_testkit::ScriptedModel::builder().build())
            .build()
            .expect("an agent");
        let (id, holder) = (SessionId::new("s"), WorkerId::new("w"));
        let created = crate::DurableMachine::create(
            store.clone(),
            id.clone(),
            holder.clone(),
            agent.machine(),
        )
        .await
        .expect("created");
        let message = Message::user("hi");
        let step = || StepRecord {
            messages: std::slice::from_ref(&message),
            tree: None,
            approvals: None,
            repeats: None,
            counters: None,
            answers: &[],
            run: None,
            usage: None,
            trace: None,
        };
        let before = store
            .acquire(&id, &holder, Duration::from_secs(5))
            .await
            .expect("renewed")
            .revision;
        let other = WorkerId::new("other");
        assert!(matches!(
            store.append_and_release(&id, &other, step()).await,
            Err(StoreError::LeaseLost { .. })
        ));
        assert!(matches!(
            store
                .append_and_release(&SessionId::new("none"), &holder, step())
                .await,
            Err(StoreError::NotFound(_))
        ));
        let revision = store
            .append_and_release(&id, &holder, step())
            .await
            .expect("the holder writes and gives up")
            .expect("it held the lease");
        let lease = store
            .acquire(&id, &other, Duration::from_secs(5))
            .await
            .expect("given up: free at once");
        assert_eq!(lease.revision, revision, "the revision it returned");
        assert_eq!(
            revision.get(),
            before.get() + 1,
            "the refused writes counted nothing, the step once"
        );
        let stored = store.load(&id).await.expect("loads");
        assert_eq!(stored.snapshot.history.len(), 1, "the step's message, once");
        assert_eq!(stored.info.steps, 1);
        drop(created);
    }

    #[tokio::test]
    async fn in_memory_reads_run_on_the_writer_s_thread_in_turn() {
        // What the readers are for: without them a read waits for the
        // writer (a database in memory has only the writer's connection).
        let store = SqliteStore::in_memory().expect("opens");
        let held = hold_the_writer(&store, Duration::from_millis(1500));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let read = tokio::time::timeout(Duration::from_millis(700), store.key("k")).await;
        assert!(read.is_err(), "the read waited for the writer");
        held.await.expect("the write ends");
    }
}
