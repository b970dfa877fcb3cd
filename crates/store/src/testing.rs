//! [`TempPostgres`]: a throwaway PostgreSQL server for tests and benchmarks,
//! started from the machine's own PostgreSQL binaries (Debian's
//! `postgresql` package) on a temporary directory and a loopback port, which
//! a test can stop and start again under its clients.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Why no server could be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TempPostgresError {
    /// No `initdb` / `pg_ctl` on this machine.
    #[error("PostgreSQL is not installed (no initdb in /usr/lib/postgresql/*/bin or on PATH)")]
    NotInstalled,
    /// A step of starting the server failed.
    #[error("{step} failed: {detail}")]
    Failed {
        /// The step (`initdb`, `pg_ctl start`, ...).
        step: &'static str,
        /// What it printed, or why it could not run.
        detail: String,
    },
}

/// How [`TempPostgres::stop`] shuts the server down (`pg_ctl -m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Shutdown {
    /// Rolls back open transactions and tells each client its connection
    /// is being closed, as an administrator's restart does.
    Fast,
    /// Kills the server's processes without a word to the clients, as a
    /// crash does; the next start recovers from the write-ahead log.
    Immediate,
}

/// A PostgreSQL server of its own, stopped and deleted on drop.
///
/// Runs `initdb` (trust authentication, user `markov`) in a temporary
/// directory and `pg_ctl start` on a free loopback port, as the `postgres`
/// user when the process runs as root (PostgreSQL refuses to run as root).
#[derive(Debug)]
pub struct TempPostgres {
    bin: PathBuf,
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
    databases: AtomicUsize,
}

fn find_bin() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().or_else(|| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .find(|p| p.join("initdb").exists() && p.join("pg_ctl").exists())
        })
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn check(step: &'static str, output: std::io::Result<Output>) -> Result<(), TempPostgresError> {
    match output {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(TempPostgresError::Failed {
            step,
            detail: format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        }),
        Err(e) => Err(TempPostgresError::Failed {
            step,
            detail: e.to_string(),
        }),
    }
}

impl TempPostgres {
    /// Whether PostgreSQL's binaries are on this machine.
    pub fn is_installed() -> bool {
        find_bin().is_some()
    }

    /// A server of a test's own, stopped when the test ends; `None` (said
    /// on stderr, and the test then returns) where PostgreSQL is not
    /// installed outside CI. Under `CI=true` a missing PostgreSQL is a
    /// failure, never a skip.
    ///
    /// # Panics
    /// PostgreSQL is missing under `CI=true`, or the server does not start.
    pub fn for_test() -> Option<TempPostgres> {
        if !Self::is_installed() {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "PostgreSQL is not installed, and CI must run the Postgres tests (.ci/run installs it)"
            );
            eprintln!("skipped: PostgreSQL not installed");
            return None;
        }
        match Self::start() {
            Ok(server) => Some(server),
            Err(err) => panic!("PostgreSQL does not start: {err}"),
        }
    }

    /// Starts a server (a few seconds).
    pub fn start() -> Result<TempPostgres, TempPostgresError> {
        let bin = find_bin().ok_or(TempPostgresError::NotInstalled)?;
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| TempPostgresError::Failed {
                step: "finding a free port",
                detail: e.to_string(),
            })?;
        let dir = std::env::temp_dir().join(format!(
            "markov-pg-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| TempPostgresError::Failed {
            step: "creating the directory",
            detail: e.to_string(),
        })?;
        let as_postgres = is_root();
        let server = TempPostgres {
            bin,
            dir,
            port,
            as_postgres,
            databases: AtomicUsize::new(0),
        };
        if as_postgres {
            check(
                "chown",
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&server.dir)
                    .output(),
            )?;
        }
        check(
            "initdb",
            server
                .command("initdb")
                .arg("-D")
                .arg(server.data())
                .args(["-U", "markov", "--auth=trust", "--no-sync", "-E", "UTF8"])
                .output(),
        )?;
        server.resume()?;
        Ok(server)
    }

    /// Stops the server, keeping its data directory and port, so that
    /// [`resume`](Self::resume) can start it again: what clients see when
    /// their database goes down.
    pub fn stop(&self, mode: Shutdown) -> Result<(), TempPostgresError> {
        let mode = match mode {
            Shutdown::Fast => "fast",
            Shutdown::Immediate => "immediate",
        };
        check(
            "pg_ctl stop",
            self.command("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .args(["-m", mode, "-w", "stop"])
                .output(),
        )
    }

    /// Starts the server on its data directory and port, and waits until
    /// it accepts connections: after [`stop`](Self::stop), the same
    /// server with the same databases.
    pub fn resume(&self) -> Result<(), TempPostgresError> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        check(
            "pg_ctl start",
            self.command("pg_ctl")
                .arg("-D")
                .arg(self.data())
                .args(["-o", &options, "-l"])
                .arg(self.dir.join("log"))
                .args(["-w", "start"])
                .output(),
        )
    }

    /// Stops the server with `mode` and starts it again: every connection
    /// open before is closed, the data survives.
    pub fn restart(&self, mode: Shutdown) -> Result<(), TempPostgresError> {
        self.stop(mode)?;
        self.resume()
    }

    /// The server's data directory.
    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// `bin/name`, run as `postgres` when this process is root.
    fn command(&self, name: &str) -> Command {
        let program = self.bin.join(name);
        if self.as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        }
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `name` (`postgres` always exists).
    pub fn url(&self, database: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=markov dbname={database}",
            self.port
        )
    }

    /// Creates a fresh database and returns its URL.
    pub fn new_database(&self) -> Result<String, TempPostgresError> {
        let n = self.databases.fetch_add(1, Ordering::Relaxed);
        let name = format!("test_{n}");
        check(
            "createdb",
            self.command("createdb")
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "markov",
                ])
                .arg(&name)
                .output(),
        )?;
        Ok(self.url(&name))
    }

    /// The directory of the server's files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.data())
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
