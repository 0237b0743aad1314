//! The JSON form of [`Function`] used in the `X-Skipper-Function` header and
//! the `skipper/function` pod annotation.
//!
//! Rules (wire contract): field names are the proto (snake_case) names on
//! output and either snake_case or lowerCamelCase on input; unknown fields are
//! ignored; integers may be JSON numbers or numeric strings; negative,
//! fractional or out-of-range integers are errors; a field given twice (even
//! once in each spelling) is an error; `null` means "unset". Output is compact,
//! in field-number order, and contains only present fields.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::{Function, Scale};

/// The function JSON could not be decoded. The message names the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(String);

impl Function {
    /// Decodes the function JSON (see the module docs for the rules).
    ///
    /// # Errors
    /// Returns [`ParseError`] for malformed JSON, wrong value types, bad
    /// integers and duplicate fields. The result is not validated: call
    /// [`Function::validate`].
    pub fn from_json(s: &str) -> Result<Self, ParseError> {
        serde_json::from_str::<FunctionDe>(s)
            .map(|f| f.0)
            .map_err(|e| ParseError(e.to_string()))
    }

    /// Encodes the function as compact JSON with proto field names.
    #[must_use]
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(128);
        let mut obj = Obj::new(&mut out);
        if !self.namespace.is_empty() {
            obj.string("namespace", &self.namespace);
        }
        if !self.deployment.is_empty() {
            obj.string("deployment", &self.deployment);
        }
        if !self.tenant.is_empty() {
            obj.string("tenant", &self.tenant);
        }
        if let Some(m) = &self.metadata {
            obj.string("metadata", m);
        }
        if let Some(s) = &self.scale {
            obj.raw("scale", &s.to_json());
        }
        if let Some(o) = self.oneshot {
            obj.raw("oneshot", if o { "true" } else { "false" });
        }
        obj.finish();
        out
    }
}

impl Scale {
    /// Encodes the scale configuration as compact JSON with proto field names.
    #[must_use]
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(96);
        let mut obj = Obj::new(&mut out);
        for (name, value) in [
            ("min_instances", self.min_instances),
            ("max_instances", self.max_instances),
            ("target_cpu_usage_milli", self.target_cpu_usage_milli),
            ("target_memory_usage_mib", self.target_memory_usage_mib),
            ("target_in_flight_requests", self.target_in_flight_requests),
            ("max_in_flight_requests", self.max_in_flight_requests),
        ] {
            if let Some(v) = value {
                obj.raw(name, &v.to_string());
            }
        }
        obj.finish();
        out
    }
}

/// Minimal compact JSON object writer (keys are fixed ASCII identifiers).
struct Obj<'a> {
    out: &'a mut String,
    first: bool,
}

impl<'a> Obj<'a> {
    fn new(out: &'a mut String) -> Self {
        out.push('{');
        Self { out, first: true }
    }
    fn key(&mut self, k: &str) {
        if !self.first {
            self.out.push(',');
        }
        self.first = false;
        self.out.push('"');
        self.out.push_str(k);
        self.out.push_str("\":");
    }
    fn string(&mut self, k: &str, v: &str) {
        self.key(k);
        // Serialising a &str cannot fail.
        self.out
            .push_str(&serde_json::to_string(v).unwrap_or_else(|_| String::from("\"\"")));
    }
    fn raw(&mut self, k: &str, v: &str) {
        self.key(k);
        self.out.push_str(v);
    }
    fn finish(self) {
        self.out.push('}');
    }
}

// === decoding ===

struct FunctionDe(Function);
struct ScaleDe(Scale);
struct U32Field(Option<u32>);

fn duplicate<E: de::Error>(name: &str) -> E {
    E::custom(format!("duplicate field {name:?}"))
}

fn set_once<T, E: de::Error>(
    slot: &mut Option<T>,
    seen: &mut bool,
    name: &str,
    v: Option<T>,
) -> Result<(), E> {
    if *seen {
        return Err(duplicate(name));
    }
    *seen = true;
    *slot = v;
    Ok(())
}

impl<'de> Deserialize<'de> for FunctionDe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = FunctionDe;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object describing a function")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FunctionDe, A::Error> {
                let mut namespace = None;
                let mut deployment = None;
                let mut tenant = None;
                let mut metadata = None;
                let mut scale = None;
                let mut oneshot = None;
                let mut seen = [false; 6];
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    match key.as_ref() {
                        "namespace" => set_once(
                            &mut namespace,
                            &mut seen[0],
                            "namespace",
                            map.next_value::<Option<String>>()?,
                        )?,
                        "deployment" => set_once(
                            &mut deployment,
                            &mut seen[1],
                            "deployment",
                            map.next_value::<Option<String>>()?,
                        )?,
                        "tenant" => set_once(
                            &mut tenant,
                            &mut seen[2],
                            "tenant",
                            map.next_value::<Option<String>>()?,
                        )?,
                        "metadata" => set_once(
                            &mut metadata,
                            &mut seen[3],
                            "metadata",
                            map.next_value::<Option<String>>()?,
                        )?,
                        "scale" => set_once(
                            &mut scale,
                            &mut seen[4],
                            "scale",
                            map.next_value::<Option<ScaleDe>>()?.map(|s| s.0),
                        )?,
                        "oneshot" => set_once(
                            &mut oneshot,
                            &mut seen[5],
                            "oneshot",
                            map.next_value::<Option<bool>>()?,
                        )?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(FunctionDe(Function {
                    namespace: namespace.unwrap_or_default(),
                    deployment: deployment.unwrap_or_default(),
                    tenant: tenant.unwrap_or_default(),
                    metadata,
                    scale,
                    oneshot,
                }))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for ScaleDe {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ScaleDe;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object describing scale")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ScaleDe, A::Error> {
                let mut s = Scale::default();
                let mut seen = [false; 6];
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    let (idx, name, slot) = match key.as_ref() {
                        "min_instances" | "minInstances" => (0, "min_instances", &mut s.min_instances),
                        "max_instances" | "maxInstances" => (1, "max_instances", &mut s.max_instances),
                        "target_cpu_usage_milli" | "targetCpuUsageMilli" => {
                            (2, "target_cpu_usage_milli", &mut s.target_cpu_usage_milli)
                        }
                        "target_memory_usage_mib" | "targetMemoryUsageMib" => {
                            (3, "target_memory_usage_mib", &mut s.target_memory_usage_mib)
                        }
                        "target_in_flight_requests" | "targetInFlightRequests" => {
                            (4, "target_in_flight_requests", &mut s.target_in_flight_requests)
                        }
                        "max_in_flight_requests" | "maxInFlightRequests" => {
                            (5, "max_in_flight_requests", &mut s.max_in_flight_requests)
                        }
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    let v = map
                        .next_value::<U32Field>()
                        .map_err(|e| de::Error::custom(format!("scale.{name}: {e}")))?;
                    set_once(slot, &mut seen[idx], &format!("scale.{name}"), v.0)?;
                }
                Ok(ScaleDe(s))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'de> Deserialize<'de> for U32Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        fn range<E: de::Error>(v: u64) -> Result<U32Field, E> {
            u32::try_from(v)
                .map(|v| U32Field(Some(v)))
                .map_err(|_| E::custom(format!("invalid value for uint32 field: {v} is out of range")))
        }
        impl<'de> Visitor<'de> for V {
            type Value = U32Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an unsigned 32-bit integer (number or numeric string)")
            }
            fn visit_unit<E: de::Error>(self) -> Result<U32Field, E> {
                Ok(U32Field(None))
            }
            fn visit_none<E: de::Error>(self) -> Result<U32Field, E> {
                Ok(U32Field(None))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<U32Field, E> {
                range(v)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<U32Field, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("invalid value for uint32 field: {v} is negative")))
                    .and_then(range)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<U32Field, E> {
                if v.fract() != 0.0 || !v.is_finite() {
                    return Err(E::custom(format!(
                        "invalid value for uint32 field: {v} is not an integer"
                    )));
                }
                if v < 0.0 {
                    return Err(E::custom(format!(
                        "invalid value for uint32 field: {v} is negative"
                    )));
                }
                if v > f64::from(u32::MAX) {
                    return Err(E::custom(format!(
                        "invalid value for uint32 field: {v} is out of range"
                    )));
                }
                // Integral and within range: the conversion is exact.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                Ok(U32Field(Some(v as u32)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<U32Field, E> {
                let n: serde_json::Number = v.parse().map_err(|_| {
                    E::custom(format!("invalid value for uint32 field: {v:?} is not a number"))
                })?;
                if let Some(u) = n.as_u64() {
                    range(u)
                } else if let Some(i) = n.as_i64() {
                    self.visit_i64(i)
                } else {
                    self.visit_f64(n.as_f64().unwrap_or(f64::NAN))
                }
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Function, String> {
        Function::from_json(s).map_err(|e| e.to_string())
    }

    #[test]
    fn accepts_snake_and_camel_case_and_numeric_strings() {
        let f = parse(r#"{"namespace":"ns","deployment":"d","tenant":"t","scale":{"minInstances":"1","max_instances":5,"targetInFlightRequests":2.0},"nonce":[1,{"x":2}]}"#).unwrap();
        let s = f.scale.unwrap();
        assert_eq!(s.min_instances, Some(1));
        assert_eq!(s.max_instances, Some(5));
        assert_eq!(s.target_in_flight_requests, Some(2));
        assert_eq!(s.target_cpu_usage_milli, None);
    }

    #[test]
    fn rejects_bad_integers_and_duplicates() {
        for (input, needle) in [
            (r#"{"scale":{"max_instances":-1}}"#, "negative"),
            (r#"{"scale":{"max_instances":1.5}}"#, "not an integer"),
            (r#"{"scale":{"max_instances":4294967296}}"#, "out of range"),
            (r#"{"scale":{"max_instances":"x"}}"#, "not a number"),
            (
                r#"{"scale":{"min_instances":1,"minInstances":1}}"#,
                "duplicate field",
            ),
            (r#"{"tenant":"a","tenant":"b"}"#, "duplicate field"),
            (r#"{"tenant":5}"#, "invalid type"),
            (r#"{"oneshot":"true"}"#, "invalid type"),
            (r#"[]"#, "invalid type"),
            (r#"{"#, "EOF"),
        ] {
            let err = parse(input).unwrap_err();
            assert!(err.contains(needle), "{input}: {err}");
        }
    }

    #[test]
    fn null_means_unset() {
        let f = parse(r#"{"namespace":null,"scale":null,"oneshot":null,"metadata":null}"#).unwrap();
        assert_eq!(f, Function::default());
        let f = parse(r#"{"scale":{"min_instances":null}}"#).unwrap();
        assert_eq!(f.scale, Some(Scale::default()));
    }

    #[test]
    fn round_trips_with_presence() {
        let input = r#"{"namespace":"ns","deployment":"dep","tenant":"t\"q","metadata":"","scale":{"min_instances":0,"max_instances":10},"oneshot":false}"#;
        let f = parse(input).unwrap();
        assert_eq!(f.to_json(), input);
        assert_eq!(Function::default().to_json(), "{}");
    }

    #[test]
    fn the_concurrency_limit_is_one_more_scale_field() {
        for input in [
            r#"{"scale":{"max_instances":2,"max_in_flight_requests":4}}"#,
            r#"{"scale":{"max_instances":2,"maxInFlightRequests":"4"}}"#,
        ] {
            let s = parse(input).unwrap().scale.unwrap();
            assert_eq!(s.max_in_flight_requests, Some(4), "{input}");
            assert_eq!(s.max_in_flight_requests(), 4);
            assert_eq!(s.to_json(), r#"{"max_instances":2,"max_in_flight_requests":4}"#);
        }
        for (input, needle) in [
            (
                r#"{"scale":{"max_in_flight_requests":1,"maxInFlightRequests":1}}"#,
                "duplicate field \"scale.max_in_flight_requests\"",
            ),
            (
                r#"{"scale":{"max_in_flight_requests":-1}}"#,
                "scale.max_in_flight_requests",
            ),
        ] {
            let err = parse(input).unwrap_err();
            assert!(err.contains(needle), "{input}: {err}");
        }
        assert_eq!(Scale::default().max_in_flight_requests(), 0, "absent: no limit");
    }
}
