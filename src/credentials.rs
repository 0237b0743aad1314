//! The credential routers and controllers present to controllers: a
//! projected ServiceAccount token with the Skipper audience, read from the
//! file the kubelet keeps fresh, sent as `authorization: Bearer <token>` on
//! every call.
//!
//! The file is read at start (a missing or empty file is an error naming
//! the flag) and again every [`RELOAD_INTERVAL`]: the kubelet replaces it
//! well before the token expires (at 80% of its life), so the value sent is
//! never stale. A failed reload keeps the last good token and logs.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tonic::metadata::{AsciiMetadataValue, MetadataValue};

use crate::shutdown::Shutdown;

/// The audience of Skipper's tokens (what controllers verify).
pub const AUDIENCE: &str = "skipper-controller";
/// Where `manifests/` mounts the projected token.
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/skipper/token";
/// How often the token file is read again.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);
/// Longest token read.
const MAX_TOKEN_BYTES: u64 = 16 * 1024;

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("failed to read token file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("token file {path} is empty")]
    Empty { path: PathBuf },
    #[error("token file {path} is larger than {MAX_TOKEN_BYTES} bytes")]
    TooLarge { path: PathBuf },
    #[error("token file {path} holds characters a header cannot carry")]
    NotAscii { path: PathBuf },
}

fn read(path: &Path) -> Result<AsciiMetadataValue, CredentialsError> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(|source| CredentialsError::Read {
        path: path.to_owned(),
        source,
    })?;
    let mut text = String::new();
    file.take(MAX_TOKEN_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|source| CredentialsError::Read {
            path: path.to_owned(),
            source,
        })?;
    if text.len() as u64 > MAX_TOKEN_BYTES {
        return Err(CredentialsError::TooLarge {
            path: path.to_owned(),
        });
    }
    let token = text.trim();
    if token.is_empty() {
        return Err(CredentialsError::Empty {
            path: path.to_owned(),
        });
    }
    MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| CredentialsError::NotAscii {
        path: path.to_owned(),
    })
}

/// A token to present, or none. Cheap to clone; clones share the value.
#[derive(Clone, Default)]
pub struct Credentials {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    path: Option<PathBuf>,
    // A std lock: a clone or a swap, never across an await.
    value: RwLock<AsciiMetadataValue>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = self.inner.as_ref().and_then(|i| i.path.as_ref());
        f.debug_struct("Credentials")
            .field("path", &path)
            .field("token", &self.inner.as_ref().map(|_| "****"))
            .finish()
    }
}

impl Credentials {
    /// No token: calls carry no `authorization`.
    #[must_use]
    pub fn none() -> Self {
        Self::default()
    }

    /// The token in `path`, read now.
    ///
    /// # Errors
    /// See [`CredentialsError`].
    pub fn from_file(path: &Path) -> Result<Self, CredentialsError> {
        let value = read(path)?;
        Ok(Self {
            inner: Some(Arc::new(Inner {
                path: Some(path.to_owned()),
                value: RwLock::new(value),
            })),
        })
    }

    /// A fixed token (tests and tools).
    ///
    /// # Errors
    /// [`CredentialsError::NotAscii`] or [`CredentialsError::Empty`].
    pub fn fixed(token: &str) -> Result<Self, CredentialsError> {
        let path = PathBuf::from("(fixed)");
        if token.trim().is_empty() {
            return Err(CredentialsError::Empty { path });
        }
        let value = MetadataValue::try_from(format!("Bearer {}", token.trim()))
            .map_err(|_| CredentialsError::NotAscii { path })?;
        Ok(Self {
            inner: Some(Arc::new(Inner {
                path: None,
                value: RwLock::new(value),
            })),
        })
    }

    /// Whether a token is presented.
    #[must_use]
    pub fn is_some(&self) -> bool {
        self.inner.is_some()
    }

    /// The `authorization` value, if any.
    #[must_use]
    pub fn value(&self) -> Option<AsciiMetadataValue> {
        let inner = self.inner.as_ref()?;
        Some(
            inner
                .value
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        )
    }

    /// Reads the file again; keeps the last good token when that fails.
    ///
    /// # Errors
    /// See [`CredentialsError`].
    pub fn reload(&self) -> Result<(), CredentialsError> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        let Some(path) = &inner.path else {
            return Ok(());
        };
        let value = read(path)?;
        *inner
            .value
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = value;
        Ok(())
    }

    /// Re-reads the file every [`RELOAD_INTERVAL`] until shutdown (a
    /// tracked task; nothing for credentials without a file).
    pub fn keep_fresh(&self, shutdown: &Shutdown) {
        if self.inner.as_ref().and_then(|i| i.path.as_ref()).is_none() {
            return;
        }
        let creds = self.clone();
        let token = shutdown.token().clone();
        shutdown.spawn("reload-token", async move {
            let mut ticker = tokio::time::interval(RELOAD_INTERVAL);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                tokio::select! {
                    () = token.cancelled() => return,
                    _ = ticker.tick() => {}
                }
                if let Err(e) = creds.reload() {
                    tracing::warn!(error = %e, "failed to reload the token; keeping the last one");
                }
            }
        });
    }
}

impl tonic::service::Interceptor for Credentials {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = self.value() {
            request.metadata_mut().insert("authorization", v);
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor as _;

    fn sent(c: &mut Credentials) -> Option<String> {
        let r = c.call(tonic::Request::new(())).unwrap();
        r.metadata()
            .get("authorization")
            .map(|v| v.to_str().unwrap().to_owned())
    }

    #[test]
    fn the_token_file_is_read_trimmed_and_reloaded_and_a_bad_reload_keeps_the_last() {
        let dir = std::env::temp_dir().join(format!("skipper-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "first\n").unwrap();
        let mut c = Credentials::from_file(&path).unwrap();
        assert_eq!(sent(&mut c).as_deref(), Some("Bearer first"));
        std::fs::write(&path, "second").unwrap();
        c.reload().unwrap();
        assert_eq!(sent(&mut c).as_deref(), Some("Bearer second"));
        std::fs::write(&path, "  \n").unwrap();
        assert!(matches!(c.reload(), Err(CredentialsError::Empty { .. })));
        assert_eq!(
            sent(&mut c).as_deref(),
            Some("Bearer second"),
            "the last good token stays"
        );
        std::fs::remove_file(&path).unwrap();
        let err = Credentials::from_file(&path).unwrap_err();
        assert!(err.to_string().contains("failed to read token file"), "{err}");
        std::fs::write(&path, "a".repeat(20_000)).unwrap();
        assert!(matches!(
            Credentials::from_file(&path),
            Err(CredentialsError::TooLarge { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(sent(&mut Credentials::none()), None);
        assert!(format!("{:?}", Credentials::fixed("secret").unwrap()).contains("****"));
        assert!(!format!("{:?}", Credentials::fixed("secret").unwrap()).contains("secret"));
    }
}
