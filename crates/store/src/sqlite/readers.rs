//! Read connections of a database file, so that reads run beside the
//! writer's batches instead of waiting behind their commit.
//!
//! On the writer's thread a read waits for the batch before it, and for a
//! synced database that batch's commit is a sync of the disk: every
//! request's API key lookup, every session read back, paid it. In WAL mode
//! readers do not block the writer nor it them, and each statement (or a
//! read's own transaction, as `load` opens) sees what was committed when it
//! began, so a caller's write, answered only once committed, is seen by
//! its next read.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use tokio::sync::Semaphore;

use super::backend;
use super::writer::{QUEUE_WAIT, panicked};
use crate::StoreError;

/// How many reads run at once (each on a connection of its own, opened
/// when first needed and kept).
pub(super) const READERS: usize = 4;

/// How long a read waits while another process checkpoints the file.
const BUSY_WAIT: Duration = Duration::from_secs(5);

/// The read connections of one database file.
pub(super) struct Readers {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
    slots: Arc<Semaphore>,
}

impl Readers {
    /// Readers of the database at `path`, none open yet.
    pub(super) fn new(path: PathBuf) -> Self {
        Readers {
            path,
            idle: Mutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new(READERS)),
        }
    }

    /// Runs `f` on a read connection, on tokio's blocking pool.
    pub(super) async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let _slot = tokio::time::timeout(QUEUE_WAIT, Arc::clone(&self.slots).acquire_owned())
            .await
            .map_err(|_| {
                StoreError::Backend(format!(
                    "the database is overloaded: no reader was free for {} s",
                    QUEUE_WAIT.as_secs()
                ))
            })?
            .map_err(|_| StoreError::Backend("the database's readers are closed".into()))?;
        let idle = self.lock().pop();
        let path = self.path.clone();
        let (kept, result) = tokio::task::spawn_blocking(move || {
            let mut conn = match idle {
                Some(conn) => conn,
                None => match open(&path) {
                    Ok(conn) => conn,
                    Err(error) => return (None, Err(error)),
                },
            };
            match catch_unwind(AssertUnwindSafe(|| f(&mut conn))) {
                // A read that left a transaction open (it failed halfway)
                // gives back no connection: the next read opens a new one.
                Ok(result) => (conn.is_autocommit().then_some(conn), result),
                Err(_) => (None, Err(panicked())),
            }
        })
        .await
        .map_err(|_| StoreError::Backend("a database read did not finish".into()))?;
        if let Some(conn) = kept {
            self.lock().push(conn);
        }
        result
    }

    /// Runs `f` at once on the calling thread, on an idle read connection
    /// that will not wait for a lock, for a read of a few microseconds
    /// that a hand-off to the blocking pool would cost many times over.
    /// `None` when no connection is idle or a reader is not free, or when
    /// the database is busy (another process checkpoints it): the caller
    /// then reads through [`read`](Self::read).
    pub(super) fn try_now<T>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, rusqlite::Error>,
    ) -> Option<Result<T, StoreError>> {
        let _slot = self.slots.try_acquire().ok()?;
        let conn = self.lock().pop()?;
        // Never block the caller's thread: a busy database is left to a
        // read on the blocking pool, which waits.
        if conn.busy_timeout(Duration::ZERO).is_err() {
            return None;
        }
        let result = catch_unwind(AssertUnwindSafe(|| f(&conn)));
        let restored = conn.busy_timeout(BUSY_WAIT).is_ok();
        let result = match result {
            Ok(Err(rusqlite::Error::SqliteFailure(e, _)))
                if e.code == rusqlite::ErrorCode::DatabaseBusy =>
            {
                None
            }
            Ok(result) => Some(result.map_err(backend)),
            Err(_) => Some(Err(panicked())),
        };
        if restored && conn.is_autocommit() {
            self.lock().push(conn);
        }
        result
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Connection>> {
        // A push or a pop leaves the list whole.
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A read-only connection to `path`, which the writer has opened in WAL
/// mode already.
fn open(path: &std::path::Path) -> Result<Connection, StoreError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(backend)?;
    // While another process checkpoints the file, wait rather than fail.
    conn.busy_timeout(BUSY_WAIT).map_err(backend)?;
    super::keep_prepared(&conn)?;
    Ok(conn)
}
