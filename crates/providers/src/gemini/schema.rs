//! JSON Schema (as markov's tools and output types give it, schemars'
//! output included) converted to the Gemini API's schema dialect, an
//! OpenAPI 3.0 subset: `type` in upper case, `nullable` instead of a
//! `null` type, `anyOf` for alternatives, `$ref`s inlined, `const` as a
//! one-value `enum`.
//!
//! What the dialect cannot say is refused with a [`SchemaError`] naming
//! where it is, never dropped silently where dropping would change what
//! the model may send: a map (`additionalProperties` with a schema), a
//! recursive `$ref`, `not`, conditionals, exclusive bounds, tuple items,
//! `patternProperties`, a non-string `enum`, and a schema that allows
//! anything (`{}` or `true`). Annotations the dialect has no place for
//! (`$schema`, `$id`, `$comment`, `examples` beyond the first,
//! `readOnly`, `writeOnly`, `deprecated`, `additionalProperties: false`)
//! are left out, and so are integer formats other than `int32` / `int64`
//! (schemars' `uint32` and the like; the `minimum` beside them stays).

use serde_json::{Map, Value, json};

/// A schema the Gemini API cannot express.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the schema of {subject} cannot be expressed in Gemini's schema dialect at {path}: {reason}"
)]
#[non_exhaustive]
pub struct SchemaError {
    /// What the schema belongs to (`tool "name"`, `the output type`).
    pub subject: String,
    /// Where in the schema, as a JSON pointer (`#/properties/tags`).
    pub path: String,
    /// What the dialect lacks.
    pub reason: String,
}

/// The deepest nesting converted (refs inlined count): a bound on work
/// for any input.
const MAX_DEPTH: usize = 64;

/// `schema` in the Gemini dialect, for `subject` (named in errors).
///
/// # Errors
/// A [`SchemaError`] naming the first place the dialect cannot express.
pub(super) fn convert(schema: &Value, subject: &str) -> Result<Value, SchemaError> {
    let mut converter = Converter {
        root: schema,
        subject,
        refs: Vec::new(),
    };
    converter.node(schema, "#", 0)
}

struct Converter<'a> {
    root: &'a Value,
    subject: &'a str,
    /// The `$ref`s being inlined, outermost first (a repeat is recursion).
    refs: Vec<String>,
}

/// The dialect's name of a JSON Schema type.
fn type_name(json_type: &str) -> Option<&'static str> {
    Some(match json_type {
        "string" => "STRING",
        "number" => "NUMBER",
        "integer" => "INTEGER",
        "boolean" => "BOOLEAN",
        "array" => "ARRAY",
        "object" => "OBJECT",
        _ => return None,
    })
}

impl<'a> Converter<'a> {
    fn error(&self, path: &str, reason: impl Into<String>) -> SchemaError {
        SchemaError {
            subject: self.subject.to_owned(),
            path: path.to_owned(),
            reason: reason.into(),
        }
    }

    /// The schema a local `$ref` (`#/$defs/x`, `#/definitions/x`) names.
    fn resolve(&self, reference: &str, path: &str) -> Result<&'a Value, SchemaError> {
        let root: &'a Value = self.root;
        let pointer = reference
            .strip_prefix('#')
            .ok_or_else(|| self.error(path, format!("the reference {reference:?} is not local")))?;
        root.pointer(pointer)
            .ok_or_else(|| self.error(path, format!("the reference {reference:?} names nothing")))
    }

    fn node(&mut self, schema: &Value, path: &str, depth: usize) -> Result<Value, SchemaError> {
        if depth > MAX_DEPTH {
            return Err(self.error(path, format!("it nests deeper than {MAX_DEPTH} levels")));
        }
        let object = match schema {
            Value::Object(object) => object,
            Value::Bool(true) => {
                return Err(self.error(path, "it allows any value, and the dialect needs a type"));
            }
            _ => return Err(self.error(path, "a schema must be an object")),
        };
        if let Some(reference) = object.get("$ref").and_then(Value::as_str) {
            if self.refs.iter().any(|r| r == reference) {
                return Err(self.error(
                    path,
                    format!("the reference {reference:?} is recursive, and the dialect has no references"),
                ));
            }
            let target = self.resolve(reference, path)?;
            self.refs.push(reference.to_owned());
            let mut inlined = self.node(target, path, depth + 1)?;
            self.refs.pop();
            // Keywords beside the `$ref` (a description) win.
            let siblings: Map<String, Value> = object
                .iter()
                .filter(|(k, _)| k.as_str() != "$ref")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if !siblings.is_empty() {
                let converted = self.keywords(&siblings, path, depth, true)?;
                if let (Value::Object(target), Value::Object(more)) = (&mut inlined, converted) {
                    target.extend(more);
                }
            }
            return Ok(inlined);
        }
        self.keywords(object, path, depth, false)
    }

    /// Converts the keywords of one schema object. `partial`: the keywords
    /// beside a `$ref`, which need no type of their own.
    fn keywords(
        &mut self,
        object: &Map<String, Value>,
        path: &str,
        depth: usize,
        partial: bool,
    ) -> Result<Value, SchemaError> {
        let mut out = Map::new();
        let mut typed = false;
        for (key, value) in object {
            let here = format!("{path}/{key}");
            match key.as_str() {
                "type" => {
                    typed = true;
                    let names: Vec<&str> = match value {
                        Value::String(one) => vec![one.as_str()],
                        Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
                        _ => return Err(self.error(&here, "a type must be a string or a list")),
                    };
                    let nullable = names.contains(&"null");
                    let types: Vec<&str> = names.into_iter().filter(|t| *t != "null").collect();
                    if nullable {
                        out.insert("nullable".into(), Value::Bool(true));
                    }
                    match types.as_slice() {
                        [] => {
                            return Err(self.error(
                                &here,
                                "a value that can only be null has no type in the dialect",
                            ));
                        }
                        [one] => {
                            let name = type_name(one).ok_or_else(|| {
                                self.error(&here, format!("unknown type {one:?}"))
                            })?;
                            out.insert("type".into(), json!(name));
                        }
                        many => {
                            // Several types: one alternative each, the
                            // other keywords applying to all.
                            let mut alternatives = Vec::new();
                            for one in many {
                                let name = type_name(one).ok_or_else(|| {
                                    self.error(&here, format!("unknown type {one:?}"))
                                })?;
                                alternatives.push(json!({"type": name}));
                            }
                            out.insert("anyOf".into(), Value::Array(alternatives));
                        }
                    }
                }
                "properties" => {
                    let Value::Object(properties) = value else {
                        return Err(self.error(&here, "properties must be an object"));
                    };
                    let mut converted = Map::new();
                    for (name, property) in properties {
                        let at = format!("{here}/{}", name.replace('~', "~0").replace('/', "~1"));
                        converted.insert(name.clone(), self.node(property, &at, depth + 1)?);
                    }
                    out.insert("properties".into(), Value::Object(converted));
                }
                "items" => match value {
                    Value::Object(_) => {
                        out.insert("items".into(), self.node(value, &here, depth + 1)?);
                    }
                    _ => {
                        return Err(self.error(
                            &here,
                            "tuple items (a list of schemas) have no form in the dialect",
                        ));
                    }
                },
                "anyOf" | "oneOf" => {
                    let Value::Array(alternatives) = value else {
                        return Err(self.error(&here, format!("{key} must be a list")));
                    };
                    let mut converted = Vec::new();
                    let mut nullable = false;
                    for (i, alternative) in alternatives.iter().enumerate() {
                        if alternative.get("type").and_then(Value::as_str) == Some("null") {
                            nullable = true;
                            continue;
                        }
                        converted.push(self.node(
                            alternative,
                            &format!("{here}/{i}"),
                            depth + 1,
                        )?);
                    }
                    if nullable {
                        out.insert("nullable".into(), Value::Bool(true));
                    }
                    match converted.len() {
                        0 => return Err(self.error(&here, "no alternative but null")),
                        // `Option<T>` as schemars writes it: T, nullable.
                        1 => {
                            if let Some(Value::Object(only)) = converted.pop() {
                                typed |= only.contains_key("type");
                                out.extend(only);
                            }
                        }
                        _ => {
                            typed = true;
                            out.insert("anyOf".into(), Value::Array(converted));
                        }
                    }
                }
                "allOf" => {
                    let Value::Array(parts) = value else {
                        return Err(self.error(&here, "allOf must be a list"));
                    };
                    match parts.as_slice() {
                        [only] => {
                            if let Value::Object(merged) =
                                self.node(only, &format!("{here}/0"), depth + 1)?
                            {
                                typed |= merged.contains_key("type");
                                out.extend(merged);
                            }
                        }
                        _ => {
                            return Err(self.error(
                                &here,
                                "allOf of several schemas has no form in the dialect",
                            ));
                        }
                    }
                }
                "enum" => {
                    let Value::Array(values) = value else {
                        return Err(self.error(&here, "enum must be a list"));
                    };
                    if values.iter().any(|v| !v.is_string() && !v.is_null()) {
                        return Err(
                            self.error(&here, "only strings can be enumerated in the dialect")
                        );
                    }
                    let strings: Vec<Value> =
                        values.iter().filter(|v| v.is_string()).cloned().collect();
                    if strings.len() < values.len() {
                        out.insert("nullable".into(), Value::Bool(true));
                    }
                    out.insert("enum".into(), Value::Array(strings));
                    if !object.contains_key("type") {
                        typed = true;
                        out.insert("type".into(), json!("STRING"));
                    }
                }
                "const" => match value {
                    Value::String(_) => {
                        out.insert("enum".into(), json!([value]));
                        if !object.contains_key("type") {
                            typed = true;
                            out.insert("type".into(), json!("STRING"));
                        }
                    }
                    _ => {
                        return Err(self.error(
                            &here,
                            "only a string const can be expressed (as a one-value enum)",
                        ));
                    }
                },
                "format" => {
                    let keep = matches!(
                        value.as_str(),
                        Some("date-time" | "enum" | "int32" | "int64" | "float" | "double")
                    );
                    if keep {
                        out.insert(key.clone(), value.clone());
                    }
                }
                "description" | "title" | "nullable" | "required" | "minItems" | "maxItems"
                | "minimum" | "maximum" | "minLength" | "maxLength" | "pattern"
                | "minProperties" | "maxProperties" | "default" | "example" => {
                    out.insert(key.clone(), value.clone());
                }
                "examples" => {
                    if let Some(first) = value.as_array().and_then(|v| v.first()) {
                        out.insert("example".into(), first.clone());
                    }
                }
                "additionalProperties" => {
                    match value {
                        Value::Bool(false) => {}
                        Value::Bool(true) => {}
                        _ => return Err(self.error(
                            &here,
                            "a map (additionalProperties with a schema) has no form in the dialect",
                        )),
                    }
                }
                "$schema" | "$id" | "$comment" | "$defs" | "definitions" | "readOnly"
                | "writeOnly" | "deprecated" | "uniqueItems" => {}
                other => {
                    return Err(self.error(
                        &here,
                        format!("the keyword {other:?} has no form in the dialect"),
                    ));
                }
            }
        }
        if !typed && !partial {
            // Properties without a type: an object, as JSON Schema reads it.
            if out.contains_key("properties") {
                out.insert("type".into(), json!("OBJECT"));
            } else {
                return Err(self.error(path, "it allows any value, and the dialect needs a type"));
            }
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemars_shapes_convert() {
        let schema = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "Order",
            "type": "object",
            "properties": {
                "id": {"type": "string", "description": "The id."},
                "count": {"type": "integer", "format": "uint32", "minimum": 0},
                "note": {"type": ["string", "null"]},
                "kind": {"$ref": "#/$defs/Kind"},
                "maybe": {"anyOf": [{"$ref": "#/$defs/Kind"}, {"type": "null"}]},
                "tags": {"type": "array", "items": {"type": "string"}}
            },
            "required": ["id", "count"],
            "additionalProperties": false,
            "$defs": {"Kind": {"type": "string", "enum": ["a", "b"]}}
        });
        let converted = convert(&schema, "tool \"order\"").unwrap();
        assert_eq!(
            converted,
            json!({
                "title": "Order",
                "type": "OBJECT",
                "properties": {
                    "id": {"type": "STRING", "description": "The id."},
                    "count": {"type": "INTEGER", "minimum": 0},
                    "note": {"type": "STRING", "nullable": true},
                    "kind": {"type": "STRING", "enum": ["a", "b"]},
                    "maybe": {"type": "STRING", "enum": ["a", "b"], "nullable": true},
                    "tags": {"type": "ARRAY", "items": {"type": "STRING"}}
                },
                "required": ["id", "count"]
            })
        );
    }

    #[test]
    fn what_the_dialect_cannot_say_is_refused_with_its_place() {
        let cases = [
            (
                json!({"type": "object", "additionalProperties": {"type": "integer"}}),
                "#/additionalProperties",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#"}}}),
                "#/properties/a/properties/a",
            ),
            (
                json!({"type": "object", "properties": {"x": {}}}),
                "#/properties/x",
            ),
            (
                json!({"type": "integer", "exclusiveMinimum": 0}),
                "#/exclusiveMinimum",
            ),
            (json!({"type": "integer", "enum": [1, 2]}), "#/enum"),
            (json!({"not": {"type": "string"}}), "#/not"),
            (json!(true), "#"),
        ];
        for (schema, path) in cases {
            let error = convert(&schema, "tool \"t\"").unwrap_err();
            assert_eq!(error.path, path, "{schema}: {error}");
            assert!(
                error.to_string().starts_with("the schema of tool \"t\""),
                "{error}"
            );
        }
    }

    #[test]
    fn deep_or_self_referencing_schemas_end() {
        let mut deep = json!({"type": "string"});
        for _ in 0..100 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(convert(&deep, "x").unwrap_err().reason.contains("deeper"));
        let recursive = json!({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                               "$ref": "#/$defs/n"});
        assert!(
            convert(&recursive, "x")
                .unwrap_err()
                .reason
                .contains("recursive")
        );
    }
}
