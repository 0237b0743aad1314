# The commands CI runs. `make test` is the README's test command.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: build test e2e lint fmt bench bench-router bench-sim bench-controller clean

## build: the release binary at target/release/skipper
build:
	$(CARGO) build --release --bin skipper

## test: every unit, integration and doc test (the e2e suite runs in `make e2e`)
test:
	$(CARGO) nextest run --no-fail-fast -E 'not binary(e2e)'
	$(CARGO) test --doc

## e2e: the end-to-end scenarios against the real binary (`skipper dev`), two at a time
e2e:
	$(CARGO) build --bin skipper
	$(CARGO) test --test e2e -- --test-threads 2 --nocapture

## lint: formatting and clippy with warnings as errors
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

## bench: criterion micro-benchmarks (reports in target/criterion)
bench:
	$(CARGO) bench --bench ring

## bench-router: router load benchmark, direct vs through the router at 1 and 32 connections
bench-router:
	$(CARGO) bench --bench router_load

## bench-sim: simulator figures (pool of 50 Ready, RSS per fixture pod, watch latency p50/p99)
bench-sim:
	$(CARGO) test --release --test devcluster_bench -- --ignored --nocapture --test-threads 1

## bench-controller: controller figures (cold/warm GetInstance latency; 100,000 idle functions: bytes per supervisor, RSS, converge CPU per tick)
bench-controller:
	$(CARGO) test --release --test controller_bench -- --ignored --nocapture --test-threads 1

clean:
	$(CARGO) clean
