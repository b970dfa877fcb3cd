//! The soak figure: `sessions` sessions at once, each sent `turns`
//! messages one after another, against one server process that stores in
//! a SQLite file (synced, as by default). After every tenth of the rounds:
//! the server's resident memory and open descriptors, and the database's
//! size. Memory should be flat once the sessions are warm (their
//! histories aside), descriptors constant, and the database grow by the
//! same bytes for every turn.
//!
//! The server's live heap is counted exactly too (its counting allocator,
//! opened just before the first session is made): after the first turn,
//! per session, is what an open session costs; its growth per turn is
//! what the history costs in memory; once the clients have left, what
//! the sessions hold without their connections.

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use markov_testkit::Recording;
use markov_testkit::http::FakeServer;
use serde_json::json;

use crate::server::{WorkerOptions, WorkerStore, answer, start_worker, vm_hwm_of};

/// One sample, after `round` rounds.
#[derive(Debug, Clone, Copy)]
struct Sample {
    round: usize,
    rss_kb: u64,
    fds: usize,
    db_bytes: u64,
    /// The server's live heap: bytes allocated and not freed since just
    /// before the first session was made.
    heap_bytes: i64,
    elapsed: Duration,
}

/// Asks the worker for its live heap (see `server::answer_heap_requests`)
/// through `stdin`; the answer is a file, read within 5 s or 0.
fn heap_of(stdin: &mut std::process::ChildStdin, dir: &std::path::Path, name: &str) -> i64 {
    let path = dir.join(name);
    if writeln!(stdin, "heap {}", path.display()).is_err() || stdin.flush().is_err() {
        return 0;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Some(bytes) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|text| text.trim().parse().ok())
        {
            return bytes;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    0
}

/// Open descriptors of process `pid`.
fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// The database's size as a reader sees it (its pages, the write-ahead
/// log's included; the files' sizes would count the log's preallocation).
fn database_bytes(path: &std::path::Path) -> u64 {
    let Ok(conn) =
        rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return 0;
    };
    let pragma = |name: &str| -> u64 {
        conn.pragma_query_value(None, name, |r| r.get::<_, i64>(0))
            .map_or(0, |v| u64::try_from(v).unwrap_or(0))
    };
    pragma("page_count") * pragma("page_size")
}

/// Runs the soak and prints one line per sample and a summary.
/// At most `in_flight` messages are sent at once: with fewer than the
/// sessions, most sessions are open but idle, as in a real service, and
/// the connections (the clients' and the provider's) stop dominating the
/// memory per session.
pub(crate) fn figure(sessions: usize, turns: usize, in_flight: usize) {
    let runtime = markov_bench::two_thread_runtime();
    let exe = std::env::current_exe().expect("the bench binary");
    let dir = std::env::temp_dir().join(format!("markov-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    let database = dir.join("sessions.db");
    runtime.block_on(async {
        let provider = FakeServer::start().await;
        provider.answer_with(answer).recording(Recording::Off);
        let options = WorkerOptions {
            store: WorkerStore::Sqlite(database.display().to_string()),
            ..WorkerOptions::memory()
        };
        let (mut worker, base) = start_worker(&exe, &provider.base_url(), &options);
        let pid = worker.id();
        let mut stdin = worker.stdin.take().expect("the worker's stdin");
        let _ = writeln!(stdin, "heap-open").and_then(|()| stdin.flush());
        let database = database.clone();
        let dir = dir.clone();
        let (samples, heap_idle) = tokio::task::spawn_blocking(move || {
            let mut client = Command::new(exe)
                .args([
                    "soak-clients",
                    &sessions.to_string(),
                    &turns.to_string(),
                    &in_flight.to_string(),
                    &base,
                ])
                .stdout(Stdio::piped())
                .spawn()
                .expect("the clients run");
            let out = client.stdout.take().expect("the client's output");
            let every = (turns / 10).max(1);
            let start = Instant::now();
            let mut samples = Vec::new();
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let Some(round) = line
                    .strip_prefix("round=")
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|r| r.parse::<usize>().ok())
                else {
                    continue;
                };
                if line.contains("failed=") && !line.ends_with("failed=0") {
                    eprintln!("soak: {line}");
                }
                if round == 1 || round % every == 0 || round == turns {
                    let sample = Sample {
                        round,
                        rss_kb: crate::proc_status_kb_of(&pid.to_string(), "VmRSS").unwrap_or(0),
                        fds: descriptors(pid),
                        db_bytes: database_bytes(&database),
                        heap_bytes: heap_of(&mut stdin, &dir, &format!("heap-{round}")),
                        elapsed: start.elapsed(),
                    };
                    println!(
                        "bench=soak sessions={sessions} round={round} elapsed_s={:.1} server_rss_mb={:.1} server_heap_mb={:.1} server_fds={} db_mb={:.2}",
                        sample.elapsed.as_secs_f64(),
                        sample.rss_kb as f64 / 1024.0,
                        sample.heap_bytes as f64 / 1_048_576.0,
                        sample.fds,
                        sample.db_bytes as f64 / 1_048_576.0,
                    );
                    let _ = std::io::stdout().flush();
                    samples.push(sample);
                }
            }
            match client.wait() {
                Ok(status) if status.success() => {}
                status => eprintln!("soak: the client process failed: {status:?}"),
            }
            // The clients have left: no connection of theirs holds buffers
            // in the server any more; what is left is the sessions (parked
            // with their histories, their last run's events) and the
            // provider's idle connections.
            std::thread::sleep(Duration::from_millis(500));
            let idle = heap_of(&mut stdin, &dir, "heap-idle");
            (samples, idle)
        })
        .await
        .expect("the soak finished");
        let peak_kb = vm_hwm_of(pid);
        let _ = worker.kill();
        let _ = worker.wait();
        summarize(sessions, in_flight, &samples, peak_kb, heap_idle);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// The summary: memory after warm-up (the first sample) to the end, per
/// turn; descriptors; the database's growth per turn in the first and the
/// second half of the run (equal when it is linear in the messages).
fn summarize(sessions: usize, in_flight: usize, samples: &[Sample], peak_kb: u64, heap_idle: i64) {
    let (Some(first_turn), Some(last)) = (samples.first(), samples.last()) else {
        println!("bench=soak_summary failed=\"no samples\"");
        return;
    };
    // Warm: after the first tenth of the rounds (the first sample is the
    // first turn's, for the memory a session costs).
    let first = samples.get(1).unwrap_or(first_turn);
    let middle = &samples[samples.len() / 2];
    let turns_between = (sessions * (last.round - first.round)).max(1) as f64;
    let growth = |a: &Sample, b: &Sample| {
        (b.db_bytes as f64 - a.db_bytes as f64) / (sessions * (b.round - a.round)).max(1) as f64
    };
    let per_session = |bytes: i64| bytes as f64 / sessions.max(1) as f64;
    println!(
        "bench=soak_session_memory sessions={sessions} in_flight={in_flight} heap_per_session_after_first_turn_bytes={:.0} heap_growth_per_turn_bytes={:.0} heap_per_session_at_end_bytes={:.0} heap_per_session_clients_gone_bytes={:.0} db_per_session_after_first_turn_bytes={:.0}",
        per_session(first_turn.heap_bytes),
        (last.heap_bytes - first.heap_bytes) as f64 / turns_between,
        per_session(last.heap_bytes),
        per_session(heap_idle),
        first_turn.db_bytes as f64 / sessions.max(1) as f64,
    );
    println!(
        "bench=soak_summary sessions={sessions} turns={} wall_s={:.1} steps_per_s={:.0} rss_warm_mb={:.1} rss_end_mb={:.1} rss_growth_bytes_per_turn={:.0} peak_rss_mb={:.1} fds_warm={} fds_end={} db_growth_bytes_per_turn_first_half={:.0} db_growth_bytes_per_turn_second_half={:.0}",
        last.round,
        last.elapsed.as_secs_f64(),
        (sessions * last.round) as f64 / last.elapsed.as_secs_f64().max(1e-9),
        first.rss_kb as f64 / 1024.0,
        last.rss_kb as f64 / 1024.0,
        (last.rss_kb as f64 - first.rss_kb as f64) * 1024.0 / turns_between,
        peak_kb as f64 / 1024.0,
        first.fds,
        last.fds,
        growth(first, middle),
        growth(middle, last),
    );
}

/// The client process: `sessions` sessions on `base` (`<url>#<key>`), then
/// `turns` rounds, each one message to every session, at most `in_flight`
/// at once; prints `round=N failed=F` after each.
pub(crate) fn clients(
    sessions: usize,
    turns: usize,
    in_flight: usize,
    base: &str,
) -> std::process::ExitCode {
    let runtime = markov_bench::two_thread_runtime();
    let Some((base, key)) = base.split_once('#') else {
        return std::process::ExitCode::from(2);
    };
    runtime.block_on(async {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder().build().expect("a client");
        let mut urls = Vec::with_capacity(sessions);
        for _ in 0..sessions {
            let id = crate::server::new_session(&client, base, key).await;
            urls.push(format!("{base}/sessions/{id}/messages"));
        }
        for round in 1..=turns {
            let runs = urls.iter().map(|url| {
                let (client, url, key) = (client.clone(), url.clone(), key.to_owned());
                tokio::spawn(async move {
                    let stream = client
                        .post(url)
                        .bearer_auth(&key)
                        .json(&json!({"text": format!("message {round}")}))
                        .send()
                        .await
                        .ok()?
                        .text()
                        .await
                        .ok()?;
                    stream.contains("event: done").then_some(())
                })
            });
            let failed = futures::stream::iter(runs)
                .buffer_unordered(in_flight.max(1))
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .filter(|r| !matches!(r, Ok(Some(()))))
                .count();
            println!("round={round} failed={failed}");
            let _ = std::io::stdout().flush();
        }
    });
    std::process::ExitCode::SUCCESS
}
