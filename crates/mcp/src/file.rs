//! The configuration file: the `mcpServers` JSON that Claude Desktop,
//! Cursor and VS Code read, with a few keys of markov's own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::McpError;
use crate::config::{Approval, McpServerConfig, ToolFilter};

/// The file's top level: `mcpServers` (or VS Code's `servers`).
#[derive(Debug, Deserialize)]
struct File {
    #[serde(rename = "mcpServers", alias = "servers")]
    servers: Option<BTreeMap<String, Entry>>,
}

/// One server of the file.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    #[serde(rename = "type")]
    kind: Option<String>,
    command: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    inherit_env: Vec<String>,
    cwd: Option<PathBuf>,
    #[serde(alias = "httpUrl")]
    url: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    roots: Vec<PathBuf>,
    timeout: Option<u64>,
    connect_timeout: Option<u64>,
    list_timeout: Option<u64>,
    approval: Option<String>,
    #[serde(default)]
    require_approval: Vec<String>,
    #[serde(default, alias = "autoApprove", alias = "alwaysAllow")]
    no_approval: Vec<String>,
    trust: Option<bool>,
    include_tools: Option<Vec<String>>,
    #[serde(default)]
    exclude_tools: Vec<String>,
    #[serde(default)]
    disabled: bool,
    #[serde(flatten)]
    other: BTreeMap<String, Value>,
}

impl McpServerConfig {
    /// Reads the servers of a configuration file (see
    /// [`from_json`](Self::from_json)); relative `cwd` and `roots` are
    /// read from the file's directory.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Vec<(String, Self)>, McpError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| McpError::Config(format!("cannot read {}: {e}", path.display())))?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_json(&text, base)
            .map_err(|e| McpError::Config(format!("{}: {}", path.display(), inner(e))))
    }

    /// Reads the servers of a configuration file's text, by name (sorted),
    /// each offering its tools as `<name>_<tool>`. The shape is the one
    /// Claude Desktop, Cursor and VS Code read:
    ///
    /// ```json
    /// {"mcpServers": {
    ///   "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem"],
    ///             "env": {"LOG_LEVEL": "info"}, "roots": ["/home/me/notes"],
    ///             "requireApproval": ["read_media_file"]},
    ///   "remote": {"url": "https://example.com/mcp", "headers": {"X-Api-Key": "…"},
    ///              "timeout": 30000}
    /// }}
    /// ```
    ///
    /// A server has a `command` (with `args`, `env`, `cwd`, `inheritEnv`:
    /// names of markov's variables to pass on besides
    /// [`DEFAULT_INHERITED_ENV`](crate::DEFAULT_INHERITED_ENV)) or a `url`
    /// (with `headers`), and may have `roots` (directories offered to the
    /// server), `timeout`, `connectTimeout` and `listTimeout` (in
    /// milliseconds: a call, the connection, a listing), `approval`
    /// (`hints`, `all` or `none`, see [`Approval`]), `requireApproval` and
    /// `noApproval` (tool names), `includeTools` and `excludeTools`,
    /// `disabled`. The other clients' names for the same things are read
    /// too: `httpUrl` for `url`, `autoApprove` and `alwaysAllow` for
    /// `noApproval`, `trust: true` for `approval: none`. `type` may say
    /// `stdio` or `http`; `sse` (the legacy
    /// transport) is refused with a sentence saying so. Values are taken
    /// as written: nothing is expanded. Other keys are ignored with a
    /// warning in the log.
    pub fn from_json(text: &str, base: &Path) -> Result<Vec<(String, Self)>, McpError> {
        let file: File = serde_json::from_str(text)
            .map_err(|e| McpError::Config(format!("not an MCP configuration: {e}")))?;
        let servers = file.servers.ok_or_else(|| {
            McpError::Config("no `mcpServers` object: nothing to connect to".into())
        })?;
        let mut out = Vec::new();
        for (name, entry) in servers {
            if entry.disabled {
                tracing::info!(server = %name, "MCP server disabled in the configuration");
                continue;
            }
            let config = entry
                .into_config(&name, base)
                .map_err(|e| McpError::Config(format!("server `{name}`: {}", inner(e))))?;
            out.push((name, config));
        }
        Ok(out)
    }
}

/// The message of a configuration error without its prefix, to nest it.
fn inner(err: McpError) -> String {
    match err {
        McpError::Config(message) => message,
        other => other.to_string(),
    }
}

impl Entry {
    fn into_config(self, name: &str, base: &Path) -> Result<McpServerConfig, McpError> {
        for key in self.other.keys() {
            tracing::warn!(server = %name, key = %key, "MCP configuration key ignored");
        }
        let kind = self.kind.as_deref().map(str::to_ascii_lowercase);
        if matches!(kind.as_deref(), Some("sse")) {
            return Err(McpError::Config(
                "`type: sse` is the legacy HTTP+SSE transport, which this client does not support: \
                 give the server's Streamable HTTP endpoint (`type: http`, often ending in `/mcp`)"
                    .into(),
            ));
        }
        let mut config = match (self.command, self.url) {
            (Some(_), Some(_)) => {
                return Err(McpError::Config(
                    "both `command` and `url`: give one".into(),
                ));
            }
            (None, None) => {
                return Err(McpError::Config(
                    "neither `command` nor `url`: give one".into(),
                ));
            }
            (Some(command), None) => {
                if matches!(kind.as_deref(), Some(k) if k != "stdio") {
                    return Err(McpError::Config(format!(
                        "`type: {}` with a `command`",
                        kind.unwrap_or_default()
                    )));
                }
                if command.trim().is_empty() {
                    return Err(McpError::Config("an empty `command`".into()));
                }
                let mut config = McpServerConfig::stdio(command, self.args);
                for (key, value) in self.env {
                    if value.contains("${") {
                        tracing::warn!(
                            server = %name,
                            variable = %key,
                            "MCP server environment value is passed as written (nothing is expanded): \
                             to pass a variable of markov's environment, name it in `inheritEnv`"
                        );
                    }
                    config = config.env(key, value);
                }
                for var in self.inherit_env {
                    config = config.inherit_env(var);
                }
                if let Some(dir) = self.cwd {
                    config = config.cwd(base.join(dir));
                }
                config
            }
            (None, Some(url)) => {
                if matches!(kind.as_deref(), Some(k) if !matches!(k, "http" | "streamable-http" | "streamablehttp"))
                {
                    return Err(McpError::Config(format!(
                        "`type: {}` with a `url`",
                        kind.unwrap_or_default()
                    )));
                }
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(McpError::Config(format!(
                        "`url` {url:?} is not an http:// or https:// URL"
                    )));
                }
                let mut config = McpServerConfig::http(url);
                for (key, value) in self.headers {
                    config = config.header(key, value);
                }
                config
            }
        };
        config = config.prefix(format!("{name}_"));
        for root in self.roots {
            config = config.root(base.join(root));
        }
        let ms = Duration::from_millis;
        if let Some(t) = self.timeout {
            config = config.call_timeout(ms(t));
        }
        if let Some(t) = self.connect_timeout {
            config = config.connect_timeout(ms(t));
        }
        if let Some(t) = self.list_timeout {
            config = config.list_timeout(ms(t));
        }
        if self.trust == Some(true) {
            config = config.approval(Approval::None);
        }
        if let Some(mode) = self.approval {
            config = config.approval(Approval::parse(&mode)?);
        }
        let mut filter = ToolFilter::default().deny(self.exclude_tools);
        if let Some(allow) = self.include_tools {
            filter = filter.allow(allow);
        }
        Ok(config
            .require_approval(self.require_approval)
            .skip_approval(self.no_approval)
            .filter(filter))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Transport;

    #[test]
    fn reads_the_shape_users_have() {
        let text = r#"{"mcpServers": {
            "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/My Files"],
                      "env": {"A": "1"}, "roots": ["notes"], "timeout": 1500,
                      "requireApproval": ["read_media_file"], "autoApprove": []},
            "remote": {"url": "https://example.invalid/mcp", "headers": {"X-Key": "k"}, "type": "http"},
            "off": {"command": "x", "disabled": true}
        }}"#;
        let servers = McpServerConfig::from_json(text, Path::new("/etc/markov")).expect("valid");
        let names: Vec<&str> = servers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["files", "remote"]);
        let files = &servers[0].1;
        match files.transport() {
            Transport::Stdio {
                command, args, env, ..
            } => {
                assert_eq!(command, "npx");
                assert_eq!(args[2], "/My Files");
                assert_eq!(env, &[("A".into(), "1".into())]);
            }
            other => panic!("not stdio: {other:?}"),
        }
        assert_eq!(files.roots, [PathBuf::from("/etc/markov/notes")]);
        assert_eq!(files.call_timeout, Duration::from_millis(1500));
        assert_eq!(files.require_approval, ["read_media_file"]);
        assert_eq!(files.prefix.as_deref(), Some("files_"));
        assert!(matches!(
            servers[1].1.transport(),
            Transport::Http { headers, .. } if headers.get("X-Key").map(String::as_str) == Some("k")
        ));
    }

    #[test]
    fn other_clients_names_for_the_same_keys() {
        let text = r#"{"mcpServers": {
            "a": {"httpUrl": "https://example.invalid/mcp", "trust": true},
            "b": {"command": "srv", "autoApprove": ["read"]}
        }}"#;
        let servers = McpServerConfig::from_json(text, Path::new(".")).expect("valid");
        assert!(matches!(servers[0].1.transport(), Transport::Http { .. }));
        assert_eq!(servers[0].1.approval, Approval::None);
        assert_eq!(servers[1].1.skip_approval, ["read"]);
    }

    #[test]
    fn legacy_sse_and_bad_entries_are_errors_in_words() {
        let err = |text: &str| {
            McpServerConfig::from_json(text, Path::new("."))
                .expect_err("refused")
                .to_string()
        };
        let sse = err(r#"{"mcpServers": {"old": {"type": "sse", "url": "http://h/sse"}}}"#);
        assert!(
            sse.contains("server `old`") && sse.contains("legacy HTTP+SSE"),
            "{sse}"
        );
        let both = err(r#"{"mcpServers": {"x": {"command": "a", "url": "http://h/mcp"}}}"#);
        assert!(both.contains("both `command` and `url`"), "{both}");
        let none = err(r#"{"servers2": {}}"#);
        assert!(none.contains("no `mcpServers`"), "{none}");
        let mode = err(r#"{"mcpServers": {"x": {"command": "a", "approval": "some"}}}"#);
        assert!(mode.contains("expected `hints`, `all` or `none`"), "{mode}");
    }
}
