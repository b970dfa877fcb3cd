//! Set-up shared by this binary's scenario tests: the built binaries run
//! with no provider configured, and a `markov-serve` process on a loopback
//! port with the way to wait for it and to stop it.

use std::future::Future;
use std::io::BufRead;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// The variables that choose a real provider and its model.
pub(crate) const PROVIDER_VARS: [&str; 8] = [
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "GEMINI_API_KEY",
    "GEMINI_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "MARKOV_OPENAI_API",
    "MARKOV_MODEL",
];

/// The built binary at `program` with every provider variable removed:
/// it runs on the scripted model unless the test sets one.
pub(crate) fn without_provider(program: &str) -> Command {
    let mut command = Command::new(program);
    for var in PROVIDER_VARS {
        command.env_remove(var);
    }
    command
}

/// A port nothing listens on (bound, then let go).
pub(crate) fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A `markov-serve` process and its database file: killed, and the file
/// (with its `.stderr` log beside it) removed, on drop.
pub(crate) struct Server(pub(crate) Child, pub(crate) std::path::PathBuf);

impl Server {
    /// Sends SIGTERM and waits (thirty seconds at most) until the server
    /// has exited: its exit status.
    pub(crate) async fn terminate(&mut self) -> ExitStatus {
        assert!(
            Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status()
                .expect("kill runs")
                .success()
        );
        let mut waited = Duration::ZERO;
        loop {
            if let Some(status) = self.0.try_wait().expect("waits") {
                return status;
            }
            assert!(
                waited < Duration::from_secs(30),
                "still running after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            waited += Duration::from_millis(50);
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_file(&self.1);
        let _ = std::fs::remove_file(self.1.with_extension("stderr"));
    }
}

/// Reads the server's stdout up to the line with the key it printed
/// (`mk_…`), adding each line to `printed`; `None` when stdout ends first.
pub(crate) fn printed_key(stdout: &mut impl BufRead, printed: &mut String) -> Option<String> {
    loop {
        let mut line = String::new();
        let read = stdout.read_line(&mut line).expect("reads");
        if read == 0 {
            return None;
        }
        printed.push_str(&line);
        if let Some(key) = line.trim().strip_prefix("mk_") {
            return Some(format!("mk_{key}"));
        }
    }
}

/// Sends a request until the server answers it (thirty seconds at most):
/// a server just started may not listen yet.
pub(crate) async fn once_listening<F, T>(mut send: impl FnMut() -> F) -> T
where
    F: Future<Output = reqwest::Result<T>>,
{
    let mut waited = Duration::ZERO;
    loop {
        match send().await {
            Ok(answer) => return answer,
            Err(_) => {
                assert!(
                    waited < Duration::from_secs(30),
                    "the server never answered"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
                waited += Duration::from_millis(100);
            }
        }
    }
}
