//! The worker: the session workflow and its activities on a task queue.

use std::sync::Arc;

use markov_executor::Agent;

use crate::activities::MarkovActivities;
use crate::client::{SessionClient, TemporalError};
use crate::workflow::MarkovSession;
use crate::{StepOptions, Steps};

/// Runs an [`Agent`] as the workflow [`MarkovSession`] on a task queue,
/// with the activities that call its registered model and tools.
#[derive(Debug, Clone)]
pub struct SessionWorker {
    agent: Agent,
    steps: Steps,
    options: StepOptions,
}

impl SessionWorker {
    /// Serves `agent`, whose model and tools were registered in `steps`
    /// ([`Steps::model`], [`Steps::tool`]): what is not registered runs in
    /// the workflow itself, again on every replay.
    pub fn new(agent: Agent, steps: Steps) -> Self {
        SessionWorker {
            agent,
            steps,
            options: StepOptions::default(),
        }
    }

    /// Schedules the activities with `options`.
    #[must_use]
    pub fn with_options(mut self, options: StepOptions) -> Self {
        self.options = options;
        self
    }

    /// Polls `client`'s task queue until the process ends or the worker
    /// fails.
    ///
    /// # Errors
    /// The worker could not be made (no Tokio runtime, a bad option) or
    /// stopped on an error.
    pub async fn run(self, client: &SessionClient) -> Result<(), TemporalError> {
        let runtime = temporalio_sdk::Runtime::from_current_tokio(Default::default())
            .map_err(|e| TemporalError::Worker(e.to_string()))?;
        let agent = self.agent;
        let options = Arc::new(self.options);
        let heartbeat_every =
            (options.heartbeat_timeout / 3).max(std::time::Duration::from_millis(100));
        let factory_options = Arc::clone(&options);
        let worker_options = temporalio_sdk::WorkerOptions::new(client.task_queue())
            .register_workflow_with_factory::<MarkovSession, _>(move || {
                MarkovSession::for_agent(agent.clone(), Arc::clone(&factory_options))
            })
            .map_err(|e| TemporalError::Worker(e.to_string()))?
            .register_activities(MarkovActivities {
                steps: self.steps,
                heartbeat_every,
            })
            // The machine and the activities meet over in-process channels,
            // woken inside the workflow's own poll: deterministic, but not
            // the SDK's wakers.
            .detect_nondeterministic_futures(false)
            .sticky_queue_schedule_to_start_timeout(options.sticky_timeout)
            .build();
        let mut worker =
            temporalio_sdk::Worker::new(&runtime, client.inner().clone(), worker_options)
                .map_err(|e| TemporalError::Worker(e.to_string()))?;
        worker
            .run()
            .await
            .map_err(|e| TemporalError::Worker(e.to_string()))
    }
}
