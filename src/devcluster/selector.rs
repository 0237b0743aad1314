//! Label selectors (query syntax and `LabelSelector` objects) and field selectors.

use std::collections::BTreeMap;

use serde_json::Value;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

impl Requirement {
    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            Self::Eq(k, v) => labels.get(k) == Some(v),
            Self::NotEq(k, v) => labels.get(k) != Some(v),
            Self::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Self::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Self::Exists(k) => labels.contains_key(k),
            Self::NotExists(k) => !labels.contains_key(k),
        }
    }
}

/// A conjunction of requirements; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<Requirement>);

/// Labels of an object (`metadata.labels`), empty when absent.
#[must_use]
pub fn labels_of(obj: &Value) -> BTreeMap<String, String> {
    obj.pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

impl LabelSelector {
    /// Parses the query syntax: `a=b`, `a==b`, `a!=b`, `a in (x,y)`,
    /// `a notin (x)`, `a`, `!a`, joined by commas.
    ///
    /// # Errors
    /// A message naming the malformed part.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for part in split_top_level(s) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            reqs.push(parse_requirement(part)?);
        }
        Ok(Self(reqs))
    }

    /// Converts a `LabelSelector` object (`matchLabels`, `matchExpressions`).
    ///
    /// # Errors
    /// A message naming an unknown operator.
    pub fn from_object(sel: &Value) -> Result<Self, String> {
        let mut reqs = Vec::new();
        if let Some(m) = sel.get("matchLabels").and_then(Value::as_object) {
            for (k, v) in m {
                reqs.push(Requirement::Eq(
                    k.clone(),
                    v.as_str().unwrap_or_default().to_owned(),
                ));
            }
        }
        if let Some(exprs) = sel.get("matchExpressions").and_then(Value::as_array) {
            for e in exprs {
                let key = e
                    .get("key")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned();
                let values: Vec<String> = e
                    .get("values")
                    .and_then(Value::as_array)
                    .map(|vs| vs.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
                    .unwrap_or_default();
                let op = e.get("operator").and_then(Value::as_str).unwrap_or_default();
                reqs.push(match op {
                    "In" => Requirement::In(key, values),
                    "NotIn" => Requirement::NotIn(key, values),
                    "Exists" => Requirement::Exists(key),
                    "DoesNotExist" => Requirement::NotExists(key),
                    other => return Err(format!("{other:?} is not a valid label selector operator")),
                });
            }
        }
        Ok(Self(reqs))
    }

    /// Whether `labels` satisfy every requirement.
    #[must_use]
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| r.matches(labels))
    }

    /// Whether the object's labels satisfy every requirement.
    #[must_use]
    pub fn matches_object(&self, obj: &Value) -> bool {
        self.0.is_empty() || self.matches(&labels_of(obj))
    }
}

/// Splits on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_set(rest: &str, part: &str) -> Result<Vec<String>, String> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| format!("unable to parse requirement {part:?}: expected a parenthesised set"))?;
    Ok(inner
        .split(',')
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect())
}

fn check_key(key: &str, part: &str) -> Result<String, String> {
    let key = key.trim();
    if key.is_empty() || key.contains(char::is_whitespace) {
        return Err(format!(
            "unable to parse requirement {part:?}: invalid label key {key:?}"
        ));
    }
    Ok(key.to_owned())
}

fn parse_requirement(part: &str) -> Result<Requirement, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement::NotExists(check_key(key, part)?));
    }
    if let Some((k, v)) = part.split_once("!=") {
        return Ok(Requirement::NotEq(check_key(k, part)?, v.trim().to_owned()));
    }
    if let Some((k, v)) = part.split_once("==") {
        return Ok(Requirement::Eq(check_key(k, part)?, v.trim().to_owned()));
    }
    if let Some((k, v)) = part.split_once('=') {
        return Ok(Requirement::Eq(check_key(k, part)?, v.trim().to_owned()));
    }
    if let Some(idx) = part.find(" notin ") {
        return Ok(Requirement::NotIn(
            check_key(&part[..idx], part)?,
            parse_set(&part[idx + 7..], part)?,
        ));
    }
    if let Some(idx) = part.find(" in ") {
        return Ok(Requirement::In(
            check_key(&part[..idx], part)?,
            parse_set(&part[idx + 4..], part)?,
        ));
    }
    Ok(Requirement::Exists(check_key(part, part)?))
}

/// A field selector: `path=value` / `path!=value` terms on dotted paths
/// (`metadata.name`, `metadata.namespace`, `status.phase`, `spec.nodeName`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parses `a.b=c,d!=e`.
    ///
    /// # Errors
    /// A message naming the malformed term.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (path, eq, value) = if let Some((k, v)) = part.split_once("!=") {
                (k, false, v)
            } else if let Some((k, v)) = part.split_once("==") {
                (k, true, v)
            } else if let Some((k, v)) = part.split_once('=') {
                (k, true, v)
            } else {
                return Err(format!("invalid field selector {part:?}: expected field=value"));
            };
            terms.push((path.trim().to_owned(), eq, value.trim().to_owned()));
        }
        Ok(Self(terms))
    }

    /// [`FieldSelector::parse`], refusing fields the real API server does
    /// not select on for `kind` (with its exact message).
    ///
    /// # Errors
    /// A message naming the malformed term or the unsupported field.
    pub fn parse_for(kind: &str, s: &str) -> Result<Self, String> {
        let parsed = Self::parse(s)?;
        let (fields, legacy) = selectable_fields(kind);
        for (path, _, _) in &parsed.0 {
            if fields.contains(&path.as_str()) {
                continue;
            }
            return Err(if legacy {
                format!("field label not supported: {path}")
            } else {
                format!(
                    "\"{path}\" is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
                )
            });
        }
        Ok(parsed)
    }

    /// Whether the object satisfies every term.
    #[must_use]
    pub fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(path, eq, value)| {
            let pointer = format!("/{}", path.replace('.', "/"));
            let actual = match obj.pointer(&pointer) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Bool(b)) => b.to_string(),
                Some(Value::Number(n)) => n.to_string(),
                // `status.podIPs` selects on the first address.
                Some(Value::Array(a)) => a
                    .first()
                    .and_then(|x| x.get("ip").and_then(Value::as_str))
                    .unwrap_or("")
                    .to_owned(),
                _ => String::new(),
            };
            (actual == *value) == *eq
        })
    }
}

/// The fields a kind selects on, and whether unknown fields get the legacy
/// `field label not supported` message (kinds with field-label conversions).
fn selectable_fields(kind: &str) -> (&'static [&'static str], bool) {
    match kind {
        "Pod" => (
            &[
                "metadata.name",
                "metadata.namespace",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.podIPs",
                "status.nominatedNodeName",
            ],
            true,
        ),
        "Node" => (&["metadata.name", "spec.unschedulable"], true),
        "Namespace" => (&["metadata.name", "status.phase"], true),
        "Secret" => (&["metadata.name", "metadata.namespace", "type"], true),
        "Service" => (
            &[
                "metadata.name",
                "metadata.namespace",
                "spec.clusterIP",
                "spec.type",
            ],
            true,
        ),
        "ReplicaSet" => (&["metadata.name", "metadata.namespace", "status.replicas"], true),
        "Event" => (
            &[
                "metadata.name",
                "metadata.namespace",
                "involvedObject.kind",
                "involvedObject.namespace",
                "involvedObject.name",
                "involvedObject.uid",
                "involvedObject.apiVersion",
                "involvedObject.resourceVersion",
                "involvedObject.fieldPath",
                "reason",
                "reportingComponent",
                "source",
                "type",
            ],
            true,
        ),
        _ => (&["metadata.name", "metadata.namespace"], false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn query_syntax_covers_every_operator() {
        let s = LabelSelector::parse("a=1,b!=2,c in (x, y),d notin (z),e,!skipper/tenant").unwrap();
        assert_eq!(s.0.len(), 6);
        let ok = labels(&[("a", "1"), ("b", "3"), ("c", "y"), ("d", "q"), ("e", "")]);
        assert!(s.matches(&ok));
        let mut bad = ok.clone();
        bad.insert("skipper/tenant".into(), "t".into());
        assert!(!s.matches(&bad));
        let mut bad = ok.clone();
        bad.insert("c".into(), "w".into());
        assert!(!s.matches(&bad));
        let mut bad = ok;
        bad.insert("d".into(), "z".into());
        assert!(!s.matches(&bad));
        assert!(LabelSelector::parse("a in x").is_err());
    }

    #[test]
    fn selector_objects_support_match_expressions() {
        let sel = json!({"matchLabels": {"skipper/deployment": "f"},
            "matchExpressions": [{"key": "skipper/tenant", "operator": "DoesNotExist"}]});
        let s = LabelSelector::from_object(&sel).unwrap();
        assert!(s.matches(&labels(&[("skipper/deployment", "f")])));
        assert!(!s.matches(&labels(&[("skipper/deployment", "f"), ("skipper/tenant", "x")])));
        assert!(
            LabelSelector::from_object(&json!({"matchExpressions": [{"key": "a", "operator": "Near"}]}))
                .is_err()
        );
    }

    #[test]
    fn field_selectors_match_dotted_paths() {
        let obj = json!({"metadata": {"name": "p1"}, "status": {"phase": "Running"}});
        assert!(FieldSelector::parse("metadata.name=p1").unwrap().matches(&obj));
        assert!(!FieldSelector::parse("metadata.name!=p1").unwrap().matches(&obj));
        assert!(
            FieldSelector::parse("status.phase==Running")
                .unwrap()
                .matches(&obj)
        );
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
