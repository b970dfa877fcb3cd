//! The runner: every case of a dataset, each repeated, against a scripted
//! or a real model, a bounded number at a time, each run stored as a
//! session.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use markov_core::model::{Model, Usage};
use markov_executor::{Agent, BuildError, Instance, MachineStep};
use markov_store::{DurableMachine, SessionId, SqliteStore, Store, WorkerId};
use serde_json::Value;

use crate::dataset::{Case, Dataset};
use crate::expect::{CaseRun, Evaluator, Expect, Verdict};
use crate::report::{CaseReport, Evaluation, Report, RunReport};

/// Builds the agent under test on the model a run gives it.
pub type AgentFactory = dyn Fn(Arc<dyn Model>) -> Result<Agent, BuildError> + Send + Sync;

/// Which model the agent runs on.
#[derive(Clone)]
pub enum ModelChoice {
    /// Each case's own [`Case::script`], a scripted model: offline and
    /// deterministic, for CI. A case without a script fails with an error.
    Scripted,
    /// A real model, for every case, named by the label.
    Live {
        /// The model.
        model: Arc<dyn Model>,
        /// What the report calls it (API, endpoint, model).
        label: String,
    },
}

impl fmt::Debug for ModelChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

impl ModelChoice {
    /// What the report calls the model.
    pub fn label(&self) -> String {
        match self {
            ModelChoice::Scripted => "scripted (each case's script)".to_owned(),
            ModelChoice::Live { label, .. } => label.clone(),
        }
    }

    /// A real model when the environment configures a provider (the
    /// variables `markov_providers::from_env` reads: `OPENAI_BASE_URL`,
    /// `ANTHROPIC_API_KEY`, ...; `MARKOV_MODEL` names the model, else a
    /// local server is asked which it serves), else [`ModelChoice::Scripted`].
    ///
    /// # Errors
    /// A provider that is configured but cannot be built or asked.
    pub async fn from_env() -> Result<Self, markov_providers::ConfigError> {
        match markov_providers::from_env()? {
            Some(configured) => {
                let configured = configured.settle_model().await?;
                Ok(ModelChoice::Live {
                    model: configured.model(),
                    label: configured.description(),
                })
            }
            None => Ok(ModelChoice::Scripted),
        }
    }
}

/// What the runner reports as it goes: after each run, how many are done
/// of how many, and the run.
pub type Progress = dyn Fn(usize, usize, &str, &RunReport) + Send + Sync;

/// Runs datasets against one agent.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use markov_eval::{Dataset, Runner};
/// use markov_executor::Agent;
///
/// let dataset = Dataset::from_toml(r#"
/// name = "greeter"
/// [[case]]
/// id = "greets"
/// input = ["hi"]
/// script = [{ text = "Hello!" }]
/// [[case.expect]]
/// kind = "output_contains"
/// value = "Hello"
/// "#).unwrap();
/// let runner = Runner::new(|model| {
///     Agent::builder("greeter").instructions("Greet the user.").shared_model(model).build()
/// });
/// let report = runner.run(&dataset).await.unwrap();
/// assert_eq!(report.summary.passed, 1);
/// # });
/// ```
pub struct Runner {
    factory: Arc<AgentFactory>,
    model: ModelChoice,
    judge: Option<Arc<dyn Model>>,
    concurrency: usize,
    repeat: Option<u32>,
    timeout: Duration,
    store: Option<(Arc<dyn Store>, String)>,
    evaluators: HashMap<String, Arc<dyn Evaluator>>,
    progress: Option<Arc<Progress>>,
    tags: Vec<String>,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("model", &self.model)
            .field("concurrency", &self.concurrency)
            .field("repeat", &self.repeat)
            .field("timeout", &self.timeout)
            .field("evaluators", &self.evaluators.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Why a dataset could not be run at all (a case that fails is a failed
/// case in the report, never this).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The session store could not be opened.
    #[error("cannot open the session store: {0}")]
    Store(#[from] markov_store::StoreError),
    /// The dataset is invalid.
    #[error(transparent)]
    Dataset(#[from] crate::DatasetError),
}

/// The longest a run of one case may take unless [`Runner::timeout`] says.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl Runner {
    /// A runner of the agent `factory` builds, on each case's scripted
    /// model, one case at a time, sessions in an in-memory SQLite store.
    pub fn new(
        factory: impl Fn(Arc<dyn Model>) -> Result<Agent, BuildError> + Send + Sync + 'static,
    ) -> Self {
        Runner {
            factory: Arc::new(factory),
            model: ModelChoice::Scripted,
            judge: None,
            concurrency: 1,
            repeat: None,
            timeout: DEFAULT_TIMEOUT,
            store: None,
            evaluators: HashMap::new(),
            progress: None,
            tags: Vec::new(),
        }
    }

    /// The model the agent runs on.
    #[must_use]
    pub fn model(mut self, model: ModelChoice) -> Self {
        self.model = model;
        self
    }

    /// The judge of `judge` expectations. Without one, a scripted run
    /// plays each case's `judge_script` and a live run asks the live model.
    #[must_use]
    pub fn judge(mut self, judge: Arc<dyn Model>) -> Self {
        self.judge = Some(judge);
        self
    }

    /// How many runs at once (at least one).
    #[must_use]
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Runs each case `n` times, whatever the dataset says.
    #[must_use]
    pub fn repeat(mut self, n: u32) -> Self {
        self.repeat = Some(n.max(1));
        self
    }

    /// The longest one run of a case may take; past it the run fails.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Stores every run as a session in `store`, which the report names as
    /// `label` (a file's path), so a failed case can be opened later.
    #[must_use]
    pub fn store(mut self, store: Arc<dyn Store>, label: impl Into<String>) -> Self {
        self.store = Some((store, label.into()));
        self
    }

    /// Registers an evaluator for the dataset's `custom` expectations
    /// named `name`.
    #[must_use]
    pub fn evaluator(
        mut self,
        name: impl Into<String>,
        evaluator: impl Evaluator + 'static,
    ) -> Self {
        self.evaluators.insert(name.into(), Arc::new(evaluator));
        self
    }

    /// Runs only the cases carrying one of `tags` (all when empty).
    #[must_use]
    pub fn tags(mut self, tags: Vec<String>) -> Self {
        self.tags = tags;
        self
    }

    /// Called after each run.
    #[must_use]
    pub fn on_progress(
        mut self,
        progress: impl Fn(usize, usize, &str, &RunReport) + Send + Sync + 'static,
    ) -> Self {
        self.progress = Some(Arc::new(progress));
        self
    }

    /// Runs every selected case of `dataset` as many times as it says. A
    /// case that errors (the agent does not build, the model fails, the
    /// run passes its timeout) is a failed run with its error.
    ///
    /// # Errors
    /// Only an invalid dataset or a store that cannot be opened.
    pub async fn run(&self, dataset: &Dataset) -> Result<Report, RunError> {
        dataset.validate()?;
        let (store, store_label) = match &self.store {
            Some((store, label)) => (store.clone(), label.clone()),
            None => (
                Arc::new(SqliteStore::in_memory()?) as Arc<dyn Store>,
                "memory (not kept)".to_owned(),
            ),
        };
        let cases: Vec<&Case> = dataset
            .cases
            .iter()
            .filter(|c| self.tags.is_empty() || c.tags.iter().any(|t| self.tags.contains(t)))
            .collect();
        let jobs: Vec<(usize, &Case, u32)> = cases
            .iter()
            .enumerate()
            .flat_map(|(i, case)| {
                let n = self.repeat.unwrap_or_else(|| case.repeats(dataset));
                (1..=n).map(move |r| (i, *case, r))
            })
            .collect();
        let total = jobs.len();
        let mut done = 0;
        let mut results: Vec<(usize, RunReport)> = Vec::with_capacity(total);
        let mut runs = futures::stream::iter(jobs)
            .map(|(i, case, repeat)| {
                let store = store.clone();
                async move { (i, self.run_case(&dataset.name, case, repeat, store).await) }
            })
            .buffer_unordered(self.concurrency);
        while let Some((i, run)) = runs.next().await {
            done += 1;
            if let Some(progress) = &self.progress {
                progress(done, total, &cases[i].id, &run);
            }
            results.push((i, run));
        }
        results.sort_by_key(|(i, run)| (*i, run.repeat));
        let mut reports: Vec<CaseReport> = cases
            .iter()
            .map(|c| CaseReport::new(c.id.clone(), c.tags.clone()))
            .collect();
        for (i, run) in results {
            reports[i].runs.push(run);
        }
        Ok(Report::new(
            dataset.name.clone(),
            self.model.label(),
            store_label,
            reports,
        ))
    }

    async fn run_case(
        &self,
        dataset: &str,
        case: &Case,
        repeat: u32,
        store: Arc<dyn Store>,
    ) -> RunReport {
        let session = SessionId::new(format!(
            "{dataset}/{}/{repeat}/{}",
            case.id,
            uuid::Uuid::new_v4().simple()
        ));
        let started = Instant::now();
        let driven = tokio::time::timeout(self.timeout, self.drive(case, &session, store)).await;
        let latency = started.elapsed();
        let (steps, history, schema) = match driven {
            Ok(Ok(ran)) => ran,
            Ok(Err(error)) => {
                return RunReport::errored(repeat, session.to_string(), error, latency);
            }
            Err(_) => {
                return RunReport::errored(
                    repeat,
                    session.to_string(),
                    format!("the run took longer than {:?}", self.timeout),
                    latency,
                );
            }
        };
        let mut run = CaseRun::new(case.id.clone(), steps, history, latency);
        run.output_schema = schema;
        run.judge = match (&self.judge, &self.model) {
            (Some(judge), _) => Some(judge.clone()),
            (None, ModelChoice::Live { model, .. }) => Some(model.clone()),
            (None, ModelChoice::Scripted) if !case.judge_script.is_empty() => {
                Some(Arc::new(case.scripted_judge()))
            }
            (None, ModelChoice::Scripted) => None,
        };
        let mut evaluations = Vec::with_capacity(case.expect.len());
        let mut names: HashMap<String, usize> = HashMap::new();
        for expect in &case.expect {
            let verdict = self.evaluate(expect, &run).await;
            let name = expect.name();
            let seen = names.entry(name.clone()).or_insert(0);
            *seen += 1;
            let evaluator = if *seen == 1 {
                name
            } else {
                format!("{name}#{seen}")
            };
            evaluations.push(Evaluation { evaluator, verdict });
        }
        RunReport::evaluated(repeat, session.to_string(), &run, evaluations)
    }

    async fn evaluate(&self, expect: &Expect, run: &CaseRun) -> Verdict {
        // An evaluator of one's own may panic: that is its failure, not
        // the run's end.
        // A judge's call is bounded like a run.
        let future = std::panic::AssertUnwindSafe(expect.evaluate(run, &self.evaluators));
        match tokio::time::timeout(self.timeout, futures::FutureExt::catch_unwind(future)).await {
            Ok(Ok(verdict)) => verdict,
            Ok(Err(_)) => Verdict::fail(format!("the evaluator `{}` panicked", expect.name())),
            Err(_) => Verdict::fail(format!(
                "the evaluator `{}` took longer than {:?}",
                expect.name(),
                self.timeout
            )),
        }
    }

    async fn drive(
        &self,
        case: &Case,
        session: &SessionId,
        store: Arc<dyn Store>,
    ) -> Result<(Vec<MachineStep>, Vec<markov_core::Message>, Option<Value>), String> {
        let model: Arc<dyn Model> = match &self.model {
            ModelChoice::Scripted if case.script.is_empty() => {
                return Err(format!(
                    "case `{}` has no script to play offline (run it on a real model)",
                    case.id
                ));
            }
            ModelChoice::Scripted => Arc::new(case.scripted_model()),
            ModelChoice::Live { model, .. } => model.clone(),
        };
        let agent = (self.factory)(model).map_err(|e| format!("the agent does not build: {e}"))?;
        let schema = agent.start_node().output().map(|o| o.schema().clone());
        let machine = match &case.state {
            None => agent.machine(),
            Some(state) => {
                let mut start = agent.start_state().clone();
                match (&mut start, state) {
                    (Value::Object(start), Value::Object(patch)) => {
                        start.extend(patch.iter().map(|(k, v)| (k.clone(), v.clone())));
                    }
                    (start, state) => *start = state.clone(),
                }
                let root = Instance::new(agent.start_node().clone(), start);
                agent
                    .machine_at(root)
                    .map_err(|e| format!("the case's starting state does not fit: {e}"))?
            }
        };
        let mut durable = DurableMachine::create(
            store,
            session.clone(),
            WorkerId::new("markov-eval"),
            machine,
        )
        .await
        .map_err(|e| format!("cannot store the session: {e}"))?;
        let mut steps = Vec::new();
        let mut failure = None;
        for turn in &case.input {
            durable.machine().enqueue_user(turn.clone());
            if let Err(e) = durable.run_each_step(|step| steps.push(step.clone())).await {
                failure = Some(format!("the run failed at step {}: {e}", steps.len() + 1));
                break;
            }
        }
        let history = durable.machine().history().to_vec();
        if let Err(e) = durable.release().await {
            tracing::warn!(session = %session, error = %e, "could not release an eval session");
        }
        match failure {
            Some(error) => Err(error),
            None => Ok((steps, history, schema)),
        }
    }
}

/// The sum of the judge's usage over a run's verdicts.
pub(crate) fn judge_usage(evaluations: &[Evaluation]) -> Usage {
    let mut usage = Usage::default();
    for e in evaluations {
        usage += e.verdict.usage;
    }
    usage
}
