//! What a case expects of its run ([`Expect`]), what evaluators see of the
//! run ([`CaseRun`]) and what they say ([`Verdict`]), and the one-method
//! [`Evaluator`] trait for evaluators of your own.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use markov_core::model::{Model, Usage};
use markov_core::{Item, Message, Role, Usd};
use markov_executor::MachineStep;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::judge;

/// One expectation of a case, as the dataset writes it (`kind = "..."`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Expect {
    /// The tools called, in the way `mode` says, each with arguments that
    /// contain the expected ones.
    Trajectory {
        /// How the calls are matched.
        #[serde(default)]
        mode: TrajectoryMode,
        /// The expected calls.
        calls: Vec<ExpectedCall>,
    },
    /// The run ended with this terminal tool, its response containing
    /// `output` when set.
    TerminalTool {
        /// The terminal tool's name.
        tool: String,
        /// Text the tool's response contains.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        output: Option<String>,
    },
    /// The last step's yield reason (`end_turn`, `tool_use`, ...).
    YieldReason {
        /// The reason's wire name.
        reason: String,
    },
    /// The policy refused exactly these calls (by error kind, such as
    /// `BUDGET_EXCEEDED`, in any order): none when `exactly` is empty.
    Refusals {
        /// The refusals' kinds.
        #[serde(default)]
        exactly: Vec<String>,
    },
    /// The run stayed within these budgets.
    Budget {
        /// Steps, every turn counted.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_steps: Option<u64>,
        /// Tokens (input, cached and output) of the agent's model calls.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_tokens: Option<u64>,
        /// Cost of the agent's model calls, in dollars (`"0.05"`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_cost_usd: Option<Usd>,
        /// Wall-clock time of the run, in milliseconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_latency_ms: Option<u64>,
    },
    /// The output is exactly this text (surrounding whitespace ignored).
    OutputEquals {
        /// The text.
        value: String,
    },
    /// The output contains this text.
    OutputContains {
        /// The text.
        value: String,
        /// Compare without regard to case.
        #[serde(default)]
        ignore_case: bool,
    },
    /// The output matches this regular expression (`regex-lite` syntax).
    OutputMatches {
        /// The pattern.
        pattern: String,
    },
    /// The output is JSON that satisfies this JSON Schema (the structural
    /// check the policy's `validate` stage makes: types, required
    /// properties, nested objects and arrays).
    OutputSchema {
        /// The schema.
        schema: Value,
    },
    /// The output is JSON that satisfies the agent's output type (the
    /// start node's).
    OutputType,
    /// A judge model reads the conversation and the rubric and answers
    /// `PASS` or `FAIL` with a reason; its usage is counted apart.
    Judge {
        /// What a good answer does.
        rubric: String,
    },
    /// An evaluator registered with the runner under `name`.
    Custom {
        /// The evaluator's name.
        name: String,
        /// Its configuration, handed to it as it is.
        #[serde(default, skip_serializing_if = "Value::is_null")]
        config: Value,
    },
}

/// How a trajectory's calls are matched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrajectoryMode {
    /// Exactly these calls, in this order, and no others.
    Exact,
    /// These calls in this order, others allowed between them.
    #[default]
    InOrder,
    /// These calls in any order, others allowed.
    Subset,
}

/// A call a trajectory expects.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectedCall {
    /// The tool.
    pub tool: String,
    /// Arguments the call's arguments contain (objects key by key,
    /// recursively; anything else equal); any arguments when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<Value>,
}

impl Expect {
    /// The evaluator's name in reports: the kind, or a custom evaluator's
    /// name.
    pub fn name(&self) -> String {
        match self {
            Expect::Trajectory { mode, .. } => format!(
                "trajectory_{}",
                match mode {
                    TrajectoryMode::Exact => "exact",
                    TrajectoryMode::InOrder => "in_order",
                    TrajectoryMode::Subset => "subset",
                }
            ),
            Expect::TerminalTool { .. } => "terminal_tool".into(),
            Expect::YieldReason { .. } => "yield_reason".into(),
            Expect::Refusals { .. } => "refusals".into(),
            Expect::Budget { .. } => "budget".into(),
            Expect::OutputEquals { .. } => "output_equals".into(),
            Expect::OutputContains { .. } => "output_contains".into(),
            Expect::OutputMatches { .. } => "output_matches".into(),
            Expect::OutputSchema { .. } => "output_schema".into(),
            Expect::OutputType => "output_type".into(),
            Expect::Judge { .. } => "judge".into(),
            Expect::Custom { name, .. } => name.clone(),
        }
    }

    /// Checks what can be checked before a run (patterns compile).
    ///
    /// # Errors
    /// What is wrong.
    pub fn check(&self) -> Result<(), String> {
        match self {
            Expect::OutputMatches { pattern } => regex_lite::Regex::new(pattern)
                .map(|_| ())
                .map_err(|e| format!("pattern `{pattern}` does not compile: {e}")),
            Expect::Trajectory { calls, .. } if calls.is_empty() => Err(
                "a trajectory names at least one call (use `refusals` or `budget` for none)"
                    .to_owned(),
            ),
            _ => Ok(()),
        }
    }

    /// Evaluates the expectation on `run`; `custom` holds the registered
    /// evaluators.
    pub async fn evaluate(
        &self,
        run: &CaseRun,
        custom: &HashMap<String, Arc<dyn Evaluator>>,
    ) -> Verdict {
        match self {
            Expect::Trajectory { mode, calls } => trajectory(run, *mode, calls),
            Expect::TerminalTool { tool, output } => terminal_tool(run, tool, output.as_deref()),
            Expect::YieldReason { reason } => match run.steps.last() {
                Some(last) if last.yield_reason.as_str() == reason => Verdict::pass(),
                Some(last) => Verdict::fail(format!(
                    "the run ended with `{}`, not `{reason}`",
                    last.yield_reason.as_str()
                ))
                .at_step(run.steps.len()),
                None => Verdict::fail("the run yielded no step"),
            },
            Expect::Refusals { exactly } => refusals(run, exactly),
            Expect::Budget {
                max_steps,
                max_tokens,
                max_cost_usd,
                max_latency_ms,
            } => budget(run, *max_steps, *max_tokens, *max_cost_usd, *max_latency_ms),
            Expect::OutputEquals { value } => with_output(run, |out| {
                (out.trim() == value.trim())
                    .then_some(())
                    .ok_or_else(|| format!("the output {out:?} is not {value:?}"))
            }),
            Expect::OutputContains { value, ignore_case } => with_output(run, |out| {
                let found = if *ignore_case {
                    out.to_lowercase().contains(&value.to_lowercase())
                } else {
                    out.contains(value.as_str())
                };
                found
                    .then_some(())
                    .ok_or_else(|| format!("the output {out:?} does not contain {value:?}"))
            }),
            Expect::OutputMatches { pattern } => match regex_lite::Regex::new(pattern) {
                Ok(re) => with_output(run, |out| {
                    re.is_match(out)
                        .then_some(())
                        .ok_or_else(|| format!("the output {out:?} does not match `{pattern}`"))
                }),
                Err(e) => Verdict::fail(format!("pattern `{pattern}` does not compile: {e}")),
            },
            Expect::OutputSchema { schema } => output_schema(run, schema),
            Expect::OutputType => match &run.output_schema {
                Some(schema) => output_schema(run, schema),
                None => Verdict::fail("the agent's start node has no output type"),
            },
            Expect::Judge { rubric } => match &run.judge {
                Some(model) => judge::judge(model.as_ref(), rubric, run).await,
                None => Verdict::fail("no judge model: give the runner one"),
            },
            Expect::Custom { name, config } => match custom.get(name) {
                Some(evaluator) => evaluator.evaluate(run, config).await,
                None => Verdict::fail(format!("no evaluator named `{name}` is registered")),
            },
        }
    }
}

/// An evaluator of your own, named in a dataset as
/// `{ kind = "custom", name = "...", config = ... }` and registered with
/// [`Runner::evaluator`](crate::Runner::evaluator).
#[async_trait]
pub trait Evaluator: Send + Sync + fmt::Debug {
    /// Judges one run; `config` is the expectation's `config` (`null` when
    /// unset).
    async fn evaluate(&self, run: &CaseRun, config: &Value) -> Verdict;
}

/// An evaluator's finding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// Whether the expectation holds.
    pub passed: bool,
    /// Why not (or, for a judge, its reason).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// The step (from 1, every turn counted) where the run went wrong,
    /// when one can be named: where to open the stored session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    /// What the evaluator's own model calls used (a judge's), apart from
    /// the agent's.
    #[serde(default, skip_serializing_if = "Usage::is_empty")]
    pub usage: Usage,
}

impl Verdict {
    /// The expectation holds.
    pub fn pass() -> Self {
        Verdict {
            passed: true,
            detail: String::new(),
            step: None,
            usage: Usage::default(),
        }
    }

    /// It does not, for `detail`.
    pub fn fail(detail: impl Into<String>) -> Self {
        Verdict {
            passed: false,
            detail: detail.into(),
            step: None,
            usage: Usage::default(),
        }
    }

    /// Names the step where the run went wrong.
    #[must_use]
    pub fn at_step(mut self, step: usize) -> Self {
        self.step = Some(step);
        self
    }
}

/// One tool call of a run, with its result.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The step (from 1) whose answer made the call.
    pub step: usize,
    /// The tool.
    pub tool: String,
    /// The arguments.
    pub args: Value,
    /// The result's text, when the call got one.
    pub result: Option<String>,
    /// Whether the result is an error.
    pub is_error: bool,
}

/// What evaluators see of one run of a case.
#[derive(Debug, Clone)]
pub struct CaseRun {
    /// The case's id.
    pub case: String,
    /// Every step of every turn, in order.
    pub steps: Vec<MachineStep>,
    /// The whole conversation.
    pub history: Vec<Message>,
    /// Every tool call, in order, with its result.
    pub calls: Vec<ToolCall>,
    /// What the user reads at the end: the last step's output.
    pub output: Option<String>,
    /// What the agent's model calls used.
    pub usage: Usage,
    /// The run's wall-clock time.
    pub latency: Duration,
    /// The JSON Schema of the agent's output type, if it has one.
    pub output_schema: Option<Value>,
    /// The judge model, if the runner has one.
    pub judge: Option<Arc<dyn Model>>,
}

impl CaseRun {
    /// The run as its steps tell it.
    pub fn new(
        case: impl Into<String>,
        steps: Vec<MachineStep>,
        history: Vec<Message>,
        latency: Duration,
    ) -> Self {
        // Results by call id, from the whole history.
        let mut results = HashMap::new();
        for message in &history {
            for item in message.item_list() {
                if let Item::ToolResult {
                    tool_use_id,
                    content,
                    is_error,
                    ..
                } = item
                {
                    results.insert(
                        tool_use_id.clone(),
                        (content.clone(), *is_error == Some(true)),
                    );
                }
            }
        }
        let mut calls: Vec<ToolCall> = Vec::new();
        let mut usage = Usage::default();
        for (n, step) in steps.iter().enumerate() {
            usage += step.usage;
            for message in step.history.iter().filter(|m| m.role == Role::Assistant) {
                for (id, name, input) in message.tool_uses() {
                    let result = results.get(id);
                    calls.push(ToolCall {
                        step: n + 1,
                        tool: name.to_owned(),
                        args: input.clone(),
                        result: result.map(|(content, _)| content.clone()),
                        is_error: result.is_some_and(|(_, is_error)| *is_error),
                    });
                }
            }
        }
        let output = steps
            .last()
            .and_then(|last| last.output().or_else(|| structured_output(&last.history)));
        CaseRun {
            case: case.into(),
            steps,
            history,
            calls,
            output,
            usage,
            latency,
            output_schema: None,
            judge: None,
        }
    }

    /// The policy's refusals: each error result whose envelope's kind is
    /// a policy stage's (a tool that ran and failed is not a refusal), with
    /// the step of its call.
    pub fn refusals(&self) -> Vec<(usize, String)> {
        self.calls
            .iter()
            .filter(|c| c.is_error)
            .filter_map(|c| {
                let envelope: Value = serde_json::from_str(c.result.as_deref()?).ok()?;
                let kind = envelope.get("error")?.get("type")?.as_str()?;
                let known = markov_policy::ToolErrorKind::from_wire(kind)?;
                (known != markov_policy::ToolErrorKind::ExecutionFailed)
                    .then(|| (c.step, kind.to_owned()))
            })
            .collect()
    }
}

/// The structured output of a step's last assistant message (an agent
/// with an output type records its answer as `output` items): a string as
/// it is, other JSON as its text.
fn structured_output(history: &[Message]) -> Option<String> {
    let message = history.iter().rev().find(|m| m.role == Role::Assistant)?;
    message.item_list().iter().find_map(|item| match item {
        Item::Output {
            data: Value::String(s),
        } => Some(s.clone()),
        Item::Output { data } => Some(data.to_string()),
        _ => None,
    })
}

/// Whether `actual` contains `expected`: objects key by key, recursively;
/// anything else equal.
pub fn json_contains(actual: &Value, expected: &Value) -> bool {
    match (actual, expected) {
        (Value::Object(a), Value::Object(e)) => e
            .iter()
            .all(|(k, ev)| a.get(k).is_some_and(|av| json_contains(av, ev))),
        _ => actual == expected,
    }
}

fn call_matches(call: &ToolCall, expected: &ExpectedCall) -> bool {
    call.tool == expected.tool
        && expected
            .args
            .as_ref()
            .is_none_or(|args| json_contains(&call.args, args))
}

fn describe(expected: &ExpectedCall) -> String {
    match &expected.args {
        Some(args) => format!("{}({args})", expected.tool),
        None => expected.tool.clone(),
    }
}

fn trajectory(run: &CaseRun, mode: TrajectoryMode, expected: &[ExpectedCall]) -> Verdict {
    let actual = &run.calls;
    let called: Vec<String> = actual
        .iter()
        .map(|c| format!("{}({})", c.tool, c.args))
        .collect();
    let last_step = run.steps.len().max(1);
    match mode {
        TrajectoryMode::Exact => {
            for (n, want) in expected.iter().enumerate() {
                match actual.get(n) {
                    Some(call) if call_matches(call, want) => {}
                    Some(call) => {
                        return Verdict::fail(format!(
                            "call {} is {}({}), expected {}; calls: [{}]",
                            n + 1,
                            call.tool,
                            call.args,
                            describe(want),
                            called.join(", ")
                        ))
                        .at_step(call.step);
                    }
                    None => {
                        return Verdict::fail(format!(
                            "call {} ({}) was never made; calls: [{}]",
                            n + 1,
                            describe(want),
                            called.join(", ")
                        ))
                        .at_step(last_step);
                    }
                }
            }
            match actual.get(expected.len()) {
                Some(extra) => Verdict::fail(format!(
                    "an extra call {}({}); calls: [{}]",
                    extra.tool,
                    extra.args,
                    called.join(", ")
                ))
                .at_step(extra.step),
                None => Verdict::pass(),
            }
        }
        TrajectoryMode::InOrder => {
            let mut rest = actual.iter();
            let mut at = 1;
            for want in expected {
                match rest.by_ref().find(|c| call_matches(c, want)) {
                    Some(call) => at = call.step,
                    None => {
                        return Verdict::fail(format!(
                            "no call {} after step {at}; calls: [{}]",
                            describe(want),
                            called.join(", ")
                        ))
                        .at_step(at);
                    }
                }
            }
            Verdict::pass()
        }
        TrajectoryMode::Subset => {
            let mut used = vec![false; actual.len()];
            for want in expected {
                let found = actual
                    .iter()
                    .enumerate()
                    .find(|(i, c)| !used[*i] && call_matches(c, want));
                match found {
                    Some((i, _)) => used[i] = true,
                    None => {
                        return Verdict::fail(format!(
                            "no call {}; calls: [{}]",
                            describe(want),
                            called.join(", ")
                        ))
                        .at_step(last_step);
                    }
                }
            }
            Verdict::pass()
        }
    }
}

fn terminal_tool(run: &CaseRun, tool: &str, output: Option<&str>) -> Verdict {
    let Some(last) = run.steps.last() else {
        return Verdict::fail("the run yielded no step");
    };
    let step = run.steps.len();
    let response = last
        .response
        .clone()
        .or_else(|| last.termination.as_ref().map(|t| format!("{t:?}")));
    let Some(response) = response else {
        return Verdict::fail(format!(
            "the run ended with `{}`, not with a terminal tool",
            last.yield_reason.as_str()
        ))
        .at_step(step);
    };
    // The call whose result is the response (several calls may share the
    // step), else the step's last call.
    let in_step = || run.calls.iter().rev().filter(|c| c.step == step);
    let ended_by = in_step()
        .find(|c| !c.is_error && c.result.as_deref() == Some(response.as_str()))
        .or_else(|| in_step().next());
    match ended_by {
        Some(call) if call.tool == tool => {}
        Some(call) => {
            return Verdict::fail(format!(
                "the run ended with terminal tool `{}`, not `{tool}`",
                call.tool
            ))
            .at_step(step);
        }
        None => {
            return Verdict::fail(format!("no call of `{tool}` in the last step")).at_step(step);
        }
    }
    match output {
        Some(want) if !response.contains(want) => Verdict::fail(format!(
            "the terminal response {response:?} does not contain {want:?}"
        ))
        .at_step(step),
        _ => Verdict::pass(),
    }
}

fn refusals(run: &CaseRun, exactly: &[String]) -> Verdict {
    let found = run.refusals();
    let mut got: Vec<&str> = found.iter().map(|(_, k)| k.as_str()).collect();
    let mut want: Vec<&str> = exactly.iter().map(String::as_str).collect();
    got.sort_unstable();
    want.sort_unstable();
    if got == want {
        return Verdict::pass();
    }
    let verdict = Verdict::fail(format!(
        "refusals [{}], expected [{}]",
        got.join(", "),
        want.join(", ")
    ));
    match found.first() {
        Some((step, _)) => verdict.at_step(*step),
        None => verdict,
    }
}

fn budget(
    run: &CaseRun,
    max_steps: Option<u64>,
    max_tokens: Option<u64>,
    max_cost: Option<Usd>,
    max_latency_ms: Option<u64>,
) -> Verdict {
    let mut over = Vec::new();
    let steps = run.steps.len() as u64;
    if let Some(max) = max_steps.filter(|max| steps > *max) {
        over.push(format!("{steps} steps > {max}"));
    }
    let tokens = run.usage.total_tokens();
    if let Some(max) = max_tokens.filter(|max| tokens > *max) {
        over.push(format!("{tokens} tokens > {max}"));
    }
    if let Some(max) = max_cost.filter(|max| run.usage.cost > *max) {
        over.push(format!("{} > {max}", run.usage.cost));
    }
    let ms = u64::try_from(run.latency.as_millis()).unwrap_or(u64::MAX);
    if let Some(max) = max_latency_ms.filter(|max| ms > *max) {
        over.push(format!("{ms} ms > {max} ms"));
    }
    if over.is_empty() {
        Verdict::pass()
    } else {
        Verdict::fail(format!("over budget: {}", over.join(", ")))
    }
}

fn with_output(run: &CaseRun, check: impl FnOnce(&str) -> Result<(), String>) -> Verdict {
    let step = run.steps.len();
    match &run.output {
        Some(out) => match check(out) {
            Ok(()) => Verdict::pass(),
            Err(why) => Verdict::fail(why).at_step(step),
        },
        None => Verdict::fail("the run has no output").at_step(step),
    }
}

fn output_schema(run: &CaseRun, schema: &Value) -> Verdict {
    with_output(run, |out| {
        let value: Value = serde_json::from_str(out.trim())
            .map_err(|e| format!("the output is not JSON ({e}): {out:?}"))?;
        markov_policy::schema::check_schema(schema, &value)
            .map_err(|why| format!("the output does not fit the schema: {why}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(step: usize, tool: &str, args: Value) -> ToolCall {
        ToolCall {
            step,
            tool: tool.into(),
            args,
            result: Some("1".into()),
            is_error: false,
        }
    }

    fn run_with(calls: Vec<ToolCall>) -> CaseRun {
        let mut run = CaseRun::new("c", vec![], vec![], Duration::ZERO);
        run.calls = calls;
        run
    }

    fn want(tool: &str, args: Option<Value>) -> ExpectedCall {
        ExpectedCall {
            tool: tool.into(),
            args,
        }
    }

    #[test]
    fn arguments_match_when_they_contain_the_expected_ones() {
        assert!(json_contains(
            &json!({"a": 1, "b": {"c": 2, "d": 3}}),
            &json!({"b": {"c": 2}})
        ));
        assert!(!json_contains(&json!({"a": 1}), &json!({"a": 2})));
        assert!(!json_contains(&json!({"a": 1}), &json!({"b": 1})));
        assert!(!json_contains(&json!([1, 2]), &json!([1])));
    }

    #[test]
    fn trajectory_modes_differ_on_order_and_extras() {
        let run = run_with(vec![
            call(1, "population", json!({"city": "Lisbon"})),
            call(1, "population", json!({"city": "Porto"})),
            call(2, "add", json!({"a": 1, "b": 2})),
        ]);
        let porto_then_add = [
            want("population", Some(json!({"city": "Porto"}))),
            want("add", None),
        ];
        assert!(trajectory(&run, TrajectoryMode::InOrder, &porto_then_add).passed);
        assert!(trajectory(&run, TrajectoryMode::Subset, &porto_then_add).passed);
        let exact = trajectory(&run, TrajectoryMode::Exact, &porto_then_add);
        assert!(!exact.passed);
        assert_eq!(exact.step, Some(1));
        let reversed = [want("add", None), want("population", None)];
        assert!(!trajectory(&run, TrajectoryMode::InOrder, &reversed).passed);
        assert!(trajectory(&run, TrajectoryMode::Subset, &reversed).passed);
        // A subset uses each call once.
        let adds = [want("add", None), want("add", None)];
        assert!(!trajectory(&run, TrajectoryMode::Subset, &adds).passed);
    }

    #[test]
    fn policy_refusals_are_read_from_error_envelopes() {
        let mut refused = call(1, "pay", json!({}));
        refused.is_error = true;
        refused.result = Some(
            r#"{"ok":false,"error":{"type":"BUDGET_EXCEEDED","message":"m","retryable":false}}"#
                .into(),
        );
        let mut failed = call(2, "pay", json!({}));
        failed.is_error = true;
        failed.result = Some(
            r#"{"ok":false,"error":{"type":"EXECUTION_FAILED","message":"m","retryable":false}}"#
                .into(),
        );
        let run = run_with(vec![refused, failed]);
        assert_eq!(run.refusals(), vec![(1, "BUDGET_EXCEEDED".to_owned())]);
        assert!(refusals(&run, &["BUDGET_EXCEEDED".into()]).passed);
        let none = refusals(&run, &[]);
        assert!(!none.passed);
        assert_eq!(none.step, Some(1));
    }
}
