//! The application's side: send messages, read a session's status, decide
//! its pending calls.

use std::time::{Duration, Instant};

use markov_policy::Decision;
use serde_json::Value;
use temporalio_client::{
    Client, ClientOptions, Connection, ConnectionOptions, WorkflowQueryOptions,
    WorkflowSignalOptions, WorkflowStartOptions,
};

use crate::workflow::{ApprovalDecision, MarkovSession, SessionInput, SessionStatus};

/// The longest one call to the server may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// `call`, bounded by [`CALL_TIMEOUT`].
async fn bounded<T>(
    what: &str,
    call: impl Future<Output = Result<T, TemporalError>>,
) -> Result<T, TemporalError> {
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(TemporalError::Timeout(CALL_TIMEOUT, what.to_owned())))
}

/// A failure talking to the Temporal server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TemporalError {
    /// The server's address is not a URL, or it could not be reached.
    #[error("cannot connect to Temporal: {0}")]
    Connect(String),
    /// A workflow could not be started or signalled.
    #[error("the session could not be signalled: {0}")]
    Signal(String),
    /// A query was not answered (no worker polls the task queue, say).
    #[error("the session could not be queried: {0}")]
    Query(String),
    /// A bounded wait ran out.
    #[error("timed out after {0:?}: {1}")]
    Timeout(Duration, String),
    /// The worker could not be made or stopped on an error.
    #[error("the worker failed: {0}")]
    Worker(String),
}

/// A connection to a Temporal server, bound to a namespace and the task
/// queue the session workers poll.
#[derive(Clone)]
pub struct SessionClient {
    client: Client,
    task_queue: String,
}

impl std::fmt::Debug for SessionClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionClient")
            .field("task_queue", &self.task_queue)
            .finish_non_exhaustive()
    }
}

impl SessionClient {
    /// Connects to the server at `address` (`http://host:7233`), within 10
    /// seconds.
    ///
    /// # Errors
    /// [`TemporalError::Connect`].
    pub async fn connect(
        address: &str,
        namespace: &str,
        task_queue: &str,
    ) -> Result<Self, TemporalError> {
        let url = temporalio_client::Url::parse(address)
            .map_err(|e| TemporalError::Connect(format!("{address}: {e}")))?;
        let options = ConnectionOptions::new(url)
            .identity(format!("markov-temporal@{}", std::process::id()))
            .connect_timeout(Duration::from_secs(10))
            .build();
        let connection =
            tokio::time::timeout(Duration::from_secs(15), Connection::connect(options))
                .await
                .map_err(|_| TemporalError::Connect(format!("{address}: no answer in 15 s")))?
                .map_err(|e| TemporalError::Connect(e.to_string()))?;
        let client = Client::new(connection, ClientOptions::new(namespace).build())
            .map_err(|e| TemporalError::Connect(e.to_string()))?;
        Ok(SessionClient {
            client,
            task_queue: task_queue.to_owned(),
        })
    }

    /// A client made by the application (TLS, an API key, other options of
    /// `temporalio_client`), on task queue `task_queue`.
    pub fn from_client(client: Client, task_queue: &str) -> Self {
        SessionClient {
            client,
            task_queue: task_queue.to_owned(),
        }
    }

    /// The task queue the workers poll.
    pub fn task_queue(&self) -> &str {
        &self.task_queue
    }

    pub(crate) fn inner(&self) -> &Client {
        &self.client
    }

    /// Sends a user message to `session`, starting its workflow when it is
    /// not running.
    ///
    /// # Errors
    /// [`TemporalError::Signal`], or [`TemporalError::Timeout`] after 30 s.
    pub async fn send(&self, session: &str, message: &str) -> Result<(), TemporalError> {
        bounded("send", async {
            self.client
                .signal_with_start_workflow(
                    MarkovSession::run,
                    SessionInput::default(),
                    MarkovSession::send,
                    message.to_owned(),
                    WorkflowStartOptions::new(self.task_queue.clone(), session.to_owned()).build(),
                )
                .await
                .map(|_| ())
                .map_err(|e| TemporalError::Signal(e.to_string()))
        })
        .await
    }

    /// Decides the pending call `id` of `session` (a
    /// [`PendingApproval`](crate::PendingApproval)'s id).
    ///
    /// # Errors
    /// [`TemporalError::Signal`], or [`TemporalError::Timeout`] after 30 s.
    pub async fn decide(
        &self,
        session: &str,
        id: &str,
        decision: Decision,
    ) -> Result<(), TemporalError> {
        bounded("decide", async {
            self.client
                .get_workflow_handle::<MarkovSession>(session)
                .signal(
                    MarkovSession::decide,
                    ApprovalDecision::new(id, decision),
                    WorkflowSignalOptions::default(),
                )
                .await
                .map_err(|e| TemporalError::Signal(e.to_string()))
        })
        .await
    }

    /// Where `session` stands (answered by a worker).
    ///
    /// # Errors
    /// [`TemporalError::Query`], or [`TemporalError::Timeout`] after 30 s.
    pub async fn status(&self, session: &str) -> Result<SessionStatus, TemporalError> {
        bounded("status", async {
            self.client
                .get_workflow_handle::<MarkovSession>(session)
                .query(MarkovSession::status, (), WorkflowQueryOptions::default())
                .await
                .map_err(|e| TemporalError::Query(e.to_string()))
        })
        .await
    }

    /// `session`'s machine as markov's snapshot JSON (`null` before its
    /// first turn).
    ///
    /// # Errors
    /// [`TemporalError::Query`], or [`TemporalError::Timeout`] after 30 s.
    pub async fn snapshot(&self, session: &str) -> Result<Value, TemporalError> {
        bounded("snapshot", async {
            self.client
                .get_workflow_handle::<MarkovSession>(session)
                .query(MarkovSession::snapshot, (), WorkflowQueryOptions::default())
                .await
                .map_err(|e| TemporalError::Query(e.to_string()))
        })
        .await
    }

    /// Waits (at most `timeout`) until `ready` holds for `session`'s status,
    /// asking every 100 ms; a query that fails meanwhile (no worker yet) is
    /// asked again.
    ///
    /// # Errors
    /// [`TemporalError::Timeout`], with the last status or error.
    pub async fn wait_until(
        &self,
        session: &str,
        timeout: Duration,
        mut ready: impl FnMut(&SessionStatus) -> bool,
    ) -> Result<SessionStatus, TemporalError> {
        let deadline = Instant::now() + timeout;
        loop {
            let last =
                match tokio::time::timeout(Duration::from_secs(5), self.status(session)).await {
                    Ok(Ok(status)) if ready(&status) => return Ok(status),
                    Ok(Ok(status)) => format!("{status:?}"),
                    Ok(Err(error)) => error.to_string(),
                    Err(_) => "a query was not answered in 5 s".to_owned(),
                };
            if Instant::now() >= deadline {
                return Err(TemporalError::Timeout(timeout, last));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
