//! [`TempPostgres`]: a throwaway PostgreSQL server for tests and benchmarks,
//! started from the machine's own PostgreSQL binaries (Debian's
//! `postgresql` package) on a temporary directory and a loopback port.

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
        let data = server.dir.join("data");
        check(
            "initdb",
            server
                .command("initdb")
                .arg("-D")
                .arg(&data)
                .args(["-U", "markov", "--auth=trust", "--no-sync", "-E", "UTF8"])
                .output(),
        )?;
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            server.dir.display()
        );
        check(
            "pg_ctl start",
            server
                .command("pg_ctl")
                .arg("-D")
                .arg(&data)
                .args(["-o", &options, "-l"])
                .arg(server.dir.join("log"))
                .args(["-w", "start"])
                .output(),
        )?;
        Ok(server)
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
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
