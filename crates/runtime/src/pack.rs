//! [`Pack`]: a reusable module of tools and state shared by the whole machine.
//!
//! A pack's state is a singleton stored on the root instance under its name.
//! Pack tools see only their pack's state.

use std::fmt;
use std::sync::Arc;

use markov_core::tool::{SharedTool, Tool};
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ConfigError;
use crate::state::{AnyObject, StateSchema, TypedState};
use crate::toolset::ToolSet;

type DynamicInstructions = dyn Fn(&Value) -> String + Send + Sync;

/// A pack's instructions: none, fixed text, or text computed from its state.
#[derive(Clone, Default)]
pub enum PackInstructions {
    /// No instructions.
    #[default]
    None,
    /// Fixed text.
    Static(String),
    /// Computed from the pack's current state.
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
    initial_state: Option<Value>,
}

/// A reusable module. Cheap to clone.
#[derive(Clone)]
pub struct Pack(Arc<PackInner>);

impl fmt::Debug for Pack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pack")
            .field("name", &self.0.name)
            .field("tools", &self.0.tools.len())
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
            initial_state: None,
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

    /// Its initial state.
    pub fn initial_state(&self) -> Option<&Value> {
        self.0.initial_state.as_ref()
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
    initial_state: Option<Value>,
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

    /// Validates and freezes the pack.
    pub fn build(mut self) -> Result<Pack, ConfigError> {
        if let Some(e) = self.errors.drain(..).next() {
            return Err(e);
        }
        let mut tools = ToolSet::new();
        for t in self.tools {
            tools.add_shared(t)?;
        }
        Ok(Pack(Arc::new(PackInner {
            name: self.name,
            description: self.description,
            instructions: self.instructions,
            schema: self.schema,
            tools,
            initial_state: self.initial_state,
        })))
    }
}
