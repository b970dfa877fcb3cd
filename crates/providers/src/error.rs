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
    /// The builder was given no API key, and the provider requires one.
    #[error("no api key was given")]
    MissingApiKey,
    /// The base URL is not an absolute `http` or `https` URL.
    #[error("invalid base url {url:?}: {reason}")]
    InvalidBaseUrl {
        /// The URL as given.
        url: String,
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
