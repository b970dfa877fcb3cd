//! Identical-call counts: a leaf that calls the same tool with the same
//! arguments over and over within one user turn is stopped.
//!
//! The rule (how many repeats, how many refusals before the run ends) is
//! the charter's loop guard; the executor passes its two numbers to
//! [`RepeatCounts::check`]. After `max_repeats` identical calls in a user
//! turn, the next one is not run and gets an error result telling the model
//! it is repeating itself; after `stop_after` more such refusals the run
//! ends. [`RepeatCounts`] holds one conversation's counts (part of its
//! [`PolicyState`](crate::PolicyState) and of its snapshot); they start over
//! with each user turn. The step limit still bounds everything.

use std::collections::HashMap;
use std::sync::Mutex;

use markov_core::ids::InstanceId;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What the loop guard's rule says about one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Repeat {
    /// Run it.
    Allowed,
    /// Do not run it: the model is repeating itself (`times` identical calls
    /// so far, this one included).
    Refused {
        /// Identical calls in this user turn, this one included.
        times: u32,
    },
    /// Do not run it, and end the run.
    Stop {
        /// Identical calls in this user turn, this one included.
        times: u32,
    },
}

/// One key's counts, as a snapshot keeps them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RepeatRecord {
    /// The leaf.
    pub instance: InstanceId,
    /// The tool.
    pub tool: String,
    /// A stable fingerprint of the arguments (FNV-1a of their canonical JSON).
    pub fingerprint: String,
    /// Calls seen in this user turn.
    pub calls: u32,
    /// Of which refused.
    pub refused: u32,
}

#[derive(Debug, Clone, Copy, Default)]
struct Count {
    calls: u32,
    refused: u32,
}

/// One conversation's identical-call counts for the current user turn.
#[derive(Debug, Default)]
pub struct RepeatCounts {
    counts: Mutex<HashMap<(InstanceId, String, u64), Count>>,
}

/// Keys remembered at most; past it the counts start over (a turn with that
/// many distinct calls is bounded by the step limit anyway).
const MAX_KEYS: usize = 4096;

impl RepeatCounts {
    /// No calls counted.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(InstanceId, String, u64), Count>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a call of `tool` with `args` by `leaf` and says whether it may
    /// run when `max_repeats` identical calls are allowed per user turn
    /// (`None`: no limit) and the run ends after `stop_after` refused ones
    /// (`None`: never).
    pub fn check(
        &self,
        max_repeats: Option<u32>,
        stop_after: Option<u32>,
        leaf: &InstanceId,
        tool: &str,
        args: &Value,
    ) -> Repeat {
        let Some(max) = max_repeats else {
            return Repeat::Allowed;
        };
        let mut counts = self.lock();
        if counts.len() >= MAX_KEYS {
            counts.clear();
        }
        let count = counts
            .entry((leaf.clone(), tool.to_owned(), fingerprint(args)))
            .or_default();
        count.calls = count.calls.saturating_add(1);
        if count.calls <= max {
            return Repeat::Allowed;
        }
        count.refused = count.refused.saturating_add(1);
        let times = count.calls;
        match stop_after {
            Some(m) if count.refused > m => Repeat::Stop { times },
            _ => Repeat::Refused { times },
        }
    }

    /// The counts of `leaf`, to put back with [`rewind`](Self::rewind).
    pub(crate) fn mark(&self, leaf: &InstanceId) -> Vec<((String, u64), (u32, u32))> {
        self.lock()
            .iter()
            .filter(|((instance, _, _), _)| instance == leaf)
            .map(|((_, tool, fp), c)| ((tool.clone(), *fp), (c.calls, c.refused)))
            .collect()
    }

    /// Puts back the counts of `leaf` taken with [`mark`](Self::mark).
    pub(crate) fn rewind(&self, leaf: &InstanceId, marked: Vec<((String, u64), (u32, u32))>) {
        let mut counts = self.lock();
        counts.retain(|(instance, _, _), _| instance != leaf);
        for ((tool, fp), (calls, refused)) in marked {
            counts.insert((leaf.clone(), tool, fp), Count { calls, refused });
        }
    }

    /// Starts a user turn: every count starts over.
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// The counts, for a snapshot (sorted, so a snapshot is deterministic).
    pub fn snapshot(&self) -> Vec<RepeatRecord> {
        let mut records: Vec<RepeatRecord> = self
            .lock()
            .iter()
            .map(|((instance, tool, fp), c)| RepeatRecord {
                instance: instance.clone(),
                tool: tool.clone(),
                fingerprint: format!("{fp:016x}"),
                calls: c.calls,
                refused: c.refused,
            })
            .collect();
        records.sort_by(|a, b| {
            (&a.instance, &a.tool, &a.fingerprint).cmp(&(&b.instance, &b.tool, &b.fingerprint))
        });
        records
    }

    /// Adds the counts of a snapshot (records whose fingerprint does not read
    /// are skipped).
    pub fn restore(&self, records: impl IntoIterator<Item = RepeatRecord>) {
        let mut counts = self.lock();
        for r in records {
            if let Ok(fp) = u64::from_str_radix(&r.fingerprint, 16) {
                counts.insert(
                    (r.instance, r.tool, fp),
                    Count {
                        calls: r.calls,
                        refused: r.refused,
                    },
                );
            }
        }
    }
}

/// FNV-1a over the arguments' canonical JSON (keys sorted): stable across
/// processes and builds, so snapshot counts keep their meaning.
fn fingerprint(args: &Value) -> u64 {
    fn feed(hash: &mut u64, bytes: &[u8]) {
        for b in bytes {
            *hash ^= u64::from(*b);
            *hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn walk(hash: &mut u64, v: &Value) {
        match v {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                feed(hash, b"{");
                for k in keys {
                    feed(hash, k.as_bytes());
                    feed(hash, b":");
                    if let Some(v) = map.get(k) {
                        walk(hash, v);
                    }
                    feed(hash, b",");
                }
                feed(hash, b"}");
            }
            Value::Array(items) => {
                feed(hash, b"[");
                for item in items {
                    walk(hash, item);
                    feed(hash, b",");
                }
                feed(hash, b"]");
            }
            other => feed(hash, other.to_string().as_bytes()),
        }
    }
    let mut hash = 0xcbf2_9ce4_8422_2325;
    walk(&mut hash, args);
    hash
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The charter's default loop guard: three calls, two refusals.
    const DEFAULT: (Option<u32>, Option<u32>) = (Some(3), Some(2));
    /// No limit.
    const OFF: (Option<u32>, Option<u32>) = (None, None);

    fn check(
        counts: &RepeatCounts,
        (max, stop): (Option<u32>, Option<u32>),
        leaf: &InstanceId,
        tool: &str,
        args: &Value,
    ) -> Repeat {
        counts.check(max, stop, leaf, tool, args)
    }

    #[test]
    fn the_fourth_identical_call_is_refused_and_the_sixth_stops_the_run() {
        let counts = RepeatCounts::new();
        let leaf = InstanceId::new("a");
        let guard = DEFAULT;
        let args = json!({"q": "x", "n": 1});
        for _ in 0..3 {
            assert_eq!(
                check(&counts, guard, &leaf, "search", &args),
                Repeat::Allowed
            );
        }
        // Key order does not matter: the same call.
        let reordered = json!({"n": 1, "q": "x"});
        assert_eq!(
            check(&counts, guard, &leaf, "search", &reordered),
            Repeat::Refused { times: 4 }
        );
        assert_eq!(
            check(&counts, guard, &leaf, "search", &args),
            Repeat::Refused { times: 5 }
        );
        assert_eq!(
            check(&counts, guard, &leaf, "search", &args),
            Repeat::Stop { times: 6 }
        );
        // Other arguments, another tool, another leaf: counted apart.
        assert_eq!(
            check(&counts, guard, &leaf, "search", &json!({"q": "y"})),
            Repeat::Allowed
        );
        assert_eq!(
            check(&counts, guard, &leaf, "fetch", &args),
            Repeat::Allowed
        );
        assert_eq!(
            check(&counts, guard, &InstanceId::new("b"), "search", &args),
            Repeat::Allowed
        );
        counts.clear();
        assert_eq!(
            check(&counts, guard, &leaf, "search", &args),
            Repeat::Allowed
        );
    }

    #[test]
    fn off_never_refuses_and_counts_survive_a_snapshot() {
        let counts = RepeatCounts::new();
        let leaf = InstanceId::new("a");
        for _ in 0..10 {
            assert_eq!(check(&counts, OFF, &leaf, "t", &json!({})), Repeat::Allowed);
        }
        let guard = (Some(2), None);
        check(&counts, guard, &leaf, "t", &json!({"a": 1}));
        check(&counts, guard, &leaf, "t", &json!({"a": 1}));
        let restored = RepeatCounts::new();
        restored.restore(counts.snapshot());
        assert_eq!(restored.snapshot(), counts.snapshot());
        assert_eq!(
            check(&restored, guard, &leaf, "t", &json!({"a": 1})),
            Repeat::Refused { times: 3 }
        );
        for _ in 0..5 {
            assert!(matches!(
                check(&restored, guard, &leaf, "t", &json!({"a": 1})),
                Repeat::Refused { .. }
            ));
        }
    }
}
