//! [`Pack`]: a reusable module of tools and state shared by the whole machine.
//!
//! A pack's state is a singleton stored on the root instance under its name.
//! Pack tools and pack commands see only their pack's state.

use std::fmt;
use std::sync::Arc;

use markov_core::tool::{SharedTool, Tool};
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::command::{Command, ErasedCommand, SharedCommand};
use crate::define::error::ConfigError;
use crate::define::toolset::ToolSet;
use crate::externalize::{Cleanup, ExternalContext, ExternalizeError, StateHandler};
use crate::state::{AnyObject, StateSchema, TypedState};

type DynamicInstructions = dyn Fn(&Value) -> String + Send + Sync;

/// A pack's instructions: none, fixed text, or text computed from its state.
#[derive(Clone, Default)]
pub enum PackInstructions {
    /// No instructions.
    #[default]
    None,
    /// Fixed text.
    Static(String),
    /// Computed from the pack's current state, whenever a system prompt is
    /// built (once per model call).
    Dynamic(Arc<DynamicInstructions>),
}

impl fmt::Debug for PackInstructions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PackInstructions::None => f.write_str("None"),
            PackInstructions::Static(s) => f.debug_tuple("Static").field(s).finish(),
            PackInstructions::Dynamic(_) => f.write_str("Dynamic(..)"),
        }
    }
}

impl PackInstructions {
    /// The instructions for `state`.
    pub fn render(&self, state: &Value) -> String {
        match self {
            PackInstructions::None => String::new(),
            PackInstructions::Static(s) => s.clone(),
            PackInstructions::Dynamic(f) => f(state),
        }
    }
}

struct PackInner {
    name: String,
    description: String,
    instructions: PackInstructions,
    schema: Arc<dyn StateSchema>,
    tools: ToolSet,
    commands: Vec<SharedCommand>,
    initial_state: Option<Value>,
    externalize: Option<StateHandler>,
}

/// A reusable module. Cheap to clone.
#[derive(Clone)]
pub struct Pack(Arc<PackInner>);

impl fmt::Debug for Pack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pack")
            .field("name", &self.0.name)
            .field("tools", &self.0.tools.len())
            .field("commands", &self.0.commands.len())
            .finish_non_exhaustive()
    }
}

impl Pack {
    /// A builder for a pack.
    pub fn builder(name: impl Into<String>, description: impl Into<String>) -> PackBuilder {
        PackBuilder {
            name: name.into(),
            description: description.into(),
            instructions: PackInstructions::None,
            schema: Arc::new(AnyObject),
            tools: Vec::new(),
            commands: Vec::new(),
            initial_state: None,
            externalize: None,
            errors: Vec::new(),
        }
    }

    /// The pack's name (the key of its state).
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Its description.
    pub fn description(&self) -> &str {
        &self.0.description
    }

    /// Its instructions.
    pub fn instructions(&self) -> &PackInstructions {
        &self.0.instructions
    }

    /// Its state schema.
    pub fn schema(&self) -> &dyn StateSchema {
        &*self.0.schema
    }

    /// Its tools.
    pub fn tools(&self) -> &ToolSet {
        &self.0.tools
    }

    /// Its commands, in declaration order.
    pub fn commands(&self) -> &[SharedCommand] {
        &self.0.commands
    }

    /// The command called `name`.
    pub fn command(&self, name: &str) -> Option<&SharedCommand> {
        self.0.commands.iter().find(|c| c.name() == name)
    }

    /// Its initial state.
    pub fn initial_state(&self) -> Option<&Value> {
        self.0.initial_state.as_ref()
    }

    /// The externalized-state handler, if the pack declares one (see
    /// [`crate::externalize`]).
    pub fn externalize_handler(&self) -> Option<&StateHandler> {
        self.0.externalize.as_ref()
    }

    /// The state schema, shared.
    pub fn shared_schema(&self) -> Arc<dyn StateSchema> {
        Arc::clone(&self.0.schema)
    }
}

/// Builds a [`Pack`].
#[derive(Debug)]
pub struct PackBuilder {
    name: String,
    description: String,
    instructions: PackInstructions,
    schema: Arc<dyn StateSchema>,
    tools: Vec<SharedTool>,
    commands: Vec<SharedCommand>,
    initial_state: Option<Value>,
    externalize: Option<StateHandler>,
    errors: Vec<ConfigError>,
}

impl PackBuilder {
    /// Fixed instructions.
    #[must_use]
    pub fn instructions(mut self, text: impl Into<String>) -> Self {
        self.instructions = PackInstructions::Static(text.into());
        self
    }

    /// Instructions computed from the pack state.
    #[must_use]
    pub fn dynamic_instructions(
        mut self,
        f: impl Fn(&Value) -> String + Send + Sync + 'static,
    ) -> Self {
        self.instructions = PackInstructions::Dynamic(Arc::new(f));
        self
    }

    /// Types the state as `S`, starting from `initial`.
    #[must_use]
    pub fn state<S>(mut self, initial: S) -> Self
    where
        S: Serialize + DeserializeOwned + JsonSchema + 'static,
    {
        self.schema = Arc::new(TypedState::<S>::new());
        match serde_json::to_value(initial) {
            Ok(v) => self.initial_state = Some(v),
            Err(e) => self.errors.push(ConfigError::InvalidInitialState {
                node: self.name.clone(),
                message: e.to_string(),
            }),
        }
        self
    }

    /// Adds a typed tool.
    #[must_use]
    pub fn tool<T: Tool>(mut self, tool: T) -> Self {
        match markov_core::tool::Erased::shared(tool) {
            Ok(t) => self.tools.push(t),
            Err(e) => self.errors.push(e.into()),
        }
        self
    }

    /// Adds a typed command (see [`crate::command`]). Its context holds the
    /// pack's state only.
    #[must_use]
    pub fn command<C: Command>(mut self, command: C) -> Self {
        self.commands.push(ErasedCommand::shared(command));
        self
    }

    /// Adds an erased command.
    #[must_use]
    pub fn shared_command(mut self, command: SharedCommand) -> Self {
        self.commands.push(command);
        self
    }

    /// Externalizes the pack's state: the handler is called once
    /// per machine with its [`ExternalContext`], and from then on
    /// `packState` messages reach its callbacks instead of the tree. See
    /// [`crate::externalize`].
    #[must_use]
    pub fn externalize(
        self,
        handler: impl Fn(&ExternalContext) -> Result<Option<Cleanup>, ExternalizeError>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.state_handler(StateHandler::new(handler))
    }

    /// Externalizes the state with a handler shared with other packs.
    #[must_use]
    pub fn state_handler(mut self, handler: StateHandler) -> Self {
        self.externalize = Some(handler);
        self
    }

    /// Validates and freezes the pack.
    pub fn build(mut self) -> Result<Pack, ConfigError> {
        if let Some(e) = self.errors.drain(..).next() {
            return Err(e);
        }
        let mut tools = ToolSet::new();
        for t in self.tools {
            tools.add_shared(t)?;
        }
        for (i, command) in self.commands.iter().enumerate() {
            if self.commands[..i]
                .iter()
                .any(|c| c.name() == command.name())
            {
                return Err(ConfigError::DuplicateCommand {
                    owner: self.name,
                    command: command.name().to_owned(),
                });
            }
        }
        Ok(Pack(Arc::new(PackInner {
            name: self.name,
            description: self.description,
            instructions: self.instructions,
            schema: self.schema,
            tools,
            commands: self.commands,
            initial_state: self.initial_state,
            externalize: self.externalize,
        })))
    }
}

impl Pack {
    /// This pack with the description, instructions and initial state of a
    /// serialized inline pack (upstream's "inline merge"); its schema, tools
    /// and commands stay this pack's. `None` keeps this pack's value.
    pub(crate) fn merged(
        &self,
        description: String,
        instructions: Option<String>,
        initial_state: Option<Value>,
    ) -> Pack {
        Pack(Arc::new(PackInner {
            name: self.0.name.clone(),
            description,
            instructions: instructions
                .map(PackInstructions::Static)
                .unwrap_or_else(|| self.0.instructions.clone()),
            schema: Arc::clone(&self.0.schema),
            tools: self.0.tools.clone(),
            commands: self.0.commands.clone(),
            initial_state: initial_state.or_else(|| self.0.initial_state.clone()),
            externalize: self.0.externalize.clone(),
        }))
    }
}
