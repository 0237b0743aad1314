# The commands CI runs. `make test` is the README's test command.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: build test lint fmt bench bench-sim e2e clean

build:
	$(CARGO) build --release --bin skipper

test:
	$(CARGO) build --bin skipper
	$(CARGO) nextest run --no-fail-fast --all-targets || $(CARGO) test --all-targets

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

bench:
	$(CARGO) bench --bench ring

# Simulator figures: pool of 50 Ready, RSS per fixture pod, watch latency p50/p99.
bench-sim:
	$(CARGO) test --release --test devcluster_bench -- --ignored --nocapture --test-threads 1

clean:
	$(CARGO) clean
