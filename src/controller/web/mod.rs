//! The controller's web UI (`--web-port`, default 8080, on `--web-host`, else `--host`): the
//! pages of the Go implementation at the same routes, server-rendered from
//! templates compiled into the binary (minijinja: the same templates can be
//! read from disk with `--web-template-dir` while working on them), kept
//! live over Server-Sent Events. Nothing is loaded from outside the binary:
//! the stylesheet and the small script are served from it, charts are
//! inline SVG drawn on the server.
//!
//! Every controller shows the whole cluster: the data is `GetClusterState`
//! aggregated across the ring (see [`hub`]), plus instance-count history
//! sampled locally. Live updates: the page's script opens
//! `/sse/<page>?<filters>`; the stream sends `patch` events, each the new
//! inner HTML of one element (by id), only when it changed. A viewer costs
//! one render per snapshot at most (viewers of the same page and filters
//! share it) and at most [`MAX_LIVE_VIEWS`] streams are open at once.
//!
//! - [`model`]: pure: snapshot → rows, health, pictures;
//! - [`history`]: bounded instance-count series;
//! - [`hub`]: snapshots and sampling, off the RPC paths;
//! - [`pages`]: templates, pages and their fragments.

pub mod history;
pub mod hub;
pub mod model;
pub mod pages;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use futures::Stream;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use self::hub::Hub;
use self::model::{Dir, Model};
use self::pages::{Page, Templates};
use super::core::Core;

/// Most live views (SSE streams) open at once; more are answered 503.
pub const MAX_LIVE_VIEWS: usize = 64;
/// Rendered fragment sets kept for sharing between viewers.
const RENDER_CACHE: usize = 64;
/// How long a browser waits before reconnecting a dropped stream.
const RECONNECT: Duration = Duration::from_secs(2);

/// Why the web UI could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("--web-port: cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("web templates: {0}")]
    Templates(#[source] minijinja::Error),
}

/// Why a request failed; `IntoResponse` is the one mapping to HTTP.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("template error: {0:#}")]
    Template(#[from] minijinja::Error),
    #[error("too many live views are open ({MAX_LIVE_VIEWS}); close some and reload")]
    TooManyViews,
    #[error("the renderer failed: {0}")]
    Join(#[from] tokio::task::JoinError),
}

impl IntoResponse for RequestError {
    fn into_response(self) -> Response {
        let status = match self {
            Self::Template(_) | Self::Join(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::TooManyViews => StatusCode::SERVICE_UNAVAILABLE,
        };
        if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
            tracing::warn!(error = %self, "web UI request failed");
        }
        (
            status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("{self}\n"),
        )
            .into_response()
    }
}

type Fragments = Arc<Vec<(String, String)>>;

/// What the handlers share.
struct Web {
    hub: Arc<Hub>,
    templates: Templates,
    views: Arc<Semaphore>,
    /// Fragments rendered for `(path + query)` at a model generation. A std
    /// mutex: lookups and inserts only.
    rendered: Mutex<HashMap<String, (u64, Fragments)>>,
}

impl Web {
    /// The page's fragments for `model`, rendered once per generation and
    /// shared by every viewer of the same page and filters. Rendering runs
    /// on a blocking thread, off the async workers.
    async fn fragments(self: &Arc<Self>, page: &Page, model: &Arc<Model>) -> Result<Fragments, RequestError> {
        let key = format!("{}{}", page.sse().unwrap_or_default(), page.query());
        if self.templates.cacheable() {
            let cache = self
                .rendered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some((generation, f)) = cache.get(&key)
                && *generation == model.generation
            {
                return Ok(f.clone());
            }
        }
        let env = self.templates.env();
        let (page2, model2) = (page.clone(), model.clone());
        let rendered = Arc::new(
            tokio::task::spawn_blocking(move || pages::render_fragments(&env, &page2, &model2)).await??,
        );
        if self.templates.cacheable() {
            let mut cache = self
                .rendered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if cache.len() >= RENDER_CACHE {
                cache.retain(|_, (g, _)| *g == model.generation);
                if cache.len() >= RENDER_CACHE {
                    cache.clear();
                }
            }
            cache.insert(key, (model.generation, rendered.clone()));
        }
        Ok(rendered)
    }
}

/// The web UI's routes over `hub`.
///
/// # Errors
/// [`Error::Templates`] when the compiled-in templates do not parse.
pub fn router(hub: Arc<Hub>, template_dir: Option<PathBuf>) -> Result<axum::Router, Error> {
    let web = Arc::new(Web {
        hub,
        templates: Templates::new(template_dir).map_err(Error::Templates)?,
        views: Arc::new(Semaphore::new(MAX_LIVE_VIEWS)),
        rendered: Mutex::new(HashMap::new()),
    });
    Ok(axum::Router::new()
        .route("/", get(dashboard))
        .route("/functions", get(functions))
        .route("/functions/{key}", get(function))
        .route("/controllers", get(controllers))
        .route("/controllers/{ip}", get(controller))
        .route("/routers", get(routers))
        .route("/routers/{ip}", get(router_page))
        .route("/instances/{name}", get(instance))
        .route("/tenants", get(tenants))
        .route("/tenants/{tenant}", get(tenant))
        .route("/deployments", get(deployments))
        .route("/deployments/{name}", get(deployment))
        .route("/events", get(events))
        .route("/config", get(config))
        .route("/sse/dashboard", get(sse_dashboard))
        .route("/sse/functions", get(sse_functions))
        .route("/sse/function/{key}", get(sse_function))
        .route("/sse/controllers", get(sse_controllers))
        .route("/sse/controller/{ip}", get(sse_controller))
        .route("/sse/routers", get(sse_routers))
        .route("/sse/router/{ip}", get(sse_router))
        .route("/sse/instance/{name}", get(sse_instance))
        .route("/sse/tenants", get(sse_tenants))
        .route("/sse/tenant/{tenant}", get(sse_tenant))
        .route("/sse/deployments", get(sse_deployments))
        .route("/sse/deployment/{name}", get(sse_deployment))
        .route("/sse/events", get(sse_events))
        .route("/static/{*path}", get(static_file))
        .route(
            "/healthz",
            get(|| async { ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], "ok") }),
        )
        .fallback(not_found)
        .with_state(web))
}

/// Binds `addr` (a failure is a start-up error naming `--web-port`).
///
/// # Errors
/// [`Error::Bind`].
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

/// Serves the web UI of `core` on `listener` until the controller shuts
/// down; the snapshot task runs alongside. Returns the bound address.
///
/// # Errors
/// [`Error::Templates`].
pub fn serve(
    core: &Arc<Core>,
    listener: TcpListener,
    template_dir: Option<PathBuf>,
) -> Result<SocketAddr, Error> {
    let local = listener.local_addr().map_err(|source| Error::Bind {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })?;
    let hub = Hub::new(core.clone());
    let app = router(hub.clone(), template_dir)?;
    let shutdown = core.shutdown.clone();
    shutdown.spawn("web-snapshots", hub.run());
    let token = shutdown.token().clone();
    shutdown.spawn("web-server", async move {
        if let Err(e) = axum::serve(crate::net::http_listener(listener), app)
            .with_graceful_shutdown(token.cancelled_owned())
            .await
        {
            tracing::warn!(error = %e, "web UI stopped");
        }
    });
    tracing::info!(address = %local, "serving the web UI");
    Ok(local)
}

// ---------------------------------------------------------------------------
// Pages

async fn page(web: Arc<Web>, page: Page) -> Result<Response, RequestError> {
    let model = web.hub.fresh().await;
    let env = web.templates.env();
    let (html, found) =
        tokio::task::spawn_blocking(move || pages::render_page(&env, &page, &model)).await??;
    let status = if found {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    Ok((status, Html(html)).into_response())
}

#[derive(Debug, Default, Deserialize)]
struct ListQuery {
    #[serde(default)]
    search: String,
    #[serde(default)]
    sort: String,
    #[serde(default)]
    dir: String,
}

#[derive(Debug, Default, Deserialize)]
struct EventsQuery {
    #[serde(default)]
    function: String,
    #[serde(default)]
    severity: String,
}

fn functions_page(q: ListQuery) -> Page {
    Page::Functions {
        search: q.search,
        sort: q.sort,
        dir: Dir::parse(Some(&q.dir)),
    }
}

fn tenants_page(q: ListQuery) -> Page {
    Page::Tenants {
        search: q.search,
        sort: q.sort,
        dir: Dir::parse(Some(&q.dir)),
    }
}

fn events_page(q: EventsQuery) -> Page {
    let severity = if q.severity == "all" {
        String::new()
    } else {
        q.severity
    };
    Page::Events {
        function: q.function,
        severity,
    }
}

async fn dashboard(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    page(w, Page::Dashboard).await
}
async fn functions(State(w): State<Arc<Web>>, Query(q): Query<ListQuery>) -> Result<Response, RequestError> {
    page(w, functions_page(q)).await
}
async fn function(State(w): State<Arc<Web>>, Path(key): Path<String>) -> Result<Response, RequestError> {
    page(w, Page::Function { key }).await
}
async fn controllers(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    page(w, Page::Controllers).await
}
async fn controller(State(w): State<Arc<Web>>, Path(ip): Path<String>) -> Result<Response, RequestError> {
    page(w, Page::Controller { ip }).await
}
async fn routers(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    page(w, Page::Routers).await
}
async fn router_page(State(w): State<Arc<Web>>, Path(ip): Path<String>) -> Result<Response, RequestError> {
    page(w, Page::Router { ip }).await
}
async fn instance(State(w): State<Arc<Web>>, Path(name): Path<String>) -> Result<Response, RequestError> {
    page(w, Page::Instance { name }).await
}
async fn tenants(State(w): State<Arc<Web>>, Query(q): Query<ListQuery>) -> Result<Response, RequestError> {
    page(w, tenants_page(q)).await
}
async fn tenant(State(w): State<Arc<Web>>, Path(tenant): Path<String>) -> Result<Response, RequestError> {
    page(w, Page::Tenant { tenant }).await
}
async fn deployments(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    page(w, Page::Deployments).await
}
async fn deployment(State(w): State<Arc<Web>>, Path(name): Path<String>) -> Result<Response, RequestError> {
    page(w, Page::Deployment { name }).await
}
async fn events(State(w): State<Arc<Web>>, Query(q): Query<EventsQuery>) -> Result<Response, RequestError> {
    page(w, events_page(q)).await
}
async fn config(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    page(w, Page::Config).await
}

async fn not_found(State(w): State<Arc<Web>>, uri: axum::http::Uri) -> Result<Response, RequestError> {
    let model = w.hub.fresh().await;
    let env = w.templates.env();
    let path = uri.path().to_owned();
    let html = tokio::task::spawn_blocking(move || pages::render_not_found(&env, &model, &path)).await??;
    Ok((StatusCode::NOT_FOUND, Html(html)).into_response())
}

async fn static_file(State(w): State<Arc<Web>>, Path(path): Path<String>) -> Response {
    match w.templates.static_file(&path) {
        Some((content_type, body)) => (
            [
                (header::CONTENT_TYPE, content_type),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "not found\n").into_response(),
    }
}

// ---------------------------------------------------------------------------
// Live updates

/// One viewer's stream state.
struct Live {
    web: Arc<Web>,
    page: Page,
    rx: tokio::sync::watch::Receiver<Option<Arc<Model>>>,
    sent: HashMap<String, String>,
    queue: std::collections::VecDeque<Event>,
    first: bool,
    stop: tokio_util::sync::CancellationToken,
    _permit: OwnedSemaphorePermit,
}

impl Live {
    /// The fragments of `model` that differ from what this viewer has.
    async fn diff(&mut self, model: &Arc<Model>) {
        match self.web.fragments(&self.page, model).await {
            Ok(fragments) => {
                for (id, html) in fragments.iter() {
                    if self.sent.get(id) == Some(html) {
                        continue;
                    }
                    let data = serde_json::json!({ "id": id, "html": html }).to_string();
                    self.queue.push_back(Event::default().event("patch").data(data));
                    self.sent.insert(id.clone(), html.clone());
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "rendering a live view failed");
                let data = serde_json::json!({ "message": e.to_string() }).to_string();
                self.queue.push_back(Event::default().event("failed").data(data));
            }
        }
    }
}

fn live(
    web: Arc<Web>,
    page: Page,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, RequestError> {
    let permit = web
        .views
        .clone()
        .try_acquire_owned()
        .map_err(|_| RequestError::TooManyViews)?;
    let rx = web.hub.subscribe();
    let stop = web.hub.core().shutdown.token().clone();
    let state = Live {
        web,
        page,
        rx,
        sent: HashMap::new(),
        queue: std::collections::VecDeque::from([Event::default().retry(RECONNECT)]),
        first: true,
        stop,
        _permit: permit,
    };
    let stream = futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(e) = s.queue.pop_front() {
                return Some((Ok(e), s));
            }
            let model = if s.first {
                s.first = false;
                s.web.hub.fresh().await
            } else {
                tokio::select! {
                    () = s.stop.cancelled() => return None,
                    r = s.rx.changed() => if r.is_err() { return None },
                }
                let current = s.rx.borrow_and_update().clone();
                match current {
                    Some(m) => m,
                    None => continue,
                }
            };
            s.diff(&model).await;
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

async fn sse_dashboard(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Dashboard)?.into_response())
}
async fn sse_functions(
    State(w): State<Arc<Web>>,
    Query(q): Query<ListQuery>,
) -> Result<Response, RequestError> {
    Ok(live(w, functions_page(q))?.into_response())
}
async fn sse_function(State(w): State<Arc<Web>>, Path(key): Path<String>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Function { key })?.into_response())
}
async fn sse_controllers(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Controllers)?.into_response())
}
async fn sse_controller(State(w): State<Arc<Web>>, Path(ip): Path<String>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Controller { ip })?.into_response())
}
async fn sse_routers(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Routers)?.into_response())
}
async fn sse_router(State(w): State<Arc<Web>>, Path(ip): Path<String>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Router { ip })?.into_response())
}
async fn sse_instance(State(w): State<Arc<Web>>, Path(name): Path<String>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Instance { name })?.into_response())
}
async fn sse_tenants(
    State(w): State<Arc<Web>>,
    Query(q): Query<ListQuery>,
) -> Result<Response, RequestError> {
    Ok(live(w, tenants_page(q))?.into_response())
}
async fn sse_tenant(State(w): State<Arc<Web>>, Path(tenant): Path<String>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Tenant { tenant })?.into_response())
}
async fn sse_deployments(State(w): State<Arc<Web>>) -> Result<Response, RequestError> {
    Ok(live(w, Page::Deployments)?.into_response())
}
async fn sse_deployment(
    State(w): State<Arc<Web>>,
    Path(name): Path<String>,
) -> Result<Response, RequestError> {
    Ok(live(w, Page::Deployment { name })?.into_response())
}
async fn sse_events(
    State(w): State<Arc<Web>>,
    Query(q): Query<EventsQuery>,
) -> Result<Response, RequestError> {
    Ok(live(w, events_page(q))?.into_response())
}
