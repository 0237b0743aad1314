//! The pprof endpoint: `/debug/pprof/profile?seconds=1` returns a CPU
//! profile that parses as pprof protobuf and names the function that was
//! burning CPU; one profile at a time; bad `seconds` are refused.
//!
//! The sampler is the process's (one at a time in a process): the tests
//! that take a profile hold [`SAMPLER`], so that a runner that runs them
//! side by side in one process (plain `cargo test`) runs them one after
//! the other.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prost::Message as _;
use skipper::profiling::proto::Profile;
use skipper::shutdown::Shutdown;

/// Held by each test that takes a profile.
static SAMPLER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// [`SAMPLER`], once the test holding it is done (each ends within a
/// minute).
async fn sampler() -> tokio::sync::MutexGuard<'static, ()> {
    tokio::time::timeout(Duration::from_secs(120), SAMPLER.lock())
        .await
        .expect("the other profiling test let the sampler go")
}

/// Spins until `stop` is set (the work the profile must catch).
#[inline(never)]
fn burn_cpu_for_profile(stop: &AtomicBool) -> u64 {
    let mut x: u64 = 1;
    while !stop.load(Ordering::Relaxed) {
        for i in 0..10_000u64 {
            x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i));
        }
    }
    x
}

async fn start() -> (std::net::SocketAddr, Shutdown) {
    let shutdown = Shutdown::new();
    let addr = skipper::profiling::serve("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5), &shutdown)
        .await
        .expect("bind the pprof endpoint");
    (addr, shutdown)
}

type Pending = tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>;

/// Starts a `seconds`-long profile request and returns once the endpoint
/// refuses a second one (so the first is the one running), with the text
/// of that refusal.
async fn running_profile(
    http: &reqwest::Client,
    addr: std::net::SocketAddr,
    seconds: u64,
) -> (Pending, String) {
    let url = format!("http://{addr}/debug/pprof/profile?seconds={seconds}");
    let probe = format!("http://{addr}/debug/pprof/profile?seconds=1");
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let pending: Pending = tokio::spawn({
                let http = http.clone();
                let url = url.clone();
                async move { http.get(url).send().await }
            });
            let r = http.get(&probe).send().await.unwrap();
            if r.status() == reqwest::StatusCode::CONFLICT {
                return (pending, r.text().await.unwrap());
            }
            // The probe ran first, so the long request was the one refused.
            assert_eq!(r.status(), reqwest::StatusCode::OK);
            let refused = pending.await.unwrap().unwrap();
            assert_eq!(refused.status(), reqwest::StatusCode::CONFLICT);
        }
    })
    .await
    .expect("a profile starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_second_profile_parses_as_pprof_and_names_the_hot_function() {
    let _sampler = sampler().await;
    let (addr, shutdown) = start().await;
    let stop = Arc::new(AtomicBool::new(false));
    let burner = {
        let stop = stop.clone();
        std::thread::spawn(move || burn_cpu_for_profile(&stop))
    };
    let http = reqwest::Client::new();
    // While one profile runs, a second is refused.
    let (first, busy) = running_profile(&http, addr, 1).await;
    assert!(busy.contains("already"), "{busy}");

    let resp = tokio::time::timeout(Duration::from_secs(20), first)
        .await
        .expect("the profile answers within its length")
        .unwrap()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    burner.join().unwrap();
    assert_eq!(resp.status(), reqwest::StatusCode::OK);
    assert_eq!(
        resp.headers()[reqwest::header::CONTENT_TYPE],
        "application/octet-stream"
    );
    let bytes = resp.bytes().await.unwrap();
    assert!(!bytes.is_empty());
    let p = Profile::decode(bytes.as_ref()).expect("pprof protobuf");
    let s = |i: i64| p.string_table[usize::try_from(i).unwrap()].as_str();
    assert_eq!(p.string_table[0], "", "string 0 is the empty string");
    assert_eq!(p.sample_type.len(), 2);
    assert_eq!(
        (s(p.sample_type[0].r#type), s(p.sample_type[0].unit)),
        ("samples", "count")
    );
    assert_eq!(
        (s(p.sample_type[1].r#type), s(p.sample_type[1].unit)),
        ("cpu", "nanoseconds")
    );
    assert_eq!(p.period, 10_000_000, "100 Hz");
    assert!(p.duration_nanos >= 900_000_000, "{}", p.duration_nanos);
    assert!(!p.sample.is_empty(), "a busy second has samples");
    let total: i64 = p.sample.iter().map(|x| x.value[0]).sum();
    // 100 Hz of process CPU time; on a busy machine the burner gets less.
    assert!(total >= 1, "{total}");
    for sample in &p.sample {
        assert_eq!(sample.value.len(), 2);
        for id in &sample.location_id {
            let loc = &p.location[usize::try_from(*id - 1).unwrap()];
            assert_eq!(loc.id, *id, "location ids are their index + 1");
            for line in &loc.line {
                let f = &p.function[usize::try_from(line.function_id - 1).unwrap()];
                assert_eq!(f.id, line.function_id);
            }
        }
    }
    let hot = p
        .function
        .iter()
        .any(|f| s(f.name).contains("burn_cpu_for_profile"));
    assert!(hot, "the profile names the burning function");

    // An independent reader: Go's pprof tool, on request (its first run
    // builds the tool, about a minute on a CI machine).
    let go =
        std::env::var_os("SKIPPER_TEST_GO_PPROF").and(["go", "/usr/local/go/bin/go"].into_iter().find(|g| {
            std::process::Command::new(g)
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
        }));
    if let Some(go) = go {
        let dir = std::env::temp_dir().join(format!("skipper-pprof-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cpu.pb");
        std::fs::write(&file, &bytes).unwrap();
        let out = std::process::Command::new(go)
            .args(["tool", "pprof", "-symbolize=none", "-top"])
            .arg(&file)
            .output()
            .unwrap();
        let top = skipper_test_support::process::succeeded("go tool pprof", out);
        let text = String::from_utf8_lossy(&top);
        assert!(text.contains("burn_cpu_for_profile"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }
    shutdown.trigger();
}

#[tokio::test]
async fn bad_lengths_are_refused_and_the_index_lists_the_profile() {
    use reqwest::StatusCode;
    let (addr, shutdown) = start().await;
    // The endpoint serves this process, the test binary: its arguments.
    let cmdline = std::env::args().collect::<Vec<_>>().join("\0");
    for (path, status, says) in [
        ("profile?seconds=0", StatusCode::BAD_REQUEST, "between 1 and 120"),
        (
            "profile?seconds=121",
            StatusCode::BAD_REQUEST,
            "between 1 and 120",
        ),
        (
            "profile?seconds=abc",
            StatusCode::BAD_REQUEST,
            "between 1 and 120",
        ),
        ("", StatusCode::OK, "profile?seconds="),
        ("heap", StatusCode::NOT_IMPLEMENTED, ""),
        ("cmdline", StatusCode::OK, cmdline.as_str()),
    ] {
        let r = skipper_test_support::http()
            .get(format!("http://{addr}/debug/pprof/{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{path}");
        let body = r.text().await.unwrap();
        assert!(body.contains(says), "{path}: {body}");
    }
    shutdown.trigger();
}

#[tokio::test]
async fn a_profile_ends_early_at_shutdown() {
    let _sampler = sampler().await;
    let (addr, shutdown) = start().await;
    let http = reqwest::Client::new();
    let (req, _) = running_profile(&http, addr, 60).await;
    // Shut down while the 60 s profile runs: it answers with what it has.
    shutdown.trigger();
    let resp = tokio::time::timeout(Duration::from_secs(15), req)
        .await
        .expect("the profile stops at shutdown, long before 60 s")
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), reqwest::StatusCode::OK);
    let p = Profile::decode(resp.bytes().await.unwrap().as_ref()).unwrap();
    assert!(p.duration_nanos < 15_000_000_000);
}
