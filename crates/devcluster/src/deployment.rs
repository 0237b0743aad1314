//! The Deployment controller's decisions, as kube-controller-manager makes
//! them (`pkg/controller/deployment`): which ReplicaSet is new, its revision
//! and annotations, rolling updates bounded by `maxSurge` and
//! `maxUnavailable`, `Recreate`, proportional scaling of a rollout in
//! flight, `paused`, rollback, the revision history limit, and the status
//! with its `Progressing` and `Available` conditions.
//!
//! [`sync`] is a pure function of one Deployment, the ReplicaSets it owns,
//! the live pods of each and the time; it returns the writes of one sync in
//! order ([`Action`]). The control loop carries them out and stops at the
//! first failure: the next pass plans again from what is stored, as the
//! real controller requeues.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};

use jiff::Timestamp;
use serde_json::{Map, Value, json};

/// Revision of a ReplicaSet (and of its Deployment): its place in the rollout sequence.
pub const REVISION: &str = "deployment.kubernetes.io/revision";
/// Earlier revisions a ReplicaSet served (a rollback to it appends them).
pub const REVISION_HISTORY: &str = "deployment.kubernetes.io/revision-history";
/// `spec.replicas` of the Deployment when the ReplicaSet was last scaled.
pub const DESIRED_REPLICAS: &str = "deployment.kubernetes.io/desired-replicas";
/// `spec.replicas` plus `maxSurge` of the Deployment when the ReplicaSet was last scaled.
pub const MAX_REPLICAS: &str = "deployment.kubernetes.io/max-replicas";
/// The revision to roll back to (the round trip of extensions/v1beta1 `rollbackTo`).
pub const ROLLBACK_TO: &str = "deprecated.deployment.rollback.to";
/// kubectl's client-side apply record, never copied to ReplicaSets.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";
/// Label that tells the pods of one template from another's.
pub const POD_TEMPLATE_HASH: &str = "pod-template-hash";
/// Bound on the `revision-history` annotation.
const MAX_REVISION_HISTORY_CHARS: usize = 2000;
/// Longest object name.
const MAX_NAME: usize = 253;

/// Annotations of a Deployment that are not copied to its ReplicaSets (and
/// kept on the Deployment through a rollback).
const NOT_COPIED: [&str; 6] = [
    LAST_APPLIED,
    REVISION,
    REVISION_HISTORY,
    DESIRED_REPLICAS,
    MAX_REPLICAS,
    ROLLBACK_TO,
];

/// `Progressing` reasons.
pub mod reason {
    /// A ReplicaSet of the rollout was scaled or its pods became ready.
    pub const REPLICA_SET_UPDATED: &str = "ReplicaSetUpdated";
    /// The new ReplicaSet could not be created.
    pub const FAILED_RS_CREATE: &str = "ReplicaSetCreateError";
    /// The new ReplicaSet was created.
    pub const NEW_REPLICA_SET: &str = "NewReplicaSetCreated";
    /// An existing ReplicaSet matches the template.
    pub const FOUND_NEW_RS: &str = "FoundNewReplicaSet";
    /// The rollout is complete.
    pub const NEW_RS_AVAILABLE: &str = "NewReplicaSetAvailable";
    /// No progress within `progressDeadlineSeconds`.
    pub const TIMED_OUT: &str = "ProgressDeadlineExceeded";
    /// `spec.paused` was set.
    pub const PAUSED: &str = "DeploymentPaused";
    /// `spec.paused` was cleared.
    pub const RESUMED: &str = "DeploymentResumed";
    /// Enough pods are available.
    pub const MINIMUM_AVAILABLE: &str = "MinimumReplicasAvailable";
    /// Too few pods are available.
    pub const MINIMUM_UNAVAILABLE: &str = "MinimumReplicasUnavailable";
}

/// An `IntOrString` bound: a count or a percentage of `spec.replicas`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntOrPercent {
    /// An absolute number of pods.
    Int(i64),
    /// A percentage of the desired pods.
    Percent(i64),
}

impl IntOrPercent {
    /// From JSON: a number, or a string `"N%"` (or a decimal string, as
    /// `IntOrString` decodes one). Anything else is `None`.
    #[must_use]
    pub fn from_json(v: &Value) -> Option<Self> {
        if let Some(n) = v.as_i64() {
            return Some(Self::Int(n));
        }
        let s = v.as_str()?;
        match s.strip_suffix('%') {
            Some(p) => p.parse().ok().map(Self::Percent),
            None => s.parse().ok().map(Self::Int),
        }
    }

    /// The value against `total` (`GetScaledValueFromIntOrPercent`): a
    /// percentage rounds up or down as asked.
    #[must_use]
    pub fn scaled(self, total: i64, round_up: bool) -> i64 {
        match self {
            Self::Int(n) => n,
            Self::Percent(p) => {
                // As the controller computes it, in floating point.
                #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
                let x = (p as f64) * (total as f64) / 100.0;
                #[allow(clippy::cast_possible_truncation)]
                let v = if round_up { x.ceil() } else { x.floor() } as i64;
                v
            }
        }
    }
}

/// How a Deployment replaces its pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Every old pod goes before a new one starts.
    Recreate,
    /// Old and new pods coexist within the bounds.
    RollingUpdate {
        /// Pods above `spec.replicas` allowed during the rollout.
        max_surge: IntOrPercent,
        /// Pods below `spec.replicas` allowed to be unavailable.
        max_unavailable: IntOrPercent,
    },
}

impl Strategy {
    /// From `spec.strategy` (absent parts take the API defaults: RollingUpdate, 25%, 25%).
    #[must_use]
    pub fn from_json(v: Option<&Value>) -> Self {
        let v = v.unwrap_or(&Value::Null);
        if v.get("type").and_then(Value::as_str) == Some("Recreate") {
            return Self::Recreate;
        }
        let bound = |field: &str| {
            v.pointer(&format!("/rollingUpdate/{field}"))
                .and_then(IntOrPercent::from_json)
                .unwrap_or(IntOrPercent::Percent(25))
        };
        Self::RollingUpdate {
            max_surge: bound("maxSurge"),
            max_unavailable: bound("maxUnavailable"),
        }
    }
}

/// One status condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// `Progressing`, `Available` or `ReplicaFailure`.
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// Why, in one word.
    pub reason: String,
    /// Why, in a sentence.
    pub message: String,
    /// When it was last set (RFC 3339).
    pub last_update: String,
    /// When `status` last changed (RFC 3339).
    pub last_transition: String,
}

impl Condition {
    fn new(type_: &str, status: &str, reason: &str, message: String, now: &str) -> Self {
        Self {
            type_: type_.to_owned(),
            status: status.to_owned(),
            reason: reason.to_owned(),
            message,
            last_update: now.to_owned(),
            last_transition: now.to_owned(),
        }
    }

    fn from_json(v: &Value) -> Self {
        let s = |f: &str| v.get(f).and_then(Value::as_str).unwrap_or("").to_owned();
        Self {
            type_: s("type"),
            status: s("status"),
            reason: s("reason"),
            message: s("message"),
            last_update: s("lastUpdateTime"),
            last_transition: s("lastTransitionTime"),
        }
    }

    fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("type".into(), json!(self.type_));
        m.insert("status".into(), json!(self.status));
        for (k, v) in [
            ("lastUpdateTime", &self.last_update),
            ("lastTransitionTime", &self.last_transition),
            ("reason", &self.reason),
            ("message", &self.message),
        ] {
            if !v.is_empty() {
                m.insert(k.into(), json!(v));
            }
        }
        Value::Object(m)
    }
}

fn get_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// `SetDeploymentCondition`: an unchanged status and reason leaves the
/// condition alone; an unchanged status keeps its transition time; the
/// condition moves to the end.
fn set_condition(conditions: &mut Vec<Condition>, mut c: Condition) {
    if let Some(cur) = get_condition(conditions, &c.type_) {
        if cur.status == c.status && cur.reason == c.reason {
            return;
        }
        if cur.status == c.status {
            c.last_transition.clone_from(&cur.last_transition);
        }
    }
    conditions.retain(|x| x.type_ != c.type_);
    conditions.push(c);
}

fn remove_condition(conditions: &mut Vec<Condition>, type_: &str) {
    conditions.retain(|c| c.type_ != type_);
}

/// A Deployment's status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeploymentStatus {
    pub observed_generation: i64,
    pub replicas: i64,
    pub updated_replicas: i64,
    pub ready_replicas: i64,
    pub available_replicas: i64,
    pub unavailable_replicas: i64,
    pub terminating_replicas: Option<i64>,
    pub collision_count: Option<i64>,
    pub conditions: Vec<Condition>,
}

fn int(v: &Value, field: &str) -> i64 {
    v.get(field).and_then(Value::as_i64).unwrap_or(0)
}

impl DeploymentStatus {
    /// From `status` JSON.
    #[must_use]
    pub fn from_json(v: &Value) -> Self {
        Self {
            observed_generation: int(v, "observedGeneration"),
            replicas: int(v, "replicas"),
            updated_replicas: int(v, "updatedReplicas"),
            ready_replicas: int(v, "readyReplicas"),
            available_replicas: int(v, "availableReplicas"),
            unavailable_replicas: int(v, "unavailableReplicas"),
            terminating_replicas: v.get("terminatingReplicas").and_then(Value::as_i64),
            collision_count: v.get("collisionCount").and_then(Value::as_i64),
            conditions: v
                .get("conditions")
                .and_then(Value::as_array)
                .map(|cs| cs.iter().map(Condition::from_json).collect())
                .unwrap_or_default(),
        }
    }

    /// As the API serves it (zero counts are left out).
    #[must_use]
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        for (k, v) in [
            ("observedGeneration", self.observed_generation),
            ("replicas", self.replicas),
            ("updatedReplicas", self.updated_replicas),
            ("readyReplicas", self.ready_replicas),
            ("availableReplicas", self.available_replicas),
            ("unavailableReplicas", self.unavailable_replicas),
        ] {
            if v != 0 {
                m.insert(k.into(), json!(v));
            }
        }
        if let Some(t) = self.terminating_replicas {
            m.insert("terminatingReplicas".into(), json!(t));
        }
        if !self.conditions.is_empty() {
            m.insert(
                "conditions".into(),
                Value::Array(self.conditions.iter().map(Condition::to_json).collect()),
            );
        }
        if let Some(c) = self.collision_count {
            m.insert("collisionCount".into(), json!(c));
        }
        Value::Object(m)
    }
}

/// What the controller reads of a Deployment.
#[derive(Debug, Clone, PartialEq)]
pub struct Deployment {
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    pub generation: i64,
    pub annotations: BTreeMap<String, String>,
    pub replicas: i64,
    /// `spec.selector` (a `LabelSelector` object).
    pub selector: Value,
    pub template: Value,
    pub strategy: Strategy,
    pub min_ready_seconds: i64,
    pub paused: bool,
    pub progress_deadline_seconds: Option<i64>,
    pub revision_history_limit: Option<i64>,
    pub deleting: bool,
    pub status: DeploymentStatus,
}

fn string_map(v: Option<&Value>) -> BTreeMap<String, String> {
    v.and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

fn meta_str(obj: &Value, field: &str) -> String {
    obj.pointer(&format!("/metadata/{field}"))
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_owned()
}

impl Deployment {
    /// From a stored Deployment.
    #[must_use]
    pub fn from_json(d: &Value) -> Self {
        let spec = d.get("spec").unwrap_or(&Value::Null);
        Self {
            name: meta_str(d, "name"),
            uid: meta_str(d, "uid"),
            resource_version: meta_str(d, "resourceVersion"),
            generation: d
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(0),
            annotations: string_map(d.pointer("/metadata/annotations")),
            replicas: spec.get("replicas").and_then(Value::as_i64).unwrap_or(1),
            selector: spec.get("selector").cloned().unwrap_or(Value::Null),
            template: spec.get("template").cloned().unwrap_or(Value::Null),
            strategy: Strategy::from_json(spec.get("strategy")),
            min_ready_seconds: int(spec, "minReadySeconds"),
            paused: spec.get("paused").and_then(Value::as_bool).unwrap_or(false),
            progress_deadline_seconds: spec.get("progressDeadlineSeconds").and_then(Value::as_i64),
            revision_history_limit: spec.get("revisionHistoryLimit").and_then(Value::as_i64),
            deleting: d
                .pointer("/metadata/deletionTimestamp")
                .is_some_and(|v| !v.is_null()),
            status: DeploymentStatus::from_json(d.get("status").unwrap_or(&Value::Null)),
        }
    }

    fn has_progress_deadline(&self) -> bool {
        self.progress_deadline_seconds
            .is_some_and(|s| s != i64::from(i32::MAX))
    }

    fn has_revision_history_limit(&self) -> bool {
        self.revision_history_limit
            .is_some_and(|l| l != i64::from(i32::MAX))
    }

    fn is_rolling_update(&self) -> bool {
        matches!(self.strategy, Strategy::RollingUpdate { .. })
    }

    /// `(maxSurge, maxUnavailable)` resolved against `spec.replicas`
    /// (`ResolveFenceposts`): surge rounds up, unavailability down, and when
    /// both come to zero one pod may be unavailable.
    #[must_use]
    pub fn fenceposts(&self) -> (i64, i64) {
        let Strategy::RollingUpdate {
            max_surge,
            max_unavailable,
        } = self.strategy
        else {
            return (0, 0);
        };
        let surge = max_surge.scaled(self.replicas, true);
        let mut unavailable = max_unavailable.scaled(self.replicas, false);
        if surge == 0 && unavailable == 0 {
            unavailable = 1;
        }
        (surge, unavailable)
    }

    /// Pods above `spec.replicas` a rollout may run.
    #[must_use]
    pub fn max_surge(&self) -> i64 {
        if self.is_rolling_update() {
            self.fenceposts().0
        } else {
            0
        }
    }

    /// Pods below `spec.replicas` a rollout may leave unavailable.
    #[must_use]
    pub fn max_unavailable(&self) -> i64 {
        if !self.is_rolling_update() || self.replicas == 0 {
            return 0;
        }
        self.fenceposts().1.min(self.replicas)
    }

    fn rollback_to(&self) -> Option<i64> {
        self.annotations.get(ROLLBACK_TO)?.parse().ok()
    }
}

/// A ReplicaSet's status, as the controller reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaSetStatus {
    pub replicas: i64,
    pub ready_replicas: i64,
    pub available_replicas: i64,
    pub terminating_replicas: Option<i64>,
    pub observed_generation: i64,
    /// Its `ReplicaFailure` condition, if any.
    pub failure: Option<Condition>,
}

/// What the controller reads of a ReplicaSet.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaSet {
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    pub created: Timestamp,
    pub generation: i64,
    pub annotations: BTreeMap<String, String>,
    pub replicas: i64,
    pub min_ready_seconds: i64,
    pub template: Value,
    pub deleting: bool,
    pub status: ReplicaSetStatus,
}

impl ReplicaSet {
    /// From a stored ReplicaSet.
    #[must_use]
    pub fn from_json(rs: &Value) -> Self {
        let spec = rs.get("spec").unwrap_or(&Value::Null);
        let status = rs.get("status").unwrap_or(&Value::Null);
        Self {
            name: meta_str(rs, "name"),
            uid: meta_str(rs, "uid"),
            resource_version: meta_str(rs, "resourceVersion"),
            created: meta_str(rs, "creationTimestamp")
                .parse()
                .unwrap_or(Timestamp::UNIX_EPOCH),
            generation: rs
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(0),
            annotations: string_map(rs.pointer("/metadata/annotations")),
            replicas: spec.get("replicas").and_then(Value::as_i64).unwrap_or(1),
            min_ready_seconds: int(spec, "minReadySeconds"),
            template: spec.get("template").cloned().unwrap_or(Value::Null),
            deleting: rs
                .pointer("/metadata/deletionTimestamp")
                .is_some_and(|v| !v.is_null()),
            status: ReplicaSetStatus {
                replicas: int(status, "replicas"),
                ready_replicas: int(status, "readyReplicas"),
                available_replicas: int(status, "availableReplicas"),
                terminating_replicas: status.get("terminatingReplicas").and_then(Value::as_i64),
                observed_generation: int(status, "observedGeneration"),
                failure: status
                    .get("conditions")
                    .and_then(Value::as_array)
                    .and_then(|cs| cs.iter().find(|c| c["type"] == "ReplicaFailure"))
                    .map(Condition::from_json),
            },
        }
    }

    /// The revision annotation: `Ok(0)` when absent, `Err` when not a number.
    fn revision(&self) -> Result<i64, ()> {
        self.annotations
            .get(REVISION)
            .map_or(Ok(0), |r| r.parse().map_err(|_| ()))
    }

    fn desired_annotation(&self) -> Option<i64> {
        non_negative(self.annotations.get(DESIRED_REPLICAS)?)
    }

    fn max_annotation(&self) -> Option<i64> {
        non_negative(self.annotations.get(MAX_REPLICAS)?)
    }
}

fn non_negative(s: &str) -> Option<i64> {
    s.parse::<u32>()
        .ok()
        .filter(|n| i32::try_from(*n).is_ok())
        .map(i64::from)
}

/// One write of a sync, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Create this ReplicaSet (complete object, without namespace).
    CreateReplicaSet(Value),
    /// Set `spec.replicas`, `spec.minReadySeconds` and `metadata.annotations`
    /// of a ReplicaSet, provided it still has `resource_version`.
    UpdateReplicaSet {
        name: String,
        resource_version: String,
        replicas: i64,
        min_ready_seconds: i64,
        annotations: BTreeMap<String, String>,
    },
    /// Delete an old ReplicaSet (revision history cleanup).
    DeleteReplicaSet { name: String, uid: String },
    /// Set the Deployment's `spec.template` and `metadata.annotations`
    /// (a rollback), provided it still has `resource_version`.
    UpdateDeployment {
        resource_version: String,
        template: Value,
        annotations: BTreeMap<String, String>,
    },
    /// Write the Deployment's status and annotations through `/status`,
    /// provided it still has `resource_version`.
    UpdateStatus {
        resource_version: String,
        annotations: BTreeMap<String, String>,
        status: Value,
    },
    /// Record an Event on the Deployment.
    Event {
        warning: bool,
        reason: &'static str,
        message: String,
    },
}

/// Everything one sync looks at.
#[derive(Debug, Clone)]
pub struct Input {
    /// The Deployment.
    pub deployment: Deployment,
    /// The ReplicaSets it controls (after adoption and release).
    pub replica_sets: Vec<ReplicaSet>,
    /// Per ReplicaSet uid, how many of its pods are not `Succeeded` or
    /// `Failed` (terminating ones included).
    pub live_pods: HashMap<String, usize>,
    /// The time of the sync.
    pub now: Timestamp,
}

/// The state of one sync: the Deployment and ReplicaSets as this sync has
/// changed them, and the writes so far.
struct Sync {
    d: Deployment,
    /// What was read (status and annotations writes compare against it).
    original: Deployment,
    rss: Vec<ReplicaSet>,
    live_pods: HashMap<String, usize>,
    now: Timestamp,
    now_str: String,
    actions: Vec<Action>,
    /// A spec write ends the sync (the status follows on the next one).
    spec_written: bool,
}

/// The writes of one sync of the Deployment (`syncDeployment`).
#[must_use]
pub fn sync(input: Input) -> Vec<Action> {
    let now_str = input.now.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
    let mut s = Sync {
        original: input.deployment.clone(),
        d: input.deployment,
        rss: input.replica_sets,
        live_pods: input.live_pods,
        now: input.now,
        now_str,
        actions: Vec::new(),
        spec_written: false,
    };
    s.run();
    s.finish()
}

/// Template equality ignoring the pod-template-hash label (`EqualIgnoreHash`),
/// with absent, null and empty values alike.
#[must_use]
pub fn equal_ignore_hash(a: &Value, b: &Value) -> bool {
    normalized_template(a) == normalized_template(b)
}

fn normalized_template(t: &Value) -> Value {
    let mut t = t.clone();
    if let Some(labels) = t.pointer_mut("/metadata/labels").and_then(Value::as_object_mut) {
        labels.remove(POD_TEMPLATE_HASH);
    }
    prune(&mut t);
    t
}

/// Drops nulls, empty objects and empty arrays, recursively.
fn prune(v: &mut Value) -> bool {
    match v {
        Value::Null => false,
        Value::Object(m) => {
            m.retain(|_, x| prune(x));
            !m.is_empty()
        }
        Value::Array(a) => {
            for x in a.iter_mut() {
                prune(x);
            }
            !a.is_empty()
        }
        _ => true,
    }
}

/// The pod-template-hash of a template (FNV-1a over its canonical JSON and
/// the collision count), spelled as the controller spells it.
#[must_use]
pub fn template_hash(template: &Value, collision_count: Option<i64>) -> String {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let mut h = OFFSET;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h ^= u32::from(*b);
            h = h.wrapping_mul(PRIME);
        }
    };
    feed(normalized_template(template).to_string().as_bytes());
    if let Some(c) = collision_count {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        // as the controller: the low 32 bits
        feed(&(c as u32).to_le_bytes());
    }
    safe_encode(&h.to_string())
}

/// `rand.SafeEncodeString`: each byte to a character without vowels or
/// look-alikes.
fn safe_encode(s: &str) -> String {
    const ALPHANUMS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    s.bytes()
        .map(|b| ALPHANUMS[usize::from(b) % ALPHANUMS.len()] as char)
        .collect()
}

/// `<deployment>-<hash>`, the deployment part cut to keep it a valid name.
#[must_use]
pub fn replica_set_name(deployment: &str, hash: &str) -> String {
    let room = MAX_NAME.saturating_sub(1 + hash.len());
    let mut base = deployment;
    if base.len() > room && room > 0 {
        let mut end = room;
        while !base.is_char_boundary(end) {
            end -= 1;
        }
        base = &base[..end];
    }
    format!("{base}-{hash}")
}

/// Sorts by creation time, then name (`ReplicaSetsByCreationTimestamp`).
fn by_creation(a: &ReplicaSet, b: &ReplicaSet) -> Ordering {
    a.created.cmp(&b.created).then_with(|| a.name.cmp(&b.name))
}

impl Sync {
    fn finish(mut self) -> Vec<Action> {
        if !self.spec_written
            && (self.d.status != self.original.status || self.d.annotations != self.original.annotations)
        {
            self.actions.push(Action::UpdateStatus {
                resource_version: self.d.resource_version.clone(),
                annotations: self.d.annotations.clone(),
                status: self.d.status.to_json(),
            });
        }
        self.actions
    }

    fn event(&mut self, warning: bool, reason: &'static str, message: String) {
        self.actions.push(Action::Event {
            warning,
            reason,
            message,
        });
    }

    fn run(&mut self) {
        if self.d.selector.is_null() || self.d.selector == json!({}) {
            self.event(
                true,
                "SelectingAll",
                "This deployment is selecting all pods. A non-empty selector is required.".into(),
            );
            if self.d.status.observed_generation < self.d.generation {
                self.d.status.observed_generation = self.d.generation;
            }
            return;
        }
        if self.d.deleting {
            let (new, old) = self.all_replica_sets(false);
            self.sync_deployment_status(new, &old);
            return;
        }
        self.check_paused_conditions();
        if self.d.paused {
            self.sync_scale();
            return;
        }
        if let Some(revision) = self.d.rollback_to() {
            self.rollback(revision);
            return;
        }
        if self.is_scaling_event() {
            self.sync_scale();
            return;
        }
        match self.d.strategy {
            Strategy::Recreate => self.rollout_recreate(),
            Strategy::RollingUpdate { .. } => self.rollout_rolling(),
        }
    }

    // === ReplicaSets and revisions ===

    /// `FindNewReplicaSet`: the oldest ReplicaSet whose template is the Deployment's.
    fn find_new(&self) -> Option<usize> {
        let mut order: Vec<usize> = (0..self.rss.len()).collect();
        order.sort_by(|&a, &b| by_creation(&self.rss[a], &self.rss[b]));
        order
            .into_iter()
            .find(|&i| equal_ignore_hash(&self.rss[i].template, &self.d.template))
    }

    fn max_revision(&self, of: &[usize]) -> i64 {
        of.iter()
            .filter_map(|&i| self.rss[i].revision().ok())
            .max()
            .unwrap_or(0)
            .max(0)
    }

    /// `getAllReplicaSetsAndSyncRevision`: the new ReplicaSet (created when
    /// asked and missing) with its revision brought up to date, and every old one.
    fn all_replica_sets(&mut self, create: bool) -> (Option<usize>, Vec<usize>) {
        let existing = self.find_new();
        let old: Vec<usize> = (0..self.rss.len()).filter(|&i| Some(i) != existing).collect();
        let new_revision = self.max_revision(&old) + 1;
        let new = match existing {
            Some(i) => {
                self.sync_existing_new(i, new_revision);
                Some(i)
            }
            None if create => self.create_new(&old, new_revision),
            None => None,
        };
        (new, old)
    }

    fn sync_existing_new(&mut self, i: usize, new_revision: i64) {
        let mut rs = self.rss[i].clone();
        let annotations_changed = set_new_replica_set_annotations(&self.d, &mut rs, new_revision, true);
        let min_ready_changed = rs.min_ready_seconds != self.d.min_ready_seconds;
        if annotations_changed || min_ready_changed {
            rs.min_ready_seconds = self.d.min_ready_seconds;
            self.write_replica_set(i, rs);
            return;
        }
        if let Some(rev) = rs.annotations.get(REVISION).cloned() {
            self.d.annotations.insert(REVISION.into(), rev);
        }
        if self.d.has_progress_deadline() && get_condition(&self.d.status.conditions, "Progressing").is_none()
        {
            let c = Condition::new(
                "Progressing",
                "True",
                reason::FOUND_NEW_RS,
                format!("Found new replica set {:?}", rs.name),
                &self.now_str,
            );
            set_condition(&mut self.d.status.conditions, c);
        }
    }

    fn create_new(&mut self, old: &[usize], new_revision: i64) -> Option<usize> {
        let hash = template_hash(&self.d.template, self.d.status.collision_count);
        let mut template = self.d.template.clone();
        if !template.get("metadata").is_some_and(Value::is_object) {
            template["metadata"] = json!({});
        }
        if !template["metadata"].get("labels").is_some_and(Value::is_object) {
            template["metadata"]["labels"] = json!({});
        }
        template["metadata"]["labels"][POD_TEMPLATE_HASH] = json!(hash);
        let mut selector = self.d.selector.clone();
        if !selector.get("matchLabels").is_some_and(Value::is_object) {
            selector["matchLabels"] = json!({});
        }
        selector["matchLabels"][POD_TEMPLATE_HASH] = json!(hash);
        let name = replica_set_name(&self.d.name, &hash);
        let mut rs = ReplicaSet {
            name: name.clone(),
            uid: String::new(),
            resource_version: String::new(),
            created: self.now,
            generation: 1,
            annotations: BTreeMap::new(),
            replicas: 0,
            min_ready_seconds: self.d.min_ready_seconds,
            template: template.clone(),
            deleting: false,
            status: ReplicaSetStatus::default(),
        };
        let all: Vec<&ReplicaSet> = old.iter().map(|&i| &self.rss[i]).chain([&rs]).collect();
        let replicas = new_rs_new_replicas(&self.d, &all, &rs);
        rs.replicas = replicas;
        set_new_replica_set_annotations(&self.d, &mut rs, new_revision, false);
        self.actions.push(Action::CreateReplicaSet(json!({
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {
                "name": name,
                "labels": template["metadata"]["labels"],
                "annotations": rs.annotations,
                "ownerReferences": [{
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "name": self.d.name,
                    "uid": self.d.uid,
                    "controller": true,
                    "blockOwnerDeletion": true,
                }],
            },
            "spec": {
                "replicas": replicas,
                "minReadySeconds": self.d.min_ready_seconds,
                "selector": selector,
                "template": template,
            },
        })));
        if replicas > 0 {
            self.event(
                false,
                "ScalingReplicaSet",
                format!("Scaled up replica set {name} from 0 to {replicas}"),
            );
        }
        self.d
            .annotations
            .insert(REVISION.into(), new_revision.to_string());
        if self.d.has_progress_deadline() {
            let c = Condition::new(
                "Progressing",
                "True",
                reason::NEW_REPLICA_SET,
                format!("Created new replica set {name:?}"),
                &self.now_str,
            );
            set_condition(&mut self.d.status.conditions, c);
        }
        self.rss.push(rs);
        Some(self.rss.len() - 1)
    }

    fn write_replica_set(&mut self, i: usize, rs: ReplicaSet) {
        self.actions.push(Action::UpdateReplicaSet {
            name: rs.name.clone(),
            resource_version: rs.resource_version.clone(),
            replicas: rs.replicas,
            min_ready_seconds: rs.min_ready_seconds,
            annotations: rs.annotations.clone(),
        });
        self.rss[i] = rs;
    }

    /// `scaleReplicaSet`: sets the size (and the desired/max annotations);
    /// true when the size changed.
    fn scale_replica_set(&mut self, i: usize, to: i64, force: bool) -> bool {
        let from = self.rss[i].replicas;
        if !force && from == to {
            return false;
        }
        let desired = self.d.replicas;
        let max = self.d.replicas + self.d.max_surge();
        let mut rs = self.rss[i].clone();
        let annotations_changed = set_replicas_annotations(&mut rs, desired, max);
        if from == to && !annotations_changed {
            return false;
        }
        rs.replicas = to;
        let name = rs.name.clone();
        self.write_replica_set(i, rs);
        if from == to {
            return false;
        }
        let direction = if from < to { "up" } else { "down" };
        self.event(
            false,
            "ScalingReplicaSet",
            format!("Scaled {direction} replica set {name} from {from} to {to}"),
        );
        true
    }

    // === Strategies ===

    fn rollout_rolling(&mut self) {
        let (new, old) = self.all_replica_sets(true);
        let Some(new) = new else { return };
        if self.reconcile_new(new, &old) {
            self.sync_rollout_status(Some(new), &old);
            return;
        }
        let active_old: Vec<usize> = old
            .iter()
            .copied()
            .filter(|&i| self.rss[i].replicas > 0)
            .collect();
        if self.reconcile_old(new, &old, active_old) {
            self.sync_rollout_status(Some(new), &old);
            return;
        }
        if deployment_complete(&self.d, &self.d.status) {
            self.cleanup(&old);
        }
        self.sync_rollout_status(Some(new), &old);
    }

    fn reconcile_new(&mut self, new: usize, old: &[usize]) -> bool {
        let (have, want) = (self.rss[new].replicas, self.d.replicas);
        if have == want {
            return false;
        }
        if have > want {
            return self.scale_replica_set(new, want, false);
        }
        let all: Vec<&ReplicaSet> = old.iter().chain([&new]).map(|&i| &self.rss[i]).collect();
        let n = new_rs_new_replicas(&self.d, &all, &self.rss[new]);
        self.scale_replica_set(new, n, false)
    }

    fn replicas_of(&self, of: impl IntoIterator<Item = usize>) -> i64 {
        of.into_iter().map(|i| self.rss[i].replicas).sum()
    }

    fn reconcile_old(&mut self, new: usize, old: &[usize], mut active_old: Vec<usize>) -> bool {
        let old_pods = self.replicas_of(active_old.iter().copied());
        if old_pods == 0 {
            return false;
        }
        let all_pods = self.replicas_of(old.iter().copied().chain([new]));
        let min_available = self.d.replicas - self.d.max_unavailable();
        let new_unavailable = self.rss[new].replicas - self.rss[new].status.available_replicas;
        let max_scaled_down = all_pods - min_available - new_unavailable;
        if max_scaled_down <= 0 {
            return false;
        }
        active_old.sort_by(|&a, &b| by_creation(&self.rss[a], &self.rss[b]));
        let cleaned = self.cleanup_unhealthy(&active_old, max_scaled_down);
        let scaled = self.scale_down_old_for_rolling_update(new, &active_old);
        cleaned + scaled > 0
    }

    /// `cleanupUnhealthyReplicas`: old pods that are not available go first.
    fn cleanup_unhealthy(&mut self, old_by_age: &[usize], max_cleanup: i64) -> i64 {
        let mut total = 0;
        for &i in old_by_age {
            if total >= max_cleanup {
                break;
            }
            let rs = &self.rss[i];
            if rs.replicas == 0 || rs.replicas == rs.status.available_replicas {
                continue;
            }
            let count = (max_cleanup - total).min(rs.replicas - rs.status.available_replicas);
            let to = rs.replicas - count;
            if to > rs.replicas {
                return total;
            }
            self.scale_replica_set(i, to, false);
            total += count;
        }
        total
    }

    fn scale_down_old_for_rolling_update(&mut self, new: usize, old_by_age: &[usize]) -> i64 {
        let min_available = self.d.replicas - self.d.max_unavailable();
        let available: i64 = old_by_age
            .iter()
            .chain([&new])
            .map(|&i| self.rss[i].status.available_replicas)
            .sum();
        if available <= min_available {
            return 0;
        }
        let want = available - min_available;
        let mut total = 0;
        for &i in old_by_age {
            if total >= want {
                break;
            }
            let replicas = self.rss[i].replicas;
            if replicas == 0 {
                continue;
            }
            let count = replicas.min(want - total);
            self.scale_replica_set(i, replicas - count, false);
            total += count;
        }
        total
    }

    fn rollout_recreate(&mut self) {
        let (mut new, mut old) = self.all_replica_sets(false);
        let active_old: Vec<usize> = old
            .iter()
            .copied()
            .filter(|&i| self.rss[i].replicas > 0)
            .collect();
        let mut scaled_down = false;
        for i in active_old {
            scaled_down |= self.scale_replica_set(i, 0, false);
        }
        if scaled_down {
            self.sync_rollout_status(new, &old);
            return;
        }
        if self.old_pods_running(new, &old) {
            self.sync_rollout_status(new, &old);
            return;
        }
        if new.is_none() {
            (new, old) = self.all_replica_sets(true);
        }
        if let Some(n) = new {
            let want = self.d.replicas;
            self.scale_replica_set(n, want, false);
        }
        if deployment_complete(&self.d, &self.d.status) {
            self.cleanup(&old);
        }
        self.sync_rollout_status(new, &old);
    }

    fn old_pods_running(&self, new: Option<usize>, old: &[usize]) -> bool {
        if old.iter().map(|&i| self.rss[i].status.replicas).sum::<i64>() > 0 {
            return true;
        }
        let new_uid = new.map(|i| self.rss[i].uid.as_str());
        self.live_pods
            .iter()
            .any(|(uid, n)| Some(uid.as_str()) != new_uid && *n > 0)
    }

    // === Scaling events and paused Deployments ===

    /// `isScalingEvent`: an active ReplicaSet was sized for another `spec.replicas`.
    fn is_scaling_event(&mut self) -> bool {
        let (new, old) = self.all_replica_sets(false);
        old.iter().chain(new.as_ref()).any(|&i| {
            let rs = &self.rss[i];
            rs.replicas > 0 && rs.desired_annotation().is_some_and(|d| d != self.d.replicas)
        })
    }

    /// `sync`: proportional scaling, history cleanup when paused, the status.
    fn sync_scale(&mut self) {
        let (new, old) = self.all_replica_sets(false);
        self.scale(new, &old);
        if self.d.paused && self.d.rollback_to().is_none() {
            self.cleanup(&old);
        }
        self.sync_deployment_status(new, &old);
    }

    /// `FindActiveOrLatest`: the one active ReplicaSet, the newest when none is active.
    fn active_or_latest(&self, new: Option<usize>, old: &[usize]) -> Option<usize> {
        let mut old_newest_first = old.to_vec();
        old_newest_first.sort_by(|&a, &b| by_creation(&self.rss[b], &self.rss[a]));
        let active: Vec<usize> = old_newest_first
            .iter()
            .copied()
            .chain(new)
            .filter(|&i| self.rss[i].replicas > 0)
            .collect();
        match active.len() {
            0 => new.or_else(|| old_newest_first.first().copied()),
            1 => Some(active[0]),
            _ => None,
        }
    }

    fn is_saturated(&self, new: Option<usize>) -> bool {
        let Some(rs) = new.map(|i| &self.rss[i]) else {
            return false;
        };
        rs.annotations
            .get(DESIRED_REPLICAS)
            .and_then(|d| d.parse::<i64>().ok())
            .is_some_and(|desired| {
                rs.replicas == self.d.replicas
                    && desired == self.d.replicas
                    && rs.status.available_replicas == self.d.replicas
            })
    }

    fn scale(&mut self, new: Option<usize>, old: &[usize]) {
        if let Some(i) = self.active_or_latest(new, old) {
            if self.rss[i].replicas != self.d.replicas {
                let want = self.d.replicas;
                self.scale_replica_set(i, want, false);
            }
            return;
        }
        if self.is_saturated(new) {
            for &i in old {
                if self.rss[i].replicas > 0 {
                    self.scale_replica_set(i, 0, false);
                }
            }
            return;
        }
        if !self.d.is_rolling_update() {
            return;
        }
        let mut active: Vec<usize> = old
            .iter()
            .copied()
            .chain(new)
            .filter(|&i| self.rss[i].replicas > 0)
            .collect();
        let allowed = if self.d.replicas > 0 {
            self.d.replicas + self.d.max_surge()
        } else {
            0
        };
        let to_add = allowed - self.replicas_of(active.iter().copied());
        match to_add.cmp(&0) {
            // Larger first; among equals the newer when growing, the older when shrinking.
            Ordering::Greater => active.sort_by(|&a, &b| {
                self.rss[b]
                    .replicas
                    .cmp(&self.rss[a].replicas)
                    .then_with(|| by_creation(&self.rss[b], &self.rss[a]))
            }),
            Ordering::Less => active.sort_by(|&a, &b| {
                self.rss[b]
                    .replicas
                    .cmp(&self.rss[a].replicas)
                    .then_with(|| by_creation(&self.rss[a], &self.rss[b]))
            }),
            Ordering::Equal => {}
        }
        let mut added = 0;
        let mut sizes: Vec<i64> = Vec::with_capacity(active.len());
        for &i in &active {
            let rs = &self.rss[i];
            if to_add == 0 {
                sizes.push(rs.replicas);
            } else {
                let p = proportion(rs, &self.d, to_add, added);
                sizes.push(rs.replicas + p);
                added += p;
            }
        }
        for (k, &i) in active.iter().enumerate() {
            if k == 0 && to_add != 0 {
                sizes[0] = (sizes[0] + to_add - added).max(0);
            }
            self.scale_replica_set(i, sizes[k], true);
        }
    }

    // === Rollback and history ===

    fn rollback(&mut self, revision: i64) {
        let (new, old) = self.all_replica_sets(true);
        let all: Vec<usize> = old.iter().copied().chain(new).collect();
        let mut target = revision;
        if target == 0 {
            target = last_revision(all.iter().map(|&i| &self.rss[i]));
            if target == 0 {
                self.event(
                    true,
                    "DeploymentRollbackRevisionNotFound",
                    "Unable to find last revision.".into(),
                );
                self.clear_rollback_to();
                return;
            }
        }
        let Some(rs) = all
            .iter()
            .map(|&i| &self.rss[i])
            .find(|rs| rs.revision() == Ok(target))
            .cloned()
        else {
            self.event(
                true,
                "DeploymentRollbackRevisionNotFound",
                "Unable to find the revision to rollback to.".into(),
            );
            self.clear_rollback_to();
            return;
        };
        if equal_ignore_hash(&self.d.template, &rs.template) {
            let message = format!(
                "The rollback revision contains the same template as current deployment {:?}",
                self.d.name
            );
            self.event(true, "DeploymentRollbackTemplateUnchanged", message);
            self.clear_rollback_to();
            return;
        }
        let mut template = rs.template.clone();
        if let Some(labels) = template
            .pointer_mut("/metadata/labels")
            .and_then(Value::as_object_mut)
        {
            labels.remove(POD_TEMPLATE_HASH);
        }
        self.d.template = template;
        let mut annotations: BTreeMap<String, String> = self
            .d
            .annotations
            .iter()
            .filter(|(k, _)| NOT_COPIED.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (k, v) in &rs.annotations {
            if !NOT_COPIED.contains(&k.as_str()) {
                annotations.insert(k.clone(), v.clone());
            }
        }
        self.d.annotations = annotations;
        self.clear_rollback_to();
        let message = format!("Rolled back deployment {:?} to revision {target}", self.d.name);
        self.event(false, "DeploymentRollback", message);
    }

    fn clear_rollback_to(&mut self) {
        self.d.annotations.remove(ROLLBACK_TO);
        self.actions.push(Action::UpdateDeployment {
            resource_version: self.d.resource_version.clone(),
            template: self.d.template.clone(),
            annotations: self.d.annotations.clone(),
        });
        self.spec_written = true;
    }

    /// `cleanupDeployment`: old ReplicaSets beyond `revisionHistoryLimit`
    /// go, oldest revision first, once they have no pods.
    fn cleanup(&mut self, old: &[usize]) {
        let Some(limit) = self
            .d
            .revision_history_limit
            .filter(|_| self.d.has_revision_history_limit())
        else {
            return;
        };
        let mut cleanable: Vec<usize> = old.iter().copied().filter(|&i| !self.rss[i].deleting).collect();
        let excess = i64::try_from(cleanable.len()).unwrap_or(i64::MAX) - limit;
        if excess <= 0 {
            return;
        }
        cleanable.sort_by(|&a, &b| {
            let (ra, rb) = (&self.rss[a], &self.rss[b]);
            match (ra.revision(), rb.revision()) {
                (Ok(x), Ok(y)) if x != y => x.cmp(&y),
                _ => by_creation(ra, rb),
            }
        });
        for &i in cleanable.iter().take(usize::try_from(excess).unwrap_or(0)) {
            let rs = &self.rss[i];
            if rs.status.replicas != 0
                || rs.replicas != 0
                || rs.generation > rs.status.observed_generation
                || rs.deleting
            {
                continue;
            }
            self.actions.push(Action::DeleteReplicaSet {
                name: rs.name.clone(),
                uid: rs.uid.clone(),
            });
        }
    }

    // === Status ===

    fn check_paused_conditions(&mut self) {
        if !self.d.has_progress_deadline() {
            return;
        }
        let cond = get_condition(&self.d.status.conditions, "Progressing");
        if cond.is_some_and(|c| c.reason == reason::TIMED_OUT) {
            return;
        }
        let paused_exists = cond.is_some_and(|c| c.reason == reason::PAUSED);
        let c = if self.d.paused && !paused_exists {
            Condition::new(
                "Progressing",
                "Unknown",
                reason::PAUSED,
                "Deployment is paused".into(),
                &self.now_str,
            )
        } else if !self.d.paused && paused_exists {
            Condition::new(
                "Progressing",
                "Unknown",
                reason::RESUMED,
                "Deployment is resumed".into(),
                &self.now_str,
            )
        } else {
            return;
        };
        set_condition(&mut self.d.status.conditions, c);
    }

    fn calculate_status(&self, new: Option<usize>, old: &[usize]) -> DeploymentStatus {
        let all: Vec<&ReplicaSet> = old.iter().chain(new.as_ref()).map(|&i| &self.rss[i]).collect();
        let available: i64 = all.iter().map(|rs| rs.status.available_replicas).sum();
        let total: i64 = all.iter().map(|rs| rs.replicas).sum();
        let terminating = all.iter().try_fold(0, |sum, rs| {
            match (rs.status.terminating_replicas, rs.status.observed_generation) {
                (Some(t), _) => Some(sum + t),
                (None, 0) => Some(sum),
                (None, _) => None,
            }
        });
        let mut status = DeploymentStatus {
            observed_generation: self.d.generation,
            replicas: all.iter().map(|rs| rs.status.replicas).sum(),
            updated_replicas: new.map_or(0, |i| self.rss[i].status.replicas),
            ready_replicas: all.iter().map(|rs| rs.status.ready_replicas).sum(),
            available_replicas: available,
            unavailable_replicas: (total - available).max(0),
            terminating_replicas: terminating,
            collision_count: self.d.status.collision_count,
            conditions: self.d.status.conditions.clone(),
        };
        let c = if available >= self.d.replicas - self.d.max_unavailable() {
            Condition::new(
                "Available",
                "True",
                reason::MINIMUM_AVAILABLE,
                "Deployment has minimum availability.".into(),
                &self.now_str,
            )
        } else {
            Condition::new(
                "Available",
                "False",
                reason::MINIMUM_UNAVAILABLE,
                "Deployment does not have minimum availability.".into(),
                &self.now_str,
            )
        };
        set_condition(&mut status.conditions, c);
        status
    }

    fn sync_deployment_status(&mut self, new: Option<usize>, old: &[usize]) {
        self.d.status = self.calculate_status(new, old);
    }

    fn sync_rollout_status(&mut self, new: Option<usize>, old: &[usize]) {
        let mut status = self.calculate_status(new, old);
        if !self.d.has_progress_deadline() {
            remove_condition(&mut status.conditions, "Progressing");
        }
        let current = get_condition(&self.d.status.conditions, "Progressing").cloned();
        let complete_before = status.replicas == status.updated_replicas
            && current
                .as_ref()
                .is_some_and(|c| c.reason == reason::NEW_RS_AVAILABLE);
        let subject = new.map_or_else(
            || format!("Deployment {:?}", self.d.name),
            |i| format!("ReplicaSet {:?}", self.rss[i].name),
        );
        if self.d.has_progress_deadline() && !complete_before {
            if deployment_complete(&self.d, &status) {
                let c = Condition::new(
                    "Progressing",
                    "True",
                    reason::NEW_RS_AVAILABLE,
                    format!("{subject} has successfully progressed."),
                    &self.now_str,
                );
                set_condition(&mut status.conditions, c);
            } else if deployment_progressing(&self.d.status, &status) {
                let mut c = Condition::new(
                    "Progressing",
                    "True",
                    reason::REPLICA_SET_UPDATED,
                    format!("{subject} is progressing."),
                    &self.now_str,
                );
                if let Some(cur) = &current {
                    if cur.status == "True" {
                        c.last_transition.clone_from(&cur.last_transition);
                    }
                    remove_condition(&mut status.conditions, "Progressing");
                }
                set_condition(&mut status.conditions, c);
            } else if self.timed_out(&status) {
                let c = Condition::new(
                    "Progressing",
                    "False",
                    reason::TIMED_OUT,
                    format!("{subject} has timed out progressing."),
                    &self.now_str,
                );
                set_condition(&mut status.conditions, c);
            }
        }
        let failure = new.and_then(|i| self.rss[i].status.failure.clone()).or_else(|| {
            old.iter()
                .chain(new.as_ref())
                .find_map(|&i| self.rss[i].status.failure.clone())
        });
        match failure {
            Some(f) => {
                let c = Condition {
                    last_update: f.last_transition.clone(),
                    ..f
                };
                set_condition(&mut status.conditions, c);
            }
            None => remove_condition(&mut status.conditions, "ReplicaFailure"),
        }
        self.d.status = status;
    }

    /// `DeploymentTimedOut`.
    fn timed_out(&self, status: &DeploymentStatus) -> bool {
        let Some(c) = get_condition(&status.conditions, "Progressing") else {
            return false;
        };
        if c.reason == reason::NEW_RS_AVAILABLE {
            return false;
        }
        if c.reason == reason::TIMED_OUT {
            return true;
        }
        let Ok(from) = c.last_update.parse::<Timestamp>() else {
            return false;
        };
        let deadline = jiff::SignedDuration::from_secs(self.d.progress_deadline_seconds.unwrap_or(0));
        from.checked_add(deadline).is_ok_and(|end| end < self.now)
    }
}

/// `DeploymentComplete`: every desired pod is updated and available, nothing else runs.
fn deployment_complete(d: &Deployment, status: &DeploymentStatus) -> bool {
    status.updated_replicas == d.replicas
        && status.replicas == d.replicas
        && status.available_replicas == d.replicas
        && status.observed_generation >= d.generation
}

/// `DeploymentProgressing`: more updated, ready or available pods, or fewer old ones.
fn deployment_progressing(old: &DeploymentStatus, new: &DeploymentStatus) -> bool {
    let old_old = old.replicas - old.updated_replicas;
    let new_old = new.replicas - new.updated_replicas;
    new.updated_replicas > old.updated_replicas
        || new_old < old_old
        || new.ready_replicas > old.ready_replicas
        || new.available_replicas > old.available_replicas
}

/// `NewRSNewReplicas`: how big the new ReplicaSet may be now.
fn new_rs_new_replicas(d: &Deployment, all: &[&ReplicaSet], new: &ReplicaSet) -> i64 {
    match d.strategy {
        Strategy::Recreate => d.replicas,
        Strategy::RollingUpdate { max_surge, .. } => {
            let surge = max_surge.scaled(d.replicas, true);
            let current: i64 = all.iter().map(|rs| rs.replicas).sum();
            let max_total = d.replicas + surge;
            if current >= max_total {
                return new.replicas;
            }
            let up = (max_total - current).min(d.replicas - new.replicas);
            new.replicas + up
        }
    }
}

/// `LastRevision`: the second highest revision.
fn last_revision<'a>(rss: impl Iterator<Item = &'a ReplicaSet>) -> i64 {
    let (mut max, mut second) = (0, 0);
    for v in rss.filter_map(|rs| rs.revision().ok()) {
        if v >= max {
            second = max;
            max = v;
        } else if v > second {
            second = v;
        }
    }
    second
}

/// `SetReplicasAnnotations`; true when they changed.
fn set_replicas_annotations(rs: &mut ReplicaSet, desired: i64, max: i64) -> bool {
    let mut changed = false;
    for (k, v) in [(DESIRED_REPLICAS, desired), (MAX_REPLICAS, max)] {
        let v = v.to_string();
        if rs.annotations.get(k) != Some(&v) {
            rs.annotations.insert(k.into(), v);
            changed = true;
        }
    }
    changed
}

/// `SetNewReplicaSetAnnotations`: the Deployment's annotations, the
/// revision (never lowered; a raised one keeps the old in the history) and,
/// for a ReplicaSet about to be created, the desired/max annotations.
fn set_new_replica_set_annotations(
    d: &Deployment,
    rs: &mut ReplicaSet,
    new_revision: i64,
    exists: bool,
) -> bool {
    let mut changed = false;
    for (k, v) in &d.annotations {
        if NOT_COPIED.contains(&k.as_str()) || rs.annotations.get(k) == Some(v) {
            continue;
        }
        rs.annotations.insert(k.clone(), v.clone());
        changed = true;
    }
    let old = rs.annotations.get(REVISION).cloned();
    let old_n = match &old {
        None => 0,
        Some(s) => match s.parse::<i64>() {
            Ok(n) => n,
            Err(_) if s.is_empty() => 0,
            Err(_) => return false,
        },
    };
    if old_n < new_revision {
        rs.annotations.insert(REVISION.into(), new_revision.to_string());
        changed = true;
        if let Some(old) = old {
            let history = rs.annotations.get(REVISION_HISTORY).cloned().unwrap_or_default();
            if history.is_empty() {
                rs.annotations.insert(REVISION_HISTORY.into(), old);
            } else {
                let mut parts: Vec<&str> = history.split(',').collect();
                let mut total = history.len() + old.len() + 1;
                let mut start = 0;
                while total > MAX_REVISION_HISTORY_CHARS && start < parts.len() {
                    total -= parts[start].len() + 1;
                    start += 1;
                }
                if total <= MAX_REVISION_HISTORY_CHARS {
                    parts.drain(..start);
                    parts.push(&old);
                    rs.annotations.insert(REVISION_HISTORY.into(), parts.join(","));
                }
            }
        }
    }
    if !exists && set_replicas_annotations(rs, d.replicas, d.replicas + d.max_surge()) {
        changed = true;
    }
    changed
}

/// `GetReplicaSetProportion`.
fn proportion(rs: &ReplicaSet, d: &Deployment, to_add: i64, added: i64) -> i64 {
    if rs.replicas == 0 || to_add == 0 || to_add == added {
        return 0;
    }
    let fraction = fraction(rs, d);
    let allowed = to_add - added;
    if to_add > 0 {
        fraction.min(allowed)
    } else {
        fraction.max(allowed)
    }
}

/// `getReplicaSetFraction`.
fn fraction(rs: &ReplicaSet, d: &Deployment) -> i64 {
    if d.replicas == 0 {
        return -rs.replicas;
    }
    let max_now = d.replicas + d.max_surge();
    let max_before = match rs.max_annotation() {
        Some(m) if m != 0 => m,
        _ => {
            if d.status.replicas == 0 {
                return 0;
            }
            d.status.replicas
        }
    };
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)] // replica counts are small
    let size = ((rs.replicas * max_now) as f64 / max_before as f64).round() as i64;
    size - rs.replicas
}

#[cfg(test)]
#[path = "deployment_tests.rs"]
mod tests;
