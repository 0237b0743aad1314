//! `skipper keygen`: writes an Ed25519 key pair for assignment tokens.
//!
//! `private.pem` (PKCS#8, `PRIVATE KEY`, mode 0600) goes to the controllers
//! (`--paseto-private-key`); `public.pem` (SPKI, `PUBLIC KEY`) goes to the
//! pods that verify tokens. A pod trusts every key of its file and picks the
//! one a token's `kid` names, so a new key is rolled in without a failed
//! assignment in three steps ([`ROTATION`]), which `keygen` prints.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::token::{SigningKey, Version};

/// Flags of `skipper keygen`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Directory to write private.pem and public.pem into (created if missing)
    #[arg(long, env = "SKIPPER_OUT_DIR", value_name = "DIR")]
    pub out_dir: PathBuf,

    /// Overwrite existing key files
    #[arg(long, env = "SKIPPER_FORCE", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true", value_parser = crate::config::GoBool)]
    pub force: bool,
}

/// Why the key pair was not written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0} already exists; pass --force to overwrite it")]
    Exists(PathBuf),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Writes a fresh key pair into `dir`; returns the paths written and the key.
///
/// # Errors
/// [`Error::Exists`] when a key file exists and `force` is false; [`Error::Write`] on I/O failure.
pub fn write_key_pair(dir: &Path, force: bool) -> Result<KeyPair, Error> {
    let private = dir.join("private.pem");
    let public = dir.join("public.pem");
    if !force {
        for p in [&private, &public] {
            if p.exists() {
                return Err(Error::Exists(p.clone()));
            }
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| Error::Write {
        path: dir.to_owned(),
        source,
    })?;
    let key = SigningKey::generate();
    write_file(&private, key.to_pem().as_bytes(), 0o600)?;
    write_file(&public, key.verifying_key().to_pem().as_bytes(), 0o644)?;
    Ok(KeyPair { private, public, key })
}

/// A key pair written by [`write_key_pair`].
#[derive(Debug)]
pub struct KeyPair {
    /// `private.pem`.
    pub private: PathBuf,
    /// `public.pem`.
    pub public: PathBuf,
    key: SigningKey,
}

impl KeyPair {
    /// The PASERK id (`kid`) tokens of `version` signed with this key carry
    /// (and the controller logs at start-up).
    #[must_use]
    pub fn key_id(&self, version: Version) -> String {
        self.key.key_id(version)
    }
}

fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), Error> {
    let err = |source| Error::Write {
        path: path.to_owned(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(err)?;
    f.write_all(data).map_err(err)
}

/// The order in which a new key replaces the old one without a failed
/// assignment: a pod refuses (401) a token whose key it does not trust, so
/// every pod must trust the new key before any controller signs with it, and
/// no controller may sign with the old key once pods stop trusting it.
pub const ROTATION: &str = "\
to rotate to this key with no failed request, roll out each step completely before the next:
  1. pools trust the old and the new key: SKIPPER_PUBLIC_KEY holds both PUBLIC KEY blocks; roll the pools
  2. controllers sign with the new key: their SKIPPER_PASETO_PRIVATE_KEY is private.pem; roll the controllers
  3. pools trust the new key only: SKIPPER_PUBLIC_KEY is public.pem; roll the pools
(README: \"Rotating the assignment key\")";

/// Runs `skipper keygen`.
///
/// # Errors
/// See [`write_key_pair`].
pub fn main(args: &Args) -> Result<ExitCode, Error> {
    let pair = write_key_pair(&args.out_dir, args.force)?;
    println!("wrote {} and {}", pair.private.display(), pair.public.display());
    println!(
        "key id: {} (v2.public tokens), {} (v4.public tokens)",
        pair.key_id(Version::V2),
        pair.key_id(Version::V4)
    );
    println!("{ROTATION}");
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::VerifyingKey;

    #[test]
    fn writes_a_matching_pair_and_refuses_to_overwrite() {
        let dir = std::env::temp_dir().join(format!("skipper-keygen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let pair = write_key_pair(&dir, false).unwrap();
        let (private, public) = (pair.private.clone(), pair.public.clone());
        let sk = SigningKey::from_pem(&std::fs::read_to_string(&private).unwrap()).unwrap();
        let pk = VerifyingKey::from_pem(&std::fs::read_to_string(&public).unwrap()).unwrap();
        assert_eq!(sk.verifying_key(), pk);
        // The printed key id is the one tokens signed with the key carry.
        for version in [Version::V2, Version::V4] {
            assert_eq!(pair.key_id(version), pk.key_id(version));
            assert!(pair.key_id(version).starts_with(if version == Version::V2 {
                "k2.pid."
            } else {
                "k4.pid."
            }));
        }
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(&private).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(matches!(write_key_pair(&dir, false), Err(Error::Exists(_))));
        write_key_pair(&dir, true).unwrap();
        let sk2 = SigningKey::from_pem(&std::fs::read_to_string(&private).unwrap()).unwrap();
        assert_ne!(sk2.verifying_key(), pk);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
