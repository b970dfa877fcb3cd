//! The studio's routes that need the application's help, because the
//! server knows no vendor and no eval format: a step's request as the
//! provider's wire body (an encoder the application gives per agent,
//! [`ServerBuilder::wire_body`](crate::ServerBuilder::wire_body)), and a
//! session's steps as an eval case file (an exporter,
//! [`ServerBuilder::case_export`](crate::ServerBuilder::case_export)).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use axum::extract::{Extension, Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use markov_core::model::{ModelError, ModelRequest};
use markov_store::{SessionId, Store};
use serde::Deserialize;
use serde_json::Value;

use crate::auth::Principal;
use crate::studio::agents::sub_agent_call;
use crate::studio::{may_read, redact, step_of};
use crate::wire::{ErrorBody, StepWire};
use crate::{ApiError, Service};

type Shared = State<Arc<Service>>;

/// Encodes a model request as one provider's wire body: the bytes sent,
/// without headers (so without keys).
pub(crate) type WireEncoder =
    Arc<dyn Fn(&ModelRequest<'_>) -> Result<Vec<u8>, ModelError> + Send + Sync>;

/// Writes session `id` of a store, or the steps in a range of it, as an
/// eval case file (its text).
pub(crate) type CaseExporter = Arc<
    dyn Fn(
            Arc<dyn Store>,
            SessionId,
            Option<Range<u64>>,
        ) -> BoxFuture<'static, Result<String, ApiError>>
        + Send
        + Sync,
>;

/// The application's encoders and exporter.
#[derive(Default, Clone)]
pub(crate) struct StudioHooks {
    /// Per agent, how its model's requests are encoded.
    pub(crate) wire: HashMap<String, WireEncoder>,
    /// How a session becomes an eval case file.
    pub(crate) case_export: Option<CaseExporter>,
}

impl std::fmt::Debug for StudioHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StudioHooks")
            .field("wire", &self.wire.keys().collect::<Vec<_>>())
            .field("case_export", &self.case_export.is_some())
            .finish()
    }
}

#[utoipa::path(get, path = "/sessions/{id}/steps/{n}/wire", tag = "studio",
    params(("id" = String, Path, description = "The session"),
           ("n" = u64, Path, description = "The step, from 0")),
    responses((status = 200, description = "The step's first model call as the provider the \
        server runs the agent on encodes it: the JSON body sent (`body`; no headers, so no keys, \
        and fields named as credentials are redacted), for the agents whose application gave the \
        server an encoder", body = StepWire),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session the caller may read, or no such step", body = ErrorBody),
              (status = 409, description = "The server has no wire encoding for this agent's \
                  model, the step's request cannot be rebuilt, or the provider cannot carry it",
                  body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn step_wire(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path((id, n)): Path<(String, u64)>,
) -> Result<axum::Json<StepWire>, ApiError> {
    let (id, stored, step) = step_of(&service, &principal, &id, n).await?;
    let encode = service
        .hooks
        .wire
        .get(&stored.info.charter)
        .ok_or_else(|| {
            ApiError::Conflict(format!(
                "this server shows no wire body of agent {:?}'s requests",
                stored.info.charter
            ))
        })?;
    let history = &stored.snapshot.history;
    let sent = step.request(history).ok_or_else(|| {
        ApiError::Conflict(format!(
            "step {n} of session {id} has no request to rebuild (no model call, or recorded \
             under a context policy before views were)"
        ))
    })?;
    Ok(axum::Json(StepWire {
        step: n,
        node: step
            .calls
            .first()
            .map(|c| c.node.clone())
            .unwrap_or_default(),
        body: encoded(encode, &sent.as_request(), &format!("step {n}"))?,
    }))
}

/// `request` as `encode` writes it, parsed, its credential-like fields
/// redacted; what the provider cannot carry is a `409` naming `what`.
fn encoded(
    encode: &WireEncoder,
    request: &ModelRequest<'_>,
    what: &str,
) -> Result<Value, ApiError> {
    let bytes = encode(request).map_err(|e| {
        ApiError::Conflict(format!("the provider cannot encode {what}'s request: {e}"))
    })?;
    let mut body: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::Internal(format!("the wire body is not JSON: {e}")))?;
    redact(&mut body);
    Ok(body)
}

#[utoipa::path(get, path = "/sessions/{id}/steps/{n}/sub_agents/{at}/wire", tag = "studio",
    params(("id" = String, Path, description = "The session"),
           ("n" = u64, Path, description = "The step, from 0"),
           ("at" = usize, Path, description = "The sub-agent step: its `at` in the step's `sub_agents`")),
    responses((status = 200, description = "A sub-agent's step's model call, rebuilt as for \
        `.../sub_agents/{at}/request`, as the encoder the application gave for the sub-agent \
        (by its tool name) writes it: the JSON body sent (`body`; no headers, so no keys, and \
        fields named as credentials are redacted)", body = StepWire),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session the caller may read, step, or sub-agent step", body = ErrorBody),
              (status = 409, description = "The server has no wire encoding for the sub-agent, \
                  the step's request cannot be rebuilt, or the provider cannot carry it",
                  body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn sub_agent_wire(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path((id, n, at)): Path<(String, u64, usize)>,
) -> Result<axum::Json<StepWire>, ApiError> {
    let sub = sub_agent_call(&service, &principal, &id, n, at).await?;
    let encode = service.hooks.wire.get(&sub.agent).ok_or_else(|| {
        ApiError::Conflict(format!(
            "this server shows no wire body of sub-agent {:?}'s requests",
            sub.agent
        ))
    })?;
    let sent = sub.request()?;
    Ok(axum::Json(StepWire {
        step: n,
        node: sub.call.node.clone(),
        body: encoded(
            encode,
            &sent.as_request(),
            &format!("sub-agent step {at} of step {n}"),
        )?,
    }))
}

/// The steps a case is made of.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct Steps {
    /// The first step, from 0 (the whole session when neither `from` nor
    /// `to` is given).
    from: Option<u64>,
    /// The step after the last (the session's end when unset).
    to: Option<u64>,
}

#[utoipa::path(get, path = "/sessions/{id}/case", tag = "studio",
    params(("id" = String, Path, description = "The session"), Steps),
    responses((status = 200, description = "The session, or the user turns of the steps \
        `from`..`to`, as an eval case file (a TOML dataset of one case): the user turns as its \
        input, the recorded model answers as the script a scripted model plays back offline, \
        the recorded tool calls and last answer as its expectations. For the agents whose \
        application gave the server an exporter.",
                  content_type = "application/toml", body = String),
              (status = 400, description = "A bad `from` or `to`", body = ErrorBody),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session the caller may read, or no such steps", body = ErrorBody),
              (status = 409, description = "The server exports no case, or the steps hold no \
                  user turn", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn case(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    steps: Result<Query<Steps>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(steps) = steps.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let range = match (steps.from, steps.to) {
        (None, None) => None,
        (from, to) => {
            let from = from.unwrap_or(0);
            let to = to.unwrap_or(u64::MAX);
            if to <= from {
                return Err(ApiError::BadRequest(format!(
                    "the steps {from}..{to} are none: `to` is after `from`"
                )));
            }
            Some(from..to)
        }
    };
    // Who may read it first: a session the caller may not read is not
    // there, whatever this server exports.
    let (id, _) = may_read(&service, &principal, &id).await?;
    let export = service.hooks.case_export.clone().ok_or_else(|| {
        ApiError::Conflict("this server exports no session as an eval case".into())
    })?;
    let file = match &range {
        Some(range) => format!("{id}-steps-{}-{}.toml", range.start, range.end),
        None => format!("{id}.toml"),
    };
    let text = export(Arc::clone(&service.store), id.clone(), range).await?;
    tracing::info!(session = %id, by = %principal.id().as_str(), "exported a session as an eval case");
    // The id is the store's; anything but a plain name is left out of the
    // header.
    let file: String = file
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    Ok((
        [
            (header::CONTENT_TYPE, "application/toml".to_owned()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{file}\""),
            ),
        ],
        text,
    )
        .into_response())
}
