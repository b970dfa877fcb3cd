//! `INVALID_INPUT`: a cheap structural check of the arguments against the
//! tool's input schema, before anything with side effects runs.
//!
//! Checked: the arguments are an object (or absent), every `required`
//! property is present, and a present property with a plain `type` (or a list
//! of types) has that JSON type. Deeper mismatches are still caught when the
//! tool deserializes its arguments, which also yields `INVALID_INPUT`. The
//! `confirmationToken` argument is ignored here (the confirmation stage,
//! inside this one, removes it).

use serde_json::Value;

use crate::approvals::CONFIRMATION_TOKEN;
use crate::error::Rejection;
use crate::gate::{Gate, GateLayer, Gated};
use crate::kind::ToolErrorKind;
use crate::schema::{expected_name, fits_type, type_name};
use crate::service::ToolRequest;
use crate::turn::TurnBudgetState;

/// The gate.
#[derive(Debug, Clone, Copy, Default)]
pub struct ValidateGate;

/// The layer of [`ValidateGate`].
pub type ValidateLayer = GateLayer<ValidateGate>;

/// A service behind [`ValidateGate`].
pub type Validate<S> = Gated<S, ValidateGate>;

/// The kind this stage rejects with.
pub const REJECTION: ToolErrorKind = ToolErrorKind::InvalidInput;

impl ValidateLayer {
    /// The layer.
    pub fn validate() -> Self {
        GateLayer::new(ValidateGate)
    }
}

impl Gate for ValidateGate {
    const NAME: &'static str = "validate";

    fn check(&self, req: &ToolRequest<'_>, _turn: &TurnBudgetState) -> Result<(), Rejection> {
        match req.tool {
            Some(tool) => check_input(&tool.definition().input_schema, &req.input)
                .map_err(|detail| Rejection::new(REJECTION).with_detail(detail)),
            None => Ok(()),
        }
    }
}

/// Checks `input` against `schema` as described in the module docs; the
/// error is the detail the model reads.
pub fn check_input(schema: &Value, input: &Value) -> Result<(), String> {
    let empty = serde_json::Map::new();
    let args = match input {
        Value::Object(map) => map,
        Value::Null => &empty,
        other => {
            return Err(format!(
                "arguments must be an object, not {}",
                type_name(other)
            ));
        }
    };
    if let Some(required) = schema.get("required").and_then(Value::as_array) {
        for name in required.iter().filter_map(Value::as_str) {
            if !args.contains_key(name) {
                return Err(format!("missing field `{name}`"));
            }
        }
    }
    if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
        for (name, value) in args {
            if name == CONFIRMATION_TOKEN {
                continue;
            }
            let Some(expected) = properties.get(name).and_then(|p| p.get("type")) else {
                continue;
            };
            if !fits_type(value, expected) {
                return Err(format!(
                    "field `{name}` must be {}, not {}",
                    expected_name(expected),
                    type_name(value)
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::check_schema;
    use serde_json::json;

    fn schema() -> Value {
        json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}, "tag": {"type": ["string", "null"]}},
            "required": ["a"]
        })
    }

    #[test]
    fn required_and_types_are_checked() {
        assert_eq!(check_input(&schema(), &json!({"a": 1})), Ok(()));
        assert_eq!(
            check_input(&schema(), &json!({"a": 1, "tag": null, "extra": true})),
            Ok(())
        );
        assert_eq!(
            check_input(&schema(), &json!({})),
            Err("missing field `a`".to_owned())
        );
        assert_eq!(
            check_input(&schema(), &json!({"a": "x"})),
            Err("field `a` must be integer, not string".to_owned())
        );
        assert_eq!(
            check_input(&schema(), &json!({"a": 1, "tag": 2})),
            Err("field `tag` must be string or null, not integer".to_owned())
        );
        assert_eq!(
            check_input(&schema(), &json!([1])),
            Err("arguments must be an object, not array".to_owned())
        );
    }

    #[test]
    fn a_schema_check_reads_bounds_refs_and_unknown_fields() {
        #[derive(serde::Deserialize, schemars::JsonSchema)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Transfer {
            amount: u32,
            to: Account,
            memo: Option<String>,
            tags: Vec<Kind>,
        }
        #[derive(serde::Deserialize, schemars::JsonSchema)]
        #[allow(dead_code)]
        struct Account {
            iban: String,
        }
        #[derive(serde::Deserialize, schemars::JsonSchema)]
        #[allow(dead_code)]
        enum Kind {
            Rent,
            Food,
        }
        let schema = markov_core::tool::input_schema_for::<Transfer>();
        let good = json!({"amount": 3, "to": {"iban": "DE00"}, "memo": null, "tags": ["Rent"]});
        assert_eq!(check_schema(&schema, &good), Ok(()));
        let bad = |patch: Value| {
            let mut v = good.clone();
            if let (Some(v), Some(p)) = (v.as_object_mut(), patch.as_object()) {
                for (k, x) in p {
                    v.insert(k.clone(), x.clone());
                }
            }
            check_schema(&schema, &v).expect_err("does not fit")
        };
        assert_eq!(
            bad(json!({"amount": -3})),
            "field `amount` must be at least 0"
        );
        assert_eq!(
            bad(json!({"amount": 1.5})),
            "field `amount` must be integer, not number"
        );
        assert_eq!(bad(json!({"to": {}})), "field `to`: missing field `iban`");
        assert!(bad(json!({"tags": ["Cars"]})).starts_with("field `tags`[0] must be one of"));
        assert_eq!(bad(json!({"extra": 1})), "arguments: unknown field `extra`");
        assert_eq!(
            bad(json!({"memo": 5})),
            "field `memo` must be string or null, not integer"
        );
    }

    #[test]
    fn the_confirmation_token_is_ignored() {
        let schema = json!({"properties": {"confirmationToken": {"type": "integer"}}});
        assert_eq!(
            check_input(&schema, &json!({"confirmationToken": "t"})),
            Ok(())
        );
    }
}
