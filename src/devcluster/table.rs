//! `meta.k8s.io/v1` `Table` rendering for `kubectl get`.

use serde_json::{Value, json};

use super::controllers::pod_ready;
use super::resources::ResourceDef;
use super::store::is_terminating;

/// Whether the `Accept` header asks for a Table.
#[must_use]
pub fn wants_table(accept: &str) -> bool {
    accept
        .split(',')
        .any(|part| part.contains("as=Table") && part.contains("g=meta.k8s.io"))
}

/// kubectl's short age format.
#[must_use]
pub fn age(created: &str) -> String {
    let Ok(ts) = created.parse::<jiff::Timestamp>() else {
        return "<unknown>".into();
    };
    let secs = (jiff::Timestamp::now().as_second() - ts.as_second()).max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 600 => format!("{}m{}s", s / 60, s % 60),
        s if s < 3 * 3600 => format!("{}m", s / 60),
        s if s < 8 * 3600 => format!("{}h{}m", s / 3600, (s % 3600) / 60),
        s if s < 48 * 3600 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn col(name: &str, kind: &str, priority: u8) -> Value {
    json!({"name": name, "type": kind, "format": if name == "Name" { "name" } else { "" }, "description": name, "priority": priority})
}

fn s(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    }
}

fn num(obj: &Value, ptr: &str) -> i64 {
    obj.pointer(ptr).and_then(Value::as_i64).unwrap_or(0)
}

fn columns(res: &ResourceDef) -> Vec<Value> {
    let mut c = vec![col("Name", "string", 0)];
    match res.kind {
        "Pod" => {
            c.extend([
                col("Ready", "string", 0),
                col("Status", "string", 0),
                col("Restarts", "string", 0),
                col("Age", "string", 0),
                col("IP", "string", 1),
                col("Node", "string", 1),
            ]);
        }
        "Deployment" => {
            c.extend([
                col("Ready", "string", 0),
                col("Up-to-date", "integer", 0),
                col("Available", "integer", 0),
                col("Age", "string", 0),
            ]);
        }
        "ReplicaSet" => {
            c.extend([
                col("Desired", "integer", 0),
                col("Current", "integer", 0),
                col("Ready", "integer", 0),
                col("Age", "string", 0),
            ]);
        }
        "Namespace" => c.extend([col("Status", "string", 0), col("Age", "string", 0)]),
        "Service" => c.extend([
            col("Type", "string", 0),
            col("Cluster-IP", "string", 0),
            col("Age", "string", 0),
        ]),
        _ => c.push(col("Age", "string", 0)),
    }
    c
}

fn cells(res: &ResourceDef, o: &Value) -> Vec<Value> {
    let name = s(o.pointer("/metadata/name"));
    let age = age(&s(o.pointer("/metadata/creationTimestamp")));
    match res.kind {
        "Pod" => {
            let total = o
                .pointer("/spec/containers")
                .and_then(Value::as_array)
                .map_or(0, Vec::len);
            let ready = if pod_ready(o) { total } else { 0 };
            let status = if is_terminating(o) {
                "Terminating".to_owned()
            } else {
                let phase = s(o.pointer("/status/phase"));
                match o.pointer("/status/containerStatuses/0/state/waiting/reason") {
                    Some(r) if phase != "Failed" && phase != "Succeeded" => s(Some(r)),
                    _ => phase,
                }
            };
            let ip = s(o.pointer("/status/podIP"));
            let node = s(o.pointer("/spec/nodeName"));
            vec![
                json!(name),
                json!(format!("{ready}/{total}")),
                json!(status),
                json!("0"),
                json!(age),
                json!(if ip.is_empty() { "<none>".into() } else { ip }),
                json!(if node.is_empty() { "<none>".into() } else { node }),
            ]
        }
        "Deployment" => vec![
            json!(name),
            json!(format!(
                "{}/{}",
                num(o, "/status/readyReplicas"),
                num(o, "/spec/replicas")
            )),
            json!(num(o, "/status/updatedReplicas")),
            json!(num(o, "/status/availableReplicas")),
            json!(age),
        ],
        "ReplicaSet" => vec![
            json!(name),
            json!(num(o, "/spec/replicas")),
            json!(num(o, "/status/replicas")),
            json!(num(o, "/status/readyReplicas")),
            json!(age),
        ],
        "Namespace" => vec![
            json!(name),
            json!(if is_terminating(o) {
                "Terminating".into()
            } else {
                s(o.pointer("/status/phase"))
            }),
            json!(age),
        ],
        "Service" => vec![
            json!(name),
            json!(s(o.pointer("/spec/type"))),
            json!(
                o.pointer("/spec/clusterIP")
                    .map_or_else(|| "None".to_owned(), |v| s(Some(v)))
            ),
            json!(age),
        ],
        _ => vec![json!(name), json!(age)],
    }
}

/// A Table of `objects`.
#[must_use]
pub fn table(res: &ResourceDef, objects: &[Value], rv: &str) -> Value {
    let rows: Vec<Value> = objects
        .iter()
        .map(|o| json!({"cells": cells(res, o), "object": o}))
        .collect();
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": columns(res),
        "rows": rows,
    })
}
