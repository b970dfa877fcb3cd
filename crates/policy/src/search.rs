//! Tool search: deferred tools are registered but not offered up front;
//! the built-in `search_tools` tool finds them by name, description and
//! parameter names (BM25, in process), and what it finds is offered for
//! the rest of the turn or the session ([`FoundScope`]).
//!
//! [`ToolSearch`] is the registry's setting; [`SearchIndex`] the index
//! built when the registry is locked; [`FoundTool`] one tool found, as a
//! conversation keeps it (durably, with its counters).

use std::collections::HashMap;
use std::sync::Arc;

use markov_core::async_trait;
use markov_core::tool::{DynTool, ToolCallError, ToolContext, ToolDefinition, ToolOutcome};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::metadata::Mode;

/// The name of the built-in search tool.
pub const SEARCH_TOOLS: &str = "search_tools";

/// How long a tool found by `search_tools` stays offered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FoundScope {
    /// Until the user's turn ends (the default).
    #[default]
    Turn,
    /// For the rest of the session.
    Session,
}

/// The registry's tool-search setting (see
/// [`PolicyConfig::tool_search`](crate::PolicyConfig::tool_search)).
///
/// Defaults: found tools stay for the turn, at most 5 results a search,
/// the in-process search even where the provider has its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToolSearch {
    pub(crate) scope: FoundScope,
    pub(crate) max_results: usize,
    pub(crate) native: bool,
}

impl Default for ToolSearch {
    fn default() -> Self {
        ToolSearch {
            scope: FoundScope::Turn,
            max_results: 5,
            native: true,
        }
    }
}

impl ToolSearch {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a found tool stays offered.
    #[must_use]
    pub fn scope(mut self, scope: FoundScope) -> Self {
        self.scope = scope;
        self
    }

    /// The most tools one search returns (at least 1, at most 50).
    #[must_use]
    pub fn max_results(mut self, n: usize) -> Self {
        self.max_results = n.clamp(1, MAX_RESULTS);
        self
    }

    /// Whether a provider with a tool search of its own uses it instead of
    /// `search_tools` (on by default): the deferred tools are then sent
    /// marked for loading on demand, and the provider finds them.
    #[must_use]
    pub fn native(mut self, native: bool) -> Self {
        self.native = native;
        self
    }

    /// How long a found tool stays offered.
    pub fn found_scope(&self) -> FoundScope {
        self.scope
    }

    /// Whether a provider's own tool search is used where there is one.
    pub fn uses_native(&self) -> bool {
        self.native
    }
}

/// The most results a search may be asked for.
const MAX_RESULTS: usize = 50;

/// The most tools a conversation keeps found at once: the oldest are
/// dropped beyond it (a log line says so).
pub(crate) const MAX_FOUND: usize = 128;

/// One tool found by `search_tools`, as a conversation keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FoundTool {
    /// The tool's name.
    pub name: String,
    /// How long it stays offered.
    pub scope: FoundScope,
}

/// BM25 parameters: term-frequency saturation and length normalization.
const K1: f64 = 1.2;
const B: f64 = 0.75;

/// One deferred tool in the index.
#[derive(Debug)]
struct Doc {
    name: String,
    description: String,
    modes: Option<Vec<Mode>>,
    terms: HashMap<String, u32>,
    len: u32,
}

/// A BM25 index over the deferred tools' names (counted twice: a name says
/// most), descriptions and parameter names, built once when the registry
/// is locked.
#[derive(Debug, Default)]
pub struct SearchIndex {
    docs: Vec<Doc>,
    /// In how many documents each term occurs.
    df: HashMap<String, u32>,
    avg_len: f64,
}

/// Splits `text` into lower-case terms: on everything that is not a letter
/// or digit, and where a lower-case letter meets an upper-case one
/// (`getWeather`: `get`, `weather`).
pub(crate) fn terms(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for c in text.chars() {
        if c.is_alphanumeric() {
            if c.is_uppercase() && prev_lower && !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            prev_lower = c.is_lowercase() || c.is_ascii_digit();
            cur.extend(c.to_lowercase());
        } else {
            prev_lower = false;
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The parameter names of an input schema (its top-level `properties`).
fn parameter_names(schema: &Value) -> impl Iterator<Item = &str> {
    schema
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flat_map(|p| p.keys().map(String::as_str))
}

impl SearchIndex {
    /// An index of `tools`, each with the modes it is allowed in (`None`:
    /// every mode).
    pub fn new<'a>(
        tools: impl IntoIterator<Item = (&'a ToolDefinition, Option<&'a [Mode]>)>,
    ) -> Self {
        let mut docs = Vec::new();
        let mut df: HashMap<String, u32> = HashMap::new();
        for (def, modes) in tools {
            let mut words = terms(def.name.as_str());
            words.extend(terms(def.name.as_str()));
            words.extend(terms(&def.description));
            for p in parameter_names(&def.input_schema) {
                words.extend(terms(p));
            }
            let mut tf: HashMap<String, u32> = HashMap::new();
            for w in &words {
                *tf.entry(w.clone()).or_default() += 1;
            }
            for t in tf.keys() {
                *df.entry(t.clone()).or_default() += 1;
            }
            docs.push(Doc {
                name: def.name.as_str().to_owned(),
                description: def.description.clone(),
                modes: modes.map(<[Mode]>::to_vec),
                len: u32::try_from(words.len()).unwrap_or(u32::MAX),
                terms: tf,
            });
        }
        let total: f64 = docs.iter().map(|d| f64::from(d.len)).sum();
        let avg_len = if docs.is_empty() {
            0.0
        } else {
            total / docs.len() as f64
        };
        SearchIndex { docs, df, avg_len }
    }

    /// How many tools it holds.
    pub fn len(&self) -> usize {
        self.docs.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    /// The names of the best `limit` matches of `query` allowed in `mode`
    /// (every tool when `None`), best first; ties keep registration order.
    /// A query whose terms match nothing finds nothing.
    pub fn search(&self, query: &str, limit: usize, mode: Option<&Mode>) -> Vec<(&str, &str)> {
        let mut q = terms(query);
        q.sort_unstable();
        q.dedup();
        let n = self.docs.len() as f64;
        let mut scored: Vec<(f64, usize)> = Vec::new();
        for (i, doc) in self.docs.iter().enumerate() {
            if let (Some(mode), Some(modes)) = (mode, &doc.modes)
                && !modes.contains(mode)
            {
                continue;
            }
            let mut score = 0.0;
            for t in &q {
                let Some(&tf) = doc.terms.get(t) else {
                    continue;
                };
                let df = f64::from(self.df.get(t).copied().unwrap_or(0));
                let idf = ((n - df + 0.5) / (df + 0.5) + 1.0).ln();
                let tf = f64::from(tf);
                let norm = 1.0 - B + B * f64::from(doc.len) / self.avg_len.max(1.0);
                score += idf * tf * (K1 + 1.0) / (tf + K1 * norm);
            }
            if score > 0.0 {
                scored.push((score, i));
            }
        }
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        scored
            .into_iter()
            .take(limit)
            .map(|(_, i)| {
                (
                    self.docs[i].name.as_str(),
                    self.docs[i].description.as_str(),
                )
            })
            .collect()
    }
}

/// The built-in `search_tools` tool over a [`SearchIndex`]; in a session,
/// it sees only the tools the session's mode allows.
#[derive(Debug, Clone)]
pub(crate) struct SearchTool {
    index: Arc<SearchIndex>,
    max_results: usize,
    mode: Option<Mode>,
    definition: Arc<ToolDefinition>,
}

impl SearchTool {
    /// The tool over `index` (its name is a constant, checked all the
    /// same).
    pub(crate) fn new(
        index: Arc<SearchIndex>,
        max_results: usize,
    ) -> Result<Self, markov_core::tool::InvalidToolName> {
        let definition = ToolDefinition::new(
            SEARCH_TOOLS,
            "Search for more tools. Only some tools are offered up front; this finds the others by what they do. The tools found are offered from then on: call them directly.",
            json!({
                "type": "object",
                "properties": {
                    "query": {
                        "type": "string",
                        "description": "Words describing the tool you need (what it does, what it takes)."
                    },
                    "max_results": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": MAX_RESULTS,
                        "description": "How many tools to return at most."
                    }
                },
                "required": ["query"],
                "additionalProperties": false
            }),
        );
        Ok(SearchTool {
            index,
            max_results,
            mode: None,
            definition: Arc::new(definition?),
        })
    }

    /// This tool restricted to `mode`.
    pub(crate) fn in_mode(&self, mode: &Mode) -> Self {
        SearchTool {
            mode: Some(mode.clone()),
            ..self.clone()
        }
    }

    /// The names a call with `input` finds.
    pub(crate) fn found(&self, input: &Value) -> Vec<String> {
        let Some(query) = input.get("query").and_then(Value::as_str) else {
            return Vec::new();
        };
        self.index
            .search(query, self.limit(input), self.mode.as_ref())
            .into_iter()
            .map(|(name, _)| name.to_owned())
            .collect()
    }

    fn limit(&self, input: &Value) -> usize {
        input
            .get("max_results")
            .and_then(Value::as_u64)
            .and_then(|n| usize::try_from(n).ok())
            .unwrap_or(self.max_results)
            .clamp(1, MAX_RESULTS)
    }
}

#[async_trait]
impl DynTool for SearchTool {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    async fn call_json(
        &self,
        input: &Value,
        _cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        let Some(query) = input.get("query").and_then(Value::as_str) else {
            return Err(ToolCallError::InvalidInput(
                "missing string field `query`".to_owned(),
            ));
        };
        let hits = self
            .index
            .search(query, self.limit(input), self.mode.as_ref());
        let tools: Vec<Value> = hits
            .iter()
            .map(|(name, description)| json!({"name": name, "description": description}))
            .collect();
        let note = if tools.is_empty() {
            "No tool matches: try other words."
        } else {
            "These tools are now offered: call them directly."
        };
        Ok(ToolOutcome::Value(json!({"tools": tools, "note": note})))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(name: &str, description: &str, params: &[&str]) -> ToolDefinition {
        let props: serde_json::Map<String, Value> = params
            .iter()
            .map(|p| ((*p).to_owned(), json!({"type": "string"})))
            .collect();
        ToolDefinition::new(
            name,
            description,
            json!({"type": "object", "properties": props}),
        )
        .unwrap()
    }

    #[test]
    fn terms_split_words_snake_and_camel_case() {
        assert_eq!(
            terms("getWeather for_city-name HTTP2"),
            ["get", "weather", "for", "city", "name", "http2"]
        );
    }

    #[test]
    fn the_best_match_comes_first_and_a_foreign_query_finds_nothing() {
        let defs = [
            def("get_weather", "Current weather for a city", &["city"]),
            def("send_email", "Send an email to someone", &["to", "subject"]),
            def("list_files", "List the files of a folder", &["path"]),
        ];
        let index = SearchIndex::new(defs.iter().map(|d| (d, None)));
        let hits = index.search("weather in Paris", 5, None);
        assert_eq!(hits.first().map(|h| h.0), Some("get_weather"));
        assert_eq!(index.search("email subject", 1, None)[0].0, "send_email");
        // Parameter names count.
        assert_eq!(index.search("path", 5, None)[0].0, "list_files");
        assert!(index.search("zebra", 5, None).is_empty());
    }

    #[test]
    fn a_mode_hides_the_tools_it_does_not_allow() {
        let defs = [def("voice_call", "Call a phone number", &["number"])];
        let voice = [Mode::VOICE];
        let index = SearchIndex::new(defs.iter().map(|d| (d, Some(&voice[..]))));
        assert!(index.search("phone call", 5, Some(&Mode::TEXT)).is_empty());
        assert_eq!(index.search("phone call", 5, Some(&Mode::VOICE)).len(), 1);
        assert_eq!(index.search("phone call", 5, None).len(), 1);
    }

    #[test]
    fn a_search_returns_at_most_the_limit() {
        let defs: Vec<ToolDefinition> = (0..20)
            .map(|i| def(&format!("files_{i}"), "Reads files", &[]))
            .collect();
        let index = SearchIndex::new(defs.iter().map(|d| (d, None)));
        let tool = SearchTool::new(Arc::new(index), 3).unwrap();
        assert_eq!(tool.found(&json!({"query": "files"})).len(), 3);
        assert_eq!(
            tool.found(&json!({"query": "files", "max_results": 7}))
                .len(),
            7
        );
        assert!(tool.found(&json!({"q": "files"})).is_empty());
    }
}
