//! Datasets: cases written by hand in TOML (or one JSON case per line), or
//! exported from a stored session ([`crate::export_session`]).

use std::path::Path;

use markov_core::model::{ModelResponse, StopReason};
use markov_core::{Item, ToolCallId};
use markov_testkit::ScriptedModel;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::expect::Expect;

/// A set of cases, run together and reported together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dataset {
    /// The dataset's name (the JUnit suite's, the report's).
    pub name: String,
    /// What it checks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// How many times each case runs unless the case says otherwise (1 by
    /// default): a real model is not deterministic, so a case has a pass
    /// rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat: Option<u32>,
    /// The cases, in order.
    #[serde(default, rename = "case")]
    pub cases: Vec<Case>,
}

/// One case: what the user says, what a scripted model answers, what is
/// expected of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// The case's id, unique in its dataset.
    pub id: String,
    /// Tags, to select cases and group them in reports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// The user turns, in order: each is enqueued and run to the end of
    /// its turn before the next.
    pub input: Vec<String>,
    /// The state the conversation starts in: an object whose keys replace
    /// those of the agent's start state (checked against the start node's
    /// state schema); the agent's start state when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
    /// How many times the case runs (the dataset's `repeat` when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat: Option<u32>,
    /// The scripted model's answers, in order: what the case plays offline.
    /// Ignored when the run uses a real model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub script: Vec<Answer>,
    /// The scripted judge's verdicts, in order, for the case's `judge`
    /// expectations when the run is offline.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub judge_script: Vec<String>,
    /// What the run must do.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expect: Vec<Expect>,
}

/// One scripted model answer: text, tool calls, or both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Answer {
    /// The answer's text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The tool calls, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<Call>,
}

/// One scripted tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Call {
    /// The call id (`call_<n>` numbered across the script when unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The tool.
    pub tool: String,
    /// The arguments (an empty object when unset).
    #[serde(default = "empty_object")]
    pub args: Value,
}

fn empty_object() -> Value {
    Value::Object(serde_json::Map::new())
}

/// Why a dataset could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DatasetError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What failed.
        source: std::io::Error,
    },
    /// The TOML does not describe a dataset.
    #[error("{path}: {detail}")]
    Toml {
        /// The file.
        path: String,
        /// What is wrong, with its line.
        detail: String,
    },
    /// A line of a JSONL dataset is not a case.
    #[error("{path}:{line}: {detail}")]
    Jsonl {
        /// The file.
        path: String,
        /// The line, from 1.
        line: usize,
        /// What is wrong.
        detail: String,
    },
    /// The dataset reads but is not usable.
    #[error("dataset {dataset}: {detail}")]
    Invalid {
        /// The dataset's name.
        dataset: String,
        /// What is wrong.
        detail: String,
    },
    /// The dataset could not be written as TOML.
    #[error("cannot write the dataset as TOML: {0}")]
    Write(String),
}

impl Dataset {
    /// Reads a dataset: TOML, or one JSON [`Case`] per line when the file
    /// name ends in `.jsonl` (the dataset is then named after the file).
    ///
    /// # Errors
    /// The file cannot be read, does not parse, or is invalid
    /// ([`Dataset::validate`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, DatasetError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| DatasetError::Io {
            path: shown.clone(),
            source,
        })?;
        let dataset = if path.extension().is_some_and(|e| e == "jsonl") {
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "dataset".to_owned());
            Self::from_jsonl(&name, &text).map_err(|(line, detail)| DatasetError::Jsonl {
                path: shown,
                line,
                detail,
            })?
        } else {
            Self::from_toml(&text).map_err(|detail| DatasetError::Toml {
                path: shown,
                detail,
            })?
        };
        dataset.validate()?;
        Ok(dataset)
    }

    /// Parses a TOML dataset (not validated).
    ///
    /// # Errors
    /// The parser's message, with the line at fault.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Parses a JSONL dataset named `name`: one case per non-blank line
    /// (not validated).
    ///
    /// # Errors
    /// The line at fault (from 1) and what is wrong with it.
    pub fn from_jsonl(name: &str, text: &str) -> Result<Self, (usize, String)> {
        let mut cases = Vec::new();
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            cases.push(serde_json::from_str(line).map_err(|e| (n + 1, e.to_string()))?);
        }
        Ok(Dataset {
            name: name.to_owned(),
            description: None,
            repeat: None,
            cases,
        })
    }

    /// The dataset as TOML.
    ///
    /// # Errors
    /// A value TOML cannot hold (a JSON `null` in a call's arguments).
    pub fn to_toml(&self) -> Result<String, DatasetError> {
        toml::to_string(self).map_err(|e| DatasetError::Write(e.to_string()))
    }

    /// Checks what the parser cannot: case ids present and unique, every
    /// case with a user turn, repeats of at least one, patterns that
    /// compile.
    ///
    /// # Errors
    /// The first problem found.
    pub fn validate(&self) -> Result<(), DatasetError> {
        let invalid = |detail: String| DatasetError::Invalid {
            dataset: self.name.clone(),
            detail,
        };
        if self.repeat == Some(0) {
            return Err(invalid("`repeat` must be at least 1".to_owned()));
        }
        let mut seen = std::collections::HashSet::new();
        for case in &self.cases {
            if case.id.trim().is_empty() {
                return Err(invalid("a case has an empty id".to_owned()));
            }
            if !seen.insert(case.id.as_str()) {
                return Err(invalid(format!("two cases are named `{}`", case.id)));
            }
            if case.input.is_empty() {
                return Err(invalid(format!("case `{}` has no input", case.id)));
            }
            if case.state.as_ref().is_some_and(|s| !s.is_object()) {
                return Err(invalid(format!(
                    "case `{}`: `state` must be a table (an object)",
                    case.id
                )));
            }
            if case.repeat == Some(0) {
                return Err(invalid(format!(
                    "case `{}`: `repeat` must be at least 1",
                    case.id
                )));
            }
            for expect in &case.expect {
                expect
                    .check()
                    .map_err(|e| invalid(format!("case `{}`: {e}", case.id)))?;
            }
        }
        Ok(())
    }
}

impl Case {
    /// How many times the case runs in `dataset`.
    pub fn repeats(&self, dataset: &Dataset) -> u32 {
        self.repeat.or(dataset.repeat).unwrap_or(1).max(1)
    }

    /// The scripted model that plays [`Case::script`]: each answer in
    /// order, tool calls numbered `call_<n>` across the script unless the
    /// answer names their ids. A request past the script is an error the
    /// run reports.
    pub fn scripted_model(&self) -> ScriptedModel {
        let mut next = 0u64;
        ScriptedModel::new(self.script.iter().map(|answer| {
            let mut content = Vec::new();
            if let Some(text) = &answer.text {
                content.push(Item::text(text.clone()));
            }
            for call in &answer.calls {
                next += 1;
                let id = call.id.clone().unwrap_or_else(|| format!("call_{next}"));
                content.push(Item::tool_use(
                    ToolCallId::new(id),
                    call.tool.clone(),
                    call.args.clone(),
                ));
            }
            let stop = if answer.calls.is_empty() {
                StopReason::EndTurn
            } else {
                StopReason::ToolUse
            };
            ModelResponse::new(content, stop)
        }))
    }

    /// The scripted judge that plays [`Case::judge_script`].
    pub fn scripted_judge(&self) -> ScriptedModel {
        ScriptedModel::new(self.judge_script.iter().map(|verdict| {
            ModelResponse::new(vec![Item::text(verdict.clone())], StopReason::EndTurn)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_toml_dataset_reads_with_its_expectations() {
        let dataset = Dataset::from_toml(
            r#"
name = "calc"
repeat = 2

[[case]]
id = "adds"
tags = ["tools"]
input = ["What is 2 + 3?"]
script = [
  { calls = [{ tool = "add", args = { a = 2, b = 3 } }] },
  { text = "5" },
]

[[case.expect]]
kind = "trajectory"
mode = "exact"
calls = [{ tool = "add", args = { a = 2 } }]

[[case.expect]]
kind = "output_contains"
value = "5"
"#,
        )
        .expect("reads");
        dataset.validate().expect("valid");
        assert_eq!(dataset.cases[0].repeats(&dataset), 2);
        assert_eq!(dataset.cases[0].script.len(), 2);
        assert_eq!(dataset.cases[0].expect.len(), 2);
        // Written back, it reads the same.
        let again = Dataset::from_toml(&dataset.to_toml().expect("writes")).expect("reads");
        assert_eq!(again, dataset);
    }

    #[test]
    fn duplicate_ids_and_bad_patterns_are_refused() {
        let twice = Dataset::from_toml(
            "name = \"d\"\n[[case]]\nid = \"a\"\ninput = [\"x\"]\n[[case]]\nid = \"a\"\ninput = [\"y\"]\n",
        )
        .expect("reads");
        assert!(
            twice
                .validate()
                .unwrap_err()
                .to_string()
                .contains("two cases")
        );
        let pattern = Dataset::from_toml(
            "name = \"d\"\n[[case]]\nid = \"a\"\ninput = [\"x\"]\n[[case.expect]]\nkind = \"output_matches\"\npattern = \"(\"\n",
        )
        .expect("reads");
        assert!(pattern.validate().is_err());
    }

    #[test]
    fn an_unknown_field_is_an_error_with_its_line() {
        let err = Dataset::from_toml("name = \"d\"\n[[case]]\nid = \"a\"\ninputs = [\"x\"]\n")
            .unwrap_err();
        assert!(err.contains("inputs"), "{err}");
    }

    #[test]
    fn a_key_written_under_an_expectation_by_mistake_is_an_error() {
        // TOML puts `judge_script` under the last `[[case.expect]]` opened.
        let err = Dataset::from_toml(
            "name = \"d\"\n[[case]]\nid = \"a\"\ninput = [\"x\"]\n[[case.expect]]\nkind = \"judge\"\nrubric = \"r\"\njudge_script = [\"PASS\"]\n",
        )
        .unwrap_err();
        assert!(err.contains("judge_script"), "{err}");
    }

    #[test]
    fn jsonl_cases_read_one_per_line() {
        let dataset = Dataset::from_jsonl(
            "j",
            "{\"id\":\"a\",\"input\":[\"hi\"]}\n\n{\"id\":\"b\",\"input\":[\"ho\"],\"expect\":[{\"kind\":\"yield_reason\",\"reason\":\"end_turn\"}]}\n",
        )
        .expect("reads");
        assert_eq!(dataset.cases.len(), 2);
        let err = Dataset::from_jsonl("j", "{\"id\":\"a\"}\n").unwrap_err();
        assert_eq!(err.0, 1);
    }
}
