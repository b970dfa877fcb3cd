//! The crate's configuration error.

/// A client could not be built from its configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A required environment variable is not set (or is empty).
    #[error("environment variable {var} is not set")]
    MissingEnv {
        /// The variable's name.
        var: &'static str,
    },
    /// An environment variable holds a value the choice does not know.
    #[error("environment variable {var} is {value:?}; expected {expected}")]
    InvalidEnv {
        /// The variable's name.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it may be.
        expected: &'static str,
    },
    /// The builder was given no API key, and the provider requires one.
    #[error("no api key was given")]
    MissingApiKey,
    /// The base URL is not an absolute `http` or `https` URL, or is one
    /// the client cannot use (an Anthropic base URL ending in `/v1`).
    #[error("invalid base url {url:?}{}: {reason}", .var.map(|v| format!(" (from {v})")).unwrap_or_default())]
    InvalidBaseUrl {
        /// The URL as given, with any password or query in it redacted.
        url: String,
        /// The environment variable it came from, if it came from one.
        var: Option<&'static str>,
        /// Why it was refused, and what to write instead.
        reason: String,
    },
    /// The client talks to a server other than the vendor's, and no model
    /// was named (`MARKOV_MODEL`): the vendor's default model name would
    /// mean nothing there, and the server did not name a single model of
    /// its own.
    #[error("no model named for {endpoint}: set {var} to the model the server serves ({reason})")]
    ModelNotNamed {
        /// The endpoint, redacted.
        endpoint: String,
        /// The variable that names the model.
        var: &'static str,
        /// What the server said when asked for its models.
        reason: String,
    },
    /// A builder option holds a value the provider would refuse or that
    /// could never take effect.
    #[error("invalid {option}: {reason}")]
    InvalidOption {
        /// The option, as the builder names it.
        option: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// The API key cannot be sent as an HTTP header value.
    #[error("the api key contains characters that cannot be sent in a header")]
    InvalidApiKey,
    /// The HTTP client (TLS setup included) could not be created.
    #[error("cannot create the http client: {0}")]
    HttpClient(String),
}
