//! The Helm chart in `charts/skipper`, rendered by the `helm` that `make
//! helm` builds: `helm lint --strict` is clean for its defaults and every
//! value file in `charts/skipper/ci/`; each value file renders exactly its
//! golden file (`*.golden.yaml`, rewritten with `SKIPPER_BLESS=1`);
//! the kustomize base renders the chart's default objects but for the
//! differences listed here; and the schema's `controller.flags` and
//! `router.flags` are the CLI's flags.
//!
//! Without the built helm each test says it is skipped; under `CI=true` it
//! fails instead.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use skipper::dev::playground::{EXAMPLE_POOL_YAML, manifest_documents};
use skipper_test_support::workspace_root;

/// Whether this is CI (`CI=true`), where a missing tool fails the test.
fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn chart() -> PathBuf {
    workspace_root().join("charts/skipper")
}

/// The built helm, or `None` with a message (a failure under `CI=true`).
fn helm() -> Option<PathBuf> {
    let helm = workspace_root().join("target/helm/helm");
    if helm.is_file() {
        return Some(helm);
    }
    assert!(!ci(), "helm is not built at {}: run `make helm`", helm.display());
    eprintln!(
        "skipped: helm is not built at {} (run `make helm`)",
        helm.display()
    );
    None
}

fn run(program: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(program)
        .args(args)
        .current_dir(workspace_root())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The value files of `charts/skipper/ci/`, each with the release name and
/// namespace its first line names (`# release: NAME namespace: NS`).
fn value_files() -> Vec<(PathBuf, String, String)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(chart().join("ci"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("-values.yaml"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(&f).unwrap();
            let first = text.lines().next().unwrap_or_default();
            let words: Vec<&str> = first.split_whitespace().collect();
            match words.as_slice() {
                ["#", "release:", release, "namespace:", ns] => {
                    (f.clone(), (*release).to_owned(), (*ns).to_owned())
                }
                _ => panic!(
                    "{}: the first line is not `# release: NAME namespace: NS`",
                    f.display()
                ),
            }
        })
        .collect()
}

fn render(helm: &Path, release: &str, ns: &str, extra: &[&str]) -> String {
    let chart = chart();
    let mut args = vec!["template", release, chart.to_str().unwrap(), "--namespace", ns];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = run(helm, &args);
    assert!(ok, "helm {args:?}: {stderr}");
    stdout
}

#[test]
fn helm_lint_is_clean_for_the_defaults_and_every_value_file() {
    let Some(helm) = helm() else { return };
    let chart = chart();
    let mut runs = vec![vec!["lint", "--strict", chart.to_str().unwrap()]];
    let files = value_files();
    for (f, _, _) in &files {
        runs.push(vec![
            "lint",
            "--strict",
            chart.to_str().unwrap(),
            "-f",
            f.to_str().unwrap(),
        ]);
    }
    for args in runs {
        let (ok, stdout, stderr) = run(&helm, &args);
        assert!(ok, "helm {args:?}:\n{stdout}{stderr}");
        for line in stdout.lines() {
            assert!(
                !line.starts_with("[WARNING]") && !line.starts_with("[ERROR]"),
                "helm {args:?}: {line}"
            );
        }
    }
}

#[test]
fn every_value_file_renders_its_golden_file() {
    let Some(helm) = helm() else { return };
    let files = value_files();
    assert!(
        files.len() >= 4,
        "at least four value files in charts/skipper/ci/: {files:?}"
    );
    let update = std::env::var_os("SKIPPER_BLESS").is_some();
    for (f, release, ns) in files {
        let rendered = render(&helm, &release, &ns, &["-f", f.to_str().unwrap()]);
        let golden = PathBuf::from(f.to_string_lossy().replace("-values.yaml", ".golden.yaml"));
        if update {
            std::fs::write(&golden, &rendered).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&golden)
            .unwrap_or_else(|e| panic!("{}: {e} (SKIPPER_BLESS=1 writes it)", golden.display()));
        if rendered != want {
            let line = rendered
                .lines()
                .zip(want.lines())
                .position(|(a, b)| a != b)
                .unwrap_or_else(|| rendered.lines().count().min(want.lines().count()));
            panic!(
                "{} renders differently from {} from line {} on:\n  rendered: {:?}\n  golden:   {:?}\n\
                 (SKIPPER_BLESS=1 rewrites the golden files)",
                f.display(),
                golden.display(),
                line + 1,
                rendered.lines().nth(line),
                want.lines().nth(line)
            );
        }
    }
}

#[test]
fn a_flag_the_chart_sets_itself_is_refused_naming_the_value_that_sets_it() {
    let Some(helm) = helm() else { return };
    let chart = chart();
    for (set, want) in [
        (
            "controller.flags.shutdown-timeout=9s",
            "controller.flags.shutdown-timeout: the chart sets --shutdown-timeout itself: set controller.shutdownTimeoutSeconds",
        ),
        (
            "router.flags.port=1",
            "router.flags.port: the chart sets --port itself: HTTP is on 8080",
        ),
        (
            "controller.flags.heartbeat-timout=1s",
            "additional properties 'heartbeat-timout' not allowed",
        ),
    ] {
        let (ok, _, stderr) = run(
            &helm,
            &["template", "skipper", chart.to_str().unwrap(), "--set", set],
        );
        assert!(!ok, "--set {set} renders");
        assert!(stderr.contains(want), "--set {set}: {stderr}");
    }
}

/// One object per (kind, namespace, name), without what only Helm adds.
fn objects(docs: impl IntoIterator<Item = Value>) -> BTreeMap<(String, String, String), Value> {
    const HELM_LABELS: [&str; 4] = [
        "app.kubernetes.io/instance",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/version",
        "helm.sh/chart",
    ];
    fn strip(v: &mut Value) {
        match v {
            Value::Object(m) => {
                if let Some(Value::Object(labels)) = m.get_mut("labels") {
                    for l in HELM_LABELS {
                        labels.remove(l);
                    }
                }
                for v in m.values_mut() {
                    strip(v);
                }
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    docs.into_iter()
        .filter(|d| !d.is_null())
        .map(|mut d| {
            strip(&mut d);
            let s = |p: &str| {
                d.pointer(p)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            ((s("/kind"), s("/metadata/namespace"), s("/metadata/name")), d)
        })
        .collect()
}

/// Every difference between two JSON values, as `path: a != b`.
fn differences(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = format!("{path}/{}", k.replace('~', "~0").replace('/', "~1"));
                match (x.get(k), y.get(k)) {
                    (Some(a), Some(b)) => differences(&p, a, b, out),
                    (a, b) => out.push(format!("{p}: {} != {}", show(a), show(b))),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (a, b)) in x.iter().zip(y).enumerate() {
                differences(&format!("{path}/{i}"), a, b, out);
            }
        }
        _ if a == b => {}
        _ => out.push(format!("{path}: {a} != {b}")),
    }
}

fn show(v: Option<&Value>) -> String {
    v.map_or_else(|| "(none)".to_owned(), Value::to_string)
}

#[test]
fn the_kustomize_base_renders_the_charts_default_objects_but_for_the_listed_differences() {
    let Some(helm) = helm() else { return };
    if !skipper_test_support::backend::kubectl_available() {
        assert!(!ci(), "kubectl is not installed");
        eprintln!("skipped: kubectl is not installed");
        return;
    }
    let (ok, kustomized, stderr) = run(Path::new("kubectl"), &["kustomize", "manifests/"]);
    assert!(ok, "kubectl kustomize manifests/: {stderr}");
    // The kustomize layout keeps the function namespace's objects with the
    // pool (example-pool.yaml); the chart renders them from
    // functionNamespaces.
    let pool_rbac = manifest_documents(EXAMPLE_POOL_YAML)
        .unwrap()
        .into_iter()
        .filter(|d| !matches!(d["kind"].as_str(), Some("Namespace" | "Deployment")));
    let kustomize = objects(
        manifest_documents(&kustomized)
            .unwrap()
            .into_iter()
            .chain(pool_rbac),
    );
    let chart = objects(manifest_documents(&render(&helm, "skipper", "skipper", &[])).unwrap());

    let mut found = Vec::new();
    for key in kustomize.keys().chain(chart.keys()).collect::<BTreeSet<_>>() {
        let name = format!("{} {}/{}", key.0, key.1, key.2);
        match (kustomize.get(key), chart.get(key)) {
            (Some(k), Some(c)) => {
                let mut d = Vec::new();
                differences("", k, c, &mut d);
                found.extend(d.into_iter().map(|d| format!("{name} {d}")));
            }
            (Some(_), None) => found.push(format!("{name}: only in the kustomize base")),
            (None, Some(_)) => found.push(format!("{name}: only in the chart")),
            (None, None) => unreachable!(),
        }
    }
    // kustomize · chart
    let listed = [
        // kustomization.yaml names a placeholder tag; the chart defaults to its appVersion.
        "Deployment skipper/skipper-controller /spec/template/spec/containers/0/image: \
         \"registry.example.com/skipper:latest\" != \"registry.example.com/skipper:0.1.0\"",
        "Deployment skipper/skipper-router /spec/template/spec/containers/0/image: \
         \"registry.example.com/skipper:latest\" != \"registry.example.com/skipper:0.1.0\"",
        // `helm install --create-namespace` (or the operator) makes it.
        "Namespace /skipper: only in the kustomize base",
    ];
    assert_eq!(
        found,
        listed.map(str::to_owned).to_vec(),
        "the kustomize base and the chart's defaults differ by more (or less) than listed"
    );
}

/// `(flag, help)` of every flag of `skipper <subcommand>`.
fn cli_flags(subcommand: &str) -> BTreeMap<String, String> {
    use clap::CommandFactory as _;
    let cli = skipper::cli::Cli::command();
    let sub = cli.find_subcommand(subcommand).unwrap();
    sub.get_arguments()
        .filter_map(|a| {
            Some((
                a.get_long()?.to_owned(),
                a.get_help().map(ToString::to_string).unwrap_or_default(),
            ))
        })
        .filter(|(long, _)| long != "help" && long != "version")
        .collect()
}

#[test]
fn the_schema_takes_every_flag_of_the_cli_by_its_name_with_its_help() {
    let path = chart().join("values.schema.json");
    let mut schema: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let update = std::env::var_os("SKIPPER_BLESS").is_some();
    let mut wrong = Vec::new();
    for component in ["controller", "router"] {
        let flags = cli_flags(component);
        let props = schema
            .pointer_mut(&format!("/properties/{component}/properties/flags/properties"))
            .and_then(Value::as_object_mut)
            .unwrap();
        let in_schema: BTreeSet<String> = props.keys().cloned().collect();
        let in_cli: BTreeSet<String> = flags.keys().cloned().collect();
        for f in in_cli.symmetric_difference(&in_schema) {
            wrong.push(format!(
                "{component}.flags.{f}: {}",
                if in_cli.contains(f) {
                    "a flag the schema lacks"
                } else {
                    "not a flag"
                }
            ));
        }
        if update {
            for (flag, help) in &flags {
                let entry = props
                    .entry(flag.clone())
                    .or_insert_with(|| json!({"type": ["string", "number"]}));
                let owned = entry["description"]
                    .as_str()
                    .is_some_and(|d| d.starts_with(OWNED_PREFIX));
                entry["description"] = json!(if owned {
                    format!("{OWNED_PREFIX}{help}")
                } else {
                    help.clone()
                });
            }
            props.retain(|k, _| flags.contains_key(k));
            continue;
        }
        for (flag, help) in &flags {
            let Some(d) = props.get(flag).and_then(|p| p["description"].as_str()) else {
                continue;
            };
            if d != help && d.strip_prefix(OWNED_PREFIX) != Some(help.as_str()) {
                wrong.push(format!(
                    "{component}.flags.{flag}: described {d:?}, the CLI says {help:?}"
                ));
            }
        }
    }
    if update {
        std::fs::write(&path, serde_json::to_string_pretty(&schema).unwrap() + "\n").unwrap();
        return;
    }
    assert!(
        wrong.is_empty(),
        "values.schema.json does not match the CLI (SKIPPER_BLESS=1 rewrites it):\n{}",
        wrong.join("\n")
    );
}

/// How the schema describes a flag the chart sets itself (the templates
/// refuse it naming the value that sets it).
const OWNED_PREFIX: &str = "Set by the chart itself (the template names the value that sets it): ";

/// The metric families the controller and the router serve, by base name
/// (without `_total`, `_bucket`, `_count` or `_sum`): the controller's from
/// its table of descriptions, the router's from its exposition with one
/// sample in each family.
fn served_metrics() -> BTreeSet<String> {
    let mut names: BTreeSet<String> = skipper::controller::metrics::DESCRIPTIONS
        .iter()
        .map(|(name, _)| format!("skipper_controller_{name}"))
        .collect();
    let mut registry = prometheus_client::registry::Registry::default();
    let m = skipper::router::metrics::Metrics::register(&mut registry);
    let label = skipper::router::metrics::DeploymentLabel {
        function_deployment: "any".to_owned(),
    };
    m.requests.get_or_create(&label).inc();
    m.in_flight.get_or_create(&label).inc();
    m.heartbeats.get_or_create(&label).inc();
    m.get_instance_duration.get_or_create(&label).observe(0.1);
    m.duration
        .get_or_create(&skipper::router::metrics::DurationLabels {
            function_deployment: label.function_deployment.clone(),
            status_class: "2xx".to_owned(),
        })
        .observe(0.1);
    m.controller_call("GetInstance");
    m.refused("router_waiting_full");
    for line in skipper::router::metrics::render(&registry).lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            names.extend(rest.split_whitespace().next().map(str::to_owned));
        }
    }
    names
}

fn base(name: &str) -> &str {
    ["_total", "_bucket", "_count", "_sum"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

#[test]
fn the_alerts_and_the_dashboard_query_only_metrics_skipper_serves() {
    let root = workspace_root();
    let mut text = std::fs::read_to_string(root.join("charts/skipper/templates/monitoring.yaml")).unwrap();
    text.push_str(&std::fs::read_to_string(root.join("charts/skipper/dashboards/skipper.json")).unwrap());
    let served = served_metrics();
    let mut queried = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("skipper_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        queried.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    let unknown: Vec<&String> = queried
        .iter()
        .filter(|q| q.starts_with("skipper_controller_") || q.starts_with("skipper_router_"))
        .filter(|q| !served.contains(base(q)))
        .collect();
    assert!(queried.len() >= 10, "{queried:?}");
    assert!(
        unknown.is_empty(),
        "queried but not served: {unknown:?} (served: {served:?})"
    );
}
