//! Label selectors (query syntax and `LabelSelector` objects) and field selectors.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::validation::{is_label_name, is_subdomain};

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

impl std::fmt::Display for Requirement {
    /// The query syntax [`LabelSelector::parse`] reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Eq(k, v) => write!(f, "{k}={v}"),
            Self::NotEq(k, v) => write!(f, "{k}!={v}"),
            Self::In(k, vs) => write!(f, "{k} in ({})", vs.join(",")),
            Self::NotIn(k, vs) => write!(f, "{k} notin ({})", vs.join(",")),
            Self::Exists(k) => f.write_str(k),
            Self::NotExists(k) => write!(f, "!{k}"),
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

impl std::fmt::Display for LabelSelector {
    /// The query syntax [`LabelSelector::parse`] reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, r) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
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
    let values = inner
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|v| check_value(v, part))
        .collect::<Result<Vec<_>, _>>()?;
    if values.is_empty() {
        return Err(format!(
            "unable to parse requirement {part:?}: for 'in', 'notin' operators, values set can't be empty"
        ));
    }
    Ok(values)
}

/// A label key: an optional DNS subdomain prefix and `/`, then a name of
/// 1–63 characters (the Kubernetes qualified-name rule).
fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    prefix.is_none_or(is_subdomain) && is_label_name(name)
}

fn check_key(key: &str, part: &str) -> Result<String, String> {
    let key = key.trim();
    if !is_label_key(key) {
        return Err(format!(
            "unable to parse requirement {part:?}: invalid label key {key:?}: name part must consist of alphanumeric \
             characters, '-', '_' or '.', and must start and end with an alphanumeric character (at most 63), with \
             an optional DNS subdomain prefix and '/'"
        ));
    }
    Ok(key.to_owned())
}

fn check_value(value: &str, part: &str) -> Result<String, String> {
    let value = value.trim();
    if !value.is_empty() && !is_label_name(value) {
        return Err(format!(
            "unable to parse requirement {part:?}: invalid label value {value:?}: a valid label must be an empty \
             string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an \
             alphanumeric character (at most 63)"
        ));
    }
    Ok(value.to_owned())
}

fn parse_requirement(part: &str) -> Result<Requirement, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement::NotExists(check_key(key, part)?));
    }
    if let Some((k, v)) = part.split_once("!=") {
        return Ok(Requirement::NotEq(check_key(k, part)?, check_value(v, part)?));
    }
    if let Some((k, v)) = part.split_once("==") {
        return Ok(Requirement::Eq(check_key(k, part)?, check_value(v, part)?));
    }
    if let Some((k, v)) = part.split_once('=') {
        return Ok(Requirement::Eq(check_key(k, part)?, check_value(v, part)?));
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

/// A field selector: `path=value` / `path==value` / `path!=value` terms on
/// dotted paths (`metadata.name`, `metadata.namespace`, `status.phase`,
/// `spec.nodeName`), split as the API server splits them: terms on commas
/// not escaped with a backslash, each at its first operator; in values a
/// backslash, `,` and `=` are escaped with a backslash.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

/// Splits on commas that a backslash does not escape.
fn split_terms(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        if escaped {
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == ',' {
            out.push(&s[start..i]);
            start = i + 1;
        }
    }
    out.push(&s[start..]);
    out
}

/// `(path, equal, raw value)` at the first position where `!=`, `==` or `=` starts.
fn split_term(term: &str) -> Option<(&str, bool, &str)> {
    for (i, _) in term.char_indices() {
        let rest = &term[i..];
        for (op, eq) in [("!=", false), ("==", true), ("=", true)] {
            if rest.starts_with(op) {
                return Some((&term[..i], eq, &term[i + op.len()..]));
            }
        }
    }
    None
}

/// A field selector value without its escapes.
fn unescape(raw: &str, term: &str) -> Result<String, String> {
    let mut out = String::with_capacity(raw.len());
    let mut escaped = false;
    for c in raw.chars() {
        match (escaped, c) {
            (true, '\\' | ',' | '=') => {
                out.push(c);
                escaped = false;
            }
            (true, _) => {
                return Err(format!(
                    "invalid field selector {term:?}: invalid escape sequence \"\\{c}\""
                ));
            }
            (false, '\\') => escaped = true,
            (false, ',' | '=') => {
                return Err(format!(
                    "invalid field selector {term:?}: unescaped {c:?} in a value (write \"\\{c}\")"
                ));
            }
            (false, _) => out.push(c),
        }
    }
    if escaped {
        return Err(format!(
            "invalid field selector {term:?}: a value may not end in a single \"\\\""
        ));
    }
    Ok(out)
}

impl FieldSelector {
    /// Parses `a.b=c,d!=e`.
    ///
    /// # Errors
    /// A message naming the malformed term.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut terms = Vec::new();
        for term in split_terms(s).into_iter().filter(|t| !t.is_empty()) {
            let (path, eq, raw) = split_term(term)
                .ok_or_else(|| format!("invalid field selector {term:?}: expected field=value"))?;
            terms.push((path.to_owned(), eq, unescape(raw, term)?));
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

impl std::fmt::Display for FieldSelector {
    /// The syntax [`FieldSelector::parse`] reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (path, eq, value)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            let op = if *eq { "=" } else { "!=" };
            let value = value
                .replace('\\', "\\\\")
                .replace(',', "\\,")
                .replace('=', "\\=");
            write!(f, "{path}{op}{value}")?;
        }
        Ok(())
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
    fn keys_and_values_follow_the_label_rules_and_print_back() {
        for bad in [
            "a=b=c",
            "bad key=x",
            "a==b!=c",
            "a in ()",
            "a in (x y)",
            "Upper.Case/x=y",
            "-a=b",
            "a=b-",
            "/a",
        ] {
            assert!(LabelSelector::parse(bad).is_err(), "{bad:?} was accepted");
        }
        let text = "example.com/a=B_1,b!=,c in (x,y-z),d notin (1),e,!f.g";
        let s = LabelSelector::parse(text).unwrap();
        assert_eq!(s.to_string(), text);
        assert_eq!(LabelSelector::parse(&s.to_string()).unwrap(), s);
    }

    #[test]
    fn field_selector_values_escape_commas_and_equals() {
        let s = FieldSelector::parse(r"metadata.name=a\,b\=c\\d,status.phase!=Running").unwrap();
        let obj = json!({"metadata": {"name": r"a,b=c\d"}, "status": {"phase": "Failed"}});
        assert!(s.matches(&obj));
        assert_eq!(s.to_string(), r"metadata.name=a\,b\=c\\d,status.phase!=Running");
        for bad in ["a=b!=c", r"a=b\", r"a=\x", "a=b=c"] {
            assert!(FieldSelector::parse(bad).is_err(), "{bad:?} was accepted");
        }
        // The first operator splits the term.
        let s = FieldSelector::parse("a!b==c").unwrap();
        assert_eq!(s.0, vec![("a!b".to_owned(), true, "c".to_owned())]);
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
