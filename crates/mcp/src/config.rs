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

/// The variables of markov's own environment a stdio server inherits by
/// default, as the official MCP SDKs pass them: enough to find programs
/// and a home directory, nothing that holds a secret. Anything else a
/// server needs is named in its configuration
/// ([`McpServerConfig::env`], [`McpServerConfig::inherit_env`]).
#[cfg(not(windows))]
pub const DEFAULT_INHERITED_ENV: &[&str] = &["HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER"];

/// The variables of markov's own environment a stdio server inherits by
/// default, as the official MCP SDKs pass them: enough to find programs
/// and a home directory, nothing that holds a secret. Anything else a
/// server needs is named in its configuration
/// ([`McpServerConfig::env`], [`McpServerConfig::inherit_env`]).
#[cfg(windows)]
pub const DEFAULT_INHERITED_ENV: &[&str] = &[
    "APPDATA",
    "HOMEDRIVE",
    "HOMEPATH",
    "LOCALAPPDATA",
    "PATH",
    "PROCESSOR_ARCHITECTURE",
    "PROGRAMFILES",
    "SYSTEMDRIVE",
    "SYSTEMROOT",
    "TEMP",
    "USERNAME",
    "USERPROFILE",
];

/// Which of a server's tools need the application's approval before they
/// run, when the tools are registered with
/// [`McpClient::default_metadata`](crate::McpClient::default_metadata).
///
/// Names given with [`McpServerConfig::require_approval`] or
/// [`McpServerConfig::skip_approval`] win over the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Approval {
    /// From the server's annotations (the default): a tool the server marks
    /// read-only (`readOnlyHint: true`) runs without approval; any other
    /// (destructive, or not marked read-only, or without annotations, which
    /// the protocol reads as "may change things") needs it.
    #[default]
    Hints,
    /// Every tool of the server needs approval.
    All,
    /// No tool of the server needs approval: the server is trusted whatever
    /// its tools do.
    None,
}

impl Approval {
    /// Reads `hints`, `all` or `none`.
    pub fn parse(word: &str) -> Result<Self, McpError> {
        match word {
            "hints" => Ok(Approval::Hints),
            "all" => Ok(Approval::All),
            "none" => Ok(Approval::None),
            other => Err(McpError::Config(format!(
                "approval `{other}`: expected `hints`, `all` or `none`"
            ))),
        }
    }
}

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
        /// The server's environment variables, set on top of the inherited
        /// ones.
        env: Vec<(OsString, OsString)>,
        /// The variables of markov's environment the server inherits, in
        /// addition to [`DEFAULT_INHERITED_ENV`]; no other is passed.
        inherit: Vec<OsString>,
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
    pub(crate) roots: Vec<PathBuf>,
    pub(crate) approval: Approval,
    pub(crate) require_approval: Vec<String>,
    pub(crate) skip_approval: Vec<String>,
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
            inherit: Vec::new(),
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
    /// command and its arguments in shell syntax: words separated by
    /// spaces, a word with spaces in single or double quotes (or its
    /// spaces escaped with `\\`). Nothing is expanded and no shell runs.
    ///
    /// ```
    /// use markov_mcp::McpServerConfig;
    ///
    /// assert!(McpServerConfig::parse("http://127.0.0.1:8000/mcp").is_ok());
    /// assert!(McpServerConfig::parse("npx -y @modelcontextprotocol/server-everything").is_ok());
    /// assert!(McpServerConfig::parse("'/opt/my tools/server' --root '/home/me/My Files'").is_ok());
    /// assert!(McpServerConfig::parse("   ").is_err());
    /// assert!(McpServerConfig::parse("server 'unclosed").is_err());
    /// ```
    pub fn parse(spec: &str) -> Result<Self, McpError> {
        let spec = spec.trim();
        if spec.starts_with("http://") || spec.starts_with("https://") {
            return Ok(Self::http(spec));
        }
        let words = shlex::split(spec).ok_or_else(|| {
            McpError::Config(format!(
                "cannot read the MCP server command `{spec}`: an unclosed quote or a trailing `\\`"
            ))
        })?;
        let mut words = words.into_iter();
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
            roots: Vec::new(),
            approval: Approval::default(),
            require_approval: Vec::new(),
            skip_approval: Vec::new(),
        }
    }

    /// Sets an environment variable of a stdio server (ignored for HTTP).
    /// A stdio server's environment is [`DEFAULT_INHERITED_ENV`], the
    /// variables named with [`inherit_env`](Self::inherit_env), and these;
    /// nothing else of markov's environment (API keys, tokens) reaches it.
    #[must_use]
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        if let Transport::Stdio { env, .. } = &mut self.transport {
            env.push((key.into(), value.into()));
        }
        self
    }

    /// Passes the variable `name` of markov's own environment to a stdio
    /// server, when it is set (ignored for HTTP); see [`env`](Self::env).
    #[must_use]
    pub fn inherit_env(mut self, name: impl Into<OsString>) -> Self {
        if let Transport::Stdio { inherit, .. } = &mut self.transport {
            inherit.push(name.into());
        }
        self
    }

    /// Offers `dir` to the server as a root (`roots/list`): a directory the
    /// server may work in, such as the one a filesystem server started
    /// without arguments serves. Roots are offered only when configured:
    /// with none, the client does not announce the capability.
    #[must_use]
    pub fn root(mut self, dir: impl Into<PathBuf>) -> Self {
        self.roots.push(dir.into());
        self
    }

    /// Which tools need approval ([`Approval::Hints`] by default).
    #[must_use]
    pub fn approval(mut self, mode: Approval) -> Self {
        self.approval = mode;
        self
    }

    /// These tools (by the server's names) need approval, whatever the mode
    /// and the server's annotations say.
    #[must_use]
    pub fn require_approval(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.require_approval
            .extend(names.into_iter().map(Into::into));
        self
    }

    /// These tools (by the server's names) run without approval, whatever
    /// the mode and the server's annotations say;
    /// [`require_approval`](Self::require_approval) wins over it.
    #[must_use]
    pub fn skip_approval(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.skip_approval.extend(names.into_iter().map(Into::into));
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
    fn parse_keeps_quoted_spaces_in_one_word() {
        let c = McpServerConfig::parse(r#"'/opt/my tools/srv' --root "/home/me/My Files" a\ b"#)
            .expect("command");
        match c.transport() {
            Transport::Stdio { command, args, .. } => {
                assert_eq!(command, "/opt/my tools/srv");
                assert_eq!(args, &["--root", "/home/me/My Files", "a b"]);
            }
            other => panic!("not stdio: {other:?}"),
        }
        assert!(matches!(
            McpServerConfig::parse("srv 'open"),
            Err(McpError::Config(_))
        ));
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
