//! The server itself: [`FakeServer`], its scripted [`Reply`]s and the
//! [`Recorded`] requests.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;

use crate::Recording;

/// One request as the server saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// The method, such as `POST`.
    pub method: String,
    /// The request target, such as `/v1/messages` (with any query string).
    pub path: String,
    /// The headers in order, names in lower case.
    pub headers: Vec<(String, String)>,
    /// The body: parsed JSON; [`Value::Null`] when empty; a
    /// [`Value::String`] holding the text when not JSON.
    pub body: Value,
}

impl Recorded {
    /// A header's value (names compared case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// How a reply's body is sent.
#[derive(Debug, Clone)]
enum Body {
    /// With a `Content-Length`.
    Full(String),
    /// Each piece written and flushed separately (as one chunk of a
    /// chunked body), then optionally a stall before the body ends.
    Chunks(Vec<Vec<u8>>, Option<Duration>),
    /// Nothing at all: the server waits this long, then closes.
    Hang(Duration),
    /// Close-delimited: the piece, again and again, `every` apart, until
    /// `for_` has passed or the client goes away.
    Repeat {
        piece: Vec<u8>,
        every: Duration,
        for_: Duration,
    },
}

/// A scripted reply: a status, headers and a body, sent whole or in pieces,
/// optionally after a delay.
#[derive(Debug, Clone)]
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Body,
    delay: Option<Duration>,
}

impl Reply {
    fn new(status: u16, content_type: Option<&str>, body: Body) -> Self {
        Reply {
            status,
            headers: content_type
                .map(|t| vec![("content-type".to_owned(), t.to_owned())])
                .unwrap_or_default(),
            body,
            delay: None,
        }
    }

    /// A JSON reply with `status`.
    pub fn json(status: u16, body: Value) -> Self {
        Self::new(
            status,
            Some("application/json"),
            Body::Full(body.to_string()),
        )
    }

    /// A plain-text reply with `status`.
    pub fn text(status: u16, body: &str) -> Self {
        Self::new(status, Some("text/plain"), Body::Full(body.to_owned()))
    }

    /// A `200` event stream (`text/event-stream`) sent in one piece, such as
    /// the text from [`anthropic::text_events`](super::anthropic::text_events).
    pub fn sse(stream: &str) -> Self {
        Self::sse_chunks(vec![stream.to_owned()])
    }

    /// A `200` event stream sent in the pieces given, each written and
    /// flushed on its own, a moment apart; a piece may end anywhere, even
    /// inside a line.
    pub fn sse_chunks(chunks: Vec<String>) -> Self {
        let chunks = chunks.into_iter().map(String::into_bytes).collect();
        Self::new(200, Some("text/event-stream"), Body::Chunks(chunks, None))
    }

    /// A `200` event stream cut into pieces of `size` bytes, wherever they
    /// fall: mid-line, mid-token, even inside a UTF-8 character. A `size` of
    /// 0 counts as 1.
    pub fn sse_split(stream: &str, size: usize) -> Self {
        let chunks = stream
            .as_bytes()
            .chunks(size.max(1))
            .map(<[u8]>::to_vec)
            .collect();
        Self::new(200, Some("text/event-stream"), Body::Chunks(chunks, None))
    }

    /// A reply that never comes: the server reads the request, waits
    /// `for_`, then closes the connection without a word.
    pub fn hang(for_: Duration) -> Self {
        Self::new(200, None, Body::Hang(for_))
    }

    /// A `200` event stream that sends `piece` again and again, `every`
    /// apart, for `for_` (or until the client goes away): a server that
    /// keeps a stream alive with pings and never answers.
    pub fn sse_repeating(piece: &str, every: Duration, for_: Duration) -> Self {
        Self::new(
            200,
            Some("text/event-stream"),
            Body::Repeat {
                piece: piece.as_bytes().to_vec(),
                every,
                for_,
            },
        )
    }

    /// A reply with `status` whose body is `piece` again and again, `every`
    /// apart, for `for_` (or until the client goes away): an error body too
    /// large to read whole.
    pub fn endless(status: u16, piece: &str, every: Duration, for_: Duration) -> Self {
        Self::new(
            status,
            Some("text/plain"),
            Body::Repeat {
                piece: piece.as_bytes().to_vec(),
                every,
                for_,
            },
        )
    }

    /// After the last piece of an event stream, the server stalls `for_`
    /// before closing (no effect on other replies).
    pub fn then_stall(mut self, for_: Duration) -> Self {
        if let Body::Chunks(_, stall) = &mut self.body {
            *stall = Some(for_);
        }
        self
    }

    /// The server waits `for_` after reading the request before it sends
    /// anything (status line included).
    pub fn delayed(mut self, for_: Duration) -> Self {
        self.delay = Some(for_);
        self
    }

    /// Adds a header, such as `retry-after`.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }
}

/// Answers the requests beyond the script (see [`FakeServer::answer_with`]).
type Responder = Arc<dyn Fn(&Recorded) -> Reply + Send + Sync>;

/// What the server and its connections share.
#[derive(Default)]
struct Shared {
    requests: Mutex<Vec<Recorded>>,
    replies: Mutex<VecDeque<Reply>>,
    responder: Mutex<Option<Responder>>,
    /// Standing replies by method and path (see [`FakeServer::route`]).
    routes: Mutex<Vec<(String, String, Reply)>>,
    /// Whether requests are kept for [`FakeServer::requests`].
    forget: AtomicBool,
    /// Requests read.
    served: AtomicUsize,
    /// Connections accepted.
    connections: AtomicUsize,
    /// Requests read and not yet answered (see [`FakeServer::max_in_flight`]).
    in_flight: AtomicUsize,
    /// The most `in_flight` has been.
    max_in_flight: AtomicUsize,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("served", &self.served.load(Ordering::Relaxed))
            .field("connections", &self.connections.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A fake provider on loopback. Dropping it stops accepting connections.
#[derive(Debug)]
pub struct FakeServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl FakeServer {
    /// Starts a server on a free port of `127.0.0.1` with nothing scripted
    /// yet; script it with [`reply`](Self::reply).
    ///
    /// # Panics
    ///
    /// If no loopback port can be bound; see [`try_start`](Self::try_start),
    /// or outside a tokio runtime.
    pub async fn start() -> Self {
        match Self::try_start().await {
            Ok(server) => server,
            Err(err) => panic!("the fake server cannot bind 127.0.0.1: {err}"),
        }
    }

    /// Starts a server already scripted with `replies`, answered in order.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub async fn scripted(replies: Vec<Reply>) -> Self {
        let server = Self::start().await;
        lock(&server.shared.replies).extend(replies);
        server
    }

    /// Starts a server, or says why no loopback port could be bound.
    pub async fn try_start() -> io::Result<Self> {
        // Room for a load test's burst of new connections: with tokio's
        // own `bind` the kernel queues 128, drops the next ones' first
        // packets, and their clients wait a second to try again.
        let socket = TcpSocket::new_v4()?;
        socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        let listener = socket.listen(4096)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let accepting = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                accepting.connections.fetch_add(1, Ordering::Relaxed);
                // A reply is written in pieces (head, body, chunks): with
                // Nagle's algorithm a piece waits for the client's delayed
                // acknowledgement of the last, 40 ms on Linux, on every
                // call of a kept-alive connection.
                let _ = socket.set_nodelay(true);
                let shared = Arc::clone(&accepting);
                tokio::spawn(async move {
                    // A client that hangs up early is no concern of the test.
                    let _ = serve(socket, &shared).await;
                });
            }
        });
        Ok(FakeServer { addr, shared, task })
    }

    /// Queues `reply` after those already scripted; returns the server, so
    /// calls chain.
    pub fn reply(&self, reply: Reply) -> &Self {
        lock(&self.shared.replies).push_back(reply);
        self
    }

    /// Answers every `method` request for `path` (the query aside) with
    /// `reply`, however often it comes and wherever it falls in the
    /// script, which it leaves alone: a server's standing endpoints, such
    /// as its model list. A later route for the same method and path
    /// replaces this one. Such requests are recorded like any other.
    /// Returns the server, so calls chain.
    pub fn route(&self, method: &str, path: &str, reply: Reply) -> &Self {
        lock(&self.shared.routes).push((method.to_owned(), path.to_owned(), reply));
        self
    }

    /// The base URL, `http://127.0.0.1:<port>`, without a trailing slash.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers every request beyond the script with `responder`'s reply
    /// to it (instead of `418`): a provider for load tests, which would
    /// otherwise script one reply per request. Returns the server, so
    /// calls chain.
    pub fn answer_with(
        &self,
        responder: impl Fn(&Recorded) -> Reply + Send + Sync + 'static,
    ) -> &Self {
        *lock(&self.shared.responder) = Some(Arc::new(responder));
        self
    }

    /// Sets whether requests are kept for [`requests`](Self::requests)
    /// ([`Recording::On`], the default). A load test turns it off, so the
    /// server's memory stays flat however many requests it answers;
    /// [`served`](Self::served) still counts them.
    pub fn recording(&self, recording: Recording) -> &Self {
        self.shared
            .forget
            .store(recording == Recording::Off, Ordering::SeqCst);
        self
    }

    /// Every request so far, in the order they arrived (those that came
    /// while recording was off are not kept).
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.shared.requests).clone()
    }

    /// How many requests the server has read, recorded or not.
    pub fn served(&self) -> usize {
        self.shared.served.load(Ordering::SeqCst)
    }

    /// How many connections the server has accepted. Replies keep the
    /// connection open for the client's next request (HTTP/1.1
    /// keep-alive), except a reply that [hangs](Reply::hang) or streams
    /// [without end](Reply::endless): a client that reuses its connections
    /// opens few.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// The only request so far.
    ///
    /// # Panics
    ///
    /// Unless exactly one request was made.
    pub fn single(&self) -> Recorded {
        let mut requests = self.requests();
        assert_eq!(
            requests.len(),
            1,
            "expected exactly one request, got {requests:?}"
        );
        requests.remove(0)
    }

    /// The most requests the server has held at once: read whole, their
    /// reply (its delay included) not yet begun. A client's requests in
    /// flight are at least as many, so this shows a bound on them is kept.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    /// How many scripted replies are still unused.
    pub fn remaining(&self) -> usize {
        lock(&self.shared.replies).len()
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Locks `m`, ignoring poisoning: a panicking test thread leaves the data
/// as usable as it was.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Answers the requests of one connection, each with the next reply, for
/// as long as the client keeps it open and the replies allow.
async fn serve(mut socket: TcpStream, shared: &Shared) -> io::Result<()> {
    let mut buffer = Vec::new();
    loop {
        let Some(request) = read_request(&mut socket, &mut buffer).await? else {
            // The client closed its idle connection.
            return Ok(());
        };
        shared.served.fetch_add(1, Ordering::SeqCst);
        let close = request
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        let path = request.path.split('?').next().unwrap_or_default();
        // The latest route for a method and path is the one in force.
        let routed = lock(&shared.routes)
            .iter()
            .rev()
            .find(|(method, route, _)| *method == request.method && route == path)
            .map(|(_, _, reply)| reply.clone());
        let scripted = routed.or_else(|| lock(&shared.replies).pop_front());
        let reply = match scripted {
            Some(reply) => reply,
            None => match lock(&shared.responder).clone() {
                Some(responder) => responder(&request),
                None => Reply::text(418, "unscripted request"),
            },
        };
        if !shared.forget.load(Ordering::SeqCst) {
            lock(&shared.requests).push(request);
        }
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if let Some(delay) = reply.delay {
            tokio::time::sleep(delay).await;
        }
        // Answered from here on: the client cannot be done with the request
        // before its reply begins.
        shared.in_flight.fetch_sub(1, Ordering::SeqCst);
        let open = write_reply(&mut socket, reply, !close).await?;
        socket.flush().await?;
        if !open {
            return socket.shutdown().await;
        }
    }
}

/// Writes `reply`; returns whether the connection stays open for another
/// request (`keep`, unless the body is delimited by closing).
async fn write_reply(socket: &mut TcpStream, reply: Reply, keep: bool) -> io::Result<bool> {
    let reason = match reply.status {
        200 => "OK",
        _ => "Scripted",
    };
    // A hanging or endless body ends only when the connection does.
    let keep = keep && matches!(reply.body, Body::Full(_) | Body::Chunks(..));
    let connection = if keep { "keep-alive" } else { "close" };
    let mut head = format!(
        "HTTP/1.1 {} {reason}\r\nconnection: {connection}\r\n",
        reply.status
    );
    for (name, value) in &reply.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    // A reply is written in as few writes as it has pieces: with Nagle off,
    // each write is a segment of its own and a wake-up of the client, which
    // a real provider's answer (a TLS record or two) does not cost.
    match reply.body {
        Body::Full(body) => {
            head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
            head.push_str(&body);
            socket.write_all(head.as_bytes()).await?;
        }
        Body::Chunks(chunks, stall) => {
            if keep {
                head.push_str("transfer-encoding: chunked\r\n");
            }
            head.push_str("\r\n");
            let mut out = head.into_bytes();
            // An empty chunk would end the body: skipped.
            let pieces: Vec<&[u8]> = chunks
                .iter()
                .map(Vec::as_slice)
                .filter(|c| !c.is_empty())
                .collect();
            let mut pieces = pieces.into_iter().peekable();
            while let Some(piece) = pieces.next() {
                if keep {
                    out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                    out.extend_from_slice(piece);
                    out.extend_from_slice(b"\r\n");
                } else {
                    out.extend_from_slice(piece);
                }
                if pieces.peek().is_none() {
                    // The last piece goes out with the body's end.
                    break;
                }
                socket.write_all(&out).await?;
                socket.flush().await?;
                out.clear();
                // Pieces arrive a moment apart.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            if let Some(stall) = stall {
                socket.write_all(&out).await?;
                socket.flush().await?;
                out.clear();
                tokio::time::sleep(stall).await;
            }
            if keep {
                out.extend_from_slice(b"0\r\n\r\n");
            }
            socket.write_all(&out).await?;
        }
        Body::Hang(duration) => {
            tokio::time::sleep(duration).await;
        }
        Body::Repeat { piece, every, for_ } => {
            head.push_str("\r\n");
            socket.write_all(head.as_bytes()).await?;
            let until = tokio::time::Instant::now() + for_;
            while tokio::time::Instant::now() < until {
                // A client that stopped reading ends the loop with an error.
                socket.write_all(&piece).await?;
                socket.flush().await?;
                if every.is_zero() {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(every).await;
                }
            }
        }
    }
    Ok(keep)
}

/// Reads a request's head and, by its `Content-Length`, its body; `None`
/// when the client closed the connection before a new request began.
/// `buffer` keeps what was read past the request for the next one.
async fn read_request(
    socket: &mut TcpStream,
    buffer: &mut Vec<u8>,
) -> io::Result<Option<Recorded>> {
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            if buffer.is_empty() {
                return Ok(None);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buffer.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let method = parts.next().unwrap_or_default().to_owned();
    let path = parts.next().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    buffer.drain(..head_end + 4);
    while buffer.len() < length {
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buffer.extend_from_slice(&chunk[..n]);
    }
    let body: Vec<u8> = buffer.drain(..length.min(buffer.len())).collect();
    Ok(Some(Recorded {
        method,
        path,
        headers,
        body: parse_body(&body),
    }))
}

/// A request body as JSON, `null` when empty, else its text.
fn parse_body(body: &[u8]) -> Value {
    if body.is_empty() {
        return Value::Null;
    }
    serde_json::from_slice(body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(body).into_owned()))
}
