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

fn terminated_reason(t: &Value) -> String {
    match t.get("reason").and_then(Value::as_str).filter(|r| !r.is_empty()) {
        Some(r) => r.to_owned(),
        None => match t.get("signal").and_then(Value::as_i64).filter(|s| *s != 0) {
            Some(sig) => format!("Signal:{sig}"),
            None => format!("ExitCode:{}", num(t, "/exitCode")),
        },
    }
}

/// kubectl's READY, STATUS and RESTARTS of a pod: ready containers (and
/// sidecars) out of all of them; the phase refined by the first init
/// container still at work, else by the containers' waiting or terminated
/// reasons; restart counts with the time of the last one.
fn pod_row(o: &Value) -> (usize, usize, String, String) {
    let list = |p: &str| {
        o.pointer(p)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let init_specs = list("/spec/initContainers");
    let sidecar = |name: &str| {
        init_specs
            .iter()
            .any(|c| c["name"] == name && c["restartPolicy"] == "Always")
    };
    let init = list("/status/initContainerStatuses");
    let containers = list("/status/containerStatuses");
    let total = list("/spec/containers").len()
        + init_specs
            .iter()
            .filter(|c| c["restartPolicy"] == "Always")
            .count();
    let mut reason = s(o.pointer("/status/reason"));
    if reason.is_empty() {
        reason = s(o.pointer("/status/phase"));
    }
    let mut restarts = 0;
    let mut last_restart = String::new();
    let mut note_restart = |c: &Value| {
        restarts += num(c, "/restartCount");
        if let Some(f) = c
            .pointer("/lastState/terminated/finishedAt")
            .and_then(Value::as_str)
            && f > last_restart.as_str()
        {
            f.clone_into(&mut last_restart);
        }
    };
    let mut ready = 0;
    let mut initializing = false;
    for (i, c) in init.iter().enumerate() {
        note_restart(c);
        let name = c["name"].as_str().unwrap_or("");
        if sidecar(name) {
            if c["ready"] == true {
                ready += 1;
            }
            if c["started"] == true {
                continue;
            }
        }
        if let Some(t) = c.pointer("/state/terminated")
            && num(t, "/exitCode") == 0
        {
            continue;
        }
        if initializing {
            continue;
        }
        initializing = true;
        reason = if let Some(t) = c.pointer("/state/terminated") {
            format!("Init:{}", terminated_reason(t))
        } else if let Some(w) = c
            .pointer("/state/waiting/reason")
            .and_then(Value::as_str)
            .filter(|r| !r.is_empty() && *r != "PodInitializing")
        {
            format!("Init:{w}")
        } else {
            format!("Init:{i}/{}", init_specs.len())
        };
    }
    if !initializing {
        let mut running = false;
        for c in containers.iter().rev() {
            note_restart(c);
            if let Some(w) = c
                .pointer("/state/waiting/reason")
                .and_then(Value::as_str)
                .filter(|r| !r.is_empty())
            {
                reason = w.to_owned();
            } else if let Some(t) = c.pointer("/state/terminated") {
                reason = terminated_reason(t);
            } else if c.pointer("/state/running").is_some() {
                running = true;
                if c["ready"] == true {
                    ready += 1;
                }
            }
        }
        if reason == "Completed" && running {
            reason = if pod_ready(o) { "Running" } else { "NotReady" }.to_owned();
        }
    } else {
        for c in &containers {
            note_restart(c);
        }
    }
    if is_terminating(o) {
        reason = "Terminating".to_owned();
    }
    let restarts = if last_restart.is_empty() {
        restarts.to_string()
    } else {
        format!("{restarts} ({} ago)", age(&last_restart))
    };
    (ready, total, reason, restarts)
}

fn cells(res: &ResourceDef, o: &Value) -> Vec<Value> {
    let name = s(o.pointer("/metadata/name"));
    let age = age(&s(o.pointer("/metadata/creationTimestamp")));
    match res.kind {
        "Pod" => {
            let (ready, total, status, restarts) = pod_row(o);
            let ip = s(o.pointer("/status/podIP"));
            let node = s(o.pointer("/spec/nodeName"));
            vec![
                json!(name),
                json!(format!("{ready}/{total}")),
                json!(status),
                json!(restarts),
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
