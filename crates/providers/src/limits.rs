//! Outgoing limits of one client: a bound on the calls in flight and a
//! token-bucket rate of requests and tokens per minute, with a queue whose
//! wait has a deadline.
//!
//! A call waits for a place before its first attempt: first for one of the
//! `max_concurrent` places (held until the call ends, its stream's last
//! event included), then for its share of each rate. Past
//! [`Limits::queue_deadline`] it ends with [`ModelError::Overloaded`]
//! naming the limit, without a request; a [`Fallback`](crate::Fallback)
//! then asks its next model. Its retries take their request from the
//! bucket again, bounded by the call's own deadline.
//!
//! The tokens a call costs are estimated before it is sent: a quarter of
//! its body's bytes (about one token per four bytes of JSON) plus its
//! `max_tokens`, as providers count the answer's allowance against the
//! rate; a call costing more than a whole minute's tokens waits for a full
//! bucket.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use markov_core::ModelError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// The outgoing limits of a client.
///
/// By default a client has at most [`Limits::DEFAULT_MAX_CONCURRENT`] calls
/// in flight: each holds at most one connection to the provider while it
/// runs (with HTTP/2 several calls share one), so this is also the bound on
/// connections per host; a call beyond it waits for a place, at most
/// [`Limits::queue_deadline`] (60 s by default), then fails with
/// [`ModelError::Overloaded`] without a request. The rates are off by
/// default.
///
/// ```
/// use std::time::Duration;
/// use markov_providers::Limits;
///
/// let limits = Limits::default()
///     .max_concurrent(8)
///     .requests_per_minute(500)
///     .tokens_per_minute(200_000)
///     .queue_deadline(Duration::from_secs(30));
/// # let _ = limits;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// The most calls in flight at once; `None` for no bound (default
    /// [`Limits::DEFAULT_MAX_CONCURRENT`]).
    pub max_concurrent: Option<usize>,
    /// Requests per minute (retries included); `None` for no rate.
    pub requests_per_minute: Option<u32>,
    /// Estimated tokens per minute (see the module docs); `None` for no rate.
    pub tokens_per_minute: Option<u32>,
    /// The longest a call waits in the queue (default 60 s).
    pub queue_deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

impl Limits {
    /// The default bound on calls in flight, and so on connections per
    /// host: the connection limit of OpenAI's and Anthropic's own SDKs.
    /// Without a bound, a service with many sessions opens a connection per
    /// waiting call and runs out of file descriptors before the provider
    /// says it is overloaded.
    pub const DEFAULT_MAX_CONCURRENT: usize = 1_000;

    /// At most [`Limits::DEFAULT_MAX_CONCURRENT`] calls in flight, no
    /// rates, a queue deadline of 60 s.
    pub(crate) const DEFAULT: Limits = Limits {
        max_concurrent: Some(Limits::DEFAULT_MAX_CONCURRENT),
        requests_per_minute: None,
        tokens_per_minute: None,
        queue_deadline: Duration::from_secs(60),
    };

    /// Bounds the calls in flight (at least 1).
    #[must_use]
    pub fn max_concurrent(mut self, calls: usize) -> Self {
        self.max_concurrent = Some(calls.max(1));
        self
    }

    /// Sets the rate of requests per minute (at least 1).
    #[must_use]
    pub fn requests_per_minute(mut self, requests: u32) -> Self {
        self.requests_per_minute = Some(requests.max(1));
        self
    }

    /// Sets the rate of estimated tokens per minute (at least 1).
    #[must_use]
    pub fn tokens_per_minute(mut self, tokens: u32) -> Self {
        self.tokens_per_minute = Some(tokens.max(1));
        self
    }

    /// Sets the longest a call waits for its place.
    #[must_use]
    pub fn queue_deadline(mut self, deadline: Duration) -> Self {
        self.queue_deadline = deadline;
        self
    }

    fn is_off(&self) -> bool {
        self.max_concurrent.is_none()
            && self.requests_per_minute.is_none()
            && self.tokens_per_minute.is_none()
    }
}

/// A token bucket that refills continuously to a minute's worth.
#[derive(Debug)]
struct Bucket {
    per_minute: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: u32) -> Mutex<Self> {
        let per_minute = f64::from(per_minute);
        Mutex::new(Bucket {
            per_minute,
            level: per_minute,
            at: Instant::now(),
        })
    }

    /// Takes `cost` (at most a full bucket) if it is there, else says how
    /// long until it will be.
    fn take(&mut self, cost: f64) -> Result<(), Duration> {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.per_minute / 60.0;
        self.level = (self.level + refill).min(self.per_minute);
        self.at = now;
        let cost = cost.min(self.per_minute);
        if self.level >= cost {
            self.level -= cost;
            return Ok(());
        }
        let missing = cost - self.level;
        let wait = missing * 60.0 / self.per_minute;
        // At least a millisecond, so that a waiter does not spin.
        Err(Duration::from_secs_f64(wait).max(Duration::from_millis(1)))
    }
}

/// The limits of one client, shared by its clones.
#[derive(Debug)]
pub(crate) struct Limiter {
    limits: Limits,
    places: Option<Arc<Semaphore>>,
    requests: Option<Mutex<Bucket>>,
    tokens: Option<Mutex<Bucket>>,
}

/// A call's place: held until the call (its stream included) ends.
#[derive(Debug)]
pub(crate) struct Place {
    _permit: Option<OwnedSemaphorePermit>,
}

impl Limiter {
    /// The limiter of `limits`, or `None` when they are all off.
    pub(crate) fn new(limits: Limits) -> Option<Arc<Self>> {
        if limits.is_off() {
            return None;
        }
        Some(Arc::new(Limiter {
            limits,
            places: limits
                .max_concurrent
                .map(|n| Arc::new(Semaphore::new(n.min(Semaphore::MAX_PERMITS)))),
            requests: limits.requests_per_minute.map(Bucket::new),
            tokens: limits.tokens_per_minute.map(Bucket::new),
        }))
    }

    /// Waits for a place and the call's share of the rates, at most the
    /// queue deadline.
    pub(crate) async fn enter(&self, tokens: u64) -> Result<Place, ModelError> {
        let wait = async {
            let permit = match &self.places {
                // The semaphore is never closed.
                Some(places) => Arc::clone(places).acquire_owned().await.ok(),
                None => None,
            };
            self.take_rate(tokens).await;
            Place { _permit: permit }
        };
        tokio::time::timeout(self.limits.queue_deadline, wait)
            .await
            .map_err(|_| {
                ModelError::Overloaded(format!(
                    "the client's own outgoing limits ({}) kept the call waiting longer than its queue deadline of {:?}; no request was sent",
                    self.describe(),
                    self.limits.queue_deadline
                ))
            })
    }

    /// Waits for one request's share of the request rate (a retry's).
    pub(crate) async fn take_request(&self) {
        self.take_rate(0).await;
    }

    async fn take_rate(&self, tokens: u64) {
        // The request first: a call that holds its request waits for its
        // tokens, never the other way round.
        #[allow(clippy::cast_precision_loss)]
        let costs = [
            (self.requests.as_ref(), 1.0),
            (self.tokens.as_ref(), tokens as f64),
        ];
        for (bucket, cost) in costs {
            let Some(bucket) = bucket else { continue };
            if cost <= 0.0 {
                continue;
            }
            loop {
                let taken = bucket.lock().unwrap_or_else(|p| p.into_inner()).take(cost);
                match taken {
                    Ok(()) => break,
                    Err(wait) => tokio::time::sleep(wait).await,
                }
            }
        }
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(n) = self.limits.max_concurrent {
            parts.push(format!("{n} calls at once"));
        }
        if let Some(n) = self.limits.requests_per_minute {
            parts.push(format!("{n} requests a minute"));
        }
        if let Some(n) = self.limits.tokens_per_minute {
            parts.push(format!("{n} tokens a minute"));
        }
        parts.join(", ")
    }
}

/// The tokens a call is estimated to cost: a quarter of its body's bytes
/// plus its answer's allowance.
pub(crate) fn estimate_tokens(body_len: usize, max_tokens: u32) -> u64 {
    u64::try_from(body_len / 4)
        .unwrap_or(u64::MAX)
        .saturating_add(u64::from(max_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Moves the bucket's last refill `by` into the past, as if that much
    /// time had gone by.
    fn age(bucket: &mut Bucket, by: Duration) {
        bucket.at = bucket
            .at
            .checked_sub(by)
            .expect("the clock goes back that far");
    }

    #[test]
    fn a_bucket_refills_to_a_minutes_worth() {
        let mut bucket = Bucket::new(60).into_inner().unwrap();
        for _ in 0..60 {
            assert_eq!(bucket.take(1.0), Ok(()));
        }
        let wait = bucket.take(1.0).unwrap_err();
        assert!(
            wait <= Duration::from_secs(1) && wait > Duration::from_millis(900),
            "{wait:?}"
        );
        age(&mut bucket, Duration::from_secs(10));
        for _ in 0..10 {
            assert_eq!(bucket.take(1.0), Ok(()));
        }
        assert!(bucket.take(1.0).is_err());
        // More than a minute's worth waits for a full bucket, not forever.
        age(&mut bucket, Duration::from_secs(120));
        assert_eq!(bucket.take(1e9), Ok(()));
    }

    #[test]
    fn calls_in_flight_are_bounded_by_default_and_all_off_makes_no_limiter() {
        let default = Limits::default();
        assert_eq!(default.max_concurrent, Some(Limits::DEFAULT_MAX_CONCURRENT));
        assert!(Limiter::new(default).is_some());
        let off = Limits {
            max_concurrent: None,
            ..Limits::default()
        };
        assert!(Limiter::new(off).is_none());
        assert_eq!(Limits::default().max_concurrent(0).max_concurrent, Some(1));
        assert_eq!(estimate_tokens(400, 50), 150);
    }
}
