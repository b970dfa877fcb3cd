//! [`FailingModel`]: fails with a given error, optionally after some successful calls.

use std::sync::Mutex;

use async_trait::async_trait;
use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse};

/// A model that returns `error`, either at once or after `n` calls served by an inner model.
///
/// ```
/// use markov_core::model::ModelError;
/// use markov_testkit::{FailingModel, ScriptedModel};
///
/// let inner = ScriptedModel::builder().text("ok").build();
/// let model = FailingModel::after(1, inner, ModelError::Overloaded("busy".into()));
/// # let _ = model;
/// ```
#[derive(Debug)]
pub struct FailingModel {
    error: ModelError,
    succeed_first: usize,
    inner: Option<Box<dyn Model>>,
    calls: Mutex<usize>,
}

impl FailingModel {
    /// Fails every call with `error`.
    pub fn new(error: ModelError) -> Self {
        FailingModel {
            error,
            succeed_first: 0,
            inner: None,
            calls: Mutex::new(0),
        }
    }

    /// Lets `inner` answer the first `n` calls, then fails every call with `error`.
    pub fn after(n: usize, inner: impl Model + 'static, error: ModelError) -> Self {
        FailingModel {
            error,
            succeed_first: n,
            inner: Some(Box::new(inner)),
            calls: Mutex::new(0),
        }
    }

    /// How many calls were made.
    pub fn calls(&self) -> usize {
        *self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl Model for FailingModel {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let n = {
            let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            *calls += 1;
            *calls
        };
        match &self.inner {
            Some(inner) if n <= self.succeed_first => inner.complete(request).await,
            _ => Err(self.error.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ScriptedModel;
    use markov_core::model::ModelSettings;

    #[tokio::test]
    async fn fails_after_n_calls() {
        let inner = ScriptedModel::builder().text("a").text("b").build();
        let model = FailingModel::after(1, inner, ModelError::Overloaded("busy".into()));
        let settings = ModelSettings::default();
        let req = ModelRequest::new("", &[], &settings);
        assert!(model.complete(req).await.is_ok());
        let err = model.complete(req).await.unwrap_err();
        assert_eq!(err, ModelError::Overloaded("busy".into()));
        assert_eq!(model.calls(), 2);
    }
}
