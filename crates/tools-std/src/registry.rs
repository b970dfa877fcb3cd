//! Tool templates: named factories with metadata, so applications can list
//! and instantiate the standard tools by name (`finishTool`, `respondTool`).

use std::fmt;

use markov_core::tool::{Erased, InvalidToolName, SharedTool};

use crate::{Finish, Respond};

/// What kind of thing a template makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TemplateKind {
    /// A tool a node can offer.
    Tool,
}

/// Whether a template can be configured before a run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Configurability {
    /// Configured statically, when the agent is defined.
    Static,
    /// Not configurable.
    None,
}

/// Display metadata of a template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TemplateMetadata {
    /// A human title.
    pub title: &'static str,
    /// What it makes.
    pub kind: TemplateKind,
    /// Whether it is statically configurable.
    pub configurability: Configurability,
}

/// A named factory of a tool.
#[derive(Clone, Copy)]
pub struct ToolTemplate {
    name: &'static str,
    metadata: TemplateMetadata,
    make: fn() -> Result<SharedTool, InvalidToolName>,
}

impl fmt::Debug for ToolTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolTemplate")
            .field("name", &self.name)
            .field("metadata", &self.metadata)
            .finish_non_exhaustive()
    }
}

impl ToolTemplate {
    /// A template.
    pub const fn new(
        name: &'static str,
        metadata: TemplateMetadata,
        make: fn() -> Result<SharedTool, InvalidToolName>,
    ) -> Self {
        ToolTemplate {
            name,
            metadata,
            make,
        }
    }

    /// The template's name (not the tool's).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Its metadata.
    pub fn metadata(&self) -> &TemplateMetadata {
        &self.metadata
    }

    /// A new tool from the template.
    pub fn instantiate(&self) -> Result<SharedTool, InvalidToolName> {
        (self.make)()
    }
}

/// A template name registered twice.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("template {0:?} is already registered")]
pub struct DuplicateTemplate(pub String);

/// Templates by name, in registration order.
#[derive(Debug, Clone, Default)]
pub struct TemplateRegistry {
    templates: Vec<ToolTemplate>,
}

impl TemplateRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a template; names are unique.
    pub fn register(&mut self, template: ToolTemplate) -> Result<&mut Self, DuplicateTemplate> {
        if self.get(template.name).is_some() {
            return Err(DuplicateTemplate(template.name.to_owned()));
        }
        self.templates.push(template);
        Ok(self)
    }

    /// The template called `name`.
    pub fn get(&self, name: &str) -> Option<&ToolTemplate> {
        self.templates.iter().find(|t| t.name == name)
    }

    /// All templates, in order.
    pub fn iter(&self) -> impl Iterator<Item = &ToolTemplate> {
        self.templates.iter()
    }
}

/// The standard templates: `finishTool` (title "Finish") and `respondTool` (title "Respond").
pub fn standard_registry() -> TemplateRegistry {
    TemplateRegistry {
        templates: vec![
            ToolTemplate::new(
                "finishTool",
                TemplateMetadata {
                    title: "Finish",
                    kind: TemplateKind::Tool,
                    configurability: Configurability::Static,
                },
                || Erased::shared(Finish),
            ),
            ToolTemplate::new(
                "respondTool",
                TemplateMetadata {
                    title: "Respond",
                    kind: TemplateKind::Tool,
                    configurability: Configurability::Static,
                },
                || Erased::shared(Respond),
            ),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_is_registered_as_finish_tool() {
        let registry = standard_registry();
        let t = registry.get("finishTool").expect("registered");
        assert_eq!(
            *t.metadata(),
            TemplateMetadata {
                title: "Finish",
                kind: TemplateKind::Tool,
                configurability: Configurability::Static,
            }
        );
        let tool = t.instantiate().expect("valid");
        assert_eq!(tool.definition().name.as_str(), "finish");
        assert_eq!(
            tool.definition().description,
            "Signal the current task is complete. Call this before ending when output is restricted."
        );
        assert!(tool.may_terminate());
        assert!(registry.get("respondTool").is_some());
    }

    #[test]
    fn names_are_unique() {
        let mut registry = standard_registry();
        let again = *registry.get("finishTool").expect("registered");
        assert_eq!(
            registry.register(again).unwrap_err(),
            DuplicateTemplate("finishTool".into())
        );
    }
}
