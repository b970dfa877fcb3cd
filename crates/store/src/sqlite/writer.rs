//! The thread that owns a SQLite connection and commits the writes of
//! many sessions together (group commit).
//!
//! A store call used to take a thread of tokio's blocking pool, lock the
//! one connection and commit a transaction of its own: under load the
//! calls queued on the lock, each woke a thread, and a synced database
//! paid one sync of the disk per step. Here one thread owns the
//! connection. Calls arrive on a bounded queue; the writes waiting when
//! the thread comes to them run in one transaction, each in a savepoint of
//! its own, so a write that fails (a lost lease, a session that exists
//! already) is rolled back alone, and one commit — one sync — makes all
//! the others durable; a write that finds no other waiting is the
//! transaction itself, without a savepoint. A caller hears back only after
//! that commit, so a step is as durable before its next model call, and
//! before its result is streamed, as it was with a transaction of its own.
//!
//! A batch of nothing but lease writes (a lease taken, renewed or given
//! up) is committed without a sync on a file that otherwise syncs every
//! commit. A lease matters only while its holder lives, and every process
//! that can hold a lease on this file runs on the machine a power loss
//! stops; the write-ahead log is synced in order, so the next commit that
//! is synced (the step, the tool call's record) makes every lease write
//! before it durable too. A message therefore waits for one sync fewer.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use crate::StoreError;

/// The most writes one transaction commits: bounds how long the readers
/// queued behind a batch wait.
const MAX_BATCH: usize = 256;

/// The most calls waiting for the thread. A call that finds the queue full
/// waits for room, which slows the callers down to the database's pace
/// (back-pressure) instead of queueing without bound.
const QUEUE: usize = 1024;

/// How long a call waits for room in a full queue before it fails.
pub(super) const QUEUE_WAIT: Duration = Duration::from_secs(10);

/// A read: runs alone, outside any write transaction.
type ReadJob = Box<dyn FnOnce(&mut Connection) + Send>;

/// A write: runs in its savepoint (or, given why it cannot run, only
/// fails), says whether to keep its changes and how to answer its caller
/// once the commit is decided.
type WriteJob = Box<dyn FnOnce(Result<&Connection, &str>) -> Written + Send>;

/// What a write did.
struct Written {
    /// Whether its savepoint is released (kept) or rolled back.
    keep: bool,
    /// Answers the caller, given why the commit failed, if it did.
    reply: Reply,
}

/// Answers a write's caller, given why the commit failed, if it did.
type Reply = Box<dyn FnOnce(Option<&str>) + Send>;

enum Job {
    Read(ReadJob),
    Write(WriteJob, Kind),
}

/// What a write changes, which says whether its commit must be synced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A session's data: synced as the connection says.
    Data,
    /// Only who holds a session's lease, until when.
    Lease,
}

/// The handle of the connection's thread; the thread ends when the last
/// handle is dropped and the queue is empty.
#[derive(Clone)]
pub(super) struct Writer {
    jobs: mpsc::Sender<Job>,
    /// Write transactions committed so far (what the tests look at).
    #[cfg(test)]
    commits: Arc<AtomicU64>,
}

pub(super) fn panicked() -> StoreError {
    StoreError::Backend("the database call panicked; it was rolled back".into())
}

fn gone() -> StoreError {
    StoreError::Backend("the database thread has stopped".into())
}

impl Writer {
    /// Starts the thread that owns `conn`.
    pub(super) fn start(conn: Connection) -> Result<Self, StoreError> {
        let (jobs, queue) = mpsc::channel(QUEUE);
        let commits = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&commits);
        let syncing = Syncing::of(&conn)?;
        std::thread::Builder::new()
            .name("markov-sqlite".into())
            .spawn(move || run(conn, queue, syncing, &counted))
            .map_err(|e| StoreError::Backend(format!("the database thread did not start: {e}")))?;
        Ok(Writer {
            jobs,
            #[cfg(test)]
            commits,
        })
    }

    /// Write transactions committed so far.
    #[cfg(test)]
    pub(super) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Calls waiting in the queue.
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.jobs.max_capacity() - self.jobs.capacity()
    }

    /// Runs `f` on the connection between write transactions.
    pub(super) async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        self.submit(Job::Read(Box::new(move |conn| {
            let result =
                catch_unwind(AssertUnwindSafe(|| f(conn))).unwrap_or_else(|_| Err(panicked()));
            let _ = answer.send(result);
        })))
        .await?;
        answered.await.map_err(|_| gone())?
    }

    /// Runs `f` in a savepoint of the next write transaction; its result
    /// once that transaction is committed. An error from `f` rolls back
    /// what `f` wrote, and only that.
    pub(super) async fn write<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        self.write_of(Kind::Data, f).await
    }

    /// [`write`](Self::write) for `f` that changes only a session's lease
    /// columns: see the module's documentation for why a batch of these
    /// alone is not synced.
    pub(super) async fn write_lease<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        self.write_of(Kind::Lease, f).await
    }

    async fn write_of<T, F>(&self, kind: Kind, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        self.submit(Job::Write(
            Box::new(move |conn| {
                let result = match conn {
                    Ok(conn) => catch_unwind(AssertUnwindSafe(|| f(conn)))
                        .unwrap_or_else(|_| Err(panicked())),
                    Err(why) => Err(not_committed(why)),
                };
                Written {
                    keep: result.is_ok(),
                    reply: Box::new(move |failed_commit| {
                        let result = match failed_commit {
                            Some(why) if result.is_ok() => Err(not_committed(why)),
                            _ => result,
                        };
                        let _ = answer.send(result);
                    }),
                }
            }),
            kind,
        ))
        .await?;
        answered.await.map_err(|_| gone())?
    }

    async fn submit(&self, job: Job) -> Result<(), StoreError> {
        let job = match self.jobs.try_send(job) {
            Ok(()) => return Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(gone()),
            Err(mpsc::error::TrySendError::Full(job)) => job,
        };
        match tokio::time::timeout(QUEUE_WAIT, self.jobs.send(job)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(gone()),
            Err(_) => Err(StoreError::Backend(format!(
                "the database is overloaded: its queue of {QUEUE} calls stayed full for {} s",
                QUEUE_WAIT.as_secs()
            ))),
        }
    }
}

fn not_committed(why: &str) -> StoreError {
    StoreError::Backend(format!("the write was not committed: {why}"))
}

/// How the connection syncs its commits, and how a batch of lease writes
/// alone is committed.
#[derive(Debug)]
struct Syncing {
    /// The `synchronous` level the connection was opened with, when it
    /// syncs every commit of a write-ahead log (`FULL` or `EXTRA`), so
    /// that a batch of lease writes may skip the sync; `None` otherwise
    /// (a database in memory, or one that does not sync each commit).
    full: Option<i64>,
    /// Whether the connection is set to `NORMAL` now, for such a batch.
    relaxed: bool,
}

impl Syncing {
    fn of(conn: &Connection) -> Result<Self, StoreError> {
        let mode: String = conn
            .pragma_query_value(None, "journal_mode", |r| r.get(0))
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        let level: i64 = conn
            .pragma_query_value(None, "synchronous", |r| r.get(0))
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        Ok(Syncing {
            full: (mode.eq_ignore_ascii_case("wal") && level >= 2).then_some(level),
            relaxed: false,
        })
    }

    /// Sets the connection for a batch: not synced when `leases_only`
    /// and the connection may skip the sync, synced as it was opened
    /// otherwise. An error means the connection could not be set back to
    /// syncing: the batch must not be committed.
    fn set(&mut self, conn: &Connection, leases_only: bool) -> Result<(), String> {
        let Some(full) = self.full else {
            return Ok(());
        };
        if leases_only == self.relaxed {
            return Ok(());
        }
        let level = if leases_only { 1 } else { full };
        match conn.execute_batch(&format!("PRAGMA synchronous = {level}")) {
            Ok(()) => {
                self.relaxed = leases_only;
                Ok(())
            }
            // Left syncing, a batch of leases is only slower.
            Err(_) if leases_only => Ok(()),
            Err(e) => Err(format!(
                "the database could not be set to sync its commits: {e}"
            )),
        }
    }
}

/// The thread: reads one at a time, writes in batches.
fn run(
    mut conn: Connection,
    mut queue: mpsc::Receiver<Job>,
    mut syncing: Syncing,
    commits: &AtomicU64,
) {
    let mut next = None;
    loop {
        let job = match next.take() {
            Some(job) => job,
            None => match queue.blocking_recv() {
                Some(job) => job,
                None => return,
            },
        };
        match job {
            Job::Read(read) => read(&mut conn),
            Job::Write(first, kind) => {
                let mut batch = vec![first];
                let mut leases_only = kind == Kind::Lease;
                while batch.len() < MAX_BATCH {
                    match queue.try_recv() {
                        Ok(Job::Write(write, kind)) => {
                            batch.push(write);
                            leases_only &= kind == Kind::Lease;
                        }
                        // A read queued after these writes runs after them.
                        Ok(read) => {
                            next = Some(read);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                match syncing.set(&conn, leases_only) {
                    Ok(()) => commit(&conn, batch, commits),
                    Err(why) => {
                        for write in batch {
                            (write(Err(&why)).reply)(Some(&why));
                        }
                    }
                }
            }
        }
    }
}

/// Runs `batch` in one transaction, each write in its savepoint, and
/// answers every caller once the commit is decided, counting a commit in
/// `commits` before the callers hear of it (so a caller that reads the
/// count after its answer sees its commit).
fn commit(conn: &Connection, batch: Vec<WriteJob>, commits: &AtomicU64) {
    let sql = |statement: &str| -> Result<(), String> {
        conn.prepare_cached(statement)
            .and_then(|mut s| s.execute([]))
            .map(drop)
            .map_err(|e| e.to_string())
    };
    if let Err(why) = sql("BEGIN IMMEDIATE") {
        for write in batch {
            (write(Err(&why)).reply)(Some(&why));
        }
        return;
    }
    if batch.len() == 1 {
        // A write alone is its own transaction: rolling the transaction
        // back rolls back exactly what it wrote, so it needs no savepoint
        // (two statements fewer for every write that finds the thread
        // idle, which is most of them when the server is not busy).
        if let Some(write) = batch.into_iter().next() {
            alone(conn, write, commits, &sql);
        }
        return;
    }
    let mut replies = Vec::with_capacity(batch.len());
    let mut jobs = batch.into_iter();
    let mut broken = None;
    for write in jobs.by_ref() {
        if let Err(why) = sql("SAVEPOINT write") {
            (write(Err(&why)).reply)(Some(&why));
            broken = Some(why);
            break;
        }
        let written = write(Ok(conn));
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (a full disk, an
            // I/O error): nothing of the batch is written, and a write
            // after this would commit on its own.
            replies.push(written.reply);
            broken = Some("the database rolled the transaction back".to_owned());
            break;
        }
        let closed = if written.keep {
            sql("RELEASE write")
        } else {
            sql("ROLLBACK TO write").and_then(|()| sql("RELEASE write"))
        };
        replies.push(written.reply);
        if let Err(why) = closed {
            broken = Some(why);
            break;
        }
    }
    let failed = match broken {
        Some(why) => {
            for write in jobs {
                (write(Err(&why)).reply)(Some(&why));
            }
            if !conn.is_autocommit() {
                let _ = sql("ROLLBACK");
            }
            Some(why)
        }
        None => match sql("COMMIT") {
            Ok(()) => None,
            Err(why) => {
                if !conn.is_autocommit() {
                    let _ = sql("ROLLBACK");
                }
                Some(why)
            }
        },
    };
    if failed.is_none() {
        commits.fetch_add(1, Ordering::Relaxed);
    }
    for reply in replies {
        reply(failed.as_deref());
    }
}

/// Runs `write` as the whole of the transaction `commit` began: committed
/// when it keeps its changes, rolled back when it does not.
fn alone(
    conn: &Connection,
    write: WriteJob,
    commits: &AtomicU64,
    sql: &dyn Fn(&str) -> Result<(), String>,
) {
    let written = write(Ok(conn));
    let failed = if conn.is_autocommit() {
        // SQLite rolled the transaction back itself (see `commit`).
        Some("the database rolled the transaction back".to_owned())
    } else if written.keep {
        sql("COMMIT").err()
    } else {
        // The write failed: its own error is its answer, and nothing of it
        // stays.
        sql("ROLLBACK").err()
    };
    if failed.is_some() && !conn.is_autocommit() {
        let _ = sql("ROLLBACK");
    }
    if written.keep && failed.is_none() {
        commits.fetch_add(1, Ordering::Relaxed);
    }
    (written.reply)(failed.as_deref());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Connection {
        let conn = Connection::open_in_memory().expect("a database");
        conn.execute_batch("CREATE TABLE t (v INTEGER PRIMARY KEY)")
            .expect("a table");
        conn
    }

    fn insert(v: i64) -> impl FnOnce(&Connection) -> Result<i64, StoreError> {
        move |conn| {
            conn.execute("INSERT INTO t (v) VALUES (?1)", [v])
                .map_err(|e| StoreError::Backend(e.to_string()))?;
            Ok(v)
        }
    }

    async fn values(writer: &Writer) -> Vec<i64> {
        writer
            .read(|conn| {
                let mut rows = conn.prepare("SELECT v FROM t ORDER BY v").expect("a query");
                let values = rows
                    .query_map([], |r| r.get(0))
                    .expect("rows")
                    .collect::<Result<Vec<i64>, _>>()
                    .expect("values");
                Ok(values)
            })
            .await
            .expect("the read runs")
    }

    /// Holds the thread in a read until the returned sender is dropped or
    /// sent to, so that what is submitted meanwhile queues up.
    async fn hold(writer: &Writer) -> std::sync::mpsc::Sender<()> {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (entered, wait_entered) = oneshot::channel();
        let gate = writer.clone();
        tokio::spawn(async move {
            gate.read(move |_| {
                let _ = entered.send(());
                let _ = held.recv();
                Ok(())
            })
            .await
        });
        wait_entered.await.expect("the thread holds");
        release
    }

    async fn queued_up(writer: &Writer, n: usize) {
        while writer.queued() < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn writes_waiting_together_are_one_commit_and_a_failing_one_is_rolled_back_alone() {
        let writer = Writer::start(table()).expect("starts");
        let release = hold(&writer).await;
        let mut calls = Vec::new();
        for v in 0..100 {
            let w = writer.clone();
            calls.push(tokio::spawn(async move { w.write(insert(v)).await }));
        }
        // A write that fails after writing: inside the batch.
        let w = writer.clone();
        let duplicate = tokio::spawn(async move {
            w.write(|conn| {
                insert(1000)(conn)?;
                insert(1000)(conn)
            })
            .await
        });
        queued_up(&writer, 101).await;
        let before = writer.commits();
        drop(release);
        for (v, call) in calls.into_iter().enumerate() {
            assert_eq!(call.await.expect("joins").expect("committed"), v as i64);
        }
        assert!(duplicate.await.expect("joins").is_err(), "its own error");
        assert_eq!(
            writer.commits() - before,
            1,
            "one transaction for the batch"
        );
        let stored = values(&writer).await;
        assert_eq!(
            stored,
            (0..100).collect::<Vec<_>>(),
            "1000 was rolled back with its write"
        );
    }

    #[tokio::test]
    async fn a_write_alone_is_its_own_transaction_and_a_failing_one_leaves_nothing() {
        let writer = Writer::start(table()).expect("starts");
        let before = writer.commits();
        let error = writer
            .write(|conn| {
                insert(7)(conn)?;
                insert(7)(conn)
            })
            .await
            .expect_err("its own error");
        assert!(error.to_string().contains("UNIQUE"), "{error}");
        assert_eq!(writer.commits(), before, "nothing committed");
        assert!(values(&writer).await.is_empty(), "7 was rolled back");
        assert_eq!(writer.write(insert(8)).await.expect("the next write"), 8);
        assert_eq!(writer.commits() - before, 1, "one commit for it");
        assert_eq!(values(&writer).await, vec![8]);
    }

    #[tokio::test]
    async fn a_panicking_write_is_rolled_back_and_answered_and_the_thread_goes_on() {
        let writer = Writer::start(table()).expect("starts");
        let error = writer
            .write(|conn| -> Result<(), StoreError> {
                insert(1)(conn)?;
                panic!("a bug in a write");
            })
            .await
            .expect_err("answered with an error");
        assert!(error.to_string().contains("panicked"), "{error}");
        assert_eq!(writer.write(insert(2)).await.expect("the next write"), 2);
        assert_eq!(values(&writer).await, vec![2]);
    }

    #[tokio::test]
    async fn when_sqlite_drops_the_transaction_no_write_of_the_batch_is_reported_done() {
        let writer = Writer::start(table()).expect("starts");
        let release = hold(&writer).await;
        type Write = Box<dyn FnOnce(&Connection) -> Result<i64, StoreError> + Send>;
        let spawn = |f: Write| {
            let w = writer.clone();
            tokio::spawn(async move { w.write(f).await })
        };
        let first = spawn(Box::new(insert(1)));
        // What SQLite does on a full disk or an I/O error: the whole
        // transaction is gone.
        let rolls_back = spawn(Box::new(|conn: &Connection| {
            conn.execute_batch("ROLLBACK")
                .map_err(|e| StoreError::Backend(e.to_string()))?;
            Ok(2)
        }));
        let after = spawn(Box::new(insert(3)));
        queued_up(&writer, 3).await;
        drop(release);
        for call in [first, rolls_back, after] {
            let error = call.await.expect("joins").expect_err("not committed");
            assert!(error.to_string().contains("not committed"), "{error}");
        }
        assert!(values(&writer).await.is_empty(), "nothing was written");
        assert_eq!(writer.write(insert(4)).await.expect("the next write"), 4);
    }

    /// The `synchronous` level a write sees, and the row it writes.
    fn level(v: i64) -> impl FnOnce(&Connection) -> Result<i64, StoreError> {
        move |conn| {
            insert(v)(conn)?;
            conn.pragma_query_value(None, "synchronous", |r| r.get(0))
                .map_err(|e| StoreError::Backend(e.to_string()))
        }
    }

    #[tokio::test]
    async fn a_batch_of_lease_writes_alone_is_not_synced_and_any_other_batch_is() {
        let dir =
            std::env::temp_dir().join(format!("markov-writer-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let conn = Connection::open(dir.join("db")).expect("opens");
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;
             CREATE TABLE t (v INTEGER PRIMARY KEY)",
        )
        .expect("a table");
        let writer = Writer::start(conn).expect("starts");
        let (normal, full) = (1, 2);
        assert_eq!(writer.write_lease(level(1)).await.expect("written"), normal);
        assert_eq!(writer.write(level(2)).await.expect("written"), full);
        assert_eq!(writer.write_lease(level(3)).await.expect("written"), normal);
        assert_eq!(writer.write_lease(level(4)).await.expect("written"), normal);
        // A lease write that waits with a data write shares its synced
        // commit.
        let release = hold(&writer).await;
        let (lease, data) = (writer.clone(), writer.clone());
        let lease = tokio::spawn(async move { lease.write_lease(level(5)).await });
        queued_up(&writer, 1).await;
        let data = tokio::spawn(async move { data.write(level(6)).await });
        queued_up(&writer, 2).await;
        drop(release);
        assert_eq!(lease.await.expect("joins").expect("written"), full);
        assert_eq!(data.await.expect("joins").expect("written"), full);
        assert_eq!(values(&writer).await, vec![1, 2, 3, 4, 5, 6]);
        let _ = std::fs::remove_dir_all(&dir);

        // A database in memory, or one that does not sync each commit, is
        // left as it is.
        let writer = Writer::start(table()).expect("starts");
        let level_in_memory = writer.write(level(1)).await.expect("written");
        assert_eq!(
            writer.write_lease(level(2)).await.expect("written"),
            level_in_memory
        );
    }

    #[tokio::test]
    async fn a_batch_that_cannot_begin_runs_nothing_and_answers_everyone() {
        let dir =
            std::env::temp_dir().join(format!("markov-writer-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let path = dir.join("db");
        let conn = Connection::open(&path).expect("opens");
        conn.execute_batch("PRAGMA journal_mode=WAL; CREATE TABLE t (v INTEGER PRIMARY KEY)")
            .expect("a table");
        conn.busy_timeout(Duration::ZERO).expect("no waiting");
        let writer = Writer::start(conn).expect("starts");
        // Another process holds the write lock.
        let other = Connection::open(&path).expect("opens");
        other.execute_batch("BEGIN IMMEDIATE").expect("locks");
        let error = writer.write(insert(1)).await.expect_err("cannot begin");
        assert!(error.to_string().contains("not committed"), "{error}");
        other.execute_batch("ROLLBACK").expect("unlocks");
        assert_eq!(writer.write(insert(2)).await.expect("then it can"), 2);
        assert_eq!(values(&writer).await, vec![2]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
