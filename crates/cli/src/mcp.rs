//! The MCP servers of `markov-demo` and `markov-serve`: `--mcp <server>`
//! and `--mcp-config <file>`, both repeatable.
//!
//! - `--mcp` takes one server: a Streamable HTTP URL, or a command in
//!   shell syntax (words separated by spaces; quote a word that holds
//!   spaces, e.g. `--mcp "'/opt/my tools/server' --root '/srv/My Files'"`;
//!   nothing is expanded and no shell runs). Its tools are named
//!   `mcp_<tool>`, the next server's `mcp2_<tool>`, and so on. Without the
//!   flag, `MARKOV_MCP` names one server the same way.
//! - `--mcp-config` takes a file in the `mcpServers` shape Claude
//!   Desktop, Cursor and VS Code read (see
//!   [`McpServerConfig::from_json`]): a server's tools are named
//!   `<its name>_<tool>`.
//!
//! A stdio server's environment is a short default list
//! ([`markov_mcp::DEFAULT_INHERITED_ENV`]) and what the file's `env`
//! names: markov's API keys never reach it. Each tool is registered with
//! [`McpClient::default_metadata`]: it needs approval unless its server
//! marks it read-only, or the file says otherwise (`approval`,
//! `requireApproval`, `noApproval`); the start-up lines say which tools
//! need approval and why.

use std::path::PathBuf;
use std::sync::Arc;

use markov_core::tool::SharedTool;
use markov_mcp::{McpClient, McpError, McpServerConfig, McpTool};
use markov_policy::ToolMetadata;

/// The command line's MCP servers, for `clap`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct McpArgs {
    /// An MCP server whose tools the agent gets (repeat for more): a
    /// Streamable HTTP URL, or a command in shell syntax (quote a path
    /// with spaces). Its tools are named `mcp_<tool>` (`mcp2_<tool>` for
    /// the second, ...). Default: the server in `MARKOV_MCP`.
    #[arg(long = "mcp", value_name = "SERVER")]
    pub servers: Vec<String>,
    /// A file of MCP servers in the `mcpServers` JSON shape of Claude
    /// Desktop, Cursor and VS Code (repeat for more); each server's tools
    /// are named `<server>_<tool>`.
    #[arg(long = "mcp-config", value_name = "FILE")]
    pub config_files: Vec<PathBuf>,
}

impl McpArgs {
    /// The servers asked for, in order: the `--mcp` ones (else
    /// `MARKOV_MCP`'s), then each file's.
    ///
    /// # Errors
    /// A server line or a file that cannot be read.
    pub fn configs(&self) -> Result<Vec<McpServerConfig>, McpError> {
        let mut lines = self.servers.clone();
        if lines.is_empty()
            && let Some(spec) = std::env::var("MARKOV_MCP")
                .ok()
                .filter(|v| !v.trim().is_empty())
        {
            lines.push(spec);
        }
        let mut out = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            let prefix = match i {
                0 => "mcp_".to_owned(),
                n => format!("mcp{}_", n + 1),
            };
            out.push(McpServerConfig::parse(line)?.prefix(prefix));
        }
        for file in &self.config_files {
            out.extend(
                McpServerConfig::from_file(file)?
                    .into_iter()
                    .map(|(_, config)| config),
            );
        }
        Ok(out)
    }
}

/// The connected servers and their tools.
#[derive(Debug, Default)]
pub struct McpServers {
    clients: Vec<McpClient>,
    tools: Vec<Arc<McpTool>>,
}

impl McpServers {
    /// Connects to each server and lists its tools. Two servers offering a
    /// tool under the same name is an error that names both (give one of
    /// them another name in the file, or fewer `--mcp` servers).
    ///
    /// # Errors
    /// A server that cannot be reached or listed, or a name offered twice.
    pub async fn connect(configs: Vec<McpServerConfig>) -> Result<Self, McpError> {
        let mut servers = McpServers::default();
        let mut names: std::collections::HashMap<String, String> = Default::default();
        for config in configs {
            let client = match McpClient::connect(config).await {
                Ok(client) => client,
                Err(err) => {
                    servers.close().await;
                    return Err(err);
                }
            };
            let tools = match client.mcp_tools().await {
                Ok(tools) => tools,
                Err(err) => {
                    client.close().await;
                    servers.close().await;
                    return Err(err);
                }
            };
            for tool in &tools {
                let name = tool.definition().name.as_str().to_owned();
                if let Some(other) = names.insert(name.clone(), client.label().to_owned()) {
                    client.close().await;
                    servers.close().await;
                    return Err(McpError::Config(format!(
                        "two MCP servers offer a tool named `{name}`: {other} and {}; \
                         give them different names in the configuration file",
                        client.label()
                    )));
                }
            }
            servers.tools.extend(tools);
            servers.clients.push(client);
        }
        Ok(servers)
    }

    /// Whether no server was asked for.
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }

    /// The start-up lines: per server, `mcp: <server>: <its tools>`; then
    /// per tool that needs approval, `  <tool> needs approval: <why>`.
    pub fn summary(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for client in &self.clients {
            let tools: Vec<&Arc<McpTool>> = self
                .tools
                .iter()
                .filter(|t| t.server() == client.label())
                .collect();
            let names: Vec<&str> = tools.iter().map(|t| t.definition().name.as_str()).collect();
            lines.push(format!("mcp: {}: {}", client.label(), names.join(", ")));
            for tool in tools {
                let decision = tool.approval();
                if decision.required {
                    lines.push(format!(
                        "  {} needs approval: {}",
                        tool.definition().name.as_str(),
                        decision.reason
                    ));
                }
            }
        }
        lines
    }

    /// Every tool, each with [`McpClient::default_metadata`] (approvals
    /// included), for an agent to run under its policies
    /// (`AgentBuilder::tools_with`).
    pub fn under_policies(&self) -> impl Iterator<Item = (SharedTool, ToolMetadata)> + '_ {
        self.tools.iter().map(|tool| {
            let shared: SharedTool = Arc::clone(tool) as SharedTool;
            (shared, McpClient::default_metadata(tool))
        })
    }

    /// Closes every session (stops the stdio servers).
    pub async fn close(&self) {
        for client in &self.clients {
            client.close().await;
        }
    }
}
