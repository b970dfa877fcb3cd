//! [`ToolChoiceEnforcer`]: a tool-choice rule applied around any model.

use async_trait::async_trait;
use futures::stream::BoxStream;
use markov_core::message::{Item, Items, Message, Role};
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StreamEvent, ToolChoice};

use markov_charter::tool_choice::{ToolChoiceRule, check_thinking};

/// A model wrapper that applies a [`ToolChoiceRule`] to every request,
/// around any client and without the machine loop (the "first call tool
/// enforcer").
///
/// Each request's tool choice is replaced by
/// [`ToolChoiceRule::choice`], where "a tool ran in this turn" is read from
/// the request's messages alone: the last user message that has any content
/// holds tool results only (the model called a tool and got its result back),
/// rather than new input. The scan walks back from the end and stops at that
/// message, so its cost is the length of the current turn, not of the history.
///
/// Messages alone cannot show a transition or a spawn into a new node; the
/// standard loop, which knows them, does not use this wrapper but asks the
/// same [`ToolChoiceRule::choice`] with its own per-instance turn state.
///
/// A request whose settings enable thinking is checked with
/// [`check_thinking`] against the inner client's
/// [`Model::thinking_allowance`] and refused with
/// [`ModelError::InvalidRequest`] before the inner client sees it.
///
/// ```
/// use markov_core::message::{Item, Message};
/// use markov_core::model::{Model, ModelRequest, ModelSettings, ToolChoice};
/// use markov_executor::ToolChoiceEnforcer;
/// use markov_charter::tool_choice::ToolChoiceRule;
/// use markov_testkit::ScriptedModel;
/// use serde_json::json;
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let scripted = ScriptedModel::builder()
///     .tool_call("lookup", json!({"key": "customer"}))
///     .text("Customer has 3 endpoints.")
///     .build();
/// let model = ToolChoiceEnforcer::new(scripted, ToolChoiceRule::RequiredFirst);
/// let settings = ModelSettings::default();
/// fn request<'a>(messages: &'a [Message], settings: &'a ModelSettings) -> ModelRequest<'a> {
///     // The caller's own tool choice is replaced by the policy's.
///     ModelRequest::new("", messages, settings).with_tool_choice(&ToolChoice::Auto)
/// }
///
/// let mut history = vec![Message::user("What endpoints does Customer have?")];
/// let first = model.complete(request(&history, &settings)).await.unwrap();
/// history.push(Message::assistant_items(first.content));
/// history.push(Message::user_items(vec![Item::tool_result("call_1", "3 endpoints", None)]));
/// model.complete(request(&history, &settings)).await.unwrap();
///
/// let sent = model.get_ref().requests();
/// assert_eq!(sent[0].tool_choice, ToolChoice::Any);
/// assert_eq!(sent[1].tool_choice, ToolChoice::Auto);
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct ToolChoiceEnforcer<M> {
    inner: M,
    policy: ToolChoiceRule,
    /// `policy.choice(false)`, kept so a request can borrow it.
    before_tool: ToolChoice,
    /// `policy.choice(true)`, kept so a request can borrow it.
    after_tool: ToolChoice,
}

impl<M> ToolChoiceEnforcer<M> {
    /// Wraps `inner`, applying `policy` to every request.
    pub fn new(inner: M, policy: ToolChoiceRule) -> Self {
        ToolChoiceEnforcer {
            inner,
            before_tool: policy.choice(false),
            after_tool: policy.choice(true),
            policy,
        }
    }

    /// The wrapped model.
    pub fn get_ref(&self) -> &M {
        &self.inner
    }

    /// The wrapped model, mutably.
    pub fn get_mut(&mut self) -> &mut M {
        &mut self.inner
    }

    /// Unwraps the model.
    pub fn into_inner(self) -> M {
        self.inner
    }

    /// The policy applied.
    pub fn policy(&self) -> &ToolChoiceRule {
        &self.policy
    }

    /// The tool choice this wrapper sends with `messages`.
    pub fn choice_for(&self, messages: &[Message]) -> &ToolChoice {
        if tool_ran_this_turn(messages) {
            &self.after_tool
        } else {
            &self.before_tool
        }
    }
}

impl<M: Model> ToolChoiceEnforcer<M> {
    fn enforce<'a>(&'a self, request: ModelRequest<'a>) -> Result<ModelRequest<'a>, ModelError> {
        if let Some(thinking) = request.settings().thinking {
            check_thinking(
                thinking,
                self.inner.thinking_allowance(request.settings(), thinking),
                &self.policy,
                request.settings().temperature,
            )
            .map_err(ModelError::InvalidRequest)?;
        }
        Ok(request.with_tool_choice(self.choice_for(request.messages())))
    }
}

/// Whether the current turn of `messages` has run a tool: the last user
/// message with any content holds tool results only.
fn tool_ran_this_turn(messages: &[Message]) -> bool {
    for message in messages.iter().rev() {
        if message.role != Role::User {
            continue;
        }
        match &message.items {
            Items::Text(text) if text.is_empty() => {}
            Items::Text(_) => return false,
            Items::List(items) if items.is_empty() => {}
            Items::List(items) => {
                return items
                    .iter()
                    .all(|item| matches!(item, Item::ToolResult { .. }));
            }
            Items::Instance(_) => {}
        }
    }
    false
}

/// A layer: the requests of `complete`, `count_tokens` and `stream` get
/// the enforced tool choice; every other method reaches the inner model
/// as it is.
#[async_trait]
impl<M: Model> markov_core::model::ModelLayer for ToolChoiceEnforcer<M> {
    type Inner = M;

    fn inner(&self) -> &M {
        &self.inner
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let request = self.enforce(request)?;
        self.inner.complete(request).await
    }

    /// Counts the request the inner model would be sent: with the tool
    /// choice this wrapper enforces.
    async fn count_tokens(
        &self,
        request: ModelRequest<'_>,
    ) -> Result<markov_core::InputTokenCount, ModelError> {
        let request = self.enforce(request)?;
        self.inner.count_tokens(request).await
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        match self.enforce(request) {
            Ok(request) => self.inner.stream(request),
            Err(e) => Box::pin(futures::stream::once(async move { Err(e) })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use markov_core::message::NativeItems;
    use markov_core::model::{Compacted, Compaction, ModelSettings, StopReason, Usage};

    /// A Responses-like client: native summaries and compaction of its own.
    #[derive(Debug)]
    struct Compacting;

    #[async_trait]
    impl Model for Compacting {
        async fn complete(&self, _r: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
            Ok(ModelResponse::new(
                vec![Item::text("hi")],
                StopReason::EndTurn,
            ))
        }
        fn provider_name(&self) -> &str {
            "openai"
        }
        fn model_name(&self) -> Option<&str> {
            Some("house-local")
        }
        fn native_summaries(&self) -> Option<&str> {
            Some("openai.responses")
        }
        async fn compact(&self, r: ModelRequest<'_>) -> Result<Compaction, ModelError> {
            Ok(Compaction::Compacted(Compacted::new(
                NativeItems::new("openai.responses", vec![r.messages().len().to_string()]),
                Usage::default(),
            )))
        }
    }

    #[tokio::test]
    async fn every_method_of_the_enforcer_reaches_the_inner_model() {
        use markov_testkit::ProbeModel;
        for rule in [ToolChoiceRule::Auto, ToolChoiceRule::RequiredFirst] {
            let model = ToolChoiceEnforcer::new(ProbeModel, rule);
            ProbeModel::assert_reached_through(&model).await;
        }
    }

    #[tokio::test]
    async fn a_compacting_model_wrapped_in_the_enforcer_still_offers_native_summaries() {
        let model = ToolChoiceEnforcer::new(Compacting, ToolChoiceRule::RequiredFirst);
        assert_eq!(model.native_summaries(), Some("openai.responses"));
        assert_eq!(model.provider_name(), "openai");
        assert_eq!(model.model_name(), Some("house-local"));
        let settings = ModelSettings::default();
        let history = [Message::user("a"), Message::user("b")];
        let Ok(Compaction::Compacted(compacted)) = model
            .compact(ModelRequest::new("", &history, &settings))
            .await
        else {
            panic!("the compaction reaches the inner model");
        };
        assert_eq!(compacted.native.items, vec!["2".to_owned()]);
    }
}
