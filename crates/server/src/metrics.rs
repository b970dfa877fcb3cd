//! What the service counts, in the form Prometheus scrapes
//! (`GET /metrics`): requests by route and status, runs, steps, tool
//! calls, errors, and latency histograms.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// A request's labels.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    /// The route's pattern (`/sessions/{id}`), never the raw path: a
    /// label per session would grow without bound.
    pub(crate) route: String,
    pub(crate) method: String,
    pub(crate) status: u16,
}

/// A route's label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteLabel {
    pub(crate) route: String,
}

/// How a run ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabel {
    pub(crate) outcome: &'static str,
}

/// The service's metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SourceLabel {
    pub(crate) source: &'static str,
}

#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    pub(crate) requests: Family<RequestLabels, Counter>,
    pub(crate) request_seconds: Family<RouteLabel, Histogram>,
    pub(crate) runs: Family<OutcomeLabel, Counter>,
    pub(crate) run_seconds: Histogram,
    pub(crate) running: Gauge,
    pub(crate) steps: Counter,
    pub(crate) tool_calls: Counter,
    pub(crate) rate_limited: Counter,
    pub(crate) unauthenticated: Counter,
    pub(crate) sessions_opened: Family<SourceLabel, Counter>,
    pub(crate) runs_continued: Counter,
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    // 1 ms to about 9 minutes.
    exponential_buckets(0.001, 2.0, 20)
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("markov");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by route, method and status",
            requests.clone(),
        );
        let request_seconds = Family::<RouteLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(seconds_buckets())
        });
        registry.register(
            "http_request_duration_seconds",
            "Time to the response's head (a streamed run's events come after it)",
            request_seconds.clone(),
        );
        let runs = Family::<OutcomeLabel, Counter>::default();
        registry.register("runs", "Runs ended, by outcome", runs.clone());
        let run_seconds = Histogram::new(seconds_buckets());
        registry.register(
            "run_duration_seconds",
            "Time from a run's start to its end",
            run_seconds.clone(),
        );
        let running = Gauge::default();
        registry.register("runs_in_progress", "Runs in progress", running.clone());
        let steps = Counter::default();
        registry.register("steps", "Steps stored", steps.clone());
        let tool_calls = Counter::default();
        registry.register("tool_calls", "Tool calls answered", tool_calls.clone());
        let rate_limited = Counter::default();
        registry.register(
            "rate_limited_requests",
            "Requests refused by a principal's rate limit",
            rate_limited.clone(),
        );
        let unauthenticated = Counter::default();
        registry.register(
            "unauthenticated_requests",
            "Requests refused for a missing or invalid credential",
            unauthenticated.clone(),
        );
        let sessions_opened = Family::<SourceLabel, Counter>::default();
        registry.register(
            "sessions_opened",
            "Sessions opened to serve a request, by where their machine came from \
             (memory: kept since it was created or last used; store: read back)",
            sessions_opened.clone(),
        );
        let runs_continued = Counter::default();
        registry.register(
            "runs_continued",
            "Runs left in progress (by a server that stopped or a worker that died) \
             that this server claimed and continued",
            runs_continued.clone(),
        );
        Metrics {
            registry,
            requests,
            request_seconds,
            runs,
            run_seconds,
            running,
            steps,
            tool_calls,
            rate_limited,
            unauthenticated,
            sessions_opened,
            runs_continued,
        }
    }

    /// Records one answered request.
    pub(crate) fn request(&self, route: &str, method: &str, status: u16, took: Duration) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                method: method.to_owned(),
                status,
            })
            .inc();
        self.request_seconds
            .get_or_create(&RouteLabel {
                route: route.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    /// Records a run's end.
    pub(crate) fn run_ended(&self, outcome: &'static str, took: Duration) {
        self.runs.get_or_create(&OutcomeLabel { outcome }).inc();
        self.run_seconds.observe(took.as_secs_f64());
    }

    /// The text exposition format.
    pub(crate) fn encode(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}
