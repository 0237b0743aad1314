//! The controller's web UI over HTTP: every route answers, a live view
//! (`/sse/functions`) receives the new tenant's row without a reload, detail
//! pages show the instance, the pool and the autoscaler's recommendations,
//! and the details the Go implementation fixes (`/healthz` → `ok`, 405 for
//! other methods, 404 for unknown paths) hold.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use skipper_test_support::controller as harness;

use std::time::Duration;

use futures::StreamExt as _;
use harness::{Ctl, NS, Sim, eventually, function, heartbeat};
use tokio::net::TcpListener;

/// Reads `patch` events from an SSE response until one for `id` satisfies
/// `want`; returns its HTML.
async fn patch_until(
    body: &mut (impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    buf: &mut String,
    id: &str,
    want: impl Fn(&str) -> bool,
) -> String {
    loop {
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let mut kind = "";
            let mut data = String::new();
            for line in event.lines() {
                if let Some(k) = line.strip_prefix("event:") {
                    kind = k.trim();
                } else if let Some(d) = line.strip_prefix("data:") {
                    data.push_str(d.trim_start());
                }
            }
            if kind != "patch" {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&data).unwrap();
            let html = v["html"].as_str().unwrap().to_owned();
            if v["id"] == id && want(&html) {
                return html;
            }
        }
        let chunk = body.next().await.expect("the stream stays open").unwrap();
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_answer_and_a_live_view_shows_a_new_tenant() {
    let sim = Sim::with_pool("fixture", 2).await;
    let mut config = sim.config("127.0.0.1");
    config.web_addr = Some("127.0.0.1:0".parse().unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut ctl = Ctl::start(&sim, config, listener).await;
    let web = ctl.web.expect("the web UI is served");
    let http = reqwest::Client::new();
    let get = |path: &str| {
        let http = http.clone();
        let url = format!("http://{web}{path}");
        async move { http.get(url).send().await.unwrap() }
    };

    let health = get("/healthz").await;
    assert_eq!(health.status(), 200);
    assert_eq!(health.text().await.unwrap(), "ok");
    let post = http.post(format!("http://{web}/")).send().await.unwrap();
    assert_eq!(post.status(), 405);
    let unknown = get("/no/such/page").await;
    assert_eq!(unknown.status(), 404);
    assert!(unknown.text().await.unwrap().contains("Not found"));
    let js = get("/static/skipper.js").await;
    assert_eq!(js.status(), 200);
    assert!(
        js.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/javascript")
    );
    assert!(js.text().await.unwrap().contains("EventSource"));

    // A live view of the functions page, opened before the tenant exists.
    let resp = get("/sse/functions?search=live").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.bytes_stream();
    let mut buf = String::new();
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        patch_until(&mut body, &mut buf, "functions-table", |_| true),
    )
    .await
    .expect("the stream sends the current table at once");
    assert!(first.contains("No functions"), "{first}");

    let f = function("fixture", "t-live", 2);
    let instance = ctl.instance(&f, Duration::from_secs(20)).await;
    let name = instance.name.unwrap();
    let row = tokio::time::timeout(
        Duration::from_secs(10),
        patch_until(&mut body, &mut buf, "functions-table", |h| h.contains("t-live")),
    )
    .await
    .expect("the new tenant appears in the live view");
    assert!(row.contains("data-function=\"fns:fixture:t-live\""), "{row}");
    drop(body);

    // Detail pages.
    let key = format!("{NS}%3Afixture%3At-live");
    // The page reads the controller's pod cache, which the watch keeps
    // current: the instance is listed once the cache holds it.
    let html = eventually(
        "the function's page lists the instance",
        Duration::from_secs(10),
        || async {
            let page = get(&format!("/functions/{key}")).await;
            assert_eq!(page.status(), 200);
            let html = page.text().await.unwrap();
            html.contains(&name).then_some(html)
        },
    )
    .await;
    assert!(
        html.contains("data-sse=\"&#x2f;sse&#x2f;function&#x2f;"),
        "the page is live"
    );
    for (path, says) in [
        (format!("/instances/{name}"), "ready"),
        ("/tenants/t-live".to_owned(), "fixture"),
        ("/deployments".to_owned(), "Pool size"),
        ("/controllers".to_owned(), "127.0.0.1"),
        ("/events?severity=1".to_owned(), "pod assigned"),
    ] {
        // Each page reads what the controller keeps (its caches, its
        // event log): the assignment's event is recorded after the
        // instance is handed out.
        eventually(
            &format!("{path} says {says:?}"),
            Duration::from_secs(10),
            || async {
                let page = get(&path).await;
                assert_eq!(page.status(), 200, "{path}");
                let html = page.text().await.unwrap();
                html.contains(says).then_some(())
            },
        )
        .await;
    }
    let config = get("/config").await.text().await.unwrap();
    assert!(config.contains("****") && !config.contains("PRIVATE KEY"));
    assert_eq!(get(&format!("/functions/{NS}%3Anope%3Ax")).await.status(), 404);

    // Router heartbeats and the autoscaler's recommendations show up.
    ctl.grpc.heartbeat(heartbeat("10.9.0.1", &f, 2)).await.unwrap();
    eventually("the router on /routers", Duration::from_secs(10), || async {
        get("/routers")
            .await
            .text()
            .await
            .unwrap()
            .contains("10.9.0.1")
            .then_some(())
    })
    .await;
    eventually(
        "a recommendation on the function page",
        Duration::from_secs(10),
        || async {
            let html = get(&format!("/functions/{key}")).await.text().await.unwrap();
            (!html.contains("No converge tick yet")).then_some(())
        },
    )
    .await;
    for path in [
        "/",
        "/functions?sort=tenant&dir=desc",
        "/tenants",
        "/routers/10.9.0.1",
        "/deployments/fixture",
    ] {
        let r = get(path).await;
        assert_eq!(r.status(), 200, "{path}");
    }
    ctl.stop().await;
}
