//! The object store: every object as JSON, one global monotonically
//! increasing resourceVersion, and a bounded event history that watches
//! replay from (older resourceVersions answer `410 Gone`).

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Value, json};
use tokio::sync::watch;

use super::error::ApiError;
use super::resources::{ResourceDef, by_kind};

/// Watch event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    /// The wire name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One change, as recorded in the history.
#[derive(Debug)]
pub struct Event {
    /// resourceVersion of the change.
    pub rv: u64,
    /// Resource of the object.
    pub res: &'static ResourceDef,
    /// Namespace of the object ("" for cluster-scoped).
    pub namespace: String,
    /// What happened.
    pub kind: EventType,
    /// The object after the change (the last state for a deletion), shared
    /// with the store.
    pub object: Arc<Value>,
    /// The object before a modification (selectors decide ADDED/DELETED from it).
    pub old: Option<Arc<Value>>,
}

type Key = (&'static str, &'static str, String, String);

/// The objects of `res` (in namespace `ns`, or in all), in key order: a
/// range of the map, as its keys start with the group and the plural (and
/// then the namespace), not a scan of every object.
fn of_resource<'a>(
    objects: &'a BTreeMap<Key, Arc<Value>>,
    res: &'static ResourceDef,
    ns: Option<&'a str>,
) -> impl Iterator<Item = (&'a Key, &'a Arc<Value>)> + 'a {
    let from: Key = (res.group, res.plural, ns.unwrap_or("").to_owned(), String::new());
    objects.range(from..).take_while(move |((g, p, n, _), _)| {
        *g == res.group && *p == res.plural && ns.is_none_or(|ns| ns == n)
    })
}

/// An object the garbage collector looks at, with its group and plural.
pub type Owned = (&'static str, &'static str, Arc<Value>);

fn key(res: &'static ResourceDef, ns: &str, name: &str) -> Key {
    (res.group, res.plural, ns.to_owned(), name.to_owned())
}

struct Inner {
    rv: u64,
    /// Shared: the control loops read snapshots of every object many
    /// times a second, and a snapshot holds references, not copies.
    objects: BTreeMap<Key, Arc<Value>>,
    log: VecDeque<Arc<Event>>,
    /// Every event with a resourceVersion above this is still in `log`.
    floor: u64,
    history: usize,
}

/// The store shared by the API server, the controllers and the kubelet.
pub struct Store {
    inner: Mutex<Inner>,
    rv_tx: watch::Sender<u64>,
}

/// The current time as Kubernetes writes it (RFC 3339, seconds, UTC).
#[must_use]
pub fn now_rfc3339() -> String {
    jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// A random RFC 4122 version 4 UID.
#[must_use]
pub fn new_uid() -> String {
    let b: [u8; 16] = rand::random();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        u32::from_be_bytes([b[0], b[1], b[2], b[3]]),
        u16::from_be_bytes([b[4], b[5]]),
        u16::from_be_bytes([b[6], b[7]]) & 0x0fff,
        (u16::from_be_bytes([b[8], b[9]]) & 0x3fff) | 0x8000,
        u64::from_be_bytes([0, 0, b[10], b[11], b[12], b[13], b[14], b[15]]),
    )
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHABET[rand::random_range(0..ALPHABET.len())] as char)
        .collect()
}

/// `metadata.name` of an object ("" when absent).
#[must_use]
pub fn name_of(obj: &Value) -> &str {
    obj.pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// `metadata.namespace` of an object ("" when absent).
#[must_use]
pub fn namespace_of(obj: &Value) -> &str {
    obj.pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// `metadata.uid` of an object ("" when absent).
#[must_use]
pub fn uid_of(obj: &Value) -> &str {
    obj.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or("")
}

/// Whether `metadata.deletionTimestamp` is set.
#[must_use]
pub fn is_terminating(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp")
        .is_some_and(|v| !v.is_null())
}

/// `metadata.finalizers`.
#[must_use]
pub fn finalizers_of(obj: &Value) -> Vec<&str> {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|f| f.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// Whether an object being deleted may go now: no finalizers left, a pod's
/// grace period over (its kubelet confirmed), a namespace's own finalizers
/// (`spec.finalizers`) done.
fn ready_to_go(res: &'static ResourceDef, obj: &Value) -> bool {
    if !is_terminating(obj) || !finalizers_of(obj).is_empty() {
        return false;
    }
    match res.kind {
        "Pod" => obj
            .pointer("/metadata/deletionGracePeriodSeconds")
            .and_then(Value::as_i64)
            .is_none_or(|g| g <= 0),
        "Namespace" => obj
            .pointer("/spec/finalizers")
            .and_then(Value::as_array)
            .is_none_or(Vec::is_empty),
        _ => true,
    }
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

impl Store {
    /// An empty store keeping `history` events for watches.
    #[must_use]
    pub fn new(history: usize) -> Self {
        let (rv_tx, _) = watch::channel(1);
        Self {
            inner: Mutex::new(Inner {
                rv: 1,
                objects: BTreeMap::new(),
                log: VecDeque::new(),
                floor: 1,
                history: history.max(1),
            }),
            rv_tx,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (every
        // mutation is a single insert/remove), so poisoning is ignored.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notified with the newest resourceVersion after every change.
    #[must_use]
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.rv_tx.subscribe()
    }

    /// The newest resourceVersion.
    #[must_use]
    pub fn current_rv(&self) -> u64 {
        self.lock().rv
    }

    /// Forgets the event history: watches from any older resourceVersion get `410 Gone`.
    pub fn compact(&self) {
        let mut inner = self.lock();
        inner.log.clear();
        inner.floor = inner.rv;
    }

    /// Events with a resourceVersion above `rv`.
    ///
    /// # Errors
    /// [`ApiError::Gone`] when part of that history has been dropped.
    pub fn events_since(&self, rv: u64) -> Result<Vec<Arc<Event>>, ApiError> {
        let inner = self.lock();
        if rv < inner.floor {
            return Err(ApiError::Gone {
                requested: rv,
                oldest: inner.floor,
            });
        }
        let start = inner.log.partition_point(|e| e.rv <= rv);
        Ok(inner.log.iter().skip(start).cloned().collect())
    }

    fn record(&self, inner: &mut Inner, event: Event) {
        inner.log.push_back(Arc::new(event));
        while inner.log.len() > inner.history {
            if let Some(e) = inner.log.pop_front() {
                inner.floor = e.rv;
            }
        }
        self.rv_tx.send_replace(inner.rv);
    }

    /// One object.
    #[must_use]
    pub fn get(&self, res: &'static ResourceDef, ns: &str, name: &str) -> Option<Value> {
        self.get_shared(res, ns, name).map(|v| Value::clone(&v))
    }

    /// One object as stored, shared rather than copied: for looking at it.
    #[must_use]
    pub fn get_shared(&self, res: &'static ResourceDef, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.lock().objects.get(&key(res, ns, name)).map(Arc::clone)
    }

    /// Every object of a resource (in one namespace or all), sorted by
    /// namespace and name, with the resourceVersion of the snapshot.
    #[must_use]
    pub fn list(&self, res: &'static ResourceDef, ns: Option<&str>) -> (Vec<Value>, u64) {
        let inner = self.lock();
        let items = of_resource(&inner.objects, res, ns)
            .map(|(_, v)| Value::clone(v))
            .collect();
        (items, inner.rv)
    }

    /// [`Store::list`] without copies: the objects as they are now, shared
    /// (what the control loops read on every pass).
    #[must_use]
    pub fn snapshot(&self, res: &'static ResourceDef, ns: Option<&str>) -> Vec<Arc<Value>> {
        let inner = self.lock();
        of_resource(&inner.objects, res, ns)
            .map(|(_, v)| Arc::clone(v))
            .collect()
    }

    /// Whether an object of a resource (in one namespace or all) satisfies
    /// `pred`, looked at in place: nothing is copied, and the store is
    /// locked while `pred` runs (it must not use the store).
    pub fn any(
        &self,
        res: &'static ResourceDef,
        ns: Option<&str>,
        mut pred: impl FnMut(&Value) -> bool,
    ) -> bool {
        let inner = self.lock();
        of_resource(&inner.objects, res, ns).any(|(_, v)| pred(v))
    }

    /// What the garbage collector looks at: every object that has
    /// ownerReferences or is being deleted (with group and plural), and
    /// which of the uids those references name exist. Nothing is allocated
    /// for the other objects.
    #[must_use]
    pub fn gc_view(&self) -> (HashSet<String>, Vec<Owned>) {
        let inner = self.lock();
        let mut named: HashSet<&str> = HashSet::new();
        let mut interesting = Vec::new();
        for ((g, p, _, _), v) in &inner.objects {
            let refs = v
                .pointer("/metadata/ownerReferences")
                .and_then(Value::as_array)
                .filter(|r| !r.is_empty());
            if let Some(refs) = refs {
                named.extend(refs.iter().filter_map(|r| r.get("uid").and_then(Value::as_str)));
            }
            if refs.is_some() || is_terminating(v) {
                interesting.push((*g, *p, Arc::clone(v)));
            }
        }
        let uids = if named.is_empty() {
            HashSet::new()
        } else {
            inner
                .objects
                .values()
                .map(|v| uid_of(v))
                .filter(|u| named.contains(u))
                .map(str::to_owned)
                .collect()
        };
        (uids, interesting)
    }

    /// The objects of a resource as they were at resourceVersion `rv`
    /// (current data when `rv` is the newest), rebuilt from the history.
    ///
    /// # Errors
    /// [`ApiError::ListTooOld`] when history before `rv` has been compacted away.
    pub fn list_at(
        &self,
        res: &'static ResourceDef,
        ns: Option<&str>,
        rv: u64,
    ) -> Result<Vec<Value>, ApiError> {
        let inner = self.lock();
        if rv < inner.floor {
            return Err(ApiError::ListTooOld);
        }
        let mut objects: BTreeMap<(String, String), Value> = of_resource(&inner.objects, res, ns)
            .map(|((_, _, n, name), v)| ((n.clone(), name.clone()), Value::clone(v)))
            .collect();
        for e in inner.log.iter().rev().take_while(|e| e.rv > rv) {
            if e.res != res || ns.is_some_and(|ns| ns != e.namespace) {
                continue;
            }
            let k = (e.namespace.clone(), name_of(&e.object).to_owned());
            match (e.kind, &e.old) {
                (EventType::Added, _) => {
                    objects.remove(&k);
                }
                (EventType::Modified | EventType::Deleted, Some(old)) => {
                    objects.insert(k, Value::clone(old));
                }
                (_, None) => {}
            }
        }
        Ok(objects.into_values().collect())
    }

    fn namespace_check(
        inner: &Inner,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
    ) -> Result<(), ApiError> {
        if !res.namespaced {
            return Ok(());
        }
        let nsres = by_kind("Namespace");
        match inner.objects.get(&key(nsres, "", ns)) {
            None => Err(ApiError::NamespaceNotFound(ns.to_owned())),
            Some(n) if is_terminating(n) => Err(ApiError::Terminating {
                res,
                name: name.to_owned(),
                namespace: ns.to_owned(),
            }),
            Some(_) => Ok(()),
        }
    }

    /// Creates an object (fills name from `generateName`, uid, timestamps,
    /// generation, resourceVersion).
    ///
    /// # Errors
    /// `AlreadyExists`, a missing namespace, or an invalid name.
    pub fn create(&self, res: &'static ResourceDef, ns: &str, obj: Value) -> Result<Value, ApiError> {
        self.create_with(res, ns, obj, false)
    }

    /// [`Store::create`]; with `dry_run` the object is checked and returned
    /// as it would be stored, without storing it (no resourceVersion).
    ///
    /// # Errors
    /// As [`Store::create`].
    pub fn create_with(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        mut obj: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        if !obj.is_object() {
            return Err(ApiError::BadRequest("the object must be a JSON object".into()));
        }
        if !obj.get("metadata").is_some_and(Value::is_object) {
            obj["metadata"] = json!({});
        }
        let mut inner = self.lock();
        let given = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("");
        Self::namespace_check(&inner, res, ns, given)?;
        let meta = &mut obj["metadata"];
        let name = match meta.get("name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_owned(),
            _ => match meta.get("generateName").and_then(Value::as_str) {
                Some(prefix) if !prefix.is_empty() => loop {
                    let candidate = format!("{prefix}{}", random_suffix());
                    if !inner.objects.contains_key(&key(res, ns, &candidate)) {
                        break candidate;
                    }
                },
                _ => {
                    return Err(ApiError::Invalid(format!(
                        "{} is invalid: metadata.name: Required value: name or generateName is required",
                        res.kind
                    )));
                }
            },
        };
        if res.group == "rbac.authorization.k8s.io" {
            // RBAC names are path segments (`system:discovery`).
            if name == "." || name == ".." || name.contains('/') || name.contains('%') {
                return Err(ApiError::Invalid(format!(
                    "{}.{} \"{name}\" is invalid: metadata.name: Invalid value: \"{name}\": may not contain '/' or '%' or be '.' or '..'",
                    res.kind, res.group
                )));
            }
        } else if !is_dns_subdomain(&name) {
            return Err(ApiError::InvalidFields {
                res,
                errors: vec![super::validation::FieldError::invalid(
                    "metadata.name".into(),
                    &json!(name),
                    super::validation::SUBDOMAIN_MESSAGE,
                )],
                name,
            });
        }
        if let Some(given) = meta.get("namespace").and_then(Value::as_str)
            && res.namespaced
            && !given.is_empty()
            && given != ns
        {
            return Err(ApiError::BadRequest(
                "the namespace of the provided object does not match the namespace sent on the request"
                    .into(),
            ));
        }
        let k = key(res, ns, &name);
        if inner.objects.contains_key(&k) {
            return Err(ApiError::AlreadyExists { res, name });
        }
        let rv = inner.rv + 1;
        meta["name"] = json!(name);
        if res.namespaced {
            meta["namespace"] = json!(ns);
        } else if let Some(m) = meta.as_object_mut() {
            m.remove("namespace");
        }
        meta["uid"] = json!(new_uid());
        meta["creationTimestamp"] = json!(now_rfc3339());
        meta["resourceVersion"] = json!(rv.to_string());
        meta["generation"] = json!(1);
        if let Some(m) = meta.as_object_mut() {
            m.remove("deletionTimestamp");
            m.remove("deletionGracePeriodSeconds");
        }
        obj["apiVersion"] = json!(res.api_version());
        obj["kind"] = json!(res.kind);
        apply_defaults(res, &mut obj);
        let invalid = super::validation::validate(res, &obj);
        if !invalid.is_empty() {
            return Err(ApiError::InvalidFields {
                res,
                name,
                errors: invalid,
            });
        }
        if dry_run {
            if let Some(m) = obj["metadata"].as_object_mut() {
                m.remove("resourceVersion");
            }
            return Ok(obj);
        }
        inner.rv = rv;
        let shared = Arc::new(obj);
        inner.objects.insert(k, shared.clone());
        self.record(
            &mut inner,
            Event {
                rv,
                res,
                namespace: ns.to_owned(),
                kind: EventType::Added,
                object: shared.clone(),
                old: None,
            },
        );
        Ok(Value::clone(&shared))
    }

    /// Read-modify-write of one object under the store lock. `f` edits a copy;
    /// a `metadata.resourceVersion` left in the copy that differs from the
    /// stored one is a conflict. Identity fields are kept; `generation` grows
    /// when `spec` changes; an unchanged object keeps its resourceVersion.
    ///
    /// # Errors
    /// `NotFound`, `Conflict`, or whatever `f` returns.
    pub fn update<F>(&self, res: &'static ResourceDef, ns: &str, name: &str, f: F) -> Result<Value, ApiError>
    where
        F: FnOnce(&mut Value) -> Result<(), ApiError>,
    {
        self.update_with(res, ns, name, false, f)
    }

    /// [`Store::update`]; with `dry_run` the result is computed and returned
    /// without storing it.
    ///
    /// # Errors
    /// As [`Store::update`].
    pub fn update_with<F>(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        dry_run: bool,
        f: F,
    ) -> Result<Value, ApiError>
    where
        F: FnOnce(&mut Value) -> Result<(), ApiError>,
    {
        let mut inner = self.lock();
        let k = key(res, ns, name);
        // Borrowed until the commit, which takes it out of the map.
        let Some(old) = inner.objects.get(&k).map(|v| &**v) else {
            return Err(ApiError::NotFound {
                res,
                name: name.to_owned(),
            });
        };
        let mut new = old.clone();
        f(&mut new)?;
        if !new.get("metadata").is_some_and(Value::is_object) {
            new["metadata"] = json!({});
        }
        default_spec(res, &mut new);
        if is_terminating(old) {
            let before = finalizers_of(old);
            let added: Vec<&str> = finalizers_of(&new)
                .into_iter()
                .filter(|f| !before.contains(f))
                .collect();
            if !added.is_empty() {
                let quoted: Vec<String> = added.iter().map(|f| format!("{f:?}")).collect();
                return Err(ApiError::Invalid(format!(
                    "{} {name:?} is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{{{}}}",
                    res.kind,
                    quoted.join(", ")
                )));
            }
        }
        let old_rv = old
            .pointer("/metadata/resourceVersion")
            .cloned()
            .unwrap_or(Value::Null);
        match new.pointer("/metadata/resourceVersion") {
            Some(Value::String(s)) if !s.is_empty() && Some(s.as_str()) != old_rv.as_str() => {
                return Err(ApiError::Conflict {
                    res,
                    name: name.to_owned(),
                });
            }
            _ => {}
        }
        if new
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .is_some_and(|n| n != name)
        {
            return Err(ApiError::BadRequest(
                "the name of the object does not match the name on the URL".into(),
            ));
        }
        for field in [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ] {
            match old["metadata"].get(field) {
                Some(v) => new["metadata"][field] = v.clone(),
                None => {
                    if let Some(m) = new["metadata"].as_object_mut() {
                        m.remove(field);
                    }
                }
            }
        }
        new["apiVersion"] = json!(res.api_version());
        new["kind"] = json!(res.kind);
        let generation = old
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or(1);
        new["metadata"]["generation"] = json!(if new.get("spec") == old.get("spec") {
            generation
        } else {
            generation + 1
        });
        new["metadata"]["resourceVersion"] = old_rv;
        if &new == old {
            return Ok(new);
        }
        let invalid = super::validation::validate_update(res, old, &new);
        if !invalid.is_empty() {
            return Err(ApiError::InvalidFields {
                res,
                name: name.to_owned(),
                errors: invalid,
            });
        }
        if dry_run {
            return Ok(new);
        }
        if ready_to_go(res, &new) {
            // The last finalizer is gone: the deletion completes.
            return Ok(self.commit_deleted(&mut inner, res, ns, &k, new));
        }
        Ok(self.commit_modified(&mut inner, res, ns, k, new))
    }

    /// Marks an object as being deleted (`deletionTimestamp`, no grace
    /// period) and adds `finalizer` (`foregroundDeletion`, `orphan`) when
    /// given; an object already marked keeps its timestamp. Without
    /// finalizers the object goes at once.
    ///
    /// # Errors
    /// `NotFound`, or `Conflict` when `uid` does not match.
    pub fn delete_with_finalizer(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        uid: Option<&str>,
        finalizer: Option<&str>,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let k = key(res, ns, name);
        let Some(old) = inner.objects.get(&k).map(|v| Value::clone(v)) else {
            return Err(ApiError::NotFound {
                res,
                name: name.to_owned(),
            });
        };
        if uid.is_some_and(|u| u != uid_of(&old)) {
            return Err(ApiError::Conflict {
                res,
                name: name.to_owned(),
            });
        }
        let mut new = old.clone();
        if !is_terminating(&new) {
            new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        }
        new["metadata"]["deletionGracePeriodSeconds"] = json!(0);
        if res.kind == "Namespace" {
            new["status"]["phase"] = json!("Terminating");
        }
        if let Some(f) = finalizer
            && !finalizers_of(&new).contains(&f)
        {
            match new["metadata"]["finalizers"].as_array_mut() {
                Some(list) => list.push(json!(f)),
                None => new["metadata"]["finalizers"] = json!([f]),
            }
        }
        if ready_to_go(res, &new) {
            return Ok(self.commit_deleted(&mut inner, res, ns, &k, new));
        }
        if new == old {
            return Ok(new);
        }
        Ok(self.commit_modified(&mut inner, res, ns, k, new))
    }

    /// Removes the object at `k` (last seen as `obj`) under the next
    /// resourceVersion and records the `DELETED` event.
    fn commit_deleted(
        &self,
        inner: &mut Inner,
        res: &'static ResourceDef,
        ns: &str,
        k: &Key,
        mut obj: Value,
    ) -> Value {
        let before = inner.objects.remove(k).unwrap_or_else(|| Arc::new(obj.clone()));
        inner.rv += 1;
        let rv = inner.rv;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        let obj = Arc::new(obj);
        self.record(
            inner,
            Event {
                rv,
                res,
                namespace: ns.to_owned(),
                kind: EventType::Deleted,
                object: obj.clone(),
                old: Some(before),
            },
        );
        Value::clone(&obj)
    }

    /// Marks an object as terminating (`deletionTimestamp`, grace period).
    ///
    /// # Errors
    /// `NotFound`.
    pub fn mark_terminating(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        grace_seconds: i64,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let k = key(res, ns, name);
        let Some(old) = inner.objects.get(&k).map(|v| Value::clone(v)) else {
            return Err(ApiError::NotFound {
                res,
                name: name.to_owned(),
            });
        };
        if is_terminating(&old) {
            return Ok(old);
        }
        let mut new = old.clone();
        new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
        new["metadata"]["deletionGracePeriodSeconds"] = json!(grace_seconds);
        Ok(self.commit_modified(&mut inner, res, ns, k, new))
    }

    /// Stores `new` in place of the object at `k` under the next
    /// resourceVersion and records the `MODIFIED` event (with the object
    /// it replaced); returns the stored object.
    fn commit_modified(
        &self,
        inner: &mut Inner,
        res: &'static ResourceDef,
        ns: &str,
        k: Key,
        mut new: Value,
    ) -> Value {
        inner.rv += 1;
        let rv = inner.rv;
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        let new = Arc::new(new);
        let old = inner.objects.insert(k, new.clone());
        self.record(
            inner,
            Event {
                rv,
                res,
                namespace: ns.to_owned(),
                kind: EventType::Modified,
                object: new.clone(),
                old,
            },
        );
        Value::clone(&new)
    }

    /// Deletes an object: it goes for good (emits `DELETED`) unless it has
    /// finalizers, which keep it, marked with a `deletionTimestamp`, until
    /// an update removes the last one. When `uid` is given, only that
    /// incarnation is deleted.
    ///
    /// # Errors
    /// `NotFound`.
    pub fn remove(
        &self,
        res: &'static ResourceDef,
        ns: &str,
        name: &str,
        uid: Option<&str>,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let k = key(res, ns, name);
        let matches = inner
            .objects
            .get(&k)
            .is_some_and(|o| uid.is_none_or(|u| uid_of(o) == u));
        if !matches {
            return Err(ApiError::NotFound {
                res,
                name: name.to_owned(),
            });
        }
        let Some(obj) = inner.objects.get(&k).map(|v| Value::clone(v)) else {
            return Err(ApiError::NotFound {
                res,
                name: name.to_owned(),
            });
        };
        if !finalizers_of(&obj).is_empty() {
            // Finalizers hold the object: it is only marked.
            let mut marked = obj.clone();
            if !is_terminating(&marked) {
                marked["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            }
            marked["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            if marked == obj {
                return Ok(obj);
            }
            return Ok(self.commit_modified(&mut inner, res, ns, k, marked));
        }
        Ok(self.commit_deleted(&mut inner, res, ns, &k, obj))
    }

    /// Every (resource, namespace, name) in a namespace (used to empty a deleted namespace).
    #[must_use]
    pub fn keys_in_namespace(&self, ns: &str) -> Vec<(&'static str, &'static str, String)> {
        self.lock()
            .objects
            .keys()
            .filter(|(_, _, n, _)| n == ns)
            .map(|(g, p, _, name)| (*g, *p, name.clone()))
            .collect()
    }
}

/// Container defaults of a real API server (port protocol, probe timings).
fn default_container(c: &mut Value) {
    if let Some(ports) = c.get_mut("ports").and_then(Value::as_array_mut) {
        for p in ports {
            if p.get("protocol").is_none() {
                p["protocol"] = json!("TCP");
            }
        }
    }
    for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
        if let Some(pr) = c.get_mut(probe).filter(|p| p.is_object()) {
            for (field, value) in [
                ("timeoutSeconds", 1),
                ("periodSeconds", 10),
                ("successThreshold", 1),
                ("failureThreshold", 3),
            ] {
                if pr.get(field).is_none() {
                    pr[field] = json!(value);
                }
            }
            if let Some(h) = pr.get_mut("httpGet").filter(|h| h.get("scheme").is_none()) {
                h["scheme"] = json!("HTTP");
            }
        }
    }
    if c.get("imagePullPolicy").is_none_or(|p| p.is_null() || p == "") {
        let image = c.get("image").and_then(Value::as_str).unwrap_or("");
        c["imagePullPolicy"] = json!(if image_tag(image) == "latest" {
            "Always"
        } else {
            "IfNotPresent"
        });
    }
    if c.get("terminationMessagePath").is_none() {
        c["terminationMessagePath"] = json!("/dev/termination-log");
    }
    if c.get("terminationMessagePolicy").is_none() {
        c["terminationMessagePolicy"] = json!("File");
    }
    if !c.get("resources").is_some_and(Value::is_object) {
        c["resources"] = json!({});
    }
}

/// The tag of an image reference: `latest` when it names none, empty when
/// it is pinned by digest.
fn image_tag(image: &str) -> &str {
    if image.contains('@') {
        return "";
    }
    let name = image.rsplit('/').next().unwrap_or(image);
    match name.rsplit_once(':') {
        Some((_, tag)) if !tag.is_empty() => tag,
        _ => "latest",
    }
}

/// `SetDefaults_PodSpec` and the container defaults, for a pod's `spec` or
/// a workload's `spec.template.spec`.
fn default_pod_spec(spec: &mut Value) {
    if !spec.is_object() {
        return;
    }
    for (field, value) in [
        ("restartPolicy", json!("Always")),
        ("terminationGracePeriodSeconds", json!(30)),
        ("dnsPolicy", json!("ClusterFirst")),
        ("schedulerName", json!("default-scheduler")),
        ("securityContext", json!({})),
    ] {
        if spec.get(field).is_none_or(Value::is_null) {
            spec[field] = value;
        }
    }
    for list in ["initContainers", "containers"] {
        if let Some(containers) = spec.get_mut(list).and_then(Value::as_array_mut) {
            for c in containers {
                default_container(c);
            }
        }
    }
}

/// Defaults that the API server fills in whenever it decodes an object, on
/// creates and updates alike: a Secret's `type`, the `spec` of a Pod,
/// Deployment or ReplicaSet (`SetDefaults_Secret`, `SetDefaults_PodSpec`,
/// `SetDefaults_Deployment`, `SetDefaults_ReplicaSet`).
fn default_spec(res: &'static ResourceDef, obj: &mut Value) {
    if res.kind == "Secret" && obj.get("type").is_none_or(|t| t.is_null() || t == "") {
        // SetDefaults_Secret.
        obj["type"] = json!("Opaque");
    }
    if !obj.get("spec").is_some_and(Value::is_object) {
        return;
    }
    match res.kind {
        "Pod" => {
            default_pod_spec(&mut obj["spec"]);
            return;
        }
        "Deployment" | "ReplicaSet" => {
            if let Some(template) = obj.pointer_mut("/spec/template/spec") {
                default_pod_spec(template);
            }
        }
        _ => return,
    }
    let spec = &mut obj["spec"];
    if spec.get("replicas").is_none_or(Value::is_null) {
        spec["replicas"] = json!(1);
    }
    if res.kind != "Deployment" {
        return;
    }
    if !spec.get("strategy").is_some_and(Value::is_object) {
        spec["strategy"] = json!({});
    }
    let strategy = &mut spec["strategy"];
    if strategy.get("type").is_none_or(|t| t.is_null() || t == "") {
        strategy["type"] = json!("RollingUpdate");
    }
    if strategy["type"] == "RollingUpdate" {
        if !strategy.get("rollingUpdate").is_some_and(Value::is_object) {
            strategy["rollingUpdate"] = json!({});
        }
        for bound in ["maxUnavailable", "maxSurge"] {
            if strategy["rollingUpdate"].get(bound).is_none_or(Value::is_null) {
                strategy["rollingUpdate"][bound] = json!("25%");
            }
        }
    }
    for (field, value) in [("revisionHistoryLimit", 10), ("progressDeadlineSeconds", 600)] {
        if spec.get(field).is_none_or(Value::is_null) {
            spec[field] = json!(value);
        }
    }
}

/// Server-side defaults a freshly created object gets.
fn apply_defaults(res: &'static ResourceDef, obj: &mut Value) {
    match res.kind {
        "Pod" => {
            if !obj.get("status").is_some_and(Value::is_object) {
                obj["status"] = json!({});
            }
            obj["status"]["phase"] = json!("Pending");
            obj["status"]["qosClass"] = json!("BestEffort");
            if obj.pointer("/spec/serviceAccountName").is_none() {
                obj["spec"]["serviceAccountName"] = json!("default");
            }
            default_spec(res, obj);
        }
        "Namespace" => {
            obj["status"] = json!({"phase": "Active"});
            obj["spec"] = json!({"finalizers": ["kubernetes"]});
        }
        "Deployment" | "ReplicaSet" => {
            default_spec(res, obj);
            if obj.pointer("/metadata/labels").is_none()
                && let Some(labels) = obj.pointer("/spec/template/metadata/labels").cloned()
            {
                obj["metadata"]["labels"] = labels;
            }
            if !obj.get("status").is_some_and(Value::is_object) {
                obj["status"] = json!({});
            }
        }
        "Service" if obj.pointer("/spec/type").is_none() => {
            obj["spec"]["type"] = json!("ClusterIP");
        }
        _ => default_spec(res, obj),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cm(name: &str) -> Value {
        json!({"metadata": {"name": name}, "data": {"k": "v"}})
    }

    fn store_with_ns(history: usize) -> Store {
        let s = Store::new(history);
        s.create(by_kind("Namespace"), "", json!({"metadata": {"name": "ns"}}))
            .unwrap();
        s
    }

    fn rv(obj: &Value) -> u64 {
        obj["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap()
    }

    #[test]
    fn resource_versions_grow_and_unchanged_updates_keep_theirs() {
        let s = store_with_ns(100);
        let res = by_kind("ConfigMap");
        let a = s.create(res, "ns", cm("a")).unwrap();
        let b = s.create(res, "ns", cm("b")).unwrap();
        assert!(rv(&b) > rv(&a));
        assert_eq!(a["metadata"]["generation"], 1);
        let same = s.update(res, "ns", "a", |_| Ok(())).unwrap();
        assert_eq!(rv(&same), rv(&a), "a no-op update is not a change");
        let changed = s
            .update(res, "ns", "a", |o| {
                o["data"]["k"] = json!("w");
                Ok(())
            })
            .unwrap();
        assert!(rv(&changed) > rv(&b));
        assert_eq!(
            changed["metadata"]["uid"], a["metadata"]["uid"],
            "identity is kept"
        );
    }

    #[test]
    fn stale_resource_versions_conflict_and_duplicates_already_exist() {
        let s = store_with_ns(100);
        let res = by_kind("ConfigMap");
        let a = s.create(res, "ns", cm("a")).unwrap();
        s.update(res, "ns", "a", |o| {
            o["data"]["k"] = json!("x");
            Ok(())
        })
        .unwrap();
        let err = s
            .update(res, "ns", "a", |o| {
                o["metadata"]["resourceVersion"] = a["metadata"]["resourceVersion"].clone();
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(err, ApiError::Conflict { .. }));
        assert!(matches!(
            s.create(res, "ns", cm("a")),
            Err(ApiError::AlreadyExists { .. })
        ));
        assert!(matches!(
            s.create(res, "missing", cm("a")),
            Err(ApiError::NamespaceNotFound(_))
        ));
        assert!(matches!(
            s.create(res, "ns", cm("Bad_Name")),
            Err(ApiError::InvalidFields { .. })
        ));
    }

    #[test]
    fn generate_name_and_spec_changes_bump_generation() {
        let s = store_with_ns(100);
        let res = by_kind("Deployment");
        let d = s
            .create(
                res,
                "ns",
                json!({"metadata": {"generateName": "web-"}, "spec": {"replicas": 1}}),
            )
            .unwrap();
        let name = name_of(&d).to_owned();
        assert!(name.starts_with("web-") && name.len() == 9, "{name}");
        let d = s
            .update(res, "ns", &name, |o| {
                o["spec"]["replicas"] = json!(2);
                Ok(())
            })
            .unwrap();
        assert_eq!(d["metadata"]["generation"], 2);
        let d = s
            .update(res, "ns", &name, |o| {
                o["status"] = json!({"replicas": 2});
                Ok(())
            })
            .unwrap();
        assert_eq!(
            d["metadata"]["generation"], 2,
            "status changes keep the generation"
        );
    }

    #[test]
    fn secrets_without_a_type_are_opaque_on_every_write() {
        let s = store_with_ns(100);
        let secrets = by_kind("Secret");
        let created = s
            .create(
                secrets,
                "ns",
                json!({"metadata": {"name": "s"}, "data": {"k": "dg=="}}),
            )
            .unwrap();
        assert_eq!(created["type"], "Opaque");
        let updated = s
            .update_with(secrets, "ns", "s", false, |o| {
                o["type"] = json!("");
                Ok(())
            })
            .unwrap();
        assert_eq!(updated["type"], "Opaque");
        let tls = s
            .create(
                secrets,
                "ns",
                json!({"metadata": {"name": "t"}, "type": "kubernetes.io/tls"}),
            )
            .unwrap();
        assert_eq!(tls["type"], "kubernetes.io/tls");
    }

    #[test]
    fn deployments_get_their_spec_defaults_on_every_write() {
        let s = store_with_ns(100);
        let res = by_kind("Deployment");
        let d = s
            .create(res, "ns", json!({"metadata": {"name": "web"}, "spec": {}}))
            .unwrap();
        let defaulted = json!({
            "replicas": 1,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}},
            "revisionHistoryLimit": 10,
            "progressDeadlineSeconds": 600,
        });
        assert_eq!(d["spec"], defaulted);
        let d = s
            .update(res, "ns", "web", |o| {
                o["spec"]["strategy"] = json!({"rollingUpdate": {"maxSurge": 1}});
                o["spec"]["revisionHistoryLimit"] = Value::Null;
                Ok(())
            })
            .unwrap();
        assert_eq!(
            d["spec"]["strategy"],
            json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": 1}})
        );
        assert_eq!(d["spec"]["revisionHistoryLimit"], 10);
        let d = s
            .update(res, "ns", "web", |o| {
                o["spec"]["strategy"] = json!({"type": "Recreate"});
                Ok(())
            })
            .unwrap();
        assert_eq!(d["spec"]["strategy"], json!({"type": "Recreate"}));
    }

    #[test]
    fn finalizers_hold_a_deleted_object_until_the_last_one_goes() {
        let s = store_with_ns(100);
        let res = by_kind("ConfigMap");
        s.create(
            res,
            "ns",
            json!({"metadata": {"name": "held", "finalizers": ["a/x", "a/y"]}}),
        )
        .unwrap();
        let marked = s.remove(res, "ns", "held", None).unwrap();
        assert!(is_terminating(&marked));
        assert_eq!(marked["metadata"]["deletionGracePeriodSeconds"], 0);
        assert!(s.get(res, "ns", "held").is_some(), "finalizers keep it");
        let err = s
            .update(res, "ns", "held", |o| {
                o["metadata"]["finalizers"] = json!(["a/x", "a/y", "a/z"]);
                Ok(())
            })
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "ConfigMap \"held\" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{\"a/z\"}"
        );
        s.update(res, "ns", "held", |o| {
            o["metadata"]["finalizers"] = json!(["a/y"]);
            Ok(())
        })
        .unwrap();
        assert!(s.get(res, "ns", "held").is_some());
        let gone = s
            .update(res, "ns", "held", |o| {
                o["metadata"]["finalizers"] = json!([]);
                Ok(())
            })
            .unwrap();
        assert!(s.get(res, "ns", "held").is_none(), "{gone}");

        // A pod in its grace period stays without finalizers; the kubelet's
        // final delete removes it.
        let pods = by_kind("Pod");
        s.create(
            pods,
            "ns",
            json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}),
        )
        .unwrap();
        s.mark_terminating(pods, "ns", "p", 30).unwrap();
        s.update(pods, "ns", "p", |o| {
            o["status"]["phase"] = json!("Running");
            Ok(())
        })
        .unwrap();
        assert!(s.get(pods, "ns", "p").is_some());
        s.remove(pods, "ns", "p", None).unwrap();
        assert!(s.get(pods, "ns", "p").is_none());

        // Foreground: the finalizer is added and holds the object.
        s.create(res, "ns", json!({"metadata": {"name": "fg"}})).unwrap();
        let fg = s
            .delete_with_finalizer(res, "ns", "fg", None, Some("foregroundDeletion"))
            .unwrap();
        assert_eq!(fg["metadata"]["finalizers"], json!(["foregroundDeletion"]));
        assert!(s.get(res, "ns", "fg").is_some());
    }

    #[test]
    fn images_without_a_tag_or_with_latest_are_pulled_always() {
        for (image, tag) in [
            ("skipper", "latest"),
            ("skipper:latest", "latest"),
            ("registry:5000/team/skipper", "latest"),
            ("registry:5000/team/skipper:1.2", "1.2"),
            ("skipper@sha256:abc", ""),
        ] {
            assert_eq!(image_tag(image), tag, "{image}");
        }
        let s = store_with_ns(100);
        let d = s
            .create(
                by_kind("Deployment"),
                "ns",
                json!({"metadata": {"name": "d"}, "spec": {"template": {"spec": {"containers": [
                    {"name": "a", "image": "skipper"}, {"name": "b", "image": "skipper:1.2"},
                ]}}}}),
            )
            .unwrap();
        let pod = &d["spec"]["template"]["spec"];
        assert_eq!(pod["containers"][0]["imagePullPolicy"], "Always");
        assert_eq!(pod["containers"][1]["imagePullPolicy"], "IfNotPresent");
        assert_eq!(pod["dnsPolicy"], "ClusterFirst");
        assert_eq!(pod["securityContext"], json!({}));
    }

    #[test]
    fn history_replays_events_and_expires_with_gone() {
        let s = store_with_ns(3);
        let res = by_kind("ConfigMap");
        let start = s.current_rv();
        for n in ["a", "b"] {
            s.create(res, "ns", cm(n)).unwrap();
        }
        let events = s.events_since(start).unwrap();
        assert_eq!(events.len(), 2);
        assert!(events.iter().all(|e| e.kind == EventType::Added));
        s.mark_terminating(res, "ns", "a", 5).unwrap();
        s.remove(res, "ns", "a", None).unwrap();
        let kinds: Vec<EventType> = s
            .events_since(start + 1)
            .unwrap()
            .iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(kinds, [EventType::Added, EventType::Modified, EventType::Deleted]);
        assert!(
            matches!(s.events_since(start), Err(ApiError::Gone { .. })),
            "history of 3 lost the first event"
        );
        s.compact();
        assert!(matches!(s.events_since(start + 3), Err(ApiError::Gone { .. })));
        assert!(s.events_since(s.current_rv()).unwrap().is_empty());
    }

    #[test]
    fn lists_at_an_older_resource_version_rebuild_that_snapshot() {
        let s = store_with_ns(100);
        let res = by_kind("ConfigMap");
        s.create(res, "ns", cm("a")).unwrap();
        let at = s.current_rv();
        s.update(res, "ns", "a", |o| {
            o["data"]["k"] = json!("changed");
            Ok(())
        })
        .unwrap();
        s.create(res, "ns", cm("b")).unwrap();
        s.remove(res, "ns", "a", None).unwrap();
        let then = s.list_at(res, Some("ns"), at).unwrap();
        assert_eq!(then.len(), 1);
        assert_eq!(then[0]["metadata"]["name"], "a");
        assert_eq!(then[0]["data"]["k"], "v");
        let now = s.list_at(res, Some("ns"), s.current_rv()).unwrap();
        assert_eq!(now.iter().map(name_of).collect::<Vec<_>>(), ["b"]);
        s.compact();
        assert!(matches!(
            s.list_at(res, Some("ns"), at),
            Err(ApiError::ListTooOld)
        ));
    }

    #[test]
    fn remove_with_a_uid_only_removes_that_incarnation() {
        let s = store_with_ns(100);
        let res = by_kind("ConfigMap");
        s.create(res, "ns", cm("a")).unwrap();
        assert!(matches!(
            s.remove(res, "ns", "a", Some("other-uid")),
            Err(ApiError::NotFound { .. })
        ));
        assert!(s.get(res, "ns", "a").is_some());
    }
}
