use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use super::*;
use crate::controller::web::history::History;
use crate::controller::web::pages::{Page, Templates, render_fragments, render_page};

const NOW: u64 = 1_800_000_000;

fn at(secs_ago: u64) -> Option<prost_types::Timestamp> {
    Some((SystemTime::UNIX_EPOCH + Duration::from_secs(NOW - secs_ago)).into())
}

fn function(ns: &str, dep: &str, tenant: &str, oneshot: bool) -> api::Function {
    api::Function {
        namespace: Some(ns.into()),
        deployment: Some(dep.into()),
        tenant: Some(tenant.into()),
        metadata: None,
        scale: Some(api::Scale {
            min_instances: Some(0),
            max_instances: Some(3),
            target_cpu_usage_milli: Some(500),
            ..Default::default()
        }),
        oneshot: Some(oneshot),
    }
}

fn instance(
    f: &api::Function,
    name: &str,
    rs: &str,
    assigned_ago: u64,
    ready_ago: Option<u64>,
) -> api::Instance {
    api::Instance {
        function: Some(f.clone()),
        name: Some(name.into()),
        addr: Some("127.0.1.5:8888".into()),
        replica_set: Some(rs.into()),
        assigned_at: at(assigned_ago),
        ready_at: ready_ago.and_then(at),
        cpu_usage_milli: Some(12),
        memory_usage_mib: Some(30),
        protocol: None,
    }
}

fn beat(router: &str, f: &api::Function, ago: u64, in_flight: u32) -> api::HeartbeatState {
    api::HeartbeatState {
        router_ip: Some(router.into()),
        heartbeat: Some(api::Heartbeat {
            function: Some(f.clone()),
            timestamp: at(ago),
            in_flight_requests: Some(in_flight),
        }),
    }
}

/// Two controllers; `web/acme` healthy with a stale instance (rollout),
/// `web/beta` waiting (one pending), `api/acme` with a stuck instance and a
/// stale heartbeat, and a oneshot `web/acme`.
fn state() -> api::ClusterState {
    let web_acme = function("fns", "web", "acme", false);
    let web_beta = function("fns", "web", "beta", false);
    let api_acme = function("fns", "api", "acme", false);
    let web_acme_once = function("fns", "web", "acme", true);
    let sup = |f: &api::Function, instances, beats, owner: &str| api::SupervisorState {
        function: Some(f.clone()),
        instances,
        router_heartbeats: beats,
        responsible_controller_ip: Some(owner.into()),
        active_replica_set: Some("web-new".into()),
        recent_recommendations: vec![api::ScaleRecommendation {
            timestamp: at(15),
            decision: Some(api::ScaleDecision {
                desired_instances: Some(2),
                unclamped_desired_instances: Some(5),
                reason: Some(ScaleReason::Cpu as i32),
                metrics: vec![api::ScaleMetric {
                    name: Some("cpu".into()),
                    value: Some(1.25),
                }],
            }),
            acted: Some(true),
            ticks: Some(3),
            since: at(45),
        }],
    };
    api::ClusterState {
        pod_ip: Some("10.0.0.1".into()),
        started_at: at(3725),
        controller_ips: vec!["10.0.0.1".into(), "10.0.0.2".into()],
        supervisors: vec![
            sup(
                &web_acme,
                vec![
                    instance(&web_acme, "web-a", "web-new", 100, Some(99)),
                    instance(&web_acme, "web-b", "web-old", 200, Some(199)),
                ],
                vec![beat("10.1.0.1", &web_acme, 2, 3)],
                "10.0.0.1",
            ),
            sup(
                &web_beta,
                vec![instance(&web_beta, "web-c", "web-new", 5, None)],
                vec![],
                "10.0.0.2",
            ),
            sup(
                &api_acme,
                vec![
                    instance(&api_acme, "api-a", "", 300, None),
                    instance(&api_acme, "api-b", "", 300, Some(290)),
                ],
                vec![
                    beat("10.1.0.2", &api_acme, 120, 4),
                    beat("10.1.0.3", &api_acme, 300, 0),
                ],
                "10.0.0.2",
            ),
            sup(&web_acme_once, vec![], vec![], "10.0.0.1"),
        ],
        events: vec![
            api::Event {
                timestamp: at(3),
                function: Some(web_beta.clone()),
                r#type: Some(EventType::PodAssigned as i32),
                message: Some("assigned pod web-c".into()),
                severity: Some(EventSeverity::Info as i32),
            },
            api::Event {
                timestamp: at(400),
                function: Some(api_acme.clone()),
                r#type: Some(EventType::StuckInstanceCleanup as i32),
                message: Some("terminated stuck instance api-z".into()),
                severity: Some(EventSeverity::Warn as i32),
            },
        ],
        config: vec![api::ConfigValue {
            name: Some("paseto-private-key".into()),
            value: Some("****".into()),
            description: Some("key".into()),
        }],
    }
}

fn model_of(state: &api::ClusterState, history: &History) -> Model {
    let pools = HashMap::from([(
        "web".to_owned(),
        Pool {
            size: 5,
            unassigned_ready: 2,
            assigned: 3,
        },
    )]);
    Model::build(&Input {
        state,
        now: SystemTime::UNIX_EPOCH + Duration::from_secs(NOW),
        generation: 7,
        history: &history.functions,
        totals: &history.totals,
        pools: &pools,
        window: Duration::from_secs(900),
    })
}

fn model() -> Model {
    model_of(&state(), &History::new(Duration::from_secs(900)))
}

#[test]
fn formatting_matches_the_go_ui() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(NOW);
    let ago_s = |s: u64| ago(now, now - Duration::from_secs(s));
    assert_eq!(ago_s(0), "0s ago");
    assert_eq!(ago_s(59), "59s ago");
    assert_eq!(ago_s(61), "1m ago");
    assert_eq!(ago_s(7200), "2h ago");
    assert_eq!(ago_s(3 * 86_400), "3d ago");
    assert_eq!(ago(now, now + Duration::from_secs(5)), "just now");
    assert_eq!(ago_opt(now, None), "—");
    assert_eq!(duration(Duration::from_secs(45)), "45s");
    assert_eq!(duration(Duration::from_secs(120)), "2m");
    assert_eq!(duration(Duration::from_secs(125)), "2m 5s");
    assert_eq!(duration(Duration::from_secs(3725)), "1h 2m");
    assert_eq!(
        path_escape("default:web-app:tenant-1"),
        "default%3Aweb-app%3Atenant-1"
    );
    assert_eq!(path_escape("a b/c"), "a%20b%2Fc");
}

#[test]
fn function_keys_keep_the_go_form_and_separate_oneshot() {
    let m = model();
    let keys: Vec<&str> = m.functions.iter().map(|f| f.key.as_str()).collect();
    assert_eq!(
        keys,
        vec![
            "fns:api:acme",
            "fns:web:acme",
            "fns:web:acme:oneshot",
            "fns:web:beta"
        ]
    );
    let f = m.function("fns:web:acme").unwrap();
    assert_eq!(f.url, "/functions/fns%3Aweb%3Aacme");
    assert!(!f.oneshot);
    assert!(m.function("fns:web:acme:oneshot").unwrap().oneshot);
}

#[test]
fn instance_status_counts_and_targets() {
    let m = model();
    let f = m.function("fns:web:acme").unwrap();
    assert_eq!((f.ready, f.pending, f.total, f.stale), (2, 0, 2, 1));
    let status: Vec<&str> = f.instances.iter().map(|i| i.status).collect();
    assert_eq!(status, vec!["ready", "stale"]);
    assert_eq!(f.instances[0].startup, "1000 ms");
    assert_eq!(f.instances[0].cpu, "12m");
    assert_eq!(f.target_cpu, "500m");
    assert_eq!(f.target_memory, "—");
    assert_eq!((f.routers, f.in_flight), (1, 3));
    assert_eq!(f.last_activity, "2s ago");
    let r = &f.recommendations[0];
    assert_eq!((r.desired, r.unclamped, r.clamped, r.reason), (2, 5, true, "cpu"));
    assert_eq!(r.metrics, "cpu: 1.2");
    assert_eq!(
        (r.ticks, r.since.as_str(), r.when.as_str()),
        (3, "45s ago", "15s ago")
    );
    let api = m.function("fns:api:acme").unwrap();
    assert_eq!(api.stuck, 1, "unready and assigned 300s ago");
    let beta = m.function("fns:web:beta").unwrap();
    assert_eq!(beta.stuck, 0, "assigned 5s ago is not stuck yet");
}

#[test]
fn health_lists_each_problem_once() {
    let m = model();
    let titles: Vec<(&str, &str, usize)> = m.issues.iter().map(|i| (i.level, i.title, i.count)).collect();
    assert_eq!(
        titles,
        vec![
            ("red", "Stuck instances", 1),
            ("yellow", "Functions waiting for pods", 1),
            ("yellow", "Stale heartbeats", 1),
            ("yellow", "Stale instances", 1),
        ]
    );
    assert_eq!(m.issues[1].items[0].0, "fns:web:beta");
    let mut healthy = state();
    healthy.supervisors.truncate(1);
    healthy.supervisors[0].instances.truncate(1);
    let m = model_of(&healthy, &History::new(Duration::from_secs(900)));
    assert!(m.issues.is_empty(), "{:?}", m.issues);
}

#[test]
fn stats_controllers_routers_tenants_deployments() {
    let m = model();
    assert_eq!(m.stats.tenants, 2);
    assert_eq!(m.stats.functions, 4);
    assert_eq!(m.stats.deployments, 2);
    assert_eq!((m.stats.ready, m.stats.pending, m.stats.total), (3, 2, 5));
    assert_eq!(m.stats.uptime, "1h 2m");
    assert_eq!(m.stats.controllers, 2);
    let c: Vec<(&str, bool, usize)> = m
        .controllers
        .iter()
        .map(|c| (c.ip.as_str(), c.is_self, c.functions))
        .collect();
    assert_eq!(c, vec![("10.0.0.1", true, 2), ("10.0.0.2", false, 2)]);
    let share: f64 = m.ring.iter().map(|s| s.percent.parse::<f64>().unwrap()).sum();
    assert!(
        (share - 100.0).abs() < 0.1,
        "the ring bar covers the key space: {share}"
    );
    assert!(!m.ring_imbalanced);
    let routers: Vec<(&str, usize, bool)> = m
        .routers
        .iter()
        .map(|r| (r.ip.as_str(), r.functions, r.quiet))
        .collect();
    assert_eq!(
        routers,
        vec![
            ("10.1.0.1", 1, false),
            ("10.1.0.2", 1, true),
            ("10.1.0.3", 1, true)
        ]
    );
    let beats: Vec<(bool, bool)> = m
        .function("fns:api:acme")
        .unwrap()
        .heartbeats
        .iter()
        .map(|h| (h.quiet, h.stale))
        .collect();
    assert_eq!(
        beats,
        vec![(true, true), (true, false)],
        "quiet with requests in flight is stale; idle is not"
    );
    let acme = m.tenants.iter().find(|t| t.tenant == "acme").unwrap();
    assert_eq!((acme.functions, acme.ready, acme.total), (3, 3, 4));
    assert_eq!(acme.deployments, vec!["api", "web"]);
    let web = m.deployments.iter().find(|d| d.name == "web").unwrap();
    assert_eq!((web.tenants, web.functions, web.max_sum), (2, 3, 9));
    assert_eq!((web.pool_size, web.unassigned_ready, web.assigned), (5, 2, 3));
    assert_eq!(web.utilisation, "33%");
    assert_eq!(m.events[0].kind, "pod assigned");
    assert_eq!(m.events[1].severity, "warn");
}

#[test]
fn imbalance_is_half_the_mean() {
    assert!(!imbalanced(&[10, 10, 10]));
    assert!(!imbalanced(&[10, 14, 6]));
    assert!(imbalanced(&[10, 16, 4]));
    assert!(!imbalanced(&[0, 0]));
    assert!(!imbalanced(&[5]));
}

#[test]
fn filters_search_sort_and_severity() {
    let m = model();
    let keys = |rows: Vec<&FunctionRow>| rows.iter().map(|f| f.key.clone()).collect::<Vec<_>>();
    assert_eq!(
        keys(filter_functions(&m.functions, "BETA", "", Dir::Asc)),
        vec!["fns:web:beta"]
    );
    assert_eq!(
        keys(filter_functions(&m.functions, "", "instances", Dir::Desc))[..2],
        ["fns:web:acme".to_owned(), "fns:api:acme".to_owned()]
    );
    assert_eq!(
        keys(filter_functions(&m.functions, "", "deployment", Dir::Asc))[0],
        "fns:api:acme"
    );
    let t = filter_tenants(&m.tenants, "api", "", Dir::Asc);
    assert_eq!(
        t.iter().map(|t| t.tenant.as_str()).collect::<Vec<_>>(),
        vec!["acme"]
    );
    let t = filter_tenants(&m.tenants, "", "functions", Dir::Desc);
    assert_eq!(t[0].tenant, "acme");
    assert_eq!(filter_events(&m.events, "", "2").len(), 1);
    assert_eq!(filter_events(&m.events, "", "1").len(), 1);
    assert_eq!(filter_events(&m.events, "WEB:beta", "").len(), 1);
    assert_eq!(filter_events(&m.events, "", "").len(), 2);
}

#[test]
fn charts_step_through_the_window() {
    let mut h = History::new(Duration::from_secs(900));
    let f = Function::from(&function("fns", "web", "acme", false));
    h.sample(NOW - 1200, &[(f.id(), 1, 1)]);
    h.sample(NOW - 600, &[(f.id(), 1, 2)]);
    h.sample(NOW - 300, &[(f.id(), 2, 2)]);
    let start = SystemTime::UNIX_EPOCH + Duration::from_secs(NOW - 900);
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(NOW);
    let s = &h.functions[&f.id()];
    let p = steps(s, start, now);
    let v: Vec<(u64, u16, u16)> = p.iter().map(|p| (NOW - p.at, p.ready, p.total)).collect();
    assert_eq!(v, vec![(900, 1, 1), (600, 1, 2), (300, 2, 2), (0, 2, 2)]);
    let svg = chart(s, start, now, 640, 140);
    assert!(
        svg.starts_with("<svg") && svg.contains("polyline class=\"ready\""),
        "{svg}"
    );
    assert!(svg.contains(">2</text>"), "the y axis shows the maximum: {svg}");
    let spark = sparkline(&Series::default(), start, now);
    assert!(spark.contains("points=\"\""), "no data, no line: {spark}");
    let m = model_of(&state(), &h);
    assert!(m.charts["fns:web:acme"].contains("points=\"0.0,"));
}

fn all_pages() -> Vec<Page> {
    vec![
        Page::Dashboard,
        Page::Functions {
            search: String::new(),
            sort: String::new(),
            dir: Dir::Asc,
        },
        Page::Functions {
            search: "acme".into(),
            sort: "instances".into(),
            dir: Dir::Desc,
        },
        Page::Function {
            key: "fns:web:acme".into(),
        },
        Page::Function {
            key: "fns:nope:x".into(),
        },
        Page::Controllers,
        Page::Controller {
            ip: "10.0.0.2".into(),
        },
        Page::Controller {
            ip: "10.9.9.9".into(),
        },
        Page::Routers,
        Page::Router {
            ip: "10.1.0.1".into(),
        },
        Page::Router {
            ip: "10.1.9.9".into(),
        },
        Page::Instance { name: "web-a".into() },
        Page::Instance { name: "gone".into() },
        Page::Tenants {
            search: String::new(),
            sort: "deployments".into(),
            dir: Dir::Asc,
        },
        Page::Tenant {
            tenant: "acme".into(),
        },
        Page::Tenant {
            tenant: "nobody".into(),
        },
        Page::Deployments,
        Page::Deployment { name: "web".into() },
        Page::Deployment { name: "none".into() },
        Page::Events {
            function: String::new(),
            severity: String::new(),
        },
        Page::Events {
            function: "web".into(),
            severity: "2".into(),
        },
        Page::Config,
    ]
}

#[test]
fn every_page_and_fragment_renders_from_the_compiled_in_templates() {
    let env = Templates::new(None).unwrap().env();
    let full = model();
    let empty = model_of(
        &api::ClusterState::default(),
        &History::new(Duration::from_secs(900)),
    );
    for m in [&full, &empty] {
        for page in all_pages() {
            let (html, found) = render_page(&env, &page, m).unwrap_or_else(|e| panic!("{page:?}: {e:#}"));
            // minijinja escapes '/' in text and attributes.
            let html = html.replace("&#x2f;", "/");
            assert!(html.starts_with("<!doctype html>"), "{page:?}");
            for id in page.fragments() {
                assert!(html.contains(&format!("id=\"{id}\"")), "{page:?} has #{id}");
            }
            if let Some(sse) = page.sse() {
                assert!(html.contains(&format!("data-sse=\"{sse}")), "{page:?}: {sse}");
            }
            let fragments = render_fragments(&env, &page, m).unwrap_or_else(|e| panic!("{page:?}: {e:#}"));
            assert_eq!(fragments.len(), page.fragments().len());
            let _ = found;
        }
    }
    let (html, found) = render_page(
        &env,
        &Page::Function {
            key: "fns:web:acme".into(),
        },
        &full,
    )
    .unwrap();
    assert!(found);
    assert!(html.contains("web-a") && html.contains("Rollout in progress — 1 stale / 1 current instances"));
    let (_, found) = render_page(
        &env,
        &Page::Function {
            key: "fns:nope:x".into(),
        },
        &full,
    )
    .unwrap();
    assert!(!found);
    let (html, _) = render_page(&env, &Page::Config, &full).unwrap();
    assert!(html.contains("****"));
    let (html, _) = render_page(&env, &Page::Dashboard, &full).unwrap();
    assert!(html.contains("Stuck instances"));
    assert!(!html.contains("<script>"), "no inline scripts");
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "nothing from outside the binary"
    );
}

#[test]
fn user_text_is_escaped() {
    let mut s = state();
    s.events[0].message = Some("<img src=x onerror=alert(1)>".into());
    let m = model_of(&s, &History::new(Duration::from_secs(900)));
    let env = Templates::new(None).unwrap().env();
    let (html, _) = render_page(
        &env,
        &Page::Events {
            function: String::new(),
            severity: String::new(),
        },
        &m,
    )
    .unwrap();
    assert!(html.contains("&lt;img src=x onerror=alert(1)&gt;"));
    assert!(!html.contains("<img src=x"));
}
