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

use crate::budget::TurnBudgetState;
use crate::confirm::CONFIRMATION_TOKEN;
use crate::error::{Rejection, ToolErrorKind};
use crate::gate::{Gate, GateLayer, Gated};
use crate::service::ToolRequest;

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
            let fits = match expected {
                Value::String(t) => has_type(value, t),
                Value::Array(ts) => ts
                    .iter()
                    .filter_map(Value::as_str)
                    .any(|t| has_type(value, t)),
                _ => true,
            };
            if !fits {
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

/// Checks `value` against `schema` as far as JSON Schema's common keywords
/// go — `type`, `enum`, `const`, numeric bounds, string lengths,
/// `required`, `properties`, `additionalProperties: false`, `items`,
/// `anyOf` / `oneOf` / `allOf`, and `$ref`s into the schema's own `$defs` —
/// recursively; the error names the first place that does not fit. What the
/// application approves in place of the model's arguments is checked this
/// way, before the decision is recorded. Other keywords are not checked
/// (the tool's own deserialization still is).
pub fn check_schema(schema: &Value, value: &Value) -> Result<(), String> {
    check_at(schema, schema, value, "arguments", 0)
}

/// How deep `$ref`s and nesting are followed before giving up (a schema
/// that refers to itself).
const MAX_SCHEMA_DEPTH: usize = 64;

fn check_at(
    root: &Value,
    schema: &Value,
    value: &Value,
    at: &str,
    depth: usize,
) -> Result<(), String> {
    if depth > MAX_SCHEMA_DEPTH {
        return Err(format!("{at}: the schema nests too deeply to check"));
    }
    let Some(schema) = schema.as_object() else {
        // `true`, `{}` or a schema this check does not read: anything fits.
        return if schema == &Value::Bool(false) {
            Err(format!("{at}: no value is allowed"))
        } else {
            Ok(())
        };
    };
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str) {
        let target = reference
            .strip_prefix("#/")
            .map(|path| path.split('/').try_fold(root, |node, part| node.get(part)))
            .unwrap_or(if reference == "#" { Some(root) } else { None });
        match target {
            Some(target) => check_at(root, target, value, at, depth + 1)?,
            None => {
                return Err(format!(
                    "{at}: the schema refers to {reference}, which it lacks"
                ));
            }
        }
    }
    if let Some(expected) = schema.get("type") {
        let fits = match expected {
            Value::String(t) => has_type(value, t),
            Value::Array(ts) => ts
                .iter()
                .filter_map(Value::as_str)
                .any(|t| has_type(value, t)),
            _ => true,
        };
        if !fits {
            return Err(format!(
                "{at} must be {}, not {}",
                expected_name(expected),
                type_name(value)
            ));
        }
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array)
        && !options.contains(value)
    {
        return Err(format!(
            "{at} must be one of {}",
            Value::Array(options.clone())
        ));
    }
    if let Some(constant) = schema.get("const")
        && constant != value
    {
        return Err(format!("{at} must be {constant}"));
    }
    if let Some(n) = value.as_f64() {
        let bound = |key: &str| schema.get(key).and_then(Value::as_f64);
        if let Some(min) = bound("minimum")
            && n < min
        {
            return Err(format!("{at} must be at least {min}"));
        }
        if let Some(max) = bound("maximum")
            && n > max
        {
            return Err(format!("{at} must be at most {max}"));
        }
        if let Some(min) = bound("exclusiveMinimum")
            && n <= min
        {
            return Err(format!("{at} must be more than {min}"));
        }
        if let Some(max) = bound("exclusiveMaximum")
            && n >= max
        {
            return Err(format!("{at} must be less than {max}"));
        }
    }
    if let Some(text) = value.as_str() {
        let length = u64::try_from(text.chars().count()).unwrap_or(u64::MAX);
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && length < min
        {
            return Err(format!("{at} must have at least {min} characters"));
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && length > max
        {
            return Err(format!("{at} must have at most {max} characters"));
        }
    }
    if let Some(object) = value.as_object() {
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for name in required.iter().filter_map(Value::as_str) {
                if !object.contains_key(name) {
                    return Err(format!("{at}: missing field `{name}`"));
                }
            }
        }
        let properties = schema.get("properties").and_then(Value::as_object);
        for (name, field) in object {
            match properties.and_then(|p| p.get(name)) {
                Some(property) => {
                    check_at(root, property, field, &format!("field `{name}`"), depth + 1)?;
                }
                None => match schema.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        return Err(format!("{at}: unknown field `{name}`"));
                    }
                    Some(extra @ Value::Object(_)) => {
                        check_at(root, extra, field, &format!("field `{name}`"), depth + 1)?;
                    }
                    _ => {}
                },
            }
        }
    }
    if let (Some(items), Some(list)) = (schema.get("items"), value.as_array()) {
        for (index, item) in list.iter().enumerate() {
            check_at(root, items, item, &format!("{at}[{index}]"), depth + 1)?;
        }
    }
    if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
        for part in all {
            check_at(root, part, value, at, depth + 1)?;
        }
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(options) = schema.get(key).and_then(Value::as_array) {
            let mut first = None;
            let fits =
                options.iter().any(
                    |option| match check_at(root, option, value, at, depth + 1) {
                        Ok(()) => true,
                        Err(e) => {
                            first.get_or_insert(e);
                            false
                        }
                    },
                );
            if !fits {
                return Err(first.unwrap_or_else(|| format!("{at} fits none of the options")));
            }
        }
    }
    Ok(())
}

fn has_type(value: &Value, t: &str) -> bool {
    match t {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        "number" => value.is_number(),
        "integer" => value.is_i64() || value.is_u64(),
        _ => true,
    }
}

fn expected_name(expected: &Value) -> String {
    match expected {
        Value::String(t) => t.clone(),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" or "),
        other => other.to_string(),
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
