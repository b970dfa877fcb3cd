//! Who is asking: API keys (hashed in the store), JWT bearer tokens from an
//! external issuer, and the browser's sign-in cookie.

use std::collections::BTreeSet;
use std::fmt;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use markov_store::{ApiKeyRecord, KeyStore, Owner, StoreError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The role that may decide on calls of the tools that require it (see
/// `ServerBuilder::approval_role`).
pub const APPROVER: &str = "approver";

/// The role that may read every session's recorded steps and fork any of
/// them (the studio). A principal without it reads and forks its own
/// sessions only; an operator gives it with the key
/// ([`create_api_key`]) or the identity provider's `roles` claim.
pub const DEVELOPER: &str = "developer";

/// An authenticated caller: the sessions it creates are its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    id: Owner,
    roles: BTreeSet<String>,
}

impl Principal {
    /// A principal with `roles`.
    pub fn new(id: impl Into<String>, roles: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Principal {
            id: Owner::new(id),
            roles: roles.into_iter().map(Into::into).collect(),
        }
    }

    /// Its id, which owns the sessions it creates.
    pub fn id(&self) -> &Owner {
        &self.id
    }

    /// Whether it has `role`.
    pub fn has_role(&self, role: &str) -> bool {
        self.roles.contains(role)
    }

    /// Its roles.
    pub fn roles(&self) -> impl Iterator<Item = &str> {
        self.roles.iter().map(String::as_str)
    }
}

/// A key just created: the only time its secret is known.
#[derive(Clone, PartialEq, Eq)]
pub struct NewApiKey {
    /// The key's public id, to revoke it.
    pub id: String,
    /// The whole key (`mk_<id>_<secret>`), to give to its user once: only
    /// its hash is stored.
    pub key: String,
    /// The principal it signs in as.
    pub principal: String,
    /// Its roles.
    pub roles: Vec<String>,
}

impl fmt::Debug for NewApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NewApiKey")
            .field("id", &self.id)
            .field("key", &"<redacted>")
            .field("principal", &self.principal)
            .field("roles", &self.roles)
            .finish()
    }
}

/// Why an API key cannot be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The principal's name is unusable.
    #[error("a principal is 1 to 128 letters, digits, `-`, `_`, `.` or `@` (got {0:?})")]
    BadPrincipal(String),
    /// A role's name is unusable.
    #[error("a role is 1 to 64 letters, digits, `-` or `_` (got {0:?})")]
    BadRole(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The operating system's random source failed.
    #[error("the operating system's random source failed: {0}")]
    Random(String),
}

/// `N` bytes from the operating system's secure random source, as
/// lowercase hex: what secrets are made of.
pub(crate) fn os_random_hex<const N: usize>() -> Result<String, KeyError> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| KeyError::Random(e.to_string()))?;
    Ok(markov_core::ids::hex(&bytes))
}

fn valid_name(name: &str, max: usize, extra: &[char]) -> bool {
    !name.is_empty()
        && name.len() <= max
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || extra.contains(&c))
}

/// Creates an API key for `principal` with `roles` and stores its hash in
/// `keys`. The returned key is the only copy of its secret.
pub async fn create_api_key(
    keys: &dyn KeyStore,
    principal: &str,
    roles: &[String],
) -> Result<NewApiKey, KeyError> {
    if !valid_name(principal, 128, &['.', '@']) {
        return Err(KeyError::BadPrincipal(principal.to_owned()));
    }
    if let Some(role) = roles.iter().find(|r| !valid_name(r, 64, &[])) {
        return Err(KeyError::BadRole(role.clone()));
    }
    // The key's id and secret come from the operating system's secure
    // random source (ids elsewhere come from a seeded generator, which
    // saves a system call per id): 48 bits for the id, 256 for the secret.
    let id = os_random_hex::<6>()?;
    let secret = os_random_hex::<32>()?;
    let record = ApiKeyRecord {
        id: id.clone(),
        principal: principal.to_owned(),
        roles: roles.to_vec(),
        hash: hash_secret(&secret),
        created_at: crate::now_ms(),
        revoked_at: None,
    };
    keys.add_key(&record).await?;
    Ok(NewApiKey {
        key: format!("mk_{id}_{secret}"),
        id,
        principal: principal.to_owned(),
        roles: roles.to_vec(),
    })
}

/// The stored form of a key's secret. A fast hash is enough: the secret is
/// 256 random bits, so there is nothing to guess from the hash. Computed on
/// every request that signs in with a key.
fn hash_secret(secret: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"markov-api-key\0");
    hasher.update(secret.as_bytes());
    markov_core::ids::hex(&hasher.finalize())
}

/// The principal `presented` signs in as, if it is a live API key, with
/// the key's public id.
pub(crate) async fn verify_api_key_with_id(
    keys: &dyn KeyStore,
    presented: &str,
) -> Result<Option<(Principal, String)>, StoreError> {
    let Some((id, secret)) = split_key(presented) else {
        return Ok(None);
    };
    let Some(record) = keys.key(id).await? else {
        return Ok(None);
    };
    let matches: bool = hash_secret(secret)
        .as_bytes()
        .ct_eq(record.hash.as_bytes())
        .into();
    if !matches || record.revoked_at.is_some() {
        return Ok(None);
    }
    Ok(Some((
        Principal::new(record.principal, record.roles),
        record.id,
    )))
}

/// The API keys this server has verified, so that a request with a known
/// key costs one read of the store's [`KeyStore::key_generation`] instead
/// of a read of the key. Every revocation raises that generation: an entry
/// read under another one is read again, so a revoked key is refused from
/// the next request on, whichever worker revoked it. Only the stored hash
/// is kept, never a secret.
#[derive(Clone, Default)]
pub(crate) struct KeyCache {
    entries: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, CachedKey>>>,
}

/// A live key as [`KeyCache`] holds it.
struct CachedKey {
    generation: u64,
    hash: String,
    principal: Principal,
}

/// How many keys a [`KeyCache`] holds; when full it starts again empty.
const CACHED_KEYS: usize = 4096;

impl fmt::Debug for KeyCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyCache")
            .field("keys", &self.lock().len())
            .finish()
    }
}

impl KeyCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, CachedKey>> {
        // An insert or a lookup leaves the map whole.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The principal `presented` signs in as, if it is a live API key:
    /// [`verify_api_key_with_id`], remembered while no key is revoked.
    pub(crate) async fn verify(
        &self,
        keys: &dyn KeyStore,
        presented: &str,
    ) -> Result<Option<Principal>, StoreError> {
        let Some((id, secret)) = split_key(presented) else {
            return Ok(None);
        };
        // Read before the key: a revocation after this read raises the
        // generation past it, so what is cached under it cannot outlive
        // the revocation.
        let generation = keys.key_generation().await?;
        let hash = hash_secret(secret);
        if let Some(cached) = self.lock().get(id)
            && cached.generation == generation
        {
            let matches: bool = hash.as_bytes().ct_eq(cached.hash.as_bytes()).into();
            return Ok(matches.then(|| cached.principal.clone()));
        }
        let Some(record) = keys.key(id).await? else {
            return Ok(None);
        };
        let matches: bool = hash.as_bytes().ct_eq(record.hash.as_bytes()).into();
        if !matches || record.revoked_at.is_some() {
            return Ok(None);
        }
        let principal = Principal::new(record.principal, record.roles);
        let mut entries = self.lock();
        if entries.len() >= CACHED_KEYS {
            tracing::debug!(keys = entries.len(), "the API key cache is full: emptied");
            entries.clear();
        }
        entries.insert(
            record.id,
            CachedKey {
                generation,
                hash: record.hash,
                principal: principal.clone(),
            },
        );
        Ok(Some(principal))
    }
}

/// A presented API key's public id and secret, if it has the form of one.
fn split_key(presented: &str) -> Option<(&str, &str)> {
    let (id, secret) = presented
        .strip_prefix("mk_")
        .and_then(|rest| rest.split_once('_'))?;
    (id.len() == 12 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some((id, secret))
}

/// Bearer tokens from an external issuer (an identity provider): their
/// signature, issuer, audience and expiry are checked; the subject is the
/// principal and the `roles` claim (a list of strings) its roles.
#[derive(Clone)]
pub struct JwtConfig {
    key: DecodingKey,
    validation: Validation,
}

impl fmt::Debug for JwtConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JwtConfig")
            .field("algorithms", &self.validation.algorithms)
            .field("issuer", &self.validation.iss)
            .field("audience", &self.validation.aud)
            .finish_non_exhaustive()
    }
}

/// A JWT configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("invalid JWT configuration: {0}")]
pub struct JwtConfigError(String);

impl JwtConfig {
    /// Tokens signed with HMAC-SHA256 and the shared `secret` (at least
    /// 32 bytes), from `issuer`, for `audience`.
    pub fn hs256(secret: &[u8], issuer: &str, audience: &str) -> Result<Self, JwtConfigError> {
        if secret.len() < 32 {
            return Err(JwtConfigError(
                "an HS256 secret has at least 32 bytes".into(),
            ));
        }
        Ok(Self::with(
            DecodingKey::from_secret(secret),
            Algorithm::HS256,
            issuer,
            audience,
        ))
    }

    /// Tokens signed with RS256 and the private key of the public key in
    /// `pem`, from `issuer`, for `audience`.
    pub fn rs256_pem(pem: &[u8], issuer: &str, audience: &str) -> Result<Self, JwtConfigError> {
        let key = DecodingKey::from_rsa_pem(pem).map_err(|e| JwtConfigError(e.to_string()))?;
        Ok(Self::with(key, Algorithm::RS256, issuer, audience))
    }

    /// Tokens signed with ES256 and the private key of the public key in
    /// `pem`, from `issuer`, for `audience`.
    pub fn es256_pem(pem: &[u8], issuer: &str, audience: &str) -> Result<Self, JwtConfigError> {
        let key = DecodingKey::from_ec_pem(pem).map_err(|e| JwtConfigError(e.to_string()))?;
        Ok(Self::with(key, Algorithm::ES256, issuer, audience))
    }

    fn with(key: DecodingKey, algorithm: Algorithm, issuer: &str, audience: &str) -> Self {
        let mut validation = Validation::new(algorithm);
        validation.set_issuer(&[issuer]);
        validation.set_audience(&[audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.leeway = 30;
        JwtConfig { key, validation }
    }

    fn verify(&self, token: &str) -> Option<Principal> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.key, &self.validation).ok()?;
        let Claims { sub, roles, .. } = data.claims;
        valid_name(&sub, 128, &['.', '@', ':', '|']).then(|| Principal::new(sub, roles))
    }
}

/// The claims read from a token.
#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    #[serde(default)]
    roles: Vec<String>,
    exp: u64,
    #[serde(default)]
    iss: String,
    #[serde(default)]
    aud: String,
    /// The sign-in cookie's key: the id of the API key that signed in.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    kid: String,
    /// The sign-in cookie's own id, which signing out refuses.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    sid: String,
}

/// The browser's sign-in cookie: a token the server signs itself, naming
/// the principal of the key that signed in.
#[derive(Clone)]
pub(crate) struct CookieSigner {
    encoding: EncodingKey,
    decoding: DecodingKey,
    /// How long a sign-in lasts.
    pub(crate) lifetime: std::time::Duration,
}

impl fmt::Debug for CookieSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CookieSigner")
            .field("lifetime", &self.lifetime)
            .finish_non_exhaustive()
    }
}

/// The issuer and audience of the sign-in cookie's token.
const COOKIE_ISSUER: &str = "markov-server";
const COOKIE_AUDIENCE: &str = "markov-web";

impl CookieSigner {
    pub(crate) fn new(secret: &[u8], lifetime: std::time::Duration) -> Self {
        CookieSigner {
            encoding: EncodingKey::from_secret(secret),
            decoding: DecodingKey::from_secret(secret),
            lifetime,
        }
    }

    /// A cookie for `principal`, signed in with the API key `key_id`.
    pub(crate) fn sign(&self, principal: &Principal, key_id: &str) -> Option<String> {
        let claims = Claims {
            sub: principal.id().as_str().to_owned(),
            roles: principal.roles().map(str::to_owned).collect(),
            exp: crate::now_ms() / 1000 + self.lifetime.as_secs(),
            iss: COOKIE_ISSUER.into(),
            aud: COOKIE_AUDIENCE.into(),
            kid: key_id.to_owned(),
            sid: uuid::Uuid::new_v4().simple().to_string(),
        };
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &self.encoding).ok()
    }

    /// The sign-in `token` records, if this server signed it and it has
    /// not expired. Whether its key is still live and whether it was
    /// signed out is for the caller to check ([`CookieSignIn`]).
    pub(crate) fn verify(&self, token: &str) -> Option<CookieSignIn> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_issuer(&[COOKIE_ISSUER]);
        validation.set_audience(&[COOKIE_AUDIENCE]);
        validation.leeway = 0;
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &validation).ok()?;
        let Claims {
            sub, exp, kid, sid, ..
        } = data.claims;
        // A cookie without its key or its own id (signed by an older
        // server) cannot be checked against either: it signs nobody in.
        (!kid.is_empty() && !sid.is_empty()).then_some(CookieSignIn {
            principal: sub,
            key: kid,
            id: sid,
            expires: exp,
        })
    }
}

/// What a valid sign-in cookie records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CookieSignIn {
    /// The principal it signed in as.
    pub(crate) principal: String,
    /// The id of the API key that signed in.
    pub(crate) key: String,
    /// The sign-in's own id.
    pub(crate) id: String,
    /// When it expires, in Unix seconds.
    pub(crate) expires: u64,
}

impl CookieSignIn {
    /// Its principal, with the roles its key has now, if the key is still
    /// live and the sign-in was not signed out: both are read from the
    /// store on every request (one indexed read each), so revoking the key
    /// or signing out on any worker takes effect on the next request on
    /// every worker, and after a restart.
    pub(crate) async fn live(&self, keys: &dyn KeyStore) -> Result<Option<Principal>, StoreError> {
        if keys.sign_in_ended(&self.id).await? {
            return Ok(None);
        }
        let Some(record) = keys.key(&self.key).await? else {
            return Ok(None);
        };
        if record.revoked_at.is_some() || record.principal != self.principal {
            return Ok(None);
        }
        Ok(Some(Principal::new(record.principal, record.roles)))
    }

    /// Ends this sign-in on every worker of the store, until its cookie
    /// would have expired anyway.
    pub(crate) async fn end(&self, keys: &dyn KeyStore) -> Result<(), StoreError> {
        keys.end_sign_in(&self.id, self.expires).await
    }
}

/// How a request proved who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Credential {
    /// `Authorization: Bearer` with an API key or a token.
    Bearer,
    /// The sign-in cookie (a browser): unsafe methods must come from an
    /// allowed origin.
    Cookie,
}

/// The verifiers of a server.
#[derive(Debug, Clone)]
pub(crate) struct Verifiers {
    pub(crate) jwt: Option<JwtConfig>,
    pub(crate) cookie: CookieSigner,
    /// The API keys verified so far.
    pub(crate) keys: KeyCache,
}

impl Verifiers {
    /// The principal of a bearer credential: an API key, or a token when
    /// an issuer is configured.
    pub(crate) async fn bearer(
        &self,
        keys: &dyn KeyStore,
        token: &str,
    ) -> Result<Option<Principal>, StoreError> {
        if token.starts_with("mk_") {
            return self.keys.verify(keys, token).await;
        }
        Ok(self.jwt.as_ref().and_then(|jwt| jwt.verify(token)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_hex_of_the_asked_length_and_never_the_same_twice() {
        let a = os_random_hex::<32>().expect("random");
        let b = os_random_hex::<32>().expect("random");
        assert_eq!(a.len(), 64);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
    }

    /// A store of keys that counts the reads of a key.
    #[derive(Debug)]
    struct Counted {
        inner: markov_store::SqliteStore,
        reads: std::sync::atomic::AtomicUsize,
    }

    #[async_trait::async_trait]
    impl KeyStore for Counted {
        async fn add_key(&self, key: &ApiKeyRecord) -> Result<(), StoreError> {
            self.inner.add_key(key).await
        }
        async fn key(&self, id: &str) -> Result<Option<ApiKeyRecord>, StoreError> {
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.inner.key(id).await
        }
        async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
            self.inner.revoke_key(id).await
        }
        async fn key_generation(&self) -> Result<u64, StoreError> {
            self.inner.key_generation().await
        }
        async fn keys(&self) -> Result<Vec<ApiKeyRecord>, StoreError> {
            self.inner.keys().await
        }
        async fn end_sign_in(&self, id: &str, expires_at: u64) -> Result<(), StoreError> {
            self.inner.end_sign_in(id, expires_at).await
        }
        async fn sign_in_ended(&self, id: &str) -> Result<bool, StoreError> {
            self.inner.sign_in_ended(id).await
        }
    }

    #[tokio::test]
    async fn a_known_key_is_not_read_again_until_a_key_is_revoked() {
        let store = Counted {
            inner: markov_store::SqliteStore::in_memory().expect("a database"),
            reads: Default::default(),
        };
        let reads = || store.reads.load(std::sync::atomic::Ordering::SeqCst);
        let alice = create_api_key(&store, "alice", &["approver".into()])
            .await
            .expect("a key");
        let bob = create_api_key(&store, "bob", &[]).await.expect("a key");
        let cache = KeyCache::default();
        let signs_in = async |key: &str| {
            cache
                .verify(&store, key)
                .await
                .expect("verifies")
                .map(|p| p.id().as_str().to_owned())
        };
        assert_eq!(signs_in(&alice.key).await.as_deref(), Some("alice"));
        assert_eq!(signs_in(&bob.key).await.as_deref(), Some("bob"));
        assert_eq!(reads(), 2);
        assert_eq!(signs_in(&alice.key).await.as_deref(), Some("alice"));
        assert_eq!(signs_in(&bob.key).await.as_deref(), Some("bob"));
        assert_eq!(reads(), 2, "known keys are not read again");

        // A wrong secret under a known id is refused from the cache too.
        let forged = format!("mk_{}_{}", alice.id, "0".repeat(64));
        assert_eq!(signs_in(&forged).await, None);

        assert!(store.revoke_key(&bob.id).await.expect("revokes"));
        assert_eq!(signs_in(&bob.key).await, None, "revoked: refused at once");
        assert_eq!(signs_in(&alice.key).await.as_deref(), Some("alice"));
        assert_eq!(reads(), 4, "a revocation makes every key be read again");
        assert_eq!(signs_in(&alice.key).await.as_deref(), Some("alice"));
        assert_eq!(signs_in(&bob.key).await, None);
        assert_eq!(reads(), 5, "a revoked key is not remembered");
    }

    #[test]
    fn a_signed_cookie_names_its_principal_and_a_forged_one_names_nobody() {
        let signer = CookieSigner::new(&[7; 32], std::time::Duration::from_secs(60));
        let alice = Principal::new("alice", ["approver"]);
        let token = signer.sign(&alice, "0123456789ab").expect("signs");
        let signed = signer.verify(&token).expect("verifies");
        assert_eq!(signed.principal, "alice");
        assert_eq!(signed.key, "0123456789ab");
        assert_eq!(signed.id.len(), 32);
        let again = signer.sign(&alice, "0123456789ab").expect("signs");
        assert_ne!(
            signer.verify(&again).map(|s| s.id),
            Some(signed.id),
            "each sign-in has its own id"
        );
        let other = CookieSigner::new(&[8; 32], std::time::Duration::from_secs(60));
        assert_eq!(other.verify(&token), None, "another server's secret");
        let mut tampered = token.clone();
        tampered.insert(token.len() / 2, 'x');
        assert_eq!(signer.verify(&tampered), None);
    }

    #[test]
    fn an_external_token_is_checked_for_issuer_audience_and_expiry() {
        let secret = [3u8; 32];
        let config = JwtConfig::hs256(&secret, "https://idp.example", "markov").expect("config");
        let sign = |iss: &str, aud: &str, exp: u64| {
            let claims = Claims {
                sub: "bob".into(),
                roles: vec!["approver".into()],
                exp,
                iss: iss.into(),
                aud: aud.into(),
                kid: String::new(),
                sid: String::new(),
            };
            jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &claims,
                &EncodingKey::from_secret(&secret),
            )
            .expect("encodes")
        };
        let later = crate::now_ms() / 1000 + 600;
        let ok = config
            .verify(&sign("https://idp.example", "markov", later))
            .expect("a valid token");
        assert_eq!(ok.id().as_str(), "bob");
        assert!(ok.has_role(APPROVER));
        assert_eq!(
            config.verify(&sign("https://evil.example", "markov", later)),
            None
        );
        assert_eq!(
            config.verify(&sign("https://idp.example", "other", later)),
            None
        );
        assert_eq!(
            config.verify(&sign("https://idp.example", "markov", 1000)),
            None
        );
        assert!(JwtConfig::hs256(b"short", "i", "a").is_err());
    }
}
