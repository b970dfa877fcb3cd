//! Accepting connections: a cap on how many are served at once, a timeout
//! on request heads, and a graceful close.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::Limits;

/// How many connections a listener from [`bind`] lets the kernel hold
/// before they are accepted; the system's `net.core.somaxconn` caps it.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds a TCP listener for [`Server::serve`](crate::Server::serve) at
/// `address`, with room for a burst of new connections.
///
/// `tokio::net::TcpListener::bind` keeps the standard library's queue of
/// 128 connections not yet accepted. Past it the kernel drops a new
/// connection's first packet, and its client tries again only after a
/// second (then two, then four): a burst of a few hundred clients at once
/// gives its last ones a second of latency before the server sees them.
/// A listener from here queues [`LISTEN_BACKLOG`] of them.
///
/// ```no_run
/// # async fn demo() -> std::io::Result<()> {
/// let listener = markov_server::bind("127.0.0.1:8080").await?;
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// When `address` does not resolve, or no address it names can be bound:
/// the last address's error.
pub async fn bind(address: impl tokio::net::ToSocketAddrs) -> std::io::Result<TcpListener> {
    let mut last = None;
    for address in tokio::net::lookup_host(address).await? {
        match listen_on(address) {
            Ok(listener) => return Ok(listener),
            Err(error) => last = Some(error),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolved to nothing",
        )
    }))
}

fn listen_on(address: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if address.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // As tokio's own `bind` does: a restarted server can bind its port
    // again while the last one's connections linger in TIME_WAIT.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Accepts connections on `listener` and serves `app` on each until
/// `shutdown` completes; returns the connections still open.
pub(crate) async fn accept(
    listener: TcpListener,
    app: Router,
    limits: &Limits,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> GracefulShutdown {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // At the cap, nothing more is accepted until a connection closes:
        // the kernel's backlog holds the others.
        let slot = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, say: wait a little rather
                    // than spin.
                    tracing::warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Events of a stream are small writes: with Nagle's algorithm each
        // would wait for the client's delayed acknowledgement of the last
        // (40 ms on Linux).
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, %peer, "cannot turn Nagle's algorithm off");
        }
        let service = app.clone().map_request(
            move |mut request: axum::extract::Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                request
            },
        );
        let connection =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, %peer, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful
}

/// Lets the open connections finish their requests (keep-alive ends),
/// waiting at most `grace`.
pub(crate) async fn close(connections: GracefulShutdown, grace: Duration) {
    if tokio::time::timeout(grace, connections.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the shutdown grace: closed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens `n` connections to `listener` at once, none of them accepted,
    /// and counts those the kernel completed within `within`.
    async fn connected_within(listener: &TcpListener, n: usize, within: Duration) -> usize {
        let address = listener.local_addr().expect("an address");
        let attempts = (0..n).map(|_| async move {
            tokio::time::timeout(within, tokio::net::TcpStream::connect(address))
                .await
                .ok()
                .and_then(Result::ok)
        });
        let streams = futures::future::join_all(attempts).await;
        streams.iter().filter(|stream| stream.is_some()).count()
    }

    // A client whose first packet is dropped sends it again after a
    // second: 700 ms tells a queued connection from a dropped one.
    const PROMPTLY: Duration = Duration::from_millis(700);
    const BURST: usize = 600;

    #[tokio::test]
    async fn a_listener_from_bind_queues_a_burst_of_connections() {
        let listener = bind("127.0.0.1:0").await.expect("a listener");
        assert_eq!(connected_within(&listener, BURST, PROMPTLY).await, BURST);
    }

    #[tokio::test]
    async fn tokio_s_own_bind_drops_the_same_burst() {
        // What `bind` is for: with the standard backlog of 128 the kernel
        // drops the connections past it, and their clients wait a second.
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a listener");
        assert!(connected_within(&listener, BURST, PROMPTLY).await < BURST);
    }

    #[tokio::test]
    async fn bind_says_why_an_address_cannot_be_bound() {
        let taken = bind("127.0.0.1:0").await.expect("a listener");
        let address = taken.local_addr().expect("an address");
        let error = bind(address).await.expect_err("the port is taken");
        assert_eq!(error.kind(), std::io::ErrorKind::AddrInUse);
    }
}
