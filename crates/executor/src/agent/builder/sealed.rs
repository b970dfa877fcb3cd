//! How a builder is built: the charter and start of what runs, the
//! executor of how it runs. Sealed: the traits are implemented by the
//! builder's states only.

use super::*;
use crate::standard::Unservable;

/// The charter of a built agent and the node it starts at.
pub trait Runnable {
    fn charter(self, agent: &str, start: Option<String>) -> Result<(Charter, Node), BuildError>;
}

/// The executor of a built agent, and the standard executor it is when
/// it is one.
pub trait Runner {
    /// What cannot be known before `build`: options that do not fit
    /// together.
    fn check(&self, agent: &str, limits: &RunOptions) -> Result<(), BuildError>;

    fn executor(self, agent: &str, charter: &Charter) -> Result<Executors, BuildError>;
}

/// An executor, and the standard executor it is when it is one.
pub(super) type Executors = (Arc<dyn Executor>, Option<StandardExecutor>);

fn conflict(
    agent: &str,
    option: &'static str,
    with: &'static str,
    why: &'static str,
) -> BuildError {
    BuildError::Conflict {
        agent: agent.to_owned(),
        option,
        with,
        why,
    }
}

/// The charter of `nodes` described by `charter`, and its start.
fn own(
    agent: &str,
    charter: CharterBuilder,
    nodes: Vec<(String, Node)>,
    start: Option<String>,
) -> Result<(Charter, Node), BuildError> {
    let start = start_of(
        agent,
        nodes.iter().map(|(name, node)| (name.as_str(), node)),
        start,
    )?;
    let charter = nodes
        .into_iter()
        .fold(charter, |charter, (name, node)| charter.node(name, node))
        .build()
        .map_err(|source| BuildError::Charter {
            agent: agent.to_owned(),
            source,
        })?;
    Ok((charter, start))
}

/// The node named `start` (else the first) of `nodes`.
fn start_of<'a>(
    agent: &str,
    nodes: impl Iterator<Item = (&'a str, &'a Node)>,
    start: Option<String>,
) -> Result<Node, BuildError> {
    let mut nodes = nodes.peekable();
    let Some(&(_, first)) = nodes.peek() else {
        return Err(BuildError::NoNode {
            agent: agent.to_owned(),
        });
    };
    let Some(start) = start else {
        return Ok(first.clone());
    };
    nodes
        .find(|(name, _)| *name == start)
        .map(|(_, node)| node.clone())
        .ok_or_else(|| BuildError::UnknownStart {
            agent: agent.to_owned(),
            node: start,
        })
}

impl Runnable for OneNode {
    fn charter(self, agent: &str, start: Option<String>) -> Result<(Charter, Node), BuildError> {
        let node = self
            .ops
            .into_iter()
            .fold(Node::builder(self.instructions).name(agent), |node, op| {
                op(node)
            })
            .build()
            .map_err(|source| BuildError::Node {
                agent: agent.to_owned(),
                node: agent.to_owned(),
                source,
            })?;
        own(agent, self.charter, vec![(agent.to_owned(), node)], start)
    }
}

impl Runnable for Nodes {
    fn charter(self, agent: &str, start: Option<String>) -> Result<(Charter, Node), BuildError> {
        own(agent, self.charter, self.nodes, start)
    }
}

impl Runnable for OnCharter {
    fn charter(self, agent: &str, start: Option<String>) -> Result<(Charter, Node), BuildError> {
        let start = start_of(agent, self.charter.nodes(), start)?;
        Ok((self.charter, start))
    }
}

impl Runner for OnExecutor {
    fn check(&self, agent: &str, limits: &RunOptions) -> Result<(), BuildError> {
        if limits.usage_limits.is_set() {
            return Err(conflict(
                agent,
                "usage_limits",
                "with_executor",
                "the standard executor checks usage limits before each model call: give the model instead",
            ));
        }
        Ok(())
    }

    fn executor(self, _agent: &str, _charter: &Charter) -> Result<Executors, BuildError> {
        Ok((self.executor, None))
    }
}

impl Runner for OnModel<NoPolicyTools> {
    fn check(&self, _agent: &str, _limits: &RunOptions) -> Result<(), BuildError> {
        Ok(())
    }

    fn executor(self, agent: &str, charter: &Charter) -> Result<Executors, BuildError> {
        self.standard(agent, charter, None)
    }
}

impl Runner for OnModel<PolicyTools> {
    fn check(&self, _agent: &str, _limits: &RunOptions) -> Result<(), BuildError> {
        Ok(())
    }

    fn executor(mut self, agent: &str, charter: &Charter) -> Result<Executors, BuildError> {
        let PolicyTools {
            registry,
            policies,
            mode,
        } = std::mem::replace(
            &mut self.tools,
            PolicyTools {
                registry: registry(),
                policies: None,
                mode: None,
            },
        );
        let registry = registry
            .policies(policies.unwrap_or_else(|| {
                PolicyConfig::new(Budget::UNLIMITED)
                    .envelope(EnvelopeMode::Off)
                    .errors(ErrorFormat::PlainText)
            }))
            .lock()
            .map_err(|source| BuildError::Tool {
                agent: agent.to_owned(),
                source,
            })?;
        self.standard(agent, charter, Some((registry, mode.unwrap_or(Mode::TEXT))))
    }
}

impl<P> OnModel<P> {
    /// The standard executor over the model, with `registry` run in
    /// its mode.
    fn standard(
        self,
        agent: &str,
        charter: &Charter,
        registry: Option<(ToolRegistry, Mode)>,
    ) -> Result<Executors, BuildError> {
        let Some(model) = self.model else {
            return Err(BuildError::NoModel {
                agent: agent.to_owned(),
            });
        };
        let mut standard = StandardExecutor::shared(model);
        if let Some(settings) = self.settings {
            standard = standard.with_settings(settings);
        }
        if let Some(prices) = self.prices {
            standard = standard.with_prices(prices);
        }
        if let Some(policy) = self.context_policy {
            standard = standard.with_context_policy(policy);
        }
        if let Some(guards) = self.guards {
            standard = standard.with_guards(guards);
        }
        for (name, guards) in self.node_guards {
            let Some((_, node)) = charter.nodes().find(|(n, _)| *n == name) else {
                return Err(BuildError::UnknownGuardedNode {
                    agent: agent.to_owned(),
                    node: name,
                });
            };
            standard = standard.with_node_guards(node, guards);
        }
        if let Some((registry, mode)) = registry {
            standard = standard.with_registry(Arc::new(registry), mode);
        }
        if let Some(sink) = self.guard_audit {
            standard = standard.with_guard_audit(sink);
        }
        standard.check_nodes(charter).map_err(|(node, why)| {
            let agent = agent.to_owned();
            match why {
                Unservable::Tools(source) => BuildError::Node {
                    agent,
                    node,
                    source,
                },
                Unservable::Refused(source) => BuildError::Unsupported {
                    agent,
                    node,
                    source,
                },
                Unservable::Native { makes, reads } => BuildError::NativeCompaction {
                    agent,
                    node,
                    makes,
                    reads,
                },
            }
        })?;
        Ok((Arc::new(standard.clone()), Some(standard)))
    }
}
