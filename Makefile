# The commands CI runs. `make test` is the README's test command.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: build test lint fmt bench e2e clean

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

clean:
	$(CARGO) clean
