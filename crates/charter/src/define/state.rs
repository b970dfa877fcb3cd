//! Node and pack state: validation against a schema, and shallow patches.
//!
//! State is stored as JSON. A [`StateSchema`] *parses* a JSON value into its
//! normalized form (the stored value) or refuses it with the validator's
//! message, and describes itself as a JSON Schema for the model.

use std::fmt;
use std::marker::PhantomData;

use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use markov_core::tool::StateUpdateError;

/// Validates and describes a state.
pub trait StateSchema: Send + Sync + fmt::Debug {
    /// Parses `value` into the value to store, or says why it is invalid.
    fn parse(&self, value: &Value) -> Result<Value, String>;

    /// The JSON Schema of the state.
    fn json_schema(&self) -> Value;

    /// The JSON Schema of a patch: the state's schema with no required keys.
    fn partial_json_schema(&self) -> Value {
        let mut schema = self.json_schema();
        if let Value::Object(map) = &mut schema {
            map.remove("required");
        }
        schema
    }
}

/// The schema of a Rust type: parsing deserializes into `S` and serializes back,
/// so unknown keys are dropped and the validator's message is serde's.
pub struct TypedState<S>(PhantomData<fn() -> S>);

impl<S> TypedState<S> {
    /// The schema of `S`.
    pub fn new() -> Self {
        TypedState(PhantomData)
    }
}

impl<S> Default for TypedState<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> fmt::Debug for TypedState<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TypedState<{}>", std::any::type_name::<S>())
    }
}

impl<S> StateSchema for TypedState<S>
where
    S: Serialize + DeserializeOwned + JsonSchema,
{
    fn parse(&self, value: &Value) -> Result<Value, String> {
        let typed = S::deserialize(value).map_err(|e| e.to_string())?;
        serde_json::to_value(typed).map_err(|e| e.to_string())
    }

    fn json_schema(&self) -> Value {
        markov_core::tool::input_schema_for::<S>()
    }
}

/// Any JSON object is a valid state (nodes that declare no state type).
#[derive(Debug, Clone, Copy, Default)]
pub struct AnyObject;

impl StateSchema for AnyObject {
    fn parse(&self, value: &Value) -> Result<Value, String> {
        match value {
            Value::Object(_) => Ok(value.clone()),
            other => Err(format!("expected an object, got {}", json_type(other))),
        }
    }

    fn json_schema(&self) -> Value {
        serde_json::json!({"type": "object"})
    }
}

/// The JSON type name of a value, for messages.
pub fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Shallow-merges `patch` into `state`: top-level keys overwrite, nested
/// values are replaced whole. A non-object state is treated as `{}`.
pub fn merge_patch(state: &Value, patch: &Value) -> Result<Value, StateUpdateError> {
    let Value::Object(patch) = patch else {
        return Err(StateUpdateError::NotAnObject);
    };
    let mut merged = match state {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    for (k, v) in patch {
        merged.insert(k.clone(), v.clone());
    }
    Ok(Value::Object(merged))
}

/// Merges `b` into the accumulated patch `a` (later keys win).
pub fn accumulate_patch(acc: &mut Option<Value>, patch: &Value) {
    let Value::Object(patch) = patch else { return };
    let target = acc.get_or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(map) = target {
        for (k, v) in patch {
            map.insert(k.clone(), v.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Serialize, Deserialize, JsonSchema)]
    struct Counter {
        count: i64,
    }

    #[test]
    fn typed_state_parses_and_normalizes() {
        let s = TypedState::<Counter>::new();
        assert_eq!(
            s.parse(&json!({"count": 1, "extra": true})).unwrap(),
            json!({"count": 1})
        );
        let err = s.parse(&json!({"count": "x"})).unwrap_err();
        assert!(err.contains("invalid type"), "{err}");
        assert_eq!(s.json_schema()["required"], json!(["count"]));
        assert!(s.partial_json_schema().get("required").is_none());
    }

    #[test]
    fn merge_is_shallow() {
        let merged = merge_patch(&json!({"a": {"x": 1}, "b": 2}), &json!({"a": {"y": 2}})).unwrap();
        assert_eq!(merged, json!({"a": {"y": 2}, "b": 2}));
        assert_eq!(
            merge_patch(&json!({}), &json!(3)),
            Err(StateUpdateError::NotAnObject)
        );
    }
}
