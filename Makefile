# The commands CI runs. `make test` is the README's test command.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: build dist test test-real e2e e2e-real chaos fuzz fuzz-smoke lint fmt bench bench-router bench-sim bench-controller clean control-plane helm helm-lint

## build: the release binary at target/release/skipper
build:
	$(CARGO) build --release --bin skipper

## dist: the product binary alone, as the container image ships it: without the `dev` feature
## (no playground, no simulator, no sandbox shim), without debug info, statically linked
## (glibc's static-pie; runs FROM scratch), at target/dist/skipper
DIST_TARGET := x86_64-unknown-linux-gnu
dist:
	RUSTFLAGS='-C target-feature=+crt-static' $(CARGO) build --profile dist --no-default-features \
		--bin skipper --target $(DIST_TARGET)
	@mkdir -p target/dist
	cp target/$(DIST_TARGET)/dist/skipper target/dist/skipper
	@echo "target/dist/skipper: $$(stat -c %s target/dist/skipper) bytes"

## control-plane: kube-apiserver, kube-controller-manager, kube-scheduler and etcd from
## tools/k8s (Go modules) into target/control-plane/, reusing Go's module and build caches
K8S_VERSION := $(shell sed -n 's/^\tk8s.io\/kubernetes v\([0-9.]*\)$$/\1/p' tools/k8s/go.mod)
K8S_MINOR := $(word 2,$(subst ., ,$(K8S_VERSION)))
K8S_LDFLAGS := -s -w \
	-X k8s.io/component-base/version.gitVersion=v$(K8S_VERSION) \
	-X k8s.io/component-base/version.gitMajor=1 \
	-X k8s.io/component-base/version.gitMinor=$(K8S_MINOR) \
	-X k8s.io/component-base/version.gitTreeState=clean \
	-X k8s.io/client-go/pkg/version.gitVersion=v$(K8S_VERSION) \
	-X k8s.io/client-go/pkg/version.gitMajor=1 \
	-X k8s.io/client-go/pkg/version.gitMinor=$(K8S_MINOR)
control-plane:
	@test -n "$(K8S_VERSION)" || { echo "tools/k8s/go.mod names no k8s.io/kubernetes version" >&2; exit 1; }
	cd tools/k8s && CGO_ENABLED=0 nice -n 10 go build -buildvcs=false -mod=readonly \
		-ldflags '$(K8S_LDFLAGS)' -o ../../target/control-plane/ ./cmd/...

## helm: the helm command from tools/helm (helm.sh/helm/v3, Go modules) into target/helm/helm,
## versioned as the module it is built from; the chart's lint, golden and install tests use it
HELM_VERSION := $(shell sed -n 's/^\thelm.sh\/helm\/v3 v\([0-9.]*\).*$$/\1/p' tools/helm/go.mod)
HELM_K8S_MINOR := $(shell sed -n 's/^\tk8s.io\/client-go v0\.\([0-9]*\)\..*$$/\1/p' tools/helm/go.mod)
HELM_LDFLAGS := -s -w \
	-X helm.sh/helm/v3/internal/version.version=v$(HELM_VERSION) \
	-X helm.sh/helm/v3/internal/version.gitTreeState=clean \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$(HELM_K8S_MINOR) \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$(HELM_K8S_MINOR)
helm:
	@test -n "$(HELM_VERSION)" || { echo "tools/helm/go.mod names no helm.sh/helm/v3 version" >&2; exit 1; }
	cd tools/helm && CGO_ENABLED=0 nice -n 10 go build -buildvcs=false -mod=readonly \
		-ldflags '$(HELM_LDFLAGS)' -o ../../target/helm/helm helm.sh/helm/v3/cmd/helm

## helm-lint: `helm lint --strict` of charts/skipper with its defaults and every value file in charts/skipper/ci/
helm-lint: helm
	target/helm/helm lint --strict charts/skipper
	for f in charts/skipper/ci/*-values.yaml; do target/helm/helm lint --strict charts/skipper -f $$f || exit 1; done

## test: every unit, integration and doc test (the e2e suite runs in `make e2e`)
test:
	@$(CARGO) nextest --version >/dev/null 2>&1 || { \
		echo "make test: installing cargo-nextest (once; it runs each test in its own process)"; \
		$(CARGO) install cargo-nextest --locked; }
	$(CARGO) nextest run --workspace --no-fail-fast -E 'not binary(e2e) and not binary(chaos)'
	$(CARGO) test --workspace --doc

## test-real: the controller suites against the real control plane with our node agent
## (SKIPPER_TEST_CONTROL_PLANE=real; run `make control-plane` first; the pod network needs root),
## two at a time (each test starts its own control plane)
test-real:
	SKIPPER_TEST_CONTROL_PLANE=real $(CARGO) nextest run --no-fail-fast --test-threads 2 \
		-E 'binary(controller) and not test(/^(bench|supervisor_memory)::/)'

## e2e: the end-to-end scenarios against the real binary (`skipper dev`), two at a time
e2e:
	$(CARGO) test --test e2e -- --test-threads 2 --nocapture

## e2e-real: the same scenarios on the real control plane (`skipper dev --control-plane real`, built by
## `make control-plane`; needs root for the pods' network); a scenario that needs the simulator prints why
## it is skipped
e2e-real: control-plane
	SKIPPER_TEST_CONTROL_PLANE=real $(CARGO) test --test e2e -- --test-threads 2 --nocapture

## chaos: the reliability suite against the real binary (header and heartbeat floods, races
## across controllers, pod and controller kills, leaked pods), two scenarios at a time; every
## figure is printed as a `chaos:` line
chaos:
	$(CARGO) test --test chaos -- --test-threads 2 --nocapture

## fuzz: coverage-guided fuzzing on stable Rust (libFuzzer; `fuzz/run` builds the targets in fuzz/
## with coverage instrumentation) of the function header, tokens, patches and selectors,
## FUZZ_SECONDS per target (default 600); findings go to target/fuzz/artifacts/
FUZZ_SECONDS ?= 600
fuzz:
	fuzz/run $(FUZZ_SECONDS)

## fuzz-smoke: FUZZ_SMOKE_SECONDS (default 15) of each fuzz target (what CI runs)
FUZZ_SMOKE_SECONDS ?= 15
fuzz-smoke:
	fuzz/run $(FUZZ_SMOKE_SECONDS)

## lint: formatting and clippy with warnings as errors
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

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
	$(CARGO) test --release --test cluster -- --ignored --nocapture --test-threads 1 bench::

## bench-controller: controller figures (cold/warm GetInstance latency; 100,000 idle functions: bytes per supervisor, RSS, converge CPU per tick)
bench-controller:
	$(CARGO) test --release --test controller -- --ignored --nocapture --test-threads 1 bench::

clean:
	$(CARGO) clean
