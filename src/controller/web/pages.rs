//! The pages: which template and fragments each one has, its live-update
//! route, and the context it renders from a [`Model`]. Templates are
//! compiled into the binary; with `--web-template-dir DIR` they are read
//! from `DIR/templates/` on every request instead (and static files from
//! `DIR/static/`), for working on them without rebuilding.

use std::path::PathBuf;
use std::sync::Arc;

use minijinja::{Environment, Value, context};
use serde::Serialize;

use super::model::{
    Dir, FunctionRow, MAX_ROWS, Model, filter_events, filter_functions, filter_tenants, path_escape,
};

/// The templates compiled into the binary, by name.
pub const TEMPLATES: &[(&str, &str)] = &[
    ("layout.html", include_str!("templates/layout.html")),
    ("macros.html", include_str!("templates/macros.html")),
    (
        "pages/dashboard.html",
        include_str!("templates/pages/dashboard.html"),
    ),
    (
        "pages/functions.html",
        include_str!("templates/pages/functions.html"),
    ),
    (
        "pages/function.html",
        include_str!("templates/pages/function.html"),
    ),
    (
        "pages/controllers.html",
        include_str!("templates/pages/controllers.html"),
    ),
    (
        "pages/controller.html",
        include_str!("templates/pages/controller.html"),
    ),
    ("pages/routers.html", include_str!("templates/pages/routers.html")),
    ("pages/router.html", include_str!("templates/pages/router.html")),
    (
        "pages/instance.html",
        include_str!("templates/pages/instance.html"),
    ),
    ("pages/tenants.html", include_str!("templates/pages/tenants.html")),
    ("pages/tenant.html", include_str!("templates/pages/tenant.html")),
    (
        "pages/deployments.html",
        include_str!("templates/pages/deployments.html"),
    ),
    (
        "pages/deployment.html",
        include_str!("templates/pages/deployment.html"),
    ),
    ("pages/events.html", include_str!("templates/pages/events.html")),
    ("pages/config.html", include_str!("templates/pages/config.html")),
    (
        "pages/not_found.html",
        include_str!("templates/pages/not_found.html"),
    ),
    (
        "fragments/health-indicators.html",
        include_str!("templates/fragments/health-indicators.html"),
    ),
    (
        "fragments/dashboard-stats.html",
        include_str!("templates/fragments/dashboard-stats.html"),
    ),
    (
        "fragments/cluster-chart.html",
        include_str!("templates/fragments/cluster-chart.html"),
    ),
    (
        "fragments/top-deployments.html",
        include_str!("templates/fragments/top-deployments.html"),
    ),
    (
        "fragments/ring-ownership.html",
        include_str!("templates/fragments/ring-ownership.html"),
    ),
    (
        "fragments/supervisors-table.html",
        include_str!("templates/fragments/supervisors-table.html"),
    ),
    (
        "fragments/recent-activity.html",
        include_str!("templates/fragments/recent-activity.html"),
    ),
    (
        "fragments/functions-table.html",
        include_str!("templates/fragments/functions-table.html"),
    ),
    (
        "fragments/function-summary.html",
        include_str!("templates/fragments/function-summary.html"),
    ),
    (
        "fragments/function-chart.html",
        include_str!("templates/fragments/function-chart.html"),
    ),
    (
        "fragments/instances-table.html",
        include_str!("templates/fragments/instances-table.html"),
    ),
    (
        "fragments/router-heartbeats.html",
        include_str!("templates/fragments/router-heartbeats.html"),
    ),
    (
        "fragments/recommendations.html",
        include_str!("templates/fragments/recommendations.html"),
    ),
    (
        "fragments/controllers-table.html",
        include_str!("templates/fragments/controllers-table.html"),
    ),
    (
        "fragments/ring-distribution.html",
        include_str!("templates/fragments/ring-distribution.html"),
    ),
    (
        "fragments/controller-detail.html",
        include_str!("templates/fragments/controller-detail.html"),
    ),
    (
        "fragments/routers-table.html",
        include_str!("templates/fragments/routers-table.html"),
    ),
    (
        "fragments/router-detail.html",
        include_str!("templates/fragments/router-detail.html"),
    ),
    (
        "fragments/instance-detail.html",
        include_str!("templates/fragments/instance-detail.html"),
    ),
    (
        "fragments/tenants-table.html",
        include_str!("templates/fragments/tenants-table.html"),
    ),
    (
        "fragments/tenant-detail.html",
        include_str!("templates/fragments/tenant-detail.html"),
    ),
    (
        "fragments/deployments-table.html",
        include_str!("templates/fragments/deployments-table.html"),
    ),
    (
        "fragments/deployment-detail.html",
        include_str!("templates/fragments/deployment-detail.html"),
    ),
    (
        "fragments/events-table.html",
        include_str!("templates/fragments/events-table.html"),
    ),
];

/// The static files compiled into the binary: `(path, content type, body)`.
pub const STATIC: &[(&str, &str, &str)] = &[
    (
        "skipper.css",
        "text/css; charset=utf-8",
        include_str!("static/skipper.css"),
    ),
    (
        "skipper.js",
        "text/javascript; charset=utf-8",
        include_str!("static/skipper.js"),
    ),
];

/// Where templates come from.
#[derive(Debug, Clone)]
pub enum Templates {
    /// Compiled in, parsed once.
    Embedded(Arc<Environment<'static>>),
    /// Read from `DIR/templates/` on every request (`--web-template-dir`).
    Dir(PathBuf),
}

impl Templates {
    /// The compiled-in templates, or `dir`'s when given.
    ///
    /// # Errors
    /// When a compiled-in template does not parse (a build defect the
    /// tests catch).
    pub fn new(dir: Option<PathBuf>) -> Result<Self, minijinja::Error> {
        if let Some(dir) = dir {
            return Ok(Self::Dir(dir));
        }
        let mut env = base_env();
        for (name, source) in TEMPLATES {
            env.add_template(name, source)?;
        }
        Ok(Self::Embedded(Arc::new(env)))
    }

    /// The environment to render with.
    #[must_use]
    pub fn env(&self) -> Arc<Environment<'static>> {
        match self {
            Self::Embedded(env) => env.clone(),
            Self::Dir(dir) => {
                let mut env = base_env();
                let root = dir.join("templates");
                env.set_loader(move |name| {
                    if !safe_path(name) {
                        return Ok(None);
                    }
                    match std::fs::read_to_string(root.join(name)) {
                        Ok(s) => Ok(Some(s)),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                        Err(e) => Err(minijinja::Error::new(
                            minijinja::ErrorKind::InvalidOperation,
                            format!("cannot read template {name}: {e}"),
                        )),
                    }
                });
                Arc::new(env)
            }
        }
    }

    /// Whether rendered pages may be cached (not in template-dir mode).
    #[must_use]
    pub fn cacheable(&self) -> bool {
        matches!(self, Self::Embedded(_))
    }

    /// A static file: `(content type, body)`.
    #[must_use]
    pub fn static_file(&self, path: &str) -> Option<(&'static str, Vec<u8>)> {
        let (_, content_type, body) = STATIC.iter().find(|(p, _, _)| *p == path)?;
        match self {
            Self::Embedded(_) => Some((content_type, body.as_bytes().to_vec())),
            Self::Dir(dir) => {
                if !safe_path(path) {
                    return None;
                }
                std::fs::read(dir.join("static").join(path))
                    .ok()
                    .map(|b| (*content_type, b))
            }
        }
    }
}

/// A relative path of plain segments (no `..`, no absolute path).
fn safe_path(p: &str) -> bool {
    !p.is_empty()
        && !p.starts_with('/')
        && p.split('/').all(|seg| {
            !seg.is_empty()
                && seg != ".."
                && seg != "."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        })
}

fn base_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    // Block tags on lines of their own leave no blank lines behind. The
    // builder only fails for conflicting delimiters, which these are not.
    if let Ok(syntax) = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        env.set_syntax(syntax);
    }
    env
}

/// A serde value for a template context.
fn ser<T: Serialize>(v: T) -> Value {
    Value::from(minijinja::value::Serde(v))
}

/// A page and its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Page {
    Dashboard,
    Functions { search: String, sort: String, dir: Dir },
    Function { key: String },
    Controllers,
    Controller { ip: String },
    Routers,
    Router { ip: String },
    Instance { name: String },
    Tenants { search: String, sort: String, dir: Dir },
    Tenant { tenant: String },
    Deployments,
    Deployment { name: String },
    Events { function: String, severity: String },
    Config,
}

/// `(name, url, label)` of the navigation tabs.
const NAV: &[(&str, &str, &str)] = &[
    ("dashboard", "/", "Dashboard"),
    ("functions", "/functions", "Functions"),
    ("tenants", "/tenants", "Tenants"),
    ("deployments", "/deployments", "Deployments"),
    ("controllers", "/controllers", "Controllers"),
    ("routers", "/routers", "Routers"),
    ("events", "/events", "Events"),
    ("config", "/config", "Config"),
];

fn query(pairs: &[(&str, &str)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", path_escape(v)))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

fn rows<T: Serialize>(all: &[&T]) -> (Value, usize, usize) {
    let shown = all.len().min(MAX_ROWS);
    (ser(&all[..shown]), shown, all.len())
}

impl Page {
    /// The page's template.
    #[must_use]
    pub fn template(&self) -> &'static str {
        match self {
            Self::Dashboard => "pages/dashboard.html",
            Self::Functions { .. } => "pages/functions.html",
            Self::Function { .. } => "pages/function.html",
            Self::Controllers => "pages/controllers.html",
            Self::Controller { .. } => "pages/controller.html",
            Self::Routers => "pages/routers.html",
            Self::Router { .. } => "pages/router.html",
            Self::Instance { .. } => "pages/instance.html",
            Self::Tenants { .. } => "pages/tenants.html",
            Self::Tenant { .. } => "pages/tenant.html",
            Self::Deployments => "pages/deployments.html",
            Self::Deployment { .. } => "pages/deployment.html",
            Self::Events { .. } => "pages/events.html",
            Self::Config => "pages/config.html",
        }
    }

    /// The ids of the elements live updates replace (each is also the
    /// template `fragments/<id>.html`).
    #[must_use]
    pub fn fragments(&self) -> &'static [&'static str] {
        match self {
            Self::Dashboard => &[
                "health-indicators",
                "dashboard-stats",
                "cluster-chart",
                "top-deployments",
                "ring-ownership",
                "supervisors-table",
                "recent-activity",
            ],
            Self::Functions { .. } => &["functions-table"],
            Self::Function { .. } => &[
                "function-summary",
                "function-chart",
                "instances-table",
                "router-heartbeats",
                "recommendations",
            ],
            Self::Controllers => &["controllers-table", "ring-distribution"],
            Self::Controller { .. } => &["controller-detail"],
            Self::Routers => &["routers-table"],
            Self::Router { .. } => &["router-detail"],
            Self::Instance { .. } => &["instance-detail"],
            Self::Tenants { .. } => &["tenants-table"],
            Self::Tenant { .. } => &["tenant-detail"],
            Self::Deployments => &["deployments-table"],
            Self::Deployment { .. } => &["deployment-detail"],
            Self::Events { .. } => &["events-table"],
            Self::Config => &[],
        }
    }

    /// The page's query string (`?a=b`, canonical; empty without
    /// parameters).
    #[must_use]
    pub fn query(&self) -> String {
        match self {
            Self::Functions { search, sort, dir } | Self::Tenants { search, sort, dir } => query(&[
                ("search", search),
                ("sort", sort),
                ("dir", if *dir == Dir::Desc { "desc" } else { "" }),
            ]),
            Self::Events { function, severity } => query(&[("function", function), ("severity", severity)]),
            _ => String::new(),
        }
    }

    /// The live-update route (as in the Go implementation), with the
    /// page's query; `None` for pages that do not change.
    #[must_use]
    pub fn sse(&self) -> Option<String> {
        let path = match self {
            Self::Dashboard => "/sse/dashboard".to_owned(),
            Self::Functions { .. } => "/sse/functions".to_owned(),
            Self::Function { key } => format!("/sse/function/{}", path_escape(key)),
            Self::Controllers => "/sse/controllers".to_owned(),
            Self::Controller { ip } => format!("/sse/controller/{}", path_escape(ip)),
            Self::Routers => "/sse/routers".to_owned(),
            Self::Router { ip } => format!("/sse/router/{}", path_escape(ip)),
            Self::Instance { name } => format!("/sse/instance/{}", path_escape(name)),
            Self::Tenants { .. } => "/sse/tenants".to_owned(),
            Self::Tenant { tenant } => format!("/sse/tenant/{}", path_escape(tenant)),
            Self::Deployments => "/sse/deployments".to_owned(),
            Self::Deployment { name } => format!("/sse/deployment/{}", path_escape(name)),
            Self::Events { .. } => "/sse/events".to_owned(),
            Self::Config => return None,
        };
        Some(path)
    }

    fn nav(&self) -> &'static str {
        match self {
            Self::Dashboard => "dashboard",
            Self::Functions { .. } | Self::Function { .. } | Self::Instance { .. } => "functions",
            Self::Controllers | Self::Controller { .. } => "controllers",
            Self::Routers | Self::Router { .. } => "routers",
            Self::Tenants { .. } | Self::Tenant { .. } => "tenants",
            Self::Deployments | Self::Deployment { .. } => "deployments",
            Self::Events { .. } => "events",
            Self::Config => "config",
        }
    }

    /// The context the page and its fragments render from, and whether the
    /// object a detail page names exists.
    #[must_use]
    #[allow(clippy::too_many_lines)]
    pub fn context(&self, m: &Model) -> (Value, bool) {
        let (title, found, extra) = match self {
            Self::Dashboard => {
                let mut top: Vec<_> = m.deployments.iter().collect();
                top.sort_by(|a, b| b.tenants.cmp(&a.tenants).then_with(|| a.name.cmp(&b.name)));
                top.truncate(5);
                let all: Vec<&FunctionRow> = m.functions.iter().collect();
                let (functions, shown, total) = rows(&all);
                let ctx = context! {
                    issues => ser(&m.issues),
                    stats => ser(&m.stats),
                    top => ser(&top),
                    ring => ser(&m.ring),
                    controllers => ser(&m.controllers),
                    functions, shown, total,
                    events => ser(m.events.iter().take(5).collect::<Vec<_>>()),
                    chart => Value::from_safe_string(m.cluster_chart.clone()),
                };
                ("Dashboard".to_owned(), true, ctx)
            }
            Self::Functions { search, sort, dir } => {
                let sort = if sort.is_empty() {
                    "deployment"
                } else {
                    sort.as_str()
                };
                let all = filter_functions(&m.functions, search, sort, *dir);
                let (functions, shown, total) = rows(&all);
                let ctx = context! {
                    functions, shown, total,
                    search, sort, dir => dir.as_str(),
                    all_count => m.functions.len(),
                };
                ("Functions".to_owned(), true, ctx)
            }
            Self::Function { key } => {
                let f = m.function(key);
                let chart = m.charts.get(key).cloned().unwrap_or_default();
                let ctx = context! {
                    key,
                    function => ser(f),
                    chart => Value::from_safe_string(chart),
                };
                (key.clone(), f.is_some(), ctx)
            }
            Self::Controllers => {
                let ctx = context! {
                    controllers => ser(&m.controllers),
                    ring => ser(&m.ring),
                    imbalanced => m.ring_imbalanced,
                };
                ("Controllers".to_owned(), true, ctx)
            }
            Self::Controller { ip } => {
                let c = m.controllers.iter().find(|c| c.ip == *ip);
                let owned: Vec<&FunctionRow> = m.functions.iter().filter(|f| f.responsible == *ip).collect();
                let (functions, shown, total) = rows(&owned);
                let ctx = context! {
                    ip,
                    controller => ser(c),
                    functions, shown, total,
                };
                (format!("Controller {ip}"), c.is_some(), ctx)
            }
            Self::Routers => {
                let ctx = context! { routers => ser(&m.routers) };
                ("Routers".to_owned(), true, ctx)
            }
            Self::Router { ip } => {
                let r = m.routers.iter().find(|r| r.ip == *ip);
                let beats: Vec<_> = m
                    .functions
                    .iter()
                    .flat_map(|f| f.heartbeats.iter())
                    .filter(|h| h.router == *ip)
                    .collect();
                let (heartbeats, shown, total) = rows(&beats);
                let ctx = context! {
                    ip,
                    router => ser(r),
                    heartbeats, shown, total,
                };
                (format!("Router {ip}"), r.is_some(), ctx)
            }
            Self::Instance { name } => {
                let found = m.instance(name);
                let ctx = context! {
                    name,
                    instance => ser(found.map(|(_, i)| i)),
                    function => ser(found.map(|(f, _)| f)),
                };
                (name.clone(), found.is_some(), ctx)
            }
            Self::Tenants { search, sort, dir } => {
                let sort = if sort.is_empty() { "tenant" } else { sort.as_str() };
                let all = filter_tenants(&m.tenants, search, sort, *dir);
                let (tenants, shown, total) = rows(&all);
                let ctx = context! {
                    tenants, shown, total,
                    search, sort, dir => dir.as_str(),
                    all_count => m.tenants.len(),
                };
                ("Tenants".to_owned(), true, ctx)
            }
            Self::Tenant { tenant } => {
                let t = m.tenants.iter().find(|t| t.tenant == *tenant);
                let fns: Vec<&FunctionRow> = m.functions.iter().filter(|f| f.tenant == *tenant).collect();
                let (functions, shown, total) = rows(&fns);
                let ctx = context! {
                    tenant_name => tenant,
                    tenant => ser(t),
                    functions, shown, total,
                };
                (format!("Tenant {tenant}"), t.is_some(), ctx)
            }
            Self::Deployments => {
                let all: Vec<_> = m.deployments.iter().collect();
                let (deployments, shown, total) = rows(&all);
                let ctx = context! { deployments, shown, total };
                ("Deployments".to_owned(), true, ctx)
            }
            Self::Deployment { name } => {
                let d = m.deployments.iter().find(|d| d.name == *name);
                let fns: Vec<&FunctionRow> = m.functions.iter().filter(|f| f.deployment == *name).collect();
                let (functions, shown, total) = rows(&fns);
                let ctx = context! {
                    name,
                    deployment => ser(d),
                    functions, shown, total,
                };
                (format!("Deployment {name}"), d.is_some(), ctx)
            }
            Self::Events { function, severity } => {
                let all = filter_events(&m.events, function, severity);
                let ctx = context! {
                    events => ser(&all),
                    function, severity,
                    all_count => m.events.len(),
                };
                ("Events".to_owned(), true, ctx)
            }
            Self::Config => {
                let ctx = context! { config => ser(&m.config) };
                ("Configuration".to_owned(), true, ctx)
            }
        };
        let sse = self
            .sse()
            .map(|p| format!("{p}{}", self.query()))
            .unwrap_or_default();
        let ctx = context! {
            title,
            found,
            nav => self.nav(),
            tabs => ser(NAV),
            sse,
            self_ip => &m.self_ip,
            taken => &m.taken,
            ..extra
        };
        (ctx, found)
    }
}

/// Renders a page; the flag says whether the object a detail page names
/// exists (the page is then answered 404, still live: it fills in when the
/// object appears).
///
/// # Errors
/// A template error (its text is the 500 answer).
pub fn render_page(
    env: &Environment<'_>,
    page: &Page,
    m: &Model,
) -> Result<(String, bool), minijinja::Error> {
    let (ctx, found) = page.context(m);
    let html = env.get_template(page.template())?.render(ctx)?;
    Ok((html, found))
}

/// Renders the page for a path nothing serves.
///
/// # Errors
/// A template error.
pub fn render_not_found(env: &Environment<'_>, m: &Model, path: &str) -> Result<String, minijinja::Error> {
    let ctx = context! {
        title => "Not found",
        found => false,
        nav => "",
        tabs => ser(NAV),
        sse => "",
        self_ip => &m.self_ip,
        taken => &m.taken,
        path,
    };
    env.get_template("pages/not_found.html")?.render(ctx)
}

/// Renders a page's fragments: `(element id, inner HTML)`.
///
/// # Errors
/// A template error.
pub fn render_fragments(
    env: &Environment<'_>,
    page: &Page,
    m: &Model,
) -> Result<Vec<(String, String)>, minijinja::Error> {
    let (ctx, _) = page.context(m);
    page.fragments()
        .iter()
        .map(|id| {
            let html = env.get_template(&format!("fragments/{id}.html"))?.render(&ctx)?;
            Ok(((*id).to_owned(), html))
        })
        .collect()
}
