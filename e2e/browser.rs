//! The controller's web UI in a real browser: headless Chromium (Debian's
//! `chromium`, driven over the DevTools protocol) opens the dashboard of a
//! running `skipper dev`, a request for a new tenant goes through the
//! router, and the tenant appears on the dashboard and then on the
//! functions page without a reload; the search filters in place; every
//! page renders with no console error, failed load or script exception;
//! a screenshot of the dashboard is written to
//! `target/web-ui-dashboard.png`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use futures::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::Message;

use crate::Timer;
use crate::harness::{Dev, NS, Opts, single};

/// The web UI port of the controllers (`--web-port` default).
const WEB_PORT: u16 = 8080;

/// Finds Chromium. A missing browser fails the test (`.ci/run` installs
/// Debian's `chromium`): the web UI is never reported green untested.
fn chromium() -> PathBuf {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find_map(|name| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|p| p.join(name))
                    .find(|p| p.is_file())
            })
        })
        .expect(
            "chromium is not installed: the browser test needs it \
             (`apt-get install -y chromium chromium-driver`; .ci/run installs it)",
        )
}

/// A headless Chromium process, killed on drop.
struct Browser {
    child: tokio::process::Child,
    devtools: String,
    _profile: tempdir::Dir,
}

mod tempdir {
    /// A directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Browser {
    async fn launch(exe: &std::path::Path) -> Self {
        let profile = std::env::temp_dir().join(format!("skipper-chromium-{:x}", rand::random::<u64>()));
        std::fs::create_dir_all(&profile).unwrap();
        let mut child = tokio::process::Command::new(exe)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--remote-debugging-port=0",
                "--window-size=1400,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let devtools = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(url) = line.strip_prefix("DevTools listening on ") {
                    return url.trim().to_owned();
                }
            }
            panic!("chromium exited before listening");
        })
        .await
        .expect("chromium starts within 30s");
        // Keep draining its stderr so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            child,
            devtools,
            _profile: tempdir::Dir(profile),
        }
    }

    /// The DevTools HTTP address (`127.0.0.1:PORT`).
    fn http(&self) -> String {
        self.devtools
            .trim_start_matches("ws://")
            .split('/')
            .next()
            .unwrap()
            .to_owned()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// A DevTools protocol session with one page.
struct Page {
    out: tokio::sync::mpsc::UnboundedSender<Message>,
    pending: Pending,
    next: AtomicU64,
    /// Console errors, exceptions and failed loads seen so far.
    problems: Arc<Mutex<Vec<String>>>,
}

impl Page {
    async fn open(browser: &Browser) -> Self {
        let targets: Value = reqwest::get(format!("http://{}/json/list", browser.http()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let ws = targets
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .expect("a page target")
            .to_owned();
        let (socket, _) = tokio_tungstenite::connect_async(ws).await.unwrap();
        let (mut sink, mut stream) = socket.split();
        let (out, mut out_rx) = tokio::sync::mpsc::unbounded_channel::<Message>();
        tokio::spawn(async move {
            while let Some(m) = out_rx.recv().await {
                if sink.send(m).await.is_err() {
                    return;
                }
            }
        });
        let pending: Pending = Arc::default();
        let problems: Arc<Mutex<Vec<String>>> = Arc::default();
        let (p, probs) = (pending.clone(), problems.clone());
        tokio::spawn(async move {
            while let Some(Ok(msg)) = stream.next().await {
                let Message::Text(text) = msg else { continue };
                let v: Value = serde_json::from_str(text.as_str()).unwrap_or_default();
                if let Some(id) = v["id"].as_u64() {
                    if let Some(tx) = p.lock().unwrap().remove(&id) {
                        let _ = tx.send(v);
                    }
                    continue;
                }
                let params = &v["params"];
                let problem = match v["method"].as_str().unwrap_or("") {
                    "Runtime.exceptionThrown" => Some(format!("exception: {}", params["exceptionDetails"])),
                    "Runtime.consoleAPICalled" if params["type"] == "error" => {
                        Some(format!("console.error: {}", params["args"]))
                    }
                    "Log.entryAdded" if params["entry"]["level"] == "error" => Some(format!(
                        "log: {} {}",
                        params["entry"]["text"], params["entry"]["url"]
                    )),
                    _ => None,
                };
                if let Some(problem) = problem {
                    probs.lock().unwrap().push(problem);
                }
            }
        });
        let page = Self {
            out,
            pending,
            next: AtomicU64::new(1),
            problems,
        };
        for method in ["Runtime.enable", "Log.enable", "Page.enable"] {
            page.call(method, json!({})).await;
        }
        page.call(
            "Emulation.setDeviceMetricsOverride",
            json!({"width": 1400, "height": 1000, "deviceScaleFactor": 1, "mobile": false}),
        )
        .await;
        page
    }

    async fn call(&self, method: &str, params: Value) -> Value {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.out.send(Message::text(msg)).unwrap();
        let v = tokio::time::timeout(Duration::from_secs(30), rx)
            .await
            .unwrap_or_else(|_| panic!("{method} answered within 30s"))
            .unwrap();
        assert!(v.get("error").is_none(), "{method}: {v}");
        v["result"].clone()
    }

    /// Evaluates `expr` in the page; its JSON value.
    async fn eval(&self, expr: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expr, "returnByValue": true}),
            )
            .await;
        assert!(r.get("exceptionDetails").is_none(), "{expr}: {r}");
        r["result"]["value"].clone()
    }

    /// Waits (at most `limit`) until `expr` is true.
    async fn until(&self, what: &str, limit: Duration, expr: &str) {
        let found = tokio::time::timeout(limit, async {
            loop {
                if self.eval(expr).await == json!(true) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        assert!(found.is_ok(), "timed out after {limit:?} waiting for {what}");
    }

    /// Loads `url`, waits for the document and (on live pages) the stream;
    /// returns the HTTP status.
    async fn visit(&self, url: &str) -> u64 {
        self.call("Page.navigate", json!({"url": url})).await;
        self.until(
            &format!("{url} to load"),
            Duration::from_secs(20),
            &format!(
                "location.href === {} && document.readyState === 'complete'",
                json!(url)
            ),
        )
        .await;
        let live = self.eval("document.body.dataset.sse !== ''").await == json!(true);
        if live {
            self.until(
                &format!("{url} to go live"),
                Duration::from_secs(20),
                "document.getElementById('live').classList.contains('on')",
            )
            .await;
        }
        self.eval("performance.getEntriesByType('navigation')[0].responseStatus")
            .await
            .as_u64()
            .unwrap_or(0)
    }

    fn problems(&self) -> Vec<String> {
        self.problems.lock().unwrap().clone()
    }
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"),
        PathBuf::from,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_new_tenant_live() {
    let exe = chromium();
    let _t = Timer::start("browser: web UI");
    // Functions stay up for the whole visit (no scale to zero midway).
    let dev = Dev::start(Opts {
        controllers: 2,
        heartbeat_timeout: "30s",
        ..Opts::default()
    })
    .await;
    let browser = Browser::launch(&exe).await;
    let page = Page::open(&browser).await;
    let ip = dev.controller_ips[0].clone();
    let web = format!("http://{ip}:{WEB_PORT}");
    // `skipper dev` prints where the web UI is.
    let printed = dev
        .stdout
        .lock()
        .unwrap()
        .iter()
        .find_map(|l| {
            l.trim_start()
                .strip_prefix("web UI:")?
                .split_whitespace()
                .next()
                .map(str::to_owned)
        })
        .expect("skipper dev prints the web UI's address");
    assert_eq!(printed.trim_end_matches('/'), web);

    // The dashboard, live; a marker that a reload would erase.
    assert_eq!(page.visit(&format!("{web}/")).await, 200);
    page.eval("window.__marker = 'kept'").await;
    let present = |id: &str, tenant: &str| {
        format!("document.querySelector('#{id} [data-function=\"{NS}:fixture:{tenant}\"]') !== null")
    };
    assert_eq!(
        page.eval(&present("supervisors-table", "browser-a")).await,
        json!(false)
    );
    assert_eq!(dev.echo_tenant(&single("browser-a"), "/").await, "browser-a");
    page.until(
        "the new tenant on the dashboard",
        Duration::from_secs(20),
        &present("supervisors-table", "browser-a"),
    )
    .await;
    page.until(
        "its assignment in the recent activity",
        Duration::from_secs(20),
        "document.getElementById('recent-activity').textContent.includes('browser-a')",
    )
    .await;
    assert_eq!(page.eval("window.__marker").await, json!("kept"), "no reload");
    let shot = page
        .call("Page.captureScreenshot", json!({"format": "png"}))
        .await;
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot["data"].as_str().unwrap())
        .unwrap();
    assert!(png.starts_with(b"\x89PNG"));
    let file = target_dir().join("web-ui-dashboard.png");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(&file, &png).unwrap();
    eprintln!("e2e: dashboard screenshot: {}", file.display());

    // The functions page of the other controller: a second new tenant.
    let other = format!("http://{}:{WEB_PORT}", dev.controller_ips[1]);
    assert_eq!(page.visit(&format!("{other}/functions")).await, 200);
    page.eval("window.__marker = 'kept'").await;
    assert_eq!(dev.echo_tenant(&single("browser-b"), "/").await, "browser-b");
    page.until(
        "the new tenant on the functions page",
        Duration::from_secs(20),
        &present("functions-table", "browser-b"),
    )
    .await;
    // The search filters the table in place.
    page.eval(
        "(() => { const i = document.querySelector('input[name=search]'); i.value = 'browser-b'; \
         i.dispatchEvent(new Event('input', {bubbles: true})); return true; })()",
    )
    .await;
    page.until(
        "the search to leave one row",
        Duration::from_secs(20),
        "document.querySelectorAll('#functions-table tbody tr').length === 1 && \
         location.search === '?search=browser-b'",
    )
    .await;
    assert_eq!(page.eval("window.__marker").await, json!("kept"), "no reload");

    // The router appears once its first heartbeat (every 10 s here) is in.
    assert_eq!(page.visit(&format!("{web}/routers")).await, 200);
    page.until(
        "the router on the routers page",
        Duration::from_secs(40),
        "document.querySelector('#routers-table tbody a') !== null",
    )
    .await;
    let router = page
        .eval("document.querySelector('#routers-table tbody a').textContent")
        .await
        .as_str()
        .unwrap()
        .to_owned();

    // Every page renders.
    let instance = dev.tenant_pods("browser-a").await.into_iter().next().unwrap();
    let key = format!("{NS}%3Afixture%3Abrowser-a");
    let paths = [
        "/".to_owned(),
        "/functions?sort=instances&dir=desc".to_owned(),
        format!("/functions/{key}"),
        "/controllers".to_owned(),
        format!("/controllers/{ip}"),
        "/routers".to_owned(),
        format!("/routers/{router}"),
        format!("/instances/{instance}"),
        "/tenants".to_owned(),
        "/tenants/browser-a".to_owned(),
        "/deployments".to_owned(),
        "/deployments/fixture".to_owned(),
        "/events?severity=1".to_owned(),
        "/config".to_owned(),
    ];
    for path in &paths {
        let status = page.visit(&format!("{web}{path}")).await;
        assert_eq!(status, 200, "{path}");
        let loaded = page
            .eval("Math.round(performance.getEntriesByType('navigation')[0].loadEventEnd)")
            .await;
        eprintln!("e2e: web UI {path} loaded in {loaded} ms");
    }
    let problems = page.problems();
    assert!(problems.is_empty(), "console errors: {problems:#?}");
}
