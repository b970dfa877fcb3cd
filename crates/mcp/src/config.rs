//! How to reach one MCP server and which of its tools to offer.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::McpError;

/// How long a connection (spawn or HTTP, plus the MCP handshake) may take
/// by default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a `tools/call` may take by default. A registry's own timeout
/// (`ToolMetadata::with_timeout`) applies as well; the shorter one wins.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a `tools/list` may take by default (all pages together).
pub const DEFAULT_LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// How the client reaches the server.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Transport {
    /// A child process speaking MCP on its stdin and stdout, started by the
    /// client and stopped with it.
    Stdio {
        /// The program.
        command: OsString,
        /// Its arguments.
        args: Vec<OsString>,
        /// Extra environment variables (the rest is inherited).
        env: Vec<(OsString, OsString)>,
        /// Its working directory (the current one when `None`).
        cwd: Option<PathBuf>,
    },
    /// A server at a Streamable HTTP endpoint.
    Http {
        /// The endpoint, e.g. `http://127.0.0.1:8000/mcp`.
        url: String,
        /// Headers sent with every request.
        headers: BTreeMap<String, String>,
        /// A bearer token, sent as `Authorization: Bearer <token>`.
        bearer: Option<String>,
    },
}

/// Which of a server's tools are offered, by the server's own tool names.
#[derive(Debug, Clone, Default)]
pub struct ToolFilter {
    allow: Option<Vec<String>>,
    deny: Vec<String>,
}

impl ToolFilter {
    /// Offers only these tools (by the server's names).
    #[must_use]
    pub fn allow(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.allow = Some(names.into_iter().map(Into::into).collect());
        self
    }

    /// Never offers these tools (by the server's names); wins over [`allow`](Self::allow).
    #[must_use]
    pub fn deny(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.deny.extend(names.into_iter().map(Into::into));
        self
    }

    /// Whether the server's tool `name` is offered.
    pub fn admits(&self, name: &str) -> bool {
        let allowed = self
            .allow
            .as_ref()
            .is_none_or(|allow| allow.iter().any(|n| n == name));
        allowed && !self.deny.iter().any(|n| n == name)
    }
}

/// One MCP server: how to reach it, which tools to offer under which
/// names, and how long each wait may be.
#[derive(Debug, Clone)]
pub struct McpServerConfig {
    pub(crate) transport: Transport,
    pub(crate) prefix: Option<String>,
    pub(crate) filter: ToolFilter,
    pub(crate) connect_timeout: Duration,
    pub(crate) call_timeout: Duration,
    pub(crate) list_timeout: Duration,
}

impl McpServerConfig {
    /// A server started as a child process: `command` with `args`.
    pub fn stdio(
        command: impl Into<OsString>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        Self::with_transport(Transport::Stdio {
            command: command.into(),
            args: args.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            cwd: None,
        })
    }

    /// A server at a Streamable HTTP endpoint. A redirect is followed only
    /// within the endpoint's origin (its scheme, host and port): one to
    /// another origin fails the connection, so the headers and token
    /// configured here reach no other host.
    pub fn http(url: impl Into<String>) -> Self {
        Self::with_transport(Transport::Http {
            url: url.into(),
            headers: BTreeMap::new(),
            bearer: None,
        })
    }

    /// Reads a server from one line of text, as the demo's `--mcp` flag
    /// and `MARKOV_MCP` take it: an `http://` or `https://` URL, or a
    /// command and its arguments separated by spaces.
    ///
    /// ```
    /// use markov_mcp::McpServerConfig;
    ///
    /// assert!(McpServerConfig::parse("http://127.0.0.1:8000/mcp").is_ok());
    /// assert!(McpServerConfig::parse("npx -y @modelcontextprotocol/server-everything").is_ok());
    /// assert!(McpServerConfig::parse("   ").is_err());
    /// ```
    pub fn parse(spec: &str) -> Result<Self, McpError> {
        let spec = spec.trim();
        if spec.starts_with("http://") || spec.starts_with("https://") {
            return Ok(Self::http(spec));
        }
        let mut words = spec.split_whitespace();
        let command = words
            .next()
            .ok_or_else(|| McpError::Config("an empty MCP server command".into()))?;
        Ok(Self::stdio(command, words))
    }

    /// Any transport.
    pub fn with_transport(transport: Transport) -> Self {
        McpServerConfig {
            transport,
            prefix: None,
            filter: ToolFilter::default(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            list_timeout: DEFAULT_LIST_TIMEOUT,
        }
    }

    /// Sets an environment variable of a stdio server (ignored for HTTP).
    #[must_use]
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        if let Transport::Stdio { env, .. } = &mut self.transport {
            env.push((key.into(), value.into()));
        }
        self
    }

    /// Sets the working directory of a stdio server (ignored for HTTP).
    #[must_use]
    pub fn cwd(mut self, dir: impl Into<PathBuf>) -> Self {
        if let Transport::Stdio { cwd, .. } = &mut self.transport {
            *cwd = Some(dir.into());
        }
        self
    }

    /// Adds a header to every HTTP request (ignored for stdio).
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        if let Transport::Http { headers, .. } = &mut self.transport {
            headers.insert(name.into(), value.into());
        }
        self
    }

    /// Sends `Authorization: Bearer <token>` with every HTTP request
    /// (ignored for stdio).
    #[must_use]
    pub fn bearer(mut self, token: impl Into<String>) -> Self {
        if let Transport::Http { bearer, .. } = &mut self.transport {
            *bearer = Some(token.into());
        }
        self
    }

    /// Offers each tool as `<prefix><server's name>`, so that two servers'
    /// tools of the same name do not collide (e.g. `"github_"`).
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    /// Offers only the tools `filter` admits.
    #[must_use]
    pub fn filter(mut self, filter: ToolFilter) -> Self {
        self.filter = filter;
        self
    }

    /// Bounds connecting (spawning or reaching the server, and the handshake).
    #[must_use]
    pub fn connect_timeout(mut self, limit: Duration) -> Self {
        self.connect_timeout = limit;
        self
    }

    /// Bounds each `tools/call`.
    #[must_use]
    pub fn call_timeout(mut self, limit: Duration) -> Self {
        self.call_timeout = limit;
        self
    }

    /// Bounds each `tools/list` (all pages together).
    #[must_use]
    pub fn list_timeout(mut self, limit: Duration) -> Self {
        self.list_timeout = limit;
        self
    }

    /// How the client reaches the server.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// A short label for messages: the command or the URL.
    pub fn label(&self) -> String {
        match &self.transport {
            Transport::Stdio { command, .. } => command.to_string_lossy().into_owned(),
            Transport::Http { url, .. } => url.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_allow_then_deny() {
        let f = ToolFilter::default().allow(["a", "b"]).deny(["b"]);
        assert!(f.admits("a"));
        assert!(!f.admits("b"));
        assert!(!f.admits("c"));
        assert!(ToolFilter::default().admits("anything"));
    }

    #[test]
    fn parse_command_and_url() {
        let c = McpServerConfig::parse("server --flag x").expect("command");
        match c.transport() {
            Transport::Stdio { command, args, .. } => {
                assert_eq!(command, "server");
                assert_eq!(args, &["--flag", "x"]);
            }
            other => panic!("not stdio: {other:?}"),
        }
        let h = McpServerConfig::parse(" https://example.invalid/mcp ").expect("url");
        assert!(
            matches!(h.transport(), Transport::Http { url, .. } if url == "https://example.invalid/mcp")
        );
    }
}
