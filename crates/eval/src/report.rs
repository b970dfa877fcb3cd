//! Reports: a table for the terminal, JSON for machines, JUnit XML for CI
//! systems, and the comparison of two reports.

use std::fmt::Write as _;
use std::time::Duration;

use markov_core::Usd;
use markov_core::model::Usage;
use serde::{Deserialize, Serialize};

use crate::expect::{CaseRun, Verdict};
use crate::run::judge_usage;

/// Everything one run of a dataset found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The dataset's name.
    pub dataset: String,
    /// The model the agent ran on.
    pub model: String,
    /// Where each run's session is stored (see [`RunReport::session`]).
    pub store: String,
    /// Each case, in the dataset's order.
    pub cases: Vec<CaseReport>,
    /// The totals.
    pub summary: Summary,
}

/// The totals of a report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Runs (cases times repeats).
    pub runs: usize,
    /// Runs that passed every expectation.
    pub passed: usize,
    /// Runs that ended in an error.
    pub errors: usize,
    /// `passed / runs` (1 for no runs).
    pub pass_rate: f64,
    /// What the agent's model calls used, all runs.
    pub usage: Usage,
    /// What the judge's calls used, all runs.
    pub judge_usage: Usage,
    /// The runs' wall-clock time, summed, in milliseconds.
    pub latency_ms: u64,
}

/// One case's runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseReport {
    /// The case's id.
    pub id: String,
    /// Its tags.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    /// Each repeat, in order.
    pub runs: Vec<RunReport>,
}

/// One run of one case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// Which repeat (from 1).
    pub repeat: u32,
    /// The stored session of this run, in the report's store.
    pub session: String,
    /// Whether every expectation held (and nothing errored).
    pub passed: bool,
    /// Why the run could not finish, when it could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Each expectation's verdict, in the case's order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evaluations: Vec<Evaluation>,
    /// The steps the run took, every turn counted.
    pub steps: usize,
    /// The first step (from 1) a failed expectation names: where to open
    /// the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_step: Option<usize>,
    /// What the agent's model calls used.
    pub usage: Usage,
    /// What the judge's calls used, apart.
    #[serde(default, skip_serializing_if = "Usage::is_empty")]
    pub judge_usage: Usage,
    /// The run's wall-clock time, in milliseconds.
    pub latency_ms: u64,
}

/// One expectation's verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// The evaluator (`trajectory_exact`, `output_contains#2`, a custom
    /// evaluator's name).
    pub evaluator: String,
    /// What it found.
    #[serde(flatten)]
    pub verdict: Verdict,
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl RunReport {
    pub(crate) fn errored(repeat: u32, session: String, error: String, latency: Duration) -> Self {
        RunReport {
            repeat,
            session,
            passed: false,
            error: Some(error),
            evaluations: Vec::new(),
            steps: 0,
            failed_step: None,
            usage: Usage::default(),
            judge_usage: Usage::default(),
            latency_ms: millis(latency),
        }
    }

    pub(crate) fn evaluated(
        repeat: u32,
        session: String,
        run: &CaseRun,
        evaluations: Vec<Evaluation>,
    ) -> Self {
        RunReport {
            repeat,
            session,
            passed: evaluations.iter().all(|e| e.verdict.passed),
            error: None,
            failed_step: evaluations
                .iter()
                .filter(|e| !e.verdict.passed)
                .filter_map(|e| e.verdict.step)
                .min(),
            steps: run.steps.len(),
            usage: run.usage,
            judge_usage: judge_usage(&evaluations),
            latency_ms: millis(run.latency),
            evaluations,
        }
    }
}

impl CaseReport {
    pub(crate) fn new(id: String, tags: Vec<String>) -> Self {
        CaseReport {
            id,
            tags,
            runs: Vec::new(),
        }
    }

    /// The share of runs that passed (1 for no runs).
    pub fn pass_rate(&self) -> f64 {
        rate(
            self.runs.iter().filter(|r| r.passed).count(),
            self.runs.len(),
        )
    }

    /// The share of runs in which `evaluator` held; an errored run counts
    /// as a failure of every evaluator. `None` when no run has it.
    pub fn evaluator_pass_rate(&self, evaluator: &str) -> Option<f64> {
        let mut seen = 0;
        let mut passed = 0;
        for run in &self.runs {
            if run.error.is_some() {
                seen += 1;
                continue;
            }
            if let Some(e) = run.evaluations.iter().find(|e| e.evaluator == evaluator) {
                seen += 1;
                passed += usize::from(e.verdict.passed);
            }
        }
        (seen > 0
            && self
                .runs
                .iter()
                .any(|r| r.evaluations.iter().any(|e| e.evaluator == evaluator)))
        .then(|| rate(passed, seen))
    }

    /// The evaluators' names, in the order of the first run that has them.
    pub fn evaluators(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for run in &self.runs {
            for e in &run.evaluations {
                if !names.contains(&e.evaluator) {
                    names.push(e.evaluator.clone());
                }
            }
        }
        names
    }

    /// The mean cost of a run.
    pub fn mean_cost(&self) -> Usd {
        let n = self.runs.len().max(1) as u64;
        let total = self
            .runs
            .iter()
            .fold(Usd::ZERO, |sum, r| sum.saturating_add(r.usage.cost));
        Usd::from_nanos(total.as_nanos() / n)
    }

    /// The mean wall-clock time of a run, in milliseconds.
    pub fn mean_latency_ms(&self) -> u64 {
        let n = self.runs.len().max(1) as u64;
        self.runs.iter().map(|r| r.latency_ms).sum::<u64>() / n
    }
}

fn rate(passed: usize, of: usize) -> f64 {
    if of == 0 {
        1.0
    } else {
        passed as f64 / of as f64
    }
}

impl Report {
    pub(crate) fn new(
        dataset: String,
        model: String,
        store: String,
        cases: Vec<CaseReport>,
    ) -> Self {
        let mut summary = Summary::default();
        for run in cases.iter().flat_map(|c| &c.runs) {
            summary.runs += 1;
            summary.passed += usize::from(run.passed);
            summary.errors += usize::from(run.error.is_some());
            summary.usage += run.usage;
            summary.judge_usage += run.judge_usage;
            summary.latency_ms = summary.latency_ms.saturating_add(run.latency_ms);
        }
        summary.pass_rate = rate(summary.passed, summary.runs);
        Report {
            dataset,
            model,
            store,
            cases,
            summary,
        }
    }

    /// The report as pretty JSON.
    pub fn to_json(&self) -> String {
        // Every field is plain data: serializing cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Reads a report written by [`Report::to_json`].
    ///
    /// # Errors
    /// The text is not such a report.
    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The table for the terminal: one line per case (pass rate, mean
    /// steps, tokens, cost and time), each failure's reason and session
    /// below it, the totals last.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "dataset {} on {}", self.dataset, self.model);
        let width = self
            .cases
            .iter()
            .map(|c| c.id.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let _ = writeln!(
            out,
            "{:<width$}  {:>7}  {:>5}  {:>8}  {:>10}  {:>8}",
            "case", "passed", "steps", "tokens", "cost", "time"
        );
        for case in &self.cases {
            let runs = case.runs.len().max(1);
            let passed = case.runs.iter().filter(|r| r.passed).count();
            let steps = case.runs.iter().map(|r| r.steps).sum::<usize>() / runs;
            let tokens = case
                .runs
                .iter()
                .map(|r| r.usage.total_tokens())
                .sum::<u64>()
                / runs as u64;
            let _ = writeln!(
                out,
                "{:<width$}  {:>7}  {:>5}  {:>8}  {:>10}  {:>6}ms",
                case.id,
                format!("{passed}/{}", case.runs.len()),
                steps,
                tokens,
                case.mean_cost().to_string(),
                case.mean_latency_ms()
            );
            for run in case.runs.iter().filter(|r| !r.passed) {
                let at = run
                    .failed_step
                    .map(|s| format!(" at step {s}"))
                    .unwrap_or_default();
                let _ = writeln!(out, "  #{} session {}{at}", run.repeat, run.session);
                if let Some(error) = &run.error {
                    let _ = writeln!(out, "    error: {error}");
                }
                for e in run.evaluations.iter().filter(|e| !e.verdict.passed) {
                    let _ = writeln!(out, "    {}: {}", e.evaluator, e.verdict.detail);
                }
            }
        }
        let s = &self.summary;
        let _ = writeln!(
            out,
            "{} of {} runs passed ({:.0}%), {} errors; {} tokens, {}; judge {} tokens, {}; sessions in {}",
            s.passed,
            s.runs,
            s.pass_rate * 100.0,
            s.errors,
            s.usage.total_tokens(),
            s.usage.cost,
            s.judge_usage.total_tokens(),
            s.judge_usage.cost,
            self.store
        );
        out
    }

    /// The report as JUnit XML: one test suite, one test case per run
    /// (`<case>#<repeat>`), a `failure` per failed expectation, an `error`
    /// for a run that could not finish, the session in `system-out`.
    pub fn to_junit(&self) -> String {
        let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let failures = self
            .cases
            .iter()
            .flat_map(|c| &c.runs)
            .filter(|r| !r.passed && r.error.is_none())
            .count();
        let seconds = |ms: u64| format!("{:.3}", ms as f64 / 1000.0);
        let _ = writeln!(
            out,
            "<testsuites name=\"markov-eval\" tests=\"{}\" failures=\"{failures}\" errors=\"{}\" time=\"{}\">",
            self.summary.runs,
            self.summary.errors,
            seconds(self.summary.latency_ms)
        );
        let _ = writeln!(
            out,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" errors=\"{}\" time=\"{}\">",
            xml_escape(&self.dataset),
            self.summary.runs,
            self.summary.errors,
            seconds(self.summary.latency_ms)
        );
        for case in &self.cases {
            for run in &case.runs {
                let _ = write!(
                    out,
                    "    <testcase classname=\"{}\" name=\"{}#{}\" time=\"{}\">",
                    xml_escape(&self.dataset),
                    xml_escape(&case.id),
                    run.repeat,
                    seconds(run.latency_ms)
                );
                if let Some(error) = &run.error {
                    let _ = write!(
                        out,
                        "\n      <error message=\"{}\">{}</error>",
                        xml_escape(error),
                        xml_escape(error)
                    );
                }
                for e in run.evaluations.iter().filter(|e| !e.verdict.passed) {
                    let at = e
                        .verdict
                        .step
                        .map(|s| format!(" (step {s})"))
                        .unwrap_or_default();
                    let _ = write!(
                        out,
                        "\n      <failure type=\"{}\" message=\"{}\">{}{}</failure>",
                        xml_escape(&e.evaluator),
                        xml_escape(&e.verdict.detail),
                        xml_escape(&e.verdict.detail),
                        xml_escape(&at)
                    );
                }
                let _ = writeln!(
                    out,
                    "\n      <system-out>session {} in {}</system-out>\n    </testcase>",
                    xml_escape(&run.session),
                    xml_escape(&self.store)
                );
            }
        }
        out.push_str("  </testsuite>\n</testsuites>\n");
        out
    }
}

/// Text made safe for XML content and attribute values: the five special
/// characters escaped, characters XML 1.0 cannot hold (control characters
/// other than tab, newline and carriage return) replaced by U+FFFD.
pub fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' | '\r' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

/// One pass rate that changed between two reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// The case.
    pub case: String,
    /// The evaluator, or `None` for the case as a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluator: Option<String>,
    /// The pass rate in the baseline.
    pub before: f64,
    /// The pass rate now.
    pub after: f64,
}

/// A case's cost and time in both reports, beside its pass rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaseDelta {
    /// The case.
    pub case: String,
    /// Its pass rate in the baseline and now.
    pub pass_rate: (f64, f64),
    /// Its mean cost per run, baseline and now.
    pub cost: (Usd, Usd),
    /// Its mean time per run in milliseconds, baseline and now.
    pub latency_ms: (u64, u64),
}

/// What changed between a baseline report and the current one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Pass rates that fell: the case's, and each evaluator's.
    pub regressions: Vec<Change>,
    /// Pass rates that rose.
    pub improvements: Vec<Change>,
    /// Cases in both reports, with cost and time beside.
    pub cases: Vec<CaseDelta>,
    /// Cases only in the current report.
    pub added: Vec<String>,
    /// Cases only in the baseline.
    pub removed: Vec<String>,
}

impl Comparison {
    /// Compares `current` with `baseline`, case by case and evaluator by
    /// evaluator.
    pub fn new(baseline: &Report, current: &Report) -> Self {
        let mut comparison = Comparison::default();
        for case in &current.cases {
            let Some(before) = baseline.cases.iter().find(|c| c.id == case.id) else {
                comparison.added.push(case.id.clone());
                continue;
            };
            let mut record = |evaluator: Option<String>, b: f64, a: f64| {
                let change = Change {
                    case: case.id.clone(),
                    evaluator,
                    before: b,
                    after: a,
                };
                if a + 1e-9 < b {
                    comparison.regressions.push(change);
                } else if a > b + 1e-9 {
                    comparison.improvements.push(change);
                }
            };
            record(None, before.pass_rate(), case.pass_rate());
            for name in case.evaluators() {
                if let (Some(b), Some(a)) = (
                    before.evaluator_pass_rate(&name),
                    case.evaluator_pass_rate(&name),
                ) {
                    record(Some(name), b, a);
                }
            }
            comparison.cases.push(CaseDelta {
                case: case.id.clone(),
                pass_rate: (before.pass_rate(), case.pass_rate()),
                cost: (before.mean_cost(), case.mean_cost()),
                latency_ms: (before.mean_latency_ms(), case.mean_latency_ms()),
            });
        }
        for case in &baseline.cases {
            if !current.cases.iter().any(|c| c.id == case.id) {
                comparison.removed.push(case.id.clone());
            }
        }
        comparison
    }

    /// Whether any pass rate fell.
    pub fn has_regressions(&self) -> bool {
        !self.regressions.is_empty()
    }

    /// The comparison for the terminal.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let line = |out: &mut String, label: &str, c: &Change| {
            let what = match &c.evaluator {
                Some(e) => format!("{} / {e}", c.case),
                None => c.case.clone(),
            };
            let _ = writeln!(
                out,
                "  {label} {what}: {:.0}% -> {:.0}%",
                c.before * 100.0,
                c.after * 100.0
            );
        };
        let _ = writeln!(
            out,
            "against the baseline: {} regressions, {} improvements",
            self.regressions.len(),
            self.improvements.len()
        );
        for c in &self.regressions {
            line(&mut out, "worse", c);
        }
        for c in &self.improvements {
            line(&mut out, "better", c);
        }
        for d in &self.cases {
            let _ = writeln!(
                out,
                "  {}: pass {:.0}% -> {:.0}%, cost {} -> {}, time {}ms -> {}ms",
                d.case,
                d.pass_rate.0 * 100.0,
                d.pass_rate.1 * 100.0,
                d.cost.0,
                d.cost.1,
                d.latency_ms.0,
                d.latency_ms.1
            );
        }
        for case in &self.added {
            let _ = writeln!(out, "  new case {case}");
        }
        for case in &self.removed {
            let _ = writeln!(out, "  case {case} is gone");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_escaping_covers_markup_quotes_and_control_characters() {
        assert_eq!(
            xml_escape("a<b & \"c\" 'd'>\u{1}\tok"),
            "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;\u{FFFD}\tok"
        );
    }

    fn run(passed: bool, evaluator: &str, detail: &str) -> RunReport {
        RunReport {
            repeat: 1,
            session: "s<1>".into(),
            passed,
            error: None,
            evaluations: vec![Evaluation {
                evaluator: evaluator.into(),
                verdict: if passed {
                    Verdict::pass()
                } else {
                    Verdict::fail(detail).at_step(2)
                },
            }],
            steps: 2,
            failed_step: (!passed).then_some(2),
            usage: Usage::default(),
            judge_usage: Usage::default(),
            latency_ms: 1500,
        }
    }

    fn report(runs: Vec<RunReport>) -> Report {
        let mut case = CaseReport::new("a&b".into(), vec![]);
        case.runs = runs;
        Report::new("d".into(), "m".into(), "s.db".into(), vec![case])
    }

    #[test]
    fn junit_names_each_run_and_escapes_failures() {
        let xml = report(vec![run(
            false,
            "output_contains",
            "output \"<x>\" lacks & y",
        )])
        .to_junit();
        assert!(
            xml.contains("<testcase classname=\"d\" name=\"a&amp;b#1\" time=\"1.500\">"),
            "{xml}"
        );
        assert!(
            xml.contains("<failure type=\"output_contains\" message=\"output &quot;&lt;x&gt;&quot; lacks &amp; y\">"),
            "{xml}"
        );
        assert!(xml.contains("session s&lt;1&gt; in s.db"), "{xml}");
        assert!(
            xml.contains("tests=\"1\" failures=\"1\" errors=\"0\""),
            "{xml}"
        );
    }

    #[test]
    fn a_comparison_lists_the_case_and_evaluator_that_fell() {
        let before = report(vec![run(true, "trajectory_exact", "")]);
        let after = report(vec![run(false, "trajectory_exact", "no add")]);
        let comparison = Comparison::new(&before, &after);
        assert_eq!(comparison.regressions.len(), 2);
        assert_eq!(
            comparison.regressions[1].evaluator.as_deref(),
            Some("trajectory_exact")
        );
        assert!(comparison.improvements.is_empty());
        let back = Comparison::new(&after, &before);
        assert_eq!(back.improvements.len(), 2);
        assert!(!back.has_regressions());
    }

    #[test]
    fn a_report_reads_back_from_its_json() {
        let report = report(vec![run(false, "judge", "meh")]);
        assert_eq!(Report::from_json(&report.to_json()).expect("reads"), report);
    }
}
