//! [`ProbeModel`]: a model whose every method answers something of its
//! own, to check that a wrapper passes each one through.

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt};
use markov_core::message::Item;
use markov_core::model::{
    Compaction, InputTokenCount, Model, ModelError, ModelRequest, ModelResponse, ModelSettings,
    StopReason, StreamEvent, Thinking, ThinkingAllowance, Unsupported, collect_stream,
};
use markov_core::tool::ToolDefinition;
use serde_json::Value;

/// A model whose every method answers something no default gives: wrap it
/// and call [`ProbeModel::assert_reached_through`] on the wrapper to check
/// that each method reaches it (a method the wrapper forgets answers its
/// default instead).
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// use std::sync::Arc;
/// use markov_testkit::ProbeModel;
///
/// ProbeModel::assert_reached_through(&Arc::new(ProbeModel)).await;
/// # });
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct ProbeModel;

impl ProbeModel {
    /// The text of its answer.
    pub const ANSWER: &'static str = "the probe's answer";
    /// Its provider's name.
    pub const PROVIDER: &'static str = "probe";
    /// Its configured model.
    pub const MODEL: &'static str = "probe-1";
    /// Its default answer tokens.
    pub const MAX_TOKENS: u32 = 7;
    /// Its count of any request.
    pub const COUNT: u64 = 11;
    /// The vendor tag of its native summaries.
    pub const VENDOR: &'static str = "probe.vendor";

    /// Asserts that every method of `model` answers as a `ProbeModel`
    /// does: that a wrapper around one forwards each. `complete` and
    /// `stream` are asked with no tools and the default settings.
    ///
    /// # Panics
    /// On the first method that does not reach the probe, naming it.
    pub async fn assert_reached_through(model: &dyn Model) {
        let settings = ModelSettings::default();
        let request = ModelRequest::new("", &[], &settings);
        let answered = model.complete(request).await;
        assert_eq!(
            answered.map(|a| a.content),
            Ok(vec![Item::text(Self::ANSWER)]),
            "complete"
        );
        assert_eq!(model.provider_name(), Self::PROVIDER, "provider_name");
        assert_eq!(model.model_name(), Some(Self::MODEL), "model_name");
        assert_eq!(
            model.default_max_tokens(&settings),
            Self::MAX_TOKENS,
            "default_max_tokens"
        );
        assert!(
            model
                .thinking_allowance(
                    &settings,
                    Thinking::Enabled {
                        budget_tokens: 1024
                    }
                )
                .temperature,
            "thinking_allowance"
        );
        assert_eq!(
            model.check_tools(&[], None),
            Err(Unsupported::output_type(Self::PROVIDER)),
            "check_tools"
        );
        assert_eq!(
            model.count_tokens(request).await,
            Ok(InputTokenCount::Counted(Self::COUNT)),
            "count_tokens"
        );
        assert_eq!(
            model.native_summaries(),
            Some(Self::VENDOR),
            "native_summaries"
        );
        assert!(model.native_tool_search(), "native_tool_search");
        assert_eq!(
            model.compact(request).await,
            Err(ModelError::InvalidRequest("the probe compacts".into())),
            "compact"
        );
        assert_eq!(
            collect_stream(model.stream(request)).await,
            Err(ModelError::InvalidRequest("the probe streams".into())),
            "stream"
        );
    }
}

#[async_trait]
impl Model for ProbeModel {
    async fn complete(&self, _request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        Ok(ModelResponse::new(
            vec![Item::text(Self::ANSWER)],
            StopReason::EndTurn,
        ))
    }

    fn provider_name(&self) -> &str {
        Self::PROVIDER
    }

    fn model_name(&self) -> Option<&str> {
        Some(Self::MODEL)
    }

    fn default_max_tokens(&self, _settings: &ModelSettings) -> u32 {
        Self::MAX_TOKENS
    }

    fn thinking_allowance(
        &self,
        _settings: &ModelSettings,
        _thinking: Thinking,
    ) -> ThinkingAllowance {
        ThinkingAllowance {
            forced_tool_choice: true,
            temperature: true,
        }
    }

    fn check_tools(
        &self,
        _tools: &[ToolDefinition],
        _output_schema: Option<&Value>,
    ) -> Result<(), Unsupported> {
        Err(Unsupported::output_type(Self::PROVIDER))
    }

    async fn count_tokens(
        &self,
        _request: ModelRequest<'_>,
    ) -> Result<InputTokenCount, ModelError> {
        Ok(InputTokenCount::Counted(Self::COUNT))
    }

    fn native_summaries(&self) -> Option<&str> {
        Some(Self::VENDOR)
    }

    fn native_tool_search(&self) -> bool {
        true
    }

    async fn compact(&self, _request: ModelRequest<'_>) -> Result<Compaction, ModelError> {
        Err(ModelError::InvalidRequest("the probe compacts".into()))
    }

    fn stream<'a>(
        &'a self,
        _request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        stream::once(async { Err(ModelError::InvalidRequest("the probe streams".into())) }).boxed()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    /// The methods the item of `source` whose first line is `header`
    /// declares, as rustfmt lays them out: a `fn` line one indent in.
    fn methods_in(source: &'static str, header: &str) -> BTreeSet<&'static str> {
        let (_, body) = source
            .split_once(&format!("\n{header}\n"))
            .unwrap_or_else(|| panic!("no line {header:?}"));
        let body = &body[..body.find("\n}\n").expect("the item ends")];
        body.lines()
            .filter_map(|line| {
                let line = line.strip_prefix("    ")?;
                let rest = line
                    .strip_prefix("async fn ")
                    .or_else(|| line.strip_prefix("fn "))?;
                Some(&rest[..rest.find(['(', '<'])?])
            })
            .collect()
    }

    /// The probe answers every method `Model` declares (else a method
    /// added to the trait would answer its default through a wrapper that
    /// forgets it, and no check would tell), and
    /// `assert_reached_through` asks each.
    #[test]
    fn the_probe_answers_and_checks_every_method_of_model() {
        let model = methods_in(
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../core/src/model.rs")),
            "pub trait Model: Send + Sync + fmt::Debug {",
        );
        assert!(
            model.contains("complete") && model.contains("stream") && model.len() >= 10,
            "{model:?}"
        );
        let probe: &'static str = include_str!("probe.rs");
        assert_eq!(
            methods_in(probe, "impl Model for ProbeModel {"),
            model,
            "ProbeModel answers every method"
        );
        let (_, check) = probe
            .split_once("pub async fn assert_reached_through(")
            .expect("the check");
        // Without spaces: rustfmt breaks a call across lines.
        let check: String = check[..check.find("\n    }\n").expect("the check ends")]
            .split_whitespace()
            .collect();
        for method in &model {
            assert!(
                check.contains(&format!("model.{method}(")),
                "assert_reached_through asks {method}"
            );
        }
    }
}
