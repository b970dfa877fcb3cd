//! Accepting connections: a cap on how many are served at once, a timeout
//! on request heads, and a graceful close.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::Limits;

/// Accepts connections on `listener` and serves `app` on each until
/// `shutdown` completes; returns the connections still open.
pub(crate) async fn accept(
    listener: tokio::net::TcpListener,
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
