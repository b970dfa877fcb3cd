//! [`ToolSet`]: tools by name, in registration order.

use markov_core::tool::{Erased, SharedTool, Tool, ToolDefinition};

use crate::define::error::ConfigError;

/// A node's tools, in registration order, with unique names.
#[derive(Debug, Clone, Default)]
pub struct ToolSet {
    tools: Vec<SharedTool>,
    definitions: Vec<ToolDefinition>,
}

impl ToolSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a typed tool; its name is checked now.
    pub fn add<T: Tool>(&mut self, tool: T) -> Result<&mut Self, ConfigError> {
        self.add_shared(Erased::shared(tool)?)
    }

    /// Adds an erased tool.
    pub fn add_shared(&mut self, tool: SharedTool) -> Result<&mut Self, ConfigError> {
        let name = tool.definition().name.as_str();
        if self.get(name).is_some() {
            return Err(ConfigError::DuplicateTool(name.to_owned()));
        }
        self.definitions.push(tool.definition().clone());
        self.tools.push(tool);
        Ok(self)
    }

    /// The tool called `name`.
    pub fn get(&self, name: &str) -> Option<&SharedTool> {
        self.tools
            .iter()
            .find(|t| t.definition().name.as_str() == name)
    }

    /// The definitions, in order (what a model is offered).
    pub fn definitions(&self) -> &[ToolDefinition] {
        &self.definitions
    }

    /// The tools, in order.
    pub fn iter(&self) -> impl Iterator<Item = &SharedTool> {
        self.tools.iter()
    }

    /// How many tools there are.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }
}
