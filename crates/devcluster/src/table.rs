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

/// kubectl's short age format (apimachinery's `duration.HumanDuration`).
#[must_use]
pub fn age(created: &str) -> String {
    let Ok(ts) = created.parse::<jiff::Timestamp>() else {
        return "<unknown>".into();
    };
    human_duration(jiff::Timestamp::now().as_second() - ts.as_second())
}

/// apimachinery's `duration.HumanDuration` of `secs` seconds.
#[must_use]
pub fn human_duration(secs: i64) -> String {
    let with = |big: i64, unit: &str, small: i64, small_unit: &str| {
        if small == 0 {
            format!("{big}{unit}")
        } else {
            format!("{big}{unit}{small}{small_unit}")
        }
    };
    let (minutes, hours) = (secs / 60, secs / 3600);
    let days = hours / 24;
    match secs {
        s if s < -1 => "<invalid>".into(),
        s if s < 0 => "0s".into(),
        s if s < 120 => format!("{s}s"),
        _ if minutes < 10 => with(minutes, "m", secs % 60, "s"),
        _ if minutes < 180 => format!("{minutes}m"),
        _ if hours < 8 => with(hours, "h", minutes % 60, "m"),
        _ if hours < 48 => format!("{hours}h"),
        _ if hours < 24 * 8 => with(days, "d", hours % 24, "h"),
        _ if hours < 24 * 365 * 2 => format!("{days}d"),
        _ if hours < 24 * 365 * 8 => with(days / 365, "y", days % 365, "d"),
        _ => format!("{}y", days / 365),
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
            col("External-IP", "string", 0),
            col("Port(s)", "string", 0),
            col("Age", "string", 0),
            col("Selector", "string", 1),
        ]),
        "Node" => c.extend([
            col("Status", "string", 0),
            col("Roles", "string", 0),
            col("Age", "string", 0),
            col("Version", "string", 0),
            col("Internal-IP", "string", 1),
            col("External-IP", "string", 1),
            col("OS-Image", "string", 1),
            col("Kernel-Version", "string", 1),
            col("Container-Runtime", "string", 1),
        ]),
        // The only kind whose first column is not its name.
        "Event" => {
            return vec![
                col("Last Seen", "string", 0),
                col("Type", "string", 0),
                col("Reason", "string", 0),
                col("Object", "string", 0),
                col("Subobject", "string", 1),
                col("Source", "string", 1),
                col("Message", "string", 0),
                col("First Seen", "string", 1),
                col("Count", "string", 1),
                col("Name", "string", 1),
            ];
        }
        _ => c.push(col("Age", "string", 0)),
    }
    c
}

/// `<none>` for an empty value, as kubectl prints it.
fn or_none(v: String) -> String {
    if v.is_empty() { "<none>".into() } else { v }
}

/// The strings of a JSON array at `ptr`.
fn strings(o: &Value, ptr: &str) -> Vec<String> {
    o.pointer(ptr)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_owned).collect())
        .unwrap_or_default()
}

/// A Service's cells after its name, as kube-apiserver prints them.
fn service_cells(o: &Value) -> Vec<Value> {
    let kind = s(o.pointer("/spec/type"));
    // The simulator assigns no cluster IPs: a headless Service's `None` is
    // all there is.
    let cluster_ip = strings(o, "/spec/clusterIPs")
        .into_iter()
        .next()
        .unwrap_or_else(|| or_none(s(o.pointer("/spec/clusterIP"))));
    let external = strings(o, "/spec/externalIPs");
    let external_ip = match kind.as_str() {
        "ClusterIP" | "NodePort" => or_none(external.join(",")),
        "LoadBalancer" => {
            let mut lb: Vec<String> = o
                .pointer("/status/loadBalancer/ingress")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|i| {
                    [i.get("ip"), i.get("hostname")]
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_str)
                        .find(|v| !v.is_empty())
                        .map(str::to_owned)
                })
                .collect();
            lb.sort();
            lb.dedup();
            lb.extend(external);
            if lb.is_empty() {
                "<pending>".into()
            } else {
                lb.join(",")
            }
        }
        "ExternalName" => s(o.pointer("/spec/externalName")),
        _ => "<unknown>".into(),
    };
    let ports: Vec<String> = o
        .pointer("/spec/ports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|p| {
            let protocol = p.get("protocol").and_then(Value::as_str).unwrap_or("TCP");
            match num(p, "/nodePort") {
                0 => format!("{}/{protocol}", num(p, "/port")),
                node => format!("{}:{node}/{protocol}", num(p, "/port")),
            }
        })
        .collect();
    let selector = o
        .pointer("/spec/selector")
        .and_then(Value::as_object)
        .map(|m| {
            let mut pairs: Vec<String> = m.iter().map(|(k, v)| format!("{k}={}", s(Some(v)))).collect();
            pairs.sort();
            pairs.join(",")
        })
        .unwrap_or_default();
    vec![
        json!(kind),
        json!(cluster_ip),
        json!(external_ip),
        json!(or_none(ports.join(","))),
        json!(age(&s(o.pointer("/metadata/creationTimestamp")))),
        json!(or_none(selector)),
    ]
}

/// A Node's cells after its name, as kube-apiserver prints them.
fn node_cells(o: &Value) -> Vec<Value> {
    let ready = o
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .rfind(|c| c["type"] == "Ready");
    let mut status = vec![match ready {
        Some(c) if c["status"] == "True" => "Ready".to_owned(),
        Some(_) => "NotReady".to_owned(),
        None => "Unknown".to_owned(),
    }];
    if o.pointer("/spec/unschedulable") == Some(&json!(true)) {
        status.push("SchedulingDisabled".into());
    }
    let mut roles: Vec<String> = o
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| match k.strip_prefix("node-role.kubernetes.io/") {
            Some(role) if !role.is_empty() => Some(role.to_owned()),
            Some(_) => None,
            None => (k == "kubernetes.io/role")
                .then(|| s(Some(v)))
                .filter(|v| !v.is_empty()),
        })
        .collect();
    roles.sort();
    roles.dedup();
    let address = |kind: &str| {
        o.pointer("/status/addresses")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|a| a["type"] == kind)
            .map_or_else(|| "<none>".to_owned(), |a| s(a.get("address")))
    };
    let info = |field: &str| {
        let v = s(o.pointer(&format!("/status/nodeInfo/{field}")));
        if v.is_empty() { "<unknown>".to_owned() } else { v }
    };
    let mut kernel = info("kernelVersion");
    let arch = s(o.pointer("/status/nodeInfo/architecture"));
    if !arch.is_empty() {
        kernel = format!("{kernel} ({arch})");
    }
    vec![
        json!(status.join(",")),
        json!(or_none(roles.join(","))),
        json!(age(&s(o.pointer("/metadata/creationTimestamp")))),
        json!(s(o.pointer("/status/nodeInfo/kubeletVersion"))),
        json!(address("InternalIP")),
        json!(address("ExternalIP")),
        json!(info("osImage")),
        json!(kernel),
        json!(info("containerRuntimeVersion")),
    ]
}

/// A core/v1 Event's cells, as kube-apiserver prints them (wide).
fn event_cells(o: &Value) -> Vec<Value> {
    let since = |ptr: &str| {
        let t = s(o.pointer(ptr));
        (!t.is_empty()).then(|| age(&t))
    };
    let first = since("/firstTimestamp")
        .or_else(|| since("/eventTime"))
        .unwrap_or_else(|| "<unknown>".into());
    let mut last = since("/lastTimestamp").unwrap_or_else(|| first.clone());
    let mut count = num(o, "/count");
    if o.get("series").is_some_and(Value::is_object) {
        last = since("/series/lastObservedTime").unwrap_or_else(|| "<unknown>".into());
        count = num(o, "/series/count");
    } else if count == 0 {
        count = 1;
    }
    let kind = s(o.pointer("/involvedObject/kind")).to_lowercase();
    let name = s(o.pointer("/involvedObject/name"));
    let target = if name.is_empty() {
        kind
    } else {
        format!("{kind}/{name}")
    };
    let first_of = |a: &str, b: &str| {
        let v = s(o.pointer(a));
        if v.is_empty() { s(o.pointer(b)) } else { v }
    };
    let component = first_of("/source/component", "/reportingComponent");
    let instance = first_of("/source/host", "/reportingInstance");
    let source = if instance.is_empty() {
        component
    } else {
        format!("{component}, {instance}")
    };
    vec![
        json!(last),
        json!(s(o.get("type"))),
        json!(s(o.get("reason"))),
        json!(target),
        json!(s(o.pointer("/involvedObject/fieldPath"))),
        json!(source),
        json!(s(o.get("message")).trim()),
        json!(first),
        json!(count),
        json!(s(o.pointer("/metadata/name"))),
    ]
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
        "Service" => std::iter::once(json!(name)).chain(service_cells(o)).collect(),
        "Node" => std::iter::once(json!(name)).chain(node_cells(o)).collect(),
        "Event" => event_cells(o),
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
