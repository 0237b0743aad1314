//! The controller's integration suite: in-process controllers against a
//! cluster (the simulator, or the real control plane with
//! `SKIPPER_TEST_CONTROL_PLANE=real`) with a pool of real fixture pods.
//! `make bench-controller` runs the ignored benchmarks of [`bench`].

mod assign;
mod auth;
mod backoff;
mod bench;
mod poisoning;
mod ring;
mod scaling;
mod startup;
mod supervisor_memory;
mod warm_path;
mod watch;
mod web_ui;

// Counts every allocation of this test binary (the controllers run in it):
// the memory bounds of `supervisor_memory` and `bench` read it.
#[global_allocator]
static GLOBAL: &stats_alloc::StatsAlloc<std::alloc::System> = &stats_alloc::INSTRUMENTED_SYSTEM;

/// Heap bytes currently allocated by this process. A reallocation's growth
/// is already in `bytes_allocated` (and its shrinking in
/// `bytes_deallocated`); `bytes_reallocated` counts it once more.
#[allow(clippy::cast_possible_wrap)]
fn live_bytes() -> i64 {
    let s = GLOBAL.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}
