//! Hash ring hot paths: owner lookups (3 and 20 members) and building a ring
//! (3, 20 and 100 members).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use skipper::domain::FunctionId;
use skipper::ring::HashRing;

fn members(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("10.0.{}.{}", i / 250, i % 250 + 1))
        .collect()
}

fn lookup(c: &mut Criterion) {
    let mut g = c.benchmark_group("ring_lookup");
    for n in [3, 20] {
        let ring = HashRing::new(members(n));
        let ids: Vec<FunctionId> = (0..1024u64)
            .map(|i| FunctionId::of("ns", "dep", &format!("tenant-{i}"), false))
            .collect();
        let mut i = 0usize;
        g.bench_with_input(BenchmarkId::from_parameter(n), &ring, |b, ring| {
            b.iter(|| {
                i = (i + 1) & 1023;
                black_box(ring.owner(black_box(ids[i])))
            });
        });
    }
    g.finish();
}

fn function_id(c: &mut Criterion) {
    c.bench_function("function_id", |b| {
        b.iter(|| {
            FunctionId::of(
                black_box("skipper-production"),
                black_box("my-app"),
                black_box("tenant-123"),
                false,
            )
        });
    });
}

fn build(c: &mut Criterion) {
    let mut g = c.benchmark_group("ring_build");
    g.sample_size(20);
    for n in [3, 20, 100] {
        let m = members(n);
        g.bench_with_input(BenchmarkId::from_parameter(n), &m, |b, m| {
            b.iter(|| HashRing::new(black_box(m)))
        });
    }
    g.finish();
}

criterion_group!(benches, lookup, function_id, build);
criterion_main!(benches);
