//! Pod volumes on the node: `emptyDir` and `hostPath` directories, and the
//! kubelet's atomically updated projections — `configMap`, `secret`,
//! `downwardAPI` and `projected` (ServiceAccount token through the
//! TokenRequest API, ConfigMaps, Secrets, downward API) — written under the
//! pod's directory and refreshed while the pod runs.
//!
//! A projection is laid out as the kubelet's atomic writer does: the files
//! live in a timestamped directory `..<time>`, `..data` links to it, and each
//! top-level name links into `..data`, so an update swaps one symlink and a
//! reader never sees half of it. Files are written with `defaultMode`
//! (0644 unless set) or the item's `mode`.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, DownwardAPIVolumeFile, KeyToPath, Secret, ServiceAccount, Volume,
};
use kube::api::{Api, PostParams};

use super::env::{PodFacts, field_value, resource_value};

/// The default file mode of projected files (0644).
pub const DEFAULT_MODE: u32 = 0o644;

/// Why a volume cannot be set up (the kubelet's `MountVolume.SetUp failed`).
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("MountVolume.SetUp failed for volume {volume:?} : {reason}")]
    SetUp { volume: String, reason: String },
    #[error("volume {volume:?}: {kind} volumes are not supported by this kubelet")]
    Unsupported { volume: String, kind: &'static str },
    #[error("writing volume {volume:?} at {path}: {source}")]
    Io {
        volume: String,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io_err(volume: &str, path: &Path) -> impl FnOnce(std::io::Error) -> VolumeError {
    let (volume, path) = (volume.to_owned(), path.to_path_buf());
    move |source| VolumeError::Io { volume, path, source }
}

/// A file of a projection: its bytes and mode.
pub type Payload = BTreeMap<PathBuf, (Vec<u8>, u32)>;

/// A ServiceAccount token held for a projection.
#[derive(Debug, Clone)]
struct Token {
    token: String,
    issued: Timestamp,
    expires: Timestamp,
}

impl Token {
    /// The kubelet's rule: refresh after 80% of the lifetime or 24 hours.
    fn needs_refresh(&self, now: Timestamp) -> bool {
        let ttl = self.expires.duration_since(self.issued);
        let refresh_at = self.expires - ttl / 5;
        now >= refresh_at || now.duration_since(self.issued) >= jiff::SignedDuration::from_hours(24)
    }
}

/// One volume of a pod as it lives on the node.
#[derive(Debug, Clone)]
pub struct Mounted {
    /// `spec.volumes[].name`.
    pub name: String,
    /// Where its content is on the host.
    pub path: PathBuf,
    /// A projection (always mounted read-only).
    pub projected: bool,
}

/// The volumes of one pod.
#[derive(Debug)]
pub struct Volumes {
    root: PathBuf,
    mounted: Vec<Mounted>,
    written: BTreeMap<String, Payload>,
    tokens: BTreeMap<(String, String), Token>,
}

/// What building a projection needs.
pub struct Context<'a> {
    pub client: &'a kube::Client,
    pub facts: &'a PodFacts<'a>,
}

fn validate_path(volume: &str, p: &str) -> Result<PathBuf, VolumeError> {
    let path = PathBuf::from(p);
    let ok = !p.is_empty()
        && path
            .components()
            .all(|c| matches!(c, Component::Normal(n) if !n.to_string_lossy().starts_with("..")));
    if ok {
        Ok(path)
    } else {
        Err(VolumeError::SetUp {
            volume: volume.to_owned(),
            reason: format!("invalid path {p:?}: must be relative and may not contain '..'"),
        })
    }
}

fn mode_of(item: Option<i32>, default: u32) -> u32 {
    item.and_then(|m| u32::try_from(m).ok()).unwrap_or(default) & 0o7777
}

fn config_map_data(cm: &ConfigMap) -> BTreeMap<String, Vec<u8>> {
    let mut out: BTreeMap<String, Vec<u8>> = cm
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
        .collect();
    for (k, v) in cm.binary_data.iter().flatten() {
        out.insert(k.clone(), v.0.clone());
    }
    out
}

fn secret_data(s: &Secret) -> BTreeMap<String, Vec<u8>> {
    let mut out: BTreeMap<String, Vec<u8>> = s
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect();
    for (k, v) in s.string_data.iter().flatten() {
        out.insert(k.clone(), v.clone().into_bytes());
    }
    out
}

/// Which ConfigMap or Secret keys are projected.
struct KeySource<'a> {
    /// `configmap` or `secret`.
    kind: &'static str,
    name: &'a str,
    optional: bool,
    /// `items` (all keys when `None`).
    items: Option<&'a [KeyToPath]>,
}

/// Adds the keys of a ConfigMap or Secret to `payload`.
fn add_keys(
    volume: &str,
    payload: &mut Payload,
    data: &BTreeMap<String, Vec<u8>>,
    source: &KeySource<'_>,
    default_mode: u32,
) -> Result<(), VolumeError> {
    let KeySource {
        kind,
        name,
        optional,
        items,
    } = *source;
    match items {
        None => {
            for (k, v) in data {
                payload.insert(validate_path(volume, k)?, (v.clone(), default_mode));
            }
        }
        Some(items) => {
            for item in items {
                match data.get(&item.key) {
                    Some(v) => {
                        payload.insert(
                            validate_path(volume, &item.path)?,
                            (v.clone(), mode_of(item.mode, default_mode)),
                        );
                    }
                    None if optional => {}
                    None => {
                        return Err(VolumeError::SetUp {
                            volume: volume.to_owned(),
                            reason: format!(
                                "{kind} {name:?} references non-existent {kind} key: {}",
                                item.key
                            ),
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

fn downward_items(
    volume: &str,
    payload: &mut Payload,
    facts: &PodFacts<'_>,
    items: &[DownwardAPIVolumeFile],
    default_mode: u32,
) -> Result<(), VolumeError> {
    for item in items {
        let value = if let Some(f) = &item.field_ref {
            field_value(facts, &f.field_path, true)
        } else if let Some(r) = &item.resource_field_ref {
            let spec = facts.pod.spec.as_ref();
            let container = spec.and_then(|s| {
                s.containers
                    .iter()
                    .find(|c| Some(c.name.as_str()) == r.container_name.as_deref())
            });
            match container {
                Some(c) => resource_value(facts, c, &r.resource, r.divisor.as_ref().map(|d| d.0.as_str())),
                None => {
                    return Err(VolumeError::SetUp {
                        volume: volume.to_owned(),
                        reason: format!(
                            "container {:?} not found for resourceFieldRef",
                            r.container_name.clone().unwrap_or_default()
                        ),
                    });
                }
            }
        } else {
            continue;
        }
        .map_err(|e| VolumeError::SetUp {
            volume: volume.to_owned(),
            reason: e.to_string(),
        })?;
        payload.insert(
            validate_path(volume, &item.path)?,
            (value.into_bytes(), mode_of(item.mode, default_mode)),
        );
    }
    Ok(())
}

impl Volumes {
    /// No volumes yet; `root` is `<pod dir>/volumes`.
    #[must_use]
    pub fn new(root: PathBuf) -> Self {
        Self {
            root,
            mounted: Vec::new(),
            written: BTreeMap::new(),
            tokens: BTreeMap::new(),
        }
    }

    /// The volumes set up so far.
    #[must_use]
    pub fn mounted(&self) -> &[Mounted] {
        &self.mounted
    }

    /// Sets up every volume of the pod (or refreshes projections that
    /// changed and tokens that are due).
    ///
    /// # Errors
    /// The first volume that cannot be set up.
    pub async fn sync(&mut self, ctx: &Context<'_>) -> Result<(), VolumeError> {
        let pod = ctx.facts.pod;
        let volumes: Vec<Volume> = pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.clone())
            .unwrap_or_default();
        let mut mounted = Vec::with_capacity(volumes.len());
        for v in &volumes {
            mounted.push(self.sync_one(ctx, v).await?);
        }
        self.mounted = mounted;
        Ok(())
    }

    async fn sync_one(&mut self, ctx: &Context<'_>, v: &Volume) -> Result<Mounted, VolumeError> {
        let name = v.name.clone();
        let dir = self.root.join(&name);
        if v.empty_dir.is_some() {
            if !dir.exists() {
                std::fs::create_dir_all(&dir).map_err(io_err(&name, &dir))?;
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777))
                    .map_err(io_err(&name, &dir))?;
            }
            return Ok(Mounted {
                name,
                path: dir,
                projected: false,
            });
        }
        if let Some(h) = &v.host_path {
            let path = PathBuf::from(&h.path);
            let kind = h.type_.as_deref().unwrap_or("");
            let exists = path.exists();
            match kind {
                "DirectoryOrCreate" if !exists => {
                    std::fs::create_dir_all(&path).map_err(io_err(&name, &path))?;
                }
                "FileOrCreate" if !exists => {
                    std::fs::File::create(&path).map_err(io_err(&name, &path))?;
                }
                "Directory" if !path.is_dir() => {
                    return Err(VolumeError::SetUp {
                        volume: name,
                        reason: format!("hostPath type check failed: {} is not a directory", h.path),
                    });
                }
                "File" if !path.is_file() => {
                    return Err(VolumeError::SetUp {
                        volume: name,
                        reason: format!("hostPath type check failed: {} is not a file", h.path),
                    });
                }
                _ => {}
            }
            return Ok(Mounted {
                name,
                path,
                projected: false,
            });
        }
        let payload = self.payload(ctx, v).await?;
        if self.written.get(&name) != Some(&payload) {
            write_atomic(&name, &dir, &payload)?;
            self.written.insert(name.clone(), payload);
        }
        Ok(Mounted {
            name,
            path: dir,
            projected: true,
        })
    }

    async fn payload(&mut self, ctx: &Context<'_>, v: &Volume) -> Result<Payload, VolumeError> {
        let volume = v.name.as_str();
        let ns = ctx.facts.pod.metadata.namespace.clone().unwrap_or_default();
        let mut payload = Payload::new();
        let setup = |reason: String| VolumeError::SetUp {
            volume: volume.to_owned(),
            reason,
        };
        if let Some(cm) = &v.config_map {
            let mode = mode_of(cm.default_mode, DEFAULT_MODE);
            let optional = cm.optional == Some(true);
            match get_config_map(ctx.client, &ns, &cm.name).await.map_err(setup)? {
                Some(obj) => add_keys(
                    volume,
                    &mut payload,
                    &config_map_data(&obj),
                    &KeySource {
                        kind: "configmap",
                        name: &cm.name,
                        optional,
                        items: cm.items.as_deref(),
                    },
                    mode,
                )?,
                None if optional => {}
                None => return Err(setup(format!("configmap {:?} not found", cm.name))),
            }
        } else if let Some(s) = &v.secret {
            let mode = mode_of(s.default_mode, DEFAULT_MODE);
            let name = s.secret_name.clone().unwrap_or_default();
            let optional = s.optional == Some(true);
            match get_secret(ctx.client, &ns, &name).await.map_err(setup)? {
                Some(obj) => add_keys(
                    volume,
                    &mut payload,
                    &secret_data(&obj),
                    &KeySource {
                        kind: "secret",
                        name: &name,
                        optional,
                        items: s.items.as_deref(),
                    },
                    mode,
                )?,
                None if optional => {}
                None => return Err(setup(format!("secret {name:?} not found"))),
            }
        } else if let Some(d) = &v.downward_api {
            let mode = mode_of(d.default_mode, DEFAULT_MODE);
            downward_items(
                volume,
                &mut payload,
                ctx.facts,
                d.items.as_deref().unwrap_or(&[]),
                mode,
            )?;
        } else if let Some(p) = &v.projected {
            let mode = mode_of(p.default_mode, DEFAULT_MODE);
            for source in p.sources.iter().flatten() {
                if let Some(cm) = &source.config_map {
                    let optional = cm.optional == Some(true);
                    match get_config_map(ctx.client, &ns, &cm.name).await.map_err(setup)? {
                        Some(obj) => add_keys(
                            volume,
                            &mut payload,
                            &config_map_data(&obj),
                            &KeySource {
                                kind: "configmap",
                                name: &cm.name,
                                optional,
                                items: cm.items.as_deref(),
                            },
                            mode,
                        )?,
                        None if optional => {}
                        None => return Err(setup(format!("configmap {:?} not found", cm.name))),
                    }
                } else if let Some(s) = &source.secret {
                    let optional = s.optional == Some(true);
                    match get_secret(ctx.client, &ns, &s.name).await.map_err(setup)? {
                        Some(obj) => add_keys(
                            volume,
                            &mut payload,
                            &secret_data(&obj),
                            &KeySource {
                                kind: "secret",
                                name: &s.name,
                                optional,
                                items: s.items.as_deref(),
                            },
                            mode,
                        )?,
                        None if optional => {}
                        None => return Err(setup(format!("secret {:?} not found", s.name))),
                    }
                } else if let Some(d) = &source.downward_api {
                    downward_items(
                        volume,
                        &mut payload,
                        ctx.facts,
                        d.items.as_deref().unwrap_or(&[]),
                        mode,
                    )?;
                } else if let Some(t) = &source.service_account_token {
                    let path = validate_path(volume, &t.path)?;
                    let token = self
                        .token(
                            ctx,
                            &ns,
                            volume,
                            &t.path,
                            t.audience.as_deref(),
                            t.expiration_seconds,
                        )
                        .await
                        .map_err(setup)?;
                    // Tokens are readable by the owner only unless the pod says otherwise.
                    let token_mode = if p.default_mode.is_some() { mode } else { 0o600 };
                    payload.insert(path, (token.into_bytes(), token_mode));
                } else if source.cluster_trust_bundle.is_some() {
                    return Err(VolumeError::Unsupported {
                        volume: volume.to_owned(),
                        kind: "clusterTrustBundle projection",
                    });
                }
            }
        } else {
            return Err(VolumeError::Unsupported {
                volume: volume.to_owned(),
                kind: volume_kind(v),
            });
        }
        Ok(payload)
    }

    async fn token(
        &mut self,
        ctx: &Context<'_>,
        ns: &str,
        volume: &str,
        path: &str,
        audience: Option<&str>,
        expiration: Option<i64>,
    ) -> Result<String, String> {
        let key = (volume.to_owned(), path.to_owned());
        let now = Timestamp::now();
        if let Some(t) = self.tokens.get(&key)
            && !t.needs_refresh(now)
        {
            return Ok(t.token.clone());
        }
        let pod = ctx.facts.pod;
        let sa = pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into());
        let seconds = expiration.unwrap_or(3600).max(600);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: audience.map(|a| vec![a.to_owned()]).unwrap_or_default(),
                expiration_seconds: Some(seconds),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: pod.metadata.name.clone(),
                    uid: pod.metadata.uid.clone(),
                }),
            },
            ..TokenRequest::default()
        };
        let api: Api<ServiceAccount> = Api::namespaced(ctx.client.clone(), ns);
        let answer: TokenRequest = api
            .create_subresource("token", &sa, &PostParams::default(), &request)
            .await
            .map_err(|e| format!("failed to fetch token: {e}"))?;
        let status = answer
            .status
            .ok_or_else(|| "failed to fetch token: the TokenRequest has no status".to_owned())?;
        let expires = status.expiration_timestamp.0;
        let issued = expires - Duration::from_secs(u64::try_from(seconds).unwrap_or(3600));
        self.tokens.insert(
            key,
            Token {
                token: status.token.clone(),
                issued,
                expires,
            },
        );
        Ok(status.token)
    }
}

/// The API name of a volume source this kubelet does not support.
fn volume_kind(v: &Volume) -> &'static str {
    if v.persistent_volume_claim.is_some() {
        "persistentVolumeClaim"
    } else if v.ephemeral.is_some() {
        "ephemeral"
    } else if v.csi.is_some() {
        "csi"
    } else if v.nfs.is_some() {
        "nfs"
    } else if v.image.is_some() {
        "image"
    } else {
        "this kind of"
    }
}

async fn get_config_map(client: &kube::Client, ns: &str, name: &str) -> Result<Option<ConfigMap>, String> {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|e| format!("getting configmap {name:?}: {e}"))
}

async fn get_secret(client: &kube::Client, ns: &str, name: &str) -> Result<Option<Secret>, String> {
    Api::<Secret>::namespaced(client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|e| format!("getting secret {name:?}: {e}"))
}

/// Writes `payload` into `dir` the way the kubelet's atomic writer does.
///
/// # Errors
/// [`VolumeError::Io`].
pub fn write_atomic(volume: &str, dir: &Path, payload: &Payload) -> Result<(), VolumeError> {
    std::fs::create_dir_all(dir).map_err(io_err(volume, dir))?;
    let previous = std::fs::read_link(dir.join("..data")).ok();
    let stamp = Timestamp::now().strftime("%Y_%m_%d_%H_%M_%S").to_string();
    let data_name = format!("..{stamp}.{:09}", rand::random_range(0..1_000_000_000u32));
    let data_dir = dir.join(&data_name);
    std::fs::create_dir(&data_dir).map_err(io_err(volume, &data_dir))?;
    std::fs::set_permissions(&data_dir, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err(volume, &data_dir))?;
    for (rel, (bytes, mode)) in payload {
        let path = data_dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(volume, parent))?;
        }
        std::fs::write(&path, bytes).map_err(io_err(volume, &path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(*mode))
            .map_err(io_err(volume, &path))?;
    }
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&data_name, &tmp).map_err(io_err(volume, &tmp))?;
    std::fs::rename(&tmp, dir.join("..data")).map_err(io_err(volume, dir))?;
    // User-visible names link into `..data`.
    let tops: std::collections::BTreeSet<String> = payload
        .keys()
        .filter_map(|p| p.components().next())
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    for top in &tops {
        let link = dir.join(top);
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink(Path::new("..data").join(top), &link)
                .map_err(io_err(volume, &link))?;
        }
    }
    for entry in std::fs::read_dir(dir).map_err(io_err(volume, dir))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("..") {
            continue;
        }
        if !tops.contains(&name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if let Some(old) = previous
        && old != Path::new(&data_name)
    {
        let _ = std::fs::remove_dir_all(dir.join(old));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("skipper-vol-test-{:016x}", rand::random::<u64>()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_atomic_writer_swaps_data_and_links_top_level_names() {
        let dir = temp_dir().join("vol");
        let mut p = Payload::new();
        p.insert("a".into(), (b"one".to_vec(), 0o644));
        p.insert("sub/b".into(), (vec![0, 159, 146, 150], 0o400));
        write_atomic("v", &dir, &p).unwrap();
        assert_eq!(std::fs::read(dir.join("a")).unwrap(), b"one");
        assert_eq!(
            std::fs::read(dir.join("sub/b")).unwrap(),
            [0, 159, 146, 150],
            "exact bytes"
        );
        let mode = std::fs::metadata(dir.join("sub/b")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o400);
        assert_eq!(std::fs::read_link(dir.join("a")).unwrap(), Path::new("..data/a"));
        let first = std::fs::read_link(dir.join("..data")).unwrap();

        let mut p2 = Payload::new();
        p2.insert("a".into(), (b"two".to_vec(), 0o644));
        write_atomic("v", &dir, &p2).unwrap();
        assert_eq!(std::fs::read(dir.join("a")).unwrap(), b"two");
        assert!(
            std::fs::symlink_metadata(dir.join("sub")).is_err(),
            "removed keys disappear"
        );
        assert!(!dir.join(first).exists(), "the old data directory is gone");
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    }

    #[test]
    fn paths_must_stay_inside_the_volume() {
        assert!(validate_path("v", "ok/file").is_ok());
        for bad in ["", "/abs", "../up", "a/../b", "..data"] {
            assert!(validate_path("v", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn items_select_and_rename_keys() {
        let data: BTreeMap<String, Vec<u8>> = [
            ("k1".to_owned(), b"v1".to_vec()),
            ("k2".to_owned(), b"v2".to_vec()),
        ]
        .into();
        let items: Vec<KeyToPath> = vec![KeyToPath {
            key: "k2".into(),
            path: "dir/two".into(),
            mode: Some(0o600),
        }];
        let mut p = Payload::new();
        let source = |items| KeySource {
            kind: "configmap",
            name: "cm",
            optional: false,
            items,
        };
        add_keys("v", &mut p, &data, &source(Some(&items)), 0o644).unwrap();
        assert_eq!(p.len(), 1);
        assert_eq!(p[Path::new("dir/two")], (b"v2".to_vec(), 0o600));
        let missing = vec![KeyToPath {
            key: "nope".into(),
            path: "x".into(),
            mode: None,
        }];
        let err = add_keys("v", &mut p, &data, &source(Some(&missing)), 0o644).unwrap_err();
        assert!(
            err.to_string().contains("non-existent configmap key: nope"),
            "{err}"
        );
    }

    #[test]
    fn tokens_refresh_after_eighty_percent_of_their_life() {
        let issued = Timestamp::from_second(1_000).unwrap();
        let t = Token {
            token: "t".into(),
            issued,
            expires: issued + Duration::from_secs(3600),
        };
        assert!(!t.needs_refresh(issued + Duration::from_secs(2800)));
        assert!(t.needs_refresh(issued + Duration::from_secs(2881)));
    }
}
