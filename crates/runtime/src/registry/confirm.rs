//! `CONFIRMATION_REQUIRED` / `CONFIRMATION_INVALID`: tools that need the
//! user's confirmation.
//!
//! A call to such a tool without a `confirmationToken` argument is answered
//! with a [`ConfirmationRequest`]: a token derived from the tool name and the
//! canonical arguments (no randomness), an expiry (now + the store's TTL,
//! 5 minutes by default, in Unix milliseconds), the arguments and a preview.
//! The application shows the preview; the model calls again with the same
//! arguments plus `confirmationToken`. A token issued for the same tool and
//! arguments and not expired lets the call through once (it is consumed);
//! the token is removed from the arguments before anything inside this stage
//! sees them. Any other token is `CONFIRMATION_INVALID`, with a fresh request.
//!
//! The store only checks that the token was issued for this exact call: it
//! does not know whether the user agreed. An application that must see the
//! user's consent should keep the token from the model until the user
//! confirms.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use markov_core::tool::ToolExecutionResult;
use serde::Serialize;
use serde_json::Value;

use super::error::{Rejection, ToolErrorKind};
use super::service::{ToolLayer, ToolRequest, ToolService};

/// The argument that carries a confirmation token.
pub const CONFIRMATION_TOKEN: &str = "confirmationToken";

/// Tokens kept at most; the oldest expiries are dropped first.
const MAX_TOKENS: usize = 1024;

/// What the model (and through it, the user) is asked to confirm.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConfirmationRequest {
    /// The token to send back as `confirmationToken`.
    pub token: String,
    /// When the token expires, in Unix milliseconds.
    pub expires: u64,
    /// The tool.
    pub tool: String,
    /// The arguments, without any token.
    pub args: Value,
    /// A one-line preview of the action.
    pub preview: String,
}

#[derive(Debug, Clone)]
struct Issued {
    tool: String,
    args_hash: u64,
    expires: SystemTime,
}

/// The in-memory store of issued confirmation tokens.
#[derive(Debug)]
pub struct ConfirmationStore {
    ttl: Duration,
    issued: Mutex<HashMap<String, Issued>>,
}

impl Default for ConfirmationStore {
    fn default() -> Self {
        Self::new(Duration::from_secs(300))
    }
}

impl ConfirmationStore {
    /// A store whose tokens live for `ttl`.
    pub fn new(ttl: Duration) -> Self {
        ConfirmationStore {
            ttl,
            issued: Mutex::new(HashMap::new()),
        }
    }

    /// How long a token lives.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Issues (or re-issues) the token of `tool` with `args` at `now`.
    pub fn issue(&self, tool: &str, args: &Value, now: SystemTime) -> ConfirmationRequest {
        let canonical = canonical(args);
        let args_hash = hash_of(&canonical);
        let token = token_for(tool, args_hash);
        // A lifetime too long for the clock ("never expires") saturates.
        let expires = now
            .checked_add(self.ttl)
            .unwrap_or(SystemTime::UNIX_EPOCH + Duration::from_secs(u64::from(u32::MAX) * 64));
        let mut issued = self.issued.lock().unwrap_or_else(|p| p.into_inner());
        issued.retain(|_, i| i.expires > now);
        if issued.len() >= MAX_TOKENS
            && let Some(oldest) = issued
                .iter()
                .min_by_key(|(_, i)| i.expires)
                .map(|(t, _)| t.clone())
        {
            issued.remove(&oldest);
        }
        issued.insert(
            token.clone(),
            Issued {
                tool: tool.to_owned(),
                args_hash,
                expires,
            },
        );
        let preview = format!("{tool} {}", canonical_text(&canonical));
        ConfirmationRequest {
            token,
            expires: expires
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            tool: tool.to_owned(),
            args: canonical,
            preview,
        }
    }

    /// Consumes `token` if it was issued for `tool` with `args` and has not
    /// expired at `now`.
    pub fn redeem(&self, token: &str, tool: &str, args: &Value, now: SystemTime) -> bool {
        let mut issued = self.issued.lock().unwrap_or_else(|p| p.into_inner());
        let valid = issued.get(token).is_some_and(|i| {
            i.tool == tool && i.args_hash == hash_of(&canonical(args)) && now < i.expires
        });
        if valid {
            issued.remove(token);
        }
        valid
    }

    /// The stage's decision for a call of `tool` (sans-IO): strips the token
    /// from `input`, then passes the call (`Ok`) or asks for a confirmation.
    pub fn check(&self, tool: &str, input: &mut Value, now: SystemTime) -> Result<(), Rejection> {
        let token = match input {
            Value::Object(map) => map.remove(CONFIRMATION_TOKEN),
            _ => None,
        };
        match token {
            None => Err(Rejection::new(ToolErrorKind::ConfirmationRequired)
                .with_confirmation(self.issue(tool, input, now))),
            Some(Value::String(token)) if self.redeem(&token, tool, input, now) => Ok(()),
            Some(_) => Err(Rejection::new(ToolErrorKind::ConfirmationInvalid)
                .with_confirmation(self.issue(tool, input, now))),
        }
    }
}

fn token_for(tool: &str, args_hash: u64) -> String {
    let mut h = DefaultHasher::new();
    tool.hash(&mut h);
    args_hash.hash(&mut h);
    format!("cfm_{:016x}", h.finish())
}

fn hash_of(canonical: &Value) -> u64 {
    let mut h = DefaultHasher::new();
    canonical_text(canonical).hash(&mut h);
    h.finish()
}

fn canonical_text(v: &Value) -> String {
    v.to_string()
}

/// `v` with object keys sorted at every level (independent of serde_json's
/// `preserve_order`).
fn canonical(v: &Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), canonical(v)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        Value::Null => Value::Object(serde_json::Map::new()),
        other => other.clone(),
    }
}

/// The confirmation stage's layer.
#[derive(Debug, Clone)]
pub struct ConfirmLayer {
    store: Arc<ConfirmationStore>,
}

impl ConfirmLayer {
    /// A layer over `store`.
    pub fn new(store: Arc<ConfirmationStore>) -> Self {
        ConfirmLayer { store }
    }
}

impl<S> ToolLayer<S> for ConfirmLayer {
    type Service = Confirm<S>;
    fn layer(&self, inner: S) -> Self::Service {
        Confirm {
            inner,
            store: Arc::clone(&self.store),
        }
    }
}

/// A service behind the confirmation stage.
#[derive(Debug, Clone)]
pub struct Confirm<S> {
    inner: S,
    store: Arc<ConfirmationStore>,
}

impl<S: ToolService> ToolService for Confirm<S> {
    fn call<'a>(&'a self, mut req: ToolRequest<'a>) -> BoxFuture<'a, ToolExecutionResult> {
        if !req.metadata.is_some_and(|m| m.requires_confirmation()) {
            return self.inner.call(req);
        }
        match self
            .store
            .check(req.name, &mut req.input, SystemTime::now())
        {
            Ok(()) => self.inner.call(req),
            Err(rejection) => {
                let result = rejection.respond(&req);
                Box::pin(std::future::ready(result))
            }
        }
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("confirm");
        self.inner.stages(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_token_round_trip() {
        let store = ConfirmationStore::default();
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        let mut input = json!({"b": 2, "a": 1});
        let err = store
            .check("pay", &mut input, now)
            .expect_err("needs a token");
        assert_eq!(err.kind(), ToolErrorKind::ConfirmationRequired);
        let request = err.confirmation().expect("a request").clone();
        assert_eq!(request.expires, 1_300_000);
        assert_eq!(request.preview, r#"pay {"a":1,"b":2}"#);
        assert!(request.token.starts_with("cfm_"));
        // Deterministic: the same call gets the same token.
        assert_eq!(
            store.issue("pay", &json!({"a": 1, "b": 2}), now).token,
            request.token
        );

        let mut with_token = json!({"a": 1, "b": 2, "confirmationToken": request.token});
        assert!(store.check("pay", &mut with_token, now).is_ok());
        assert_eq!(with_token, json!({"a": 1, "b": 2}), "the token is stripped");
        // Consumed.
        let mut again = json!({"a": 1, "b": 2, "confirmationToken": request.token});
        let err = store.check("pay", &mut again, now).expect_err("used");
        assert_eq!(err.kind(), ToolErrorKind::ConfirmationInvalid);
    }

    #[test]
    fn wrong_and_expired_tokens_are_refused() {
        let store = ConfirmationStore::default();
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        let token = store.issue("pay", &json!({"a": 1}), now).token;
        assert!(
            !store.redeem(&token, "pay", &json!({"a": 2}), now),
            "other args"
        );
        assert!(
            !store.redeem(&token, "refund", &json!({"a": 1}), now),
            "other tool"
        );
        assert!(
            !store.redeem("cfm_0", "pay", &json!({"a": 1}), now),
            "unknown"
        );
        let later = now + Duration::from_secs(301);
        assert!(
            !store.redeem(&token, "pay", &json!({"a": 1}), later),
            "expired"
        );
    }

    #[test]
    fn a_lifetime_longer_than_the_clock_does_not_panic() {
        let store = ConfirmationStore::new(Duration::MAX);
        let request = store.issue("pay", &serde_json::json!({"amount": 1}), SystemTime::now());
        assert!(request.expires > 0);
    }
}
