//! Figure 7: the HTTP service under load. N sessions at once, each created
//! over HTTP and sent one message whose answer comes from the Anthropic
//! client talking to the loopback fake provider, which answers after
//! 100 ms; the runs are stored in SQLite (in memory) and streamed back as
//! server-sent events.

use std::sync::Arc;
use std::time::{Duration, Instant};

use markov_executor::StandardExecutor;
use markov_providers::Anthropic;
use markov_runtime::charter::Charter;
use markov_runtime::node::Node;
use markov_server::{Agent, router};
use markov_store::{SqliteStore, WorkerId};
use markov_testkit::http::{FakeServer, Reply, anthropic};
use serde_json::json;

use crate::Stats;

/// The fake provider's latency.
pub(crate) const MODEL_LATENCY: Duration = Duration::from_millis(100);

/// One load run.
#[derive(Debug)]
pub(crate) struct ServerFigure {
    pub(crate) sessions: usize,
    pub(crate) completed: usize,
    pub(crate) wall: Duration,
    /// Latency of a message (request to end of stream) minus the model's.
    pub(crate) added: Stats,
    pub(crate) vm_hwm_kb: u64,
}

async fn load(n: usize) -> ServerFigure {
    let provider = FakeServer::start().await;
    for _ in 0..n {
        provider.reply(Reply::json(200, anthropic::text("ok")).delayed(MODEL_LATENCY));
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let model = Anthropic::builder()
        .api_key("sk-ant-bench")
        .base_url(provider.base_url())
        .max_retries(0)
        .timeout(Duration::from_secs(120))
        .build()
        .expect("the client builds");
    let node = Node::builder("Answer.").name("main").build().expect("node");
    let charter = Charter::builder("load")
        .node("main", node.clone())
        .build()
        .expect("charter");
    let agent = Agent {
        charter,
        start: node,
        state: json!({}),
        executor: Arc::new(StandardExecutor::new(model)),
    };
    let store = Arc::new(SqliteStore::in_memory().expect("a database"));
    let app = router(agent, store, WorkerId::new("bench"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let base = format!("http://{}", listener.local_addr().expect("an address"));
    tokio::spawn(markov_server::serve(listener, app));

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("a client");
    // Every session first, then every message at once: N sessions held.
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        let created = client
            .post(format!("{base}/sessions"))
            .send()
            .await
            .expect("created");
        let body: serde_json::Value = created.json().await.expect("json");
        ids.push(body["id"].as_str().unwrap_or_default().to_owned());
    }
    let start = Instant::now();
    let runs = ids.into_iter().map(|id| {
        let client = client.clone();
        let url = format!("{base}/sessions/{id}/messages");
        tokio::spawn(async move {
            let sent = Instant::now();
            let stream = client
                .post(url)
                .json(&json!({"text": "hi"}))
                .send()
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            stream
                .contains("event: done")
                .then(|| sent.elapsed().saturating_sub(MODEL_LATENCY))
        })
    });
    let results = futures::future::join_all(runs).await;
    let wall = start.elapsed();
    let added: Vec<Duration> = results
        .into_iter()
        .filter_map(|r| r.ok().flatten())
        .collect();
    ServerFigure {
        sessions: n,
        completed: added.len(),
        wall,
        added: Stats::of(&added),
        vm_hwm_kb: crate::proc_status_kb("VmHWM").unwrap_or(0),
    }
}

/// Figure 7 for each N, on a 2-worker runtime.
pub(crate) fn server_figures(ns: &[usize]) -> Vec<ServerFigure> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    ns.iter()
        .map(|&n| {
            let figure = runtime.block_on(load(n));
            println!(
                "bench=server sessions={} completed={} wall_ms={:.0} steps_per_s={:.0} added_p50_ms={:.1} added_p99_ms={:.1} vm_hwm_mb={:.1}",
                figure.sessions,
                figure.completed,
                figure.wall.as_secs_f64() * 1e3,
                figure.completed as f64 / figure.wall.as_secs_f64(),
                figure.added.median_us / 1e3,
                figure.added.p99_us / 1e3,
                figure.vm_hwm_kb as f64 / 1024.0
            );
            figure
        })
        .collect()
}
