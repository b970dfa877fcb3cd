//! The checks every request goes through before a handler sees it: the
//! access log and metrics, the `Host` and `Origin`, the security headers,
//! the body's declared length, the credential and the principal's rate.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum_extra::extract::CookieJar;
use governor::clock::{Clock, DefaultClock};

use crate::auth::{Credential, Principal};
use crate::{ApiError, Service};

/// The sign-in cookie's name.
pub(crate) const COOKIE: &str = "markov_session";

/// The lowercase host of `authority` (`Host: example.com:8080` →
/// `example.com`; `[::1]:80` → `[::1]`), if it is one.
pub(crate) fn host_name(authority: &str) -> Option<String> {
    let authority = authority.trim().to_ascii_lowercase();
    let host = if authority.starts_with('[') {
        let end = authority.find(']')?;
        let (host, rest) = authority.split_at(end + 1);
        let port_ok = rest
            .strip_prefix(':')
            .is_some_and(|port| port.parse::<u16>().is_ok());
        if !(rest.is_empty() || port_ok) {
            return None;
        }
        host.to_owned()
    } else {
        let host = match authority.rsplit_once(':') {
            Some((host, port)) => {
                port.parse::<u16>().ok()?;
                host
            }
            None => authority.as_str(),
        };
        host.to_owned()
    };
    let plain = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == ':');
    (!host.is_empty() && plain).then_some(host)
}

/// `(scheme, host)` of an origin or URL without a path
/// (`https://app.example.com:8443`).
pub(crate) fn split_origin(origin: &str) -> Option<(String, String)> {
    let (scheme, rest) = origin.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    if scheme != "http" && scheme != "https" {
        return None;
    }
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') || rest.contains('@') {
        return None;
    }
    Some((scheme, host_name(rest)?))
}

impl Service {
    fn allows_host(&self, host: &str) -> bool {
        self.hosts.iter().any(|h| h == host)
    }

    fn allows_origin(&self, origin: &str) -> bool {
        self.cors.iter().any(|o| o.eq_ignore_ascii_case(origin))
            || split_origin(origin).is_some_and(|(_, host)| self.allows_host(&host))
    }
}

/// The outermost layer: one structured access-log line and the request
/// metrics per request.
pub(crate) async fn access_log(
    State(service): State<Arc<Service>>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    let took = started.elapsed();
    let status = response.status().as_u16();
    let principal = response
        .extensions()
        .get::<Principal>()
        .map(|p| p.id().as_str().to_owned());
    tracing::info!(
        target: "markov_server::access",
        method = %method,
        route = %route,
        status,
        ms = %format_args!("{:.3}", took.as_secs_f64() * 1000.0),
        principal = principal.as_deref().unwrap_or("-"),
        "request"
    );
    service
        .metrics
        .request(&route, method.as_str(), status, took);
    response
}

/// Refuses a foreign `Host` or `Origin`, refuses a declared body over the
/// limit before reading it, and adds the security headers.
pub(crate) async fn hosts_and_headers(
    State(service): State<Arc<Service>>,
    request: Request,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned)
        .or_else(|| request.uri().authority().map(|a| a.to_string()));
    let refused = match host.as_deref().and_then(host_name) {
        Some(name) if service.allows_host(&name) => None,
        Some(name) => Some(format!("host {name:?} is not served here")),
        None => Some("a request needs a Host".to_owned()),
    };
    if let Some(reason) = refused {
        return secured(ApiError::Forbidden(reason).into_response());
    }
    if let Some(origin) = request.headers().get(header::ORIGIN) {
        let allowed = origin
            .to_str()
            .is_ok_and(|origin| service.allows_origin(origin));
        if !allowed {
            return secured(
                ApiError::Forbidden("requests from this origin are refused".into()).into_response(),
            );
        }
    }
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let limit = service.limits.max_body_bytes;
    if declared.is_some_and(|length| length > limit as u64) {
        let mut response = ApiError::TooLarge(format!(
            "the request body is larger than {limit} bytes, this server's limit"
        ))
        .into_response();
        // The body is never read, so the connection cannot carry another
        // request: say so, or a client reuses it and its next request
        // fails on a closed socket.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return secured(response);
    }
    secured(next.run(request).await)
}

/// The headers every response carries; a page sets its own
/// `Content-Security-Policy`, everything else gets the strictest.
fn secured(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers
        .entry(header::CONTENT_SECURITY_POLICY)
        .or_insert(HeaderValue::from_static(
            "default-src 'none'; frame-ancestors 'none'",
        ));
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// The bearer token of `headers`, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Requires a credential, then the principal's rate; hands the principal
/// to the handler (and to the access log).
pub(crate) async fn authenticate(
    State(service): State<Arc<Service>>,
    jar: CookieJar,
    mut request: Request,
    next: Next,
) -> Response {
    let found = if let Some(token) = bearer(request.headers()) {
        match service.verifiers.bearer(&*service.keys, token).await {
            Ok(principal) => principal.map(|p| (p, Credential::Bearer)),
            Err(error) => return ApiError::from(error).into_response(),
        }
    } else {
        let signed = jar
            .get(COOKIE)
            .and_then(|cookie| service.verifiers.cookie.verify(cookie.value()));
        match signed {
            None => None,
            Some(signed) => match signed.live(&*service.keys).await {
                Ok(principal) => principal.map(|p| (p, Credential::Cookie)),
                Err(error) => return ApiError::from(error).into_response(),
            },
        }
    };
    let Some((principal, credential)) = found else {
        service.metrics.unauthenticated.inc();
        return ApiError::Unauthorized(
            "a credential is needed: `Authorization: Bearer <API key or token>`, or sign in".into(),
        )
        .into_response();
    };
    let unsafe_method = !matches!(*request.method(), Method::GET | Method::HEAD);
    if credential == Credential::Cookie
        && unsafe_method
        && !request.headers().contains_key(header::ORIGIN)
    {
        // The origin itself was checked already; a browser always sends
        // it on such a request, so one without it did not come from our
        // page.
        return ApiError::Forbidden("a signed-in browser's request needs an Origin".into())
            .into_response();
    }
    if let Err(not_until) = service
        .limiter
        .check_key(&principal.id().as_str().to_owned())
    {
        service.metrics.rate_limited.inc();
        let wait = not_until.wait_time_from(DefaultClock::default().now());
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        let mut response = ApiError::TooManyRequests(seconds.max(1)).into_response();
        response.extensions_mut().insert(principal);
        return response;
    }
    request.extensions_mut().insert(principal.clone());
    let mut response = next.run(request).await;
    response.extensions_mut().insert(principal);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_read_without_their_port_and_odd_ones_are_refused() {
        assert_eq!(
            host_name("Example.com:8080").as_deref(),
            Some("example.com")
        );
        assert_eq!(host_name("127.0.0.1").as_deref(), Some("127.0.0.1"));
        assert_eq!(host_name("[::1]:80").as_deref(), Some("[::1]"));
        assert_eq!(host_name("[::1]").as_deref(), Some("[::1]"));
        assert_eq!(host_name("evil.com:x"), None);
        assert_eq!(host_name("a/b"), None);
        assert_eq!(host_name(""), None);
        // Not a port after the bracket, even one whose first character
        // takes more than a byte.
        assert_eq!(host_name("[::1]é"), None);
        assert_eq!(host_name("[::1]:é"), None);
        assert_eq!(host_name("[::1]x80"), None);
        assert_eq!(
            split_origin("https://app.example.com:8443"),
            Some(("https".into(), "app.example.com".into()))
        );
        assert_eq!(split_origin("ftp://x"), None);
        assert_eq!(split_origin("https://x/path"), None);
        assert_eq!(split_origin("https://user@x"), None);
    }
}
