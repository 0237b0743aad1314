//! kube-rs against the simulator: watcher and reflector semantics (initial
//! list, add/modify/delete, selectors, resumed and expired watches,
//! bookmarks, timeouts), Status errors, optimistic concurrency, paging and
//! the fault-injection knobs.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use skipper_test_support::devcluster as common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::{WatchStreamExt as _, reflector, watcher};
use skipper_devcluster::Cluster;
use skipper_test_support::list_version;

const NS: &str = "watch";

fn cm(name: &str, labels: &[(&str, &str)]) -> ConfigMap {
    let mut c = ConfigMap::default();
    c.metadata.name = Some(name.into());
    c.metadata.labels = Some(
        labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    );
    c.data = Some(BTreeMap::from([("k".to_owned(), "v0".to_owned())]));
    c
}

/// A simulator with namespace [`NS`] and the ConfigMaps API of it.
async fn configmaps() -> (Cluster, Api<ConfigMap>) {
    let cluster = common::cluster(&[NS]).await;
    let api = Api::namespaced(cluster.client().unwrap(), NS);
    (cluster, api)
}

/// Creates ConfigMap `name` with `labels` through `api`.
async fn create(api: &Api<ConfigMap>, name: &str, labels: &[(&str, &str)]) -> ConfigMap {
    api.create(&PostParams::default(), &cm(name, labels))
        .await
        .unwrap()
}

/// Applies the JSON merge patch `patch` to ConfigMap `name`.
async fn merge(api: &Api<ConfigMap>, name: &str, patch: serde_json::Value) -> ConfigMap {
    skipper_test_support::patch(api, name, Patch::Merge(patch)).await
}

fn name(c: &ConfigMap) -> String {
    c.metadata.name.clone().unwrap_or_default()
}

/// The ConfigMap every namespace has (the cluster CA); the tests' own objects are the others.
const ROOT_CA: &str = "kube-root-ca.crt";

/// Next watcher event that is not an error (410 relists surface as errors first).
async fn next_event<S>(stream: &mut S) -> watcher::Event<ConfigMap>
where
    S: Stream<Item = Result<watcher::Event<ConfigMap>, watcher::Error>> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.next().await {
                Some(Ok(e)) => return e,
                Some(Err(_)) => {}
                None => panic!("watcher ended"),
            }
        }
    })
    .await
    .expect("watcher event within 10s")
}

/// The next watcher event (within 10 s); an error or the end of the stream
/// fails the test.
async fn next_ok<K, S>(stream: &mut S) -> watcher::Event<K>
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("watcher event within 10s")
        .expect("the watcher goes on")
        .expect("a watcher event, not an error")
}

/// A watcher of `api` with `config`, past its initial listing, which held
/// exactly `names` (in any order; the cluster CA aside).
async fn watching(
    api: &Api<ConfigMap>,
    config: watcher::Config,
    names: &[&str],
) -> futures::stream::BoxStream<'static, Result<watcher::Event<ConfigMap>, watcher::Error>> {
    let mut w = watcher(api.clone(), config).boxed();
    let mut listed = initial_names(&mut w).await;
    listed.sort();
    let mut names = names.to_vec();
    names.sort_unstable();
    assert_eq!(listed, names, "the initial listing");
    w
}

/// Consumes an initial listing (Init, InitApply*, InitDone) and returns the names.
async fn initial_names<S>(stream: &mut S) -> Vec<String>
where
    S: Stream<Item = Result<watcher::Event<ConfigMap>, watcher::Error>> + Unpin,
{
    assert!(matches!(next_event(stream).await, watcher::Event::Init));
    let mut names = Vec::new();
    loop {
        match next_event(stream).await {
            watcher::Event::InitApply(c) if name(&c) == ROOT_CA => {}
            watcher::Event::InitApply(c) => names.push(name(&c)),
            watcher::Event::InitDone => return names,
            other => panic!("unexpected event during init: {other:?}"),
        }
    }
}

#[tokio::test]
async fn watcher_lists_then_streams_adds_modifications_and_deletes() {
    let (_cluster, api) = configmaps().await;
    create(&api, "a", &[]).await;
    create(&api, "b", &[]).await;
    let mut w = watching(&api, watcher::Config::default(), &["a", "b"]).await;

    create(&api, "c", &[]).await;
    assert!(matches!(next_event(&mut w).await, watcher::Event::Apply(c) if name(&c) == "c"));
    merge(&api, "a", serde_json::json!({"data": {"k": "v1"}})).await;
    match next_event(&mut w).await {
        watcher::Event::Apply(c) => {
            assert_eq!(name(&c), "a");
            assert_eq!(c.data.unwrap()["k"], "v1");
        }
        other => panic!("want Apply(a), got {other:?}"),
    }
    api.delete("b", &DeleteParams::default()).await.unwrap();
    assert!(matches!(next_event(&mut w).await, watcher::Event::Delete(c) if name(&c) == "b"));
}

#[tokio::test]
async fn streaming_lists_send_initial_events_then_changes() {
    let (_cluster, api) = configmaps().await;
    create(&api, "s1", &[]).await;
    let mut w = watching(&api, watcher::Config::default().streaming_lists(), &["s1"]).await;
    create(&api, "s2", &[]).await;
    assert!(matches!(next_event(&mut w).await, watcher::Event::Apply(c) if name(&c) == "s2"));
}

#[tokio::test]
async fn metadata_only_lists_and_watches_work() {
    let (cluster, api) = configmaps().await;
    create(&api, "m1", &[("a", "b")]).await;
    let list = api
        .list_metadata(&ListParams::default().fields(&format!("metadata.name!={ROOT_CA}")))
        .await
        .unwrap();
    assert_eq!(list.items[0].metadata.name.as_deref(), Some("m1"));
    let one = api.get_metadata("m1").await.unwrap();
    assert_eq!(one.metadata.labels.unwrap()["a"], "b");
    // On the wire: PartialObjectMetadata without the data.
    let raw = common::api_get_as(
        &cluster,
        &format!("/api/v1/namespaces/{NS}/configmaps/m1"),
        "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json",
    )
    .await;
    assert_eq!(raw["kind"], "PartialObjectMetadata");
    assert!(raw.get("data").is_none());

    let meta: Api<kube::core::PartialObjectMeta<ConfigMap>> = Api::namespaced(cluster.client().unwrap(), NS);
    let mut w = watcher(meta, watcher::Config::default()).boxed();
    let mut init = Vec::new();
    loop {
        match next_ok(&mut w).await {
            watcher::Event::InitApply(m) if m.metadata.name.as_deref() != Some(ROOT_CA) => {
                init.push(m.metadata.name.unwrap());
            }
            watcher::Event::InitDone => break,
            _ => {}
        }
    }
    assert_eq!(init, ["m1"]);
    create(&api, "m2", &[]).await;
    match next_ok(&mut w).await {
        watcher::Event::Apply(m) => assert_eq!(m.metadata.name.as_deref(), Some("m2")),
        other => panic!("want Apply(m2), got {other:?}"),
    }
}

#[tokio::test]
async fn label_selectors_filter_and_objects_leave_when_labels_stop_matching() {
    let (_cluster, api) = configmaps().await;
    create(&api, "in", &[("skipper/deployment", "f")]).await;
    create(&api, "other", &[("skipper/deployment", "g")]).await;
    create(
        &api,
        "taken",
        &[("skipper/deployment", "f"), ("skipper/tenant", "t")],
    )
    .await;
    let sel = "skipper/deployment in (f),!skipper/tenant";
    let listed = api.list(&ListParams::default().labels(sel)).await.unwrap();
    assert_eq!(listed.items.iter().map(name).collect::<Vec<_>>(), ["in"]);

    let mut w = watching(&api, watcher::Config::default().labels(sel), &["in"]).await;
    create(&api, "ignored", &[("skipper/deployment", "g")]).await;
    create(&api, "in2", &[("skipper/deployment", "f")]).await;
    assert!(matches!(next_event(&mut w).await, watcher::Event::Apply(c) if name(&c) == "in2"));
    // Labelling "in" with a tenant moves it out of the selection: a DELETED event.
    merge(
        &api,
        "in",
        serde_json::json!({"metadata": {"labels": {"skipper/tenant": "x"}}}),
    )
    .await;
    assert!(matches!(next_event(&mut w).await, watcher::Event::Delete(c) if name(&c) == "in"));
    // Removing the label brings it back.
    merge(
        &api,
        "in",
        serde_json::json!({"metadata": {"labels": {"skipper/tenant": null}}}),
    )
    .await;
    assert!(matches!(next_event(&mut w).await, watcher::Event::Apply(c) if name(&c) == "in"));
}

#[tokio::test]
async fn a_dropped_watch_resumes_from_its_resource_version_without_losing_events() {
    let (cluster, api) = configmaps().await;
    create(&api, "before", &[]).await;
    let mut w = watching(&api, watcher::Config::default(), &["before"]).await;
    for round in 0..3 {
        cluster.drop_watches();
        create(&api, &format!("after-{round}"), &[]).await;
        match next_event(&mut w).await {
            watcher::Event::Apply(c) => assert_eq!(name(&c), format!("after-{round}")),
            other => panic!("a resumed watch delivers the missed event, not {other:?}"),
        }
    }

    // A reflector converges on the same state through drops.
    let (reader, writer) = reflector::store();
    let rf = reflector(
        writer,
        watcher(api.clone(), watcher::Config::default()).default_backoff(),
    );
    let handle = tokio::spawn(rf.for_each(|_| async {}));
    reader.wait_until_ready().await.unwrap();
    cluster.drop_watches();
    api.delete("before", &DeleteParams::default()).await.unwrap();
    create(&api, "late", &[]).await;
    common::eventually("reflector sees the changes", Duration::from_secs(10), || {
        let mut names: Vec<String> = reader
            .state()
            .iter()
            .map(|c| name(c))
            .filter(|n| n != ROOT_CA)
            .collect();
        names.sort();
        async move { (names == ["after-0", "after-1", "after-2", "late"]).then_some(()) }
    })
    .await;
    handle.abort();
}

#[tokio::test]
async fn an_expired_resource_version_makes_the_watcher_relist() {
    let (cluster, api) = configmaps().await;
    create(&api, "one", &[]).await;
    let mut w = watching(&api, watcher::Config::default(), &["one"]).await;

    // Raw watch from a too-old resourceVersion: an ERROR event with 410 Expired.
    let rv = list_version(&api).await;
    create(&api, "two", &[]).await;
    cluster.compact();
    let mut raw = api.watch(&WatchParams::default(), &rv).await.unwrap().boxed();
    match tokio::time::timeout(Duration::from_secs(5), raw.next())
        .await
        .unwrap()
    {
        Some(Ok(WatchEvent::Error(e))) => {
            assert_eq!(e.code, 410);
            assert_eq!(e.reason, "Expired");
        }
        other => panic!("want a 410 ERROR event, got {other:?}"),
    }

    cluster.drop_watches();
    // The watcher re-watches from its old resourceVersion, gets 410 and relists.
    let mut names = initial_names(&mut w).await;
    names.sort();
    assert_eq!(names, ["one", "two"]);
}

#[tokio::test]
async fn bookmarks_arrive_when_asked_and_timeout_seconds_ends_the_watch() {
    let (_cluster, api) = configmaps().await;
    let rv = list_version(&api).await;
    let started = Instant::now();
    let mut raw = api
        .watch(&WatchParams::default().timeout(1), &rv)
        .await
        .unwrap()
        .boxed();
    let mut bookmarks = 0;
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(5), raw.next())
        .await
        .expect("watch ends in time")
    {
        if let Ok(WatchEvent::Bookmark(b)) = ev {
            assert!(!b.metadata.resource_version.is_empty());
            bookmarks += 1;
        }
    }
    assert!(bookmarks >= 1, "a bookmark every 200ms during a 1s watch");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "the watch lasts timeoutSeconds"
    );
}

fn api_error(e: kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason),
        other => panic!("want an API error, got {other}"),
    }
}

#[tokio::test]
async fn errors_are_status_objects_with_real_reasons_and_codes() {
    let (cluster, api) = configmaps().await;
    let pp = PostParams::default();
    assert_eq!(
        api_error(api.get("nope").await.unwrap_err()),
        (404, "NotFound".into())
    );
    let created = create(&api, "dup", &[]).await;
    assert_eq!(
        api_error(api.create(&pp, &cm("dup", &[])).await.unwrap_err()),
        (409, "AlreadyExists".into())
    );
    // Optimistic concurrency: a replace with a stale resourceVersion is a 409 Conflict.
    merge(&api, "dup", serde_json::json!({"data": {"k": "v2"}})).await;
    let mut stale = created.clone();
    stale.data = Some(BTreeMap::from([("k".to_owned(), "stale".to_owned())]));
    assert_eq!(
        api_error(api.replace("dup", &pp, &stale).await.unwrap_err()),
        (409, "Conflict".into())
    );
    let fresh = api.get("dup").await.unwrap();
    api.replace("dup", &pp, &fresh).await.unwrap();
    // A merge patch carrying a stale resourceVersion is a conflict too.
    let stale_rv = created.metadata.resource_version.clone().unwrap();
    let precondition =
        Patch::Merge(serde_json::json!({"metadata": {"resourceVersion": stale_rv}, "data": {"k": "x"}}));
    assert_eq!(
        api_error(
            api.patch("dup", &PatchParams::default(), &precondition)
                .await
                .unwrap_err()
        ),
        (409, "Conflict".into())
    );
    // A failed JSON Patch test is 422 Invalid.
    // kube 5 takes json-patch 4's `Patch`; let inference pick it.
    let patch =
        serde_json::from_value(serde_json::json!([{"op": "test", "path": "/data/k", "value": "other"}]))
            .unwrap();
    assert_eq!(
        api_error(
            api.patch("dup", &PatchParams::default(), &Patch::Json::<()>(patch))
                .await
                .unwrap_err()
        ),
        (422, "Invalid".into())
    );
    let missing_ns: Api<ConfigMap> = Api::namespaced(cluster.client().unwrap(), "absent");
    assert_eq!(
        api_error(missing_ns.create(&pp, &cm("x", &[])).await.unwrap_err()),
        (404, "NotFound".into())
    );
}

#[tokio::test]
async fn dry_run_writes_answer_without_changing_anything() {
    let (_cluster, api) = configmaps().await;
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let created = api.create(&dry, &cm("d", &[])).await.unwrap();
    assert_eq!(created.metadata.name.as_deref(), Some("d"));
    assert!(api.get_opt("d").await.unwrap().is_none(), "nothing was created");
    create(&api, "d", &[]).await;
    let before = api.get("d").await.unwrap();
    let pp = PatchParams {
        dry_run: true,
        ..PatchParams::default()
    };
    let patched = api
        .patch("d", &pp, &Patch::Merge(serde_json::json!({"data": {"k": "dry"}})))
        .await
        .unwrap();
    assert_eq!(patched.data.unwrap()["k"], "dry");
    assert_eq!(api.get("d").await.unwrap(), before, "nothing was patched");
    let dp = DeleteParams {
        dry_run: true,
        ..DeleteParams::default()
    };
    api.delete("d", &dp).await.unwrap();
    assert!(api.get_opt("d").await.unwrap().is_some(), "nothing was deleted");
}

#[tokio::test]
async fn field_selectors_and_paging_work() {
    let (_cluster, api) = configmaps().await;
    for i in 0..5 {
        create(&api, &format!("c{i}"), &[]).await;
    }
    let one = api
        .list(&ListParams::default().fields("metadata.name=c3"))
        .await
        .unwrap();
    assert_eq!(one.items.iter().map(name).collect::<Vec<_>>(), ["c3"]);
    let mut seen = Vec::new();
    let mut versions = Vec::new();
    let mut lp = ListParams::default().limit(2);
    loop {
        let page = api.list(&lp).await.unwrap();
        assert!(page.items.len() <= 2);
        seen.extend(page.items.iter().map(name).filter(|n| n != ROOT_CA));
        versions.push(page.metadata.resource_version.clone().unwrap());
        if versions.len() == 1 {
            // A change between pages: the pages still report the first page's version.
            api.delete("c0", &DeleteParams::default()).await.unwrap();
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => break,
        }
    }
    assert_eq!(seen, ["c0", "c1", "c2", "c3", "c4"]);
    assert!(versions.iter().all(|v| *v == versions[0]), "{versions:?}");
    // A watch from that version sees the change made while paging.
    let mut w = api
        .watch(&WatchParams::default(), &versions[0])
        .await
        .unwrap()
        .boxed();
    match tokio::time::timeout(Duration::from_secs(5), w.next())
        .await
        .unwrap()
    {
        Some(Ok(WatchEvent::Deleted(c))) => assert_eq!(name(&c), "c0"),
        other => panic!("want DELETED c0, got {other:?}"),
    }
}

#[tokio::test]
async fn injected_write_failures_and_latency_apply_over_rust_and_http() {
    let (cluster, api) = configmaps().await;
    let pp = PostParams::default();
    // (kube's client retries 503 by itself, so the tests inject 500 and 409.)
    cluster.fail_next_writes_in(NS, 2, http::StatusCode::INTERNAL_SERVER_ERROR);
    for _ in 0..2 {
        assert_eq!(
            api_error(api.create(&pp, &cm("f", &[])).await.unwrap_err()),
            (500, "InternalError".into())
        );
    }
    create(&api, "f", &[]).await;
    assert!(api.get("f").await.is_ok(), "reads are not affected");

    let http = common::api_http(&cluster);
    let resp = http
        .post(format!(
            "{}/_sim/fail-writes?count=1&status=409&namespace={NS}",
            cluster.base_url()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        api_error(api.create(&pp, &cm("g", &[])).await.unwrap_err()),
        (409, "Conflict".into())
    );
    create(&api, "g", &[]).await;

    http.post(format!("{}/_sim/latency?ms=300", cluster.base_url()))
        .send()
        .await
        .unwrap();
    let started = Instant::now();
    api.get("g").await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    cluster.set_latency(Duration::ZERO);
}
