//! A fake provider for the tests: a minimal HTTP/1.1 server on loopback
//! that records every request and answers each with the next scripted reply.
//! It speaks just enough HTTP for reqwest (one request per connection,
//! `Connection: close`), which keeps the tests free of a mock-server crate.
//! [`machine`] builds a whole calculator machine for the end-to-end runs.

#![allow(dead_code, unreachable_pub)]

pub mod machine;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Recorded {
    /// A header's value (names compared case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("the request body is JSON")
    }
}

/// How a reply's body is sent.
#[derive(Debug, Clone)]
enum Body {
    /// With a `Content-Length`.
    Full(String),
    /// Close-delimited, each piece written and flushed separately, then
    /// optionally a stall before closing.
    Chunks(Vec<String>, Option<Duration>),
    /// Nothing at all: the server waits this long, then closes.
    Hang(Duration),
}

/// A scripted reply.
#[derive(Debug, Clone)]
pub struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Body,
}

impl Reply {
    /// A JSON reply.
    pub fn json(status: u16, body: Value) -> Self {
        Reply {
            status,
            headers: vec![("content-type".into(), "application/json".into())],
            body: Body::Full(body.to_string()),
        }
    }

    /// A plain-text reply.
    pub fn text(status: u16, body: &str) -> Self {
        Reply {
            status,
            headers: vec![("content-type".into(), "text/plain".into())],
            body: Body::Full(body.into()),
        }
    }

    /// An event stream sent in pieces, split wherever the test says.
    pub fn sse_chunks(chunks: Vec<String>) -> Self {
        Reply {
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            body: Body::Chunks(chunks, None),
        }
    }

    /// After the body, the server stalls this long before closing (only
    /// for event streams).
    pub fn then_stall(mut self, for_: Duration) -> Self {
        if let Body::Chunks(_, stall) = &mut self.body {
            *stall = Some(for_);
        }
        self
    }

    /// An event stream cut into pieces of `size` bytes (mid-line, mid-token).
    pub fn sse_split(text: &str, size: usize) -> Self {
        let chunks = text
            .as_bytes()
            .chunks(size)
            .map(|c| String::from_utf8_lossy(c).into_owned())
            .collect();
        Self::sse_chunks(chunks)
    }

    /// A reply that never comes.
    pub fn hang(for_: Duration) -> Self {
        Reply {
            status: 200,
            headers: Vec::new(),
            body: Body::Hang(for_),
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// One named SSE event with JSON data.
pub fn sse_event(name: &str, data: Value) -> String {
    format!("event: {name}\ndata: {data}\n\n")
}

/// One unnamed SSE event (`data:` only), as OpenAI sends them.
pub fn sse_data(data: &str) -> String {
    format!("data: {data}\n\n")
}

/// The server. Dropping it stops accepting connections.
pub struct FakeServer {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<Recorded>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeServer {
    /// Starts a server answering with `replies` in order; a request beyond
    /// the script gets a 418, which no client retries.
    pub async fn start(replies: Vec<Reply>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let requests = Arc::new(Mutex::new(Vec::new()));
        let replies = Arc::new(Mutex::new(VecDeque::from(replies)));
        let recorded = Arc::clone(&requests);
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let recorded = Arc::clone(&recorded);
                let replies = Arc::clone(&replies);
                tokio::spawn(async move {
                    let _ = serve(socket, recorded, replies).await;
                });
            }
        });
        FakeServer {
            addr,
            requests,
            task,
        }
    }

    /// The base URL, `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().expect("lock").clone()
    }

    /// The only request; panics unless exactly one was made.
    pub fn single(&self) -> Recorded {
        let requests = self.requests();
        assert_eq!(requests.len(), 1, "expected exactly one request");
        requests.into_iter().next().expect("one request")
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(
    mut socket: TcpStream,
    recorded: Arc<Mutex<Vec<Recorded>>>,
    replies: Arc<Mutex<VecDeque<Reply>>>,
) -> std::io::Result<()> {
    let request = read_request(&mut socket).await?;
    recorded.lock().expect("lock").push(request);
    let reply = replies
        .lock()
        .expect("lock")
        .pop_front()
        .unwrap_or_else(|| Reply::text(418, "unscripted request"));
    let reason = match reply.status {
        200 => "OK",
        _ => "Scripted",
    };
    let mut head = format!(
        "HTTP/1.1 {} {reason}\r\nconnection: close\r\n",
        reply.status
    );
    for (name, value) in &reply.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    match reply.body {
        Body::Full(body) => {
            head.push_str(&format!("content-length: {}\r\n\r\n", body.len()));
            socket.write_all(head.as_bytes()).await?;
            socket.write_all(body.as_bytes()).await?;
        }
        Body::Chunks(chunks, stall) => {
            head.push_str("\r\n");
            socket.write_all(head.as_bytes()).await?;
            for chunk in chunks {
                socket.write_all(chunk.as_bytes()).await?;
                socket.flush().await?;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            if let Some(stall) = stall {
                tokio::time::sleep(stall).await;
            }
        }
        Body::Hang(duration) => {
            tokio::time::sleep(duration).await;
        }
    }
    socket.flush().await?;
    socket.shutdown().await
}

async fn read_request(socket: &mut TcpStream) -> std::io::Result<Recorded> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
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
    let mut body = buffer[head_end + 4..].to_vec();
    while body.len() < length {
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok(Recorded {
        method,
        path,
        headers,
        body,
    })
}
