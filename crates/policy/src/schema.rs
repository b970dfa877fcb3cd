//! A check of a JSON value against a JSON Schema, as far as its common
//! keywords go ([`check_schema`]): what the application approves in place
//! of the model's arguments is checked this way, and the validate stage
//! uses its type names.

use serde_json::Value;

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
    if let Some(expected) = schema.get("type")
        && !fits_type(value, expected)
    {
        return Err(format!(
            "{at} must be {}, not {}",
            expected_name(expected),
            type_name(value)
        ));
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

/// Whether `value` has the JSON type `expected` names: a type, or a list of
/// types (anything else constrains nothing).
pub(crate) fn fits_type(value: &Value, expected: &Value) -> bool {
    match expected {
        Value::String(t) => has_type(value, t),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .any(|t| has_type(value, t)),
        _ => true,
    }
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

pub(crate) fn expected_name(expected: &Value) -> String {
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

pub(crate) fn type_name(value: &Value) -> &'static str {
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
