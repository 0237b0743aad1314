# The commands CI runs. `make test` is the README's test command.
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: build dist test test-real e2e e2e-real e2e-kubelet chaos fuzz fuzz-smoke lint fmt bench bench-router bench-cold bench-slow bench-sim bench-controller clean control-plane \
	helm helm-lint nodes image image-check

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

## nodes: what kubelet nodes run, from tools/nodes (Go modules) into target/nodes/: kubelet at the
## control plane's pin, containerd with its runc shim and ctr (without cgo or the btrfs, devmapper
## and zfs snapshotters), metrics-server, and the pods' pause image (target/nodes/pause.oci.tar, a
## static C program from scratch); runc and the CNI plugins come from Debian (`.ci/run` installs them)
NODES_K8S_VERSION := $(shell sed -n 's/^\tk8s.io\/kubernetes v\([0-9.]*\)$$/\1/p' tools/nodes/kubelet/go.mod)
CONTAINERD_VERSION := $(shell sed -n 's/^\(require \|\t\)github.com\/containerd\/containerd\/v2 v\([0-9.]*\)$$/\2/p' tools/nodes/containerd/go.mod)
METRICS_SERVER_VERSION := $(shell sed -n 's/^\tsigs.k8s.io\/metrics-server v\([0-9.]*\)$$/\1/p' tools/nodes/metrics-server/go.mod)
CONTAINERD_LDFLAGS := -s -w -X github.com/containerd/containerd/v2/version.Version=$(CONTAINERD_VERSION)
METRICS_SERVER_LDFLAGS := -s -w -X k8s.io/client-go/pkg/version.gitVersion=v$(METRICS_SERVER_VERSION)
NODES_GO_BUILD := CGO_ENABLED=0 nice -n 10 go build -buildvcs=false -mod=readonly
NODES_DIR := $(CURDIR)/target/nodes
# buildah keeps its images and layers under target/ (vfs: plain directories, no mounts) and
# leaves nothing in the host's container storage; tools/containers-private keeps what it writes
# elsewhere (its blob-info cache under /var/lib/containers) off the host.
BUILDAH = $(CURDIR)/tools/containers-private buildah --root $(CURDIR)/target/buildah/root --runroot $(CURDIR)/target/buildah/run --storage-driver vfs
PAUSE_IMAGE := localhost/skipper/pause:1
nodes:
	@test -n "$(NODES_K8S_VERSION)" -a -n "$(CONTAINERD_VERSION)" -a -n "$(METRICS_SERVER_VERSION)" || { \
		echo "tools/nodes: a go.mod names no k8s.io/kubernetes, containerd or metrics-server version" >&2; exit 1; }
	@test "$(NODES_K8S_VERSION)" = "$(K8S_VERSION)" || { echo "tools/nodes/kubelet pins k8s.io/kubernetes \
		v$(NODES_K8S_VERSION), the control plane (tools/k8s) v$(K8S_VERSION): they must match" >&2; exit 1; }
	cd tools/nodes/kubelet && $(NODES_GO_BUILD) -ldflags '$(K8S_LDFLAGS)' -o $(NODES_DIR)/ ./cmd/kubelet
	cd tools/nodes/containerd && $(NODES_GO_BUILD) -tags 'no_btrfs no_devmapper no_zfs' \
		-ldflags '$(CONTAINERD_LDFLAGS)' -o $(NODES_DIR)/ ./cmd/...
	cd tools/nodes/metrics-server && $(NODES_GO_BUILD) -ldflags '$(METRICS_SERVER_LDFLAGS)' \
		-o $(NODES_DIR)/ ./cmd/metrics-server
	@command -v buildah >/dev/null || { echo "make nodes: the pause image needs buildah (apt-get install -y buildah)" >&2; exit 1; }
	rm -rf target/nodes/pause-context && mkdir -p target/nodes/pause-context
	gcc -static -Os -s -Wall -Werror -o target/nodes/pause tools/nodes/pause/pause.c
	cp target/nodes/pause target/nodes/pause-context/pause
	$(BUILDAH) bud --quiet --timestamp 0 --isolation chroot -f $(CURDIR)/tools/nodes/pause/Containerfile \
		-t $(PAUSE_IMAGE) target/nodes/pause-context >/dev/null
	rm -f target/nodes/pause.oci.tar
	$(BUILDAH) push --quiet $(PAUSE_IMAGE) oci-archive:target/nodes/pause.oci.tar:$(PAUSE_IMAGE)
	$(BUILDAH) rmi --all >/dev/null
	@ls target/nodes

## image: the container image, built without a daemon: `make dist`'s static product binary with CA
## certificates and a numeric non-root user, FROM scratch (Containerfile), into
## target/image/skipper.oci.tar (reference localhost/skipper:VERSION); prints its size
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -1)
REVISION := $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
IMAGE := localhost/skipper:$(VERSION)
IMAGE_SOURCE ?= $(shell git remote get-url origin 2>/dev/null)
CA_CERTIFICATES ?= /etc/ssl/certs/ca-certificates.crt
image: dist
	@command -v buildah >/dev/null || { echo "make image: needs buildah (apt-get install -y buildah)" >&2; exit 1; }
	@test -s $(CA_CERTIFICATES) || { echo "make image: no CA certificates at $(CA_CERTIFICATES) \
		(apt-get install -y ca-certificates, or set CA_CERTIFICATES)" >&2; exit 1; }
	rm -rf target/image/context && mkdir -p target/image/context
	cp target/dist/skipper target/image/context/skipper
	cp $(CA_CERTIFICATES) target/image/context/ca-certificates.crt
	$(BUILDAH) bud --quiet --isolation chroot --timestamp $$(git log -1 --format=%ct 2>/dev/null || echo 0) \
		--build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) --build-arg SOURCE=$(IMAGE_SOURCE) \
		-f $(CURDIR)/Containerfile -t $(IMAGE) target/image/context >/dev/null
	rm -f target/image/skipper.oci.tar
	$(BUILDAH) push --quiet $(IMAGE) oci-archive:target/image/skipper.oci.tar:$(IMAGE)
	$(BUILDAH) rmi --all >/dev/null
	@echo "image $(IMAGE): target/image/skipper.oci.tar, $$(du -k target/image/skipper.oci.tar | cut -f1) KiB"

## image-check: the image under podman with runc as an operator runs it (any UID, read-only root,
## no capabilities): `skipper controller --help`, `skipper fixture` answering HTTP, `skipper router`
## answering /livez
image-check:
	tools/containers-private tools/image-check target/image/skipper.oci.tar

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
		$(CARGO) install cargo-nextest --locked --no-default-features; }
	$(CARGO) nextest run --workspace --no-fail-fast \
		-E 'not binary(e2e) and not binary(chaos) and not (binary(controller) and test(/^poisoning::/))'
	$(CARGO) test --workspace --doc

## test-real: the controller suites against the real control plane with our node agent
## (SKIPPER_TEST_CONTROL_PLANE=real; run `make control-plane` first; the pod network needs root),
## two at a time (each test starts its own control plane)
test-real:
	SKIPPER_TEST_CONTROL_PLANE=real $(CARGO) nextest run --no-fail-fast --test-threads 2 \
		-E 'binary(controller) and not test(/^(bench|supervisor_memory)::/)'

## e2e: the end-to-end scenarios against the real binary (`skipper dev`), two at a time; the
## kubelet-node mode's own check (`kubelet::`, it needs the image) runs in `make e2e-kubelet`
e2e:
	$(CARGO) test --test e2e -- --test-threads 2 --nocapture --skip kubelet::

## e2e-real: the same scenarios on the real control plane (`skipper dev --control-plane real`, built by
## `make control-plane`; needs root for the pods' network); a scenario that needs the simulator prints why
## it is skipped
e2e-real: control-plane
	SKIPPER_TEST_CONTROL_PLANE=real $(CARGO) test --test e2e -- --test-threads 2 --nocapture

## e2e-kubelet: scenarios on kubelet nodes (`skipper dev --control-plane real --nodes kubelet`: the
## controllers, the router and the pool pods of the image; needs `make control-plane nodes image`):
## echo and affinity, oneshot (a pod per request, released), claims across three controllers and a
## ring change when one is SIGKILLed, a pool pod's container SIGKILLed under load, a WebSocket
## keeping its pod, a rolling update of the pool replacing stale instances; then the mode's own
## check (nodes, containers of the image, nothing left on the host after a SIGKILL and a restart)
E2E_KUBELET_SCENARIOS := s01_echo_and_affinity s03_oneshot s05_three_controllers_failover \
	s06_pod_crash_under_load s07_websocket_keeps_pod s08_rollout
e2e-kubelet:
	SKIPPER_TEST_NODES=kubelet $(CARGO) test --test e2e -- --test-threads 1 --nocapture $(E2E_KUBELET_SCENARIOS)
	$(CARGO) test --test e2e -- --test-threads 1 --nocapture kubelet::

## chaos: the reliability suite against the real binary (header and heartbeat floods, races
## across controllers, pod and controller kills, key rotation under load, leaked pods), two
## scenarios at a time, then the heartbeat flood alone (it measures the controllers' memory and
## their liveness under 120,000 heartbeat entries, not what another scenario costs); every figure
## is printed as a `chaos:` line; then pool poisoning (a tenant replaying its token to pool pods)
## on the controller harness
chaos:
	$(CARGO) test --test chaos -- --test-threads 2 --nocapture --skip heartbeat_flood
	$(CARGO) test --test chaos -- --nocapture heartbeat_flood
	$(CARGO) test --test controller -- --nocapture poisoning::

## fuzz: coverage-guided fuzzing on stable Rust (libFuzzer; `fuzz/run` builds the targets in fuzz/
## with coverage instrumentation) of the function header, tokens, patches and selectors,
## FUZZ_SECONDS per target (default 600); findings go to target/fuzz/artifacts/
FUZZ_SECONDS ?= 600
fuzz:
	fuzz/run $(FUZZ_SECONDS)

## fuzz-smoke: FUZZ_SMOKE_SECONDS (default 15) of each fuzz target from a fixed seed (what CI
## runs; `make fuzz` explores with a new seed each run)
FUZZ_SMOKE_SECONDS ?= 15
fuzz-smoke:
	FUZZ_SEED=1 fuzz/run $(FUZZ_SMOKE_SECONDS)

## lint: formatting and clippy with warnings as errors
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all

## bench: criterion micro-benchmarks (reports in target/criterion)
bench:
	$(CARGO) bench --bench ring

## bench-router: router load benchmark, direct vs through the router at 1 and 32 connections;
## then HTTP/2 and gRPC with h2load at 1 and 100 streams, the router (to HTTP/1.1 and h2c pools)
## against nginx (http2 with proxy_pass and grpc_pass) in front of the same pod
bench-router:
	$(CARGO) bench --bench router_load
	$(CARGO) bench --bench router_h2

## bench-cold: cold starts through the router (new tenants, free pool pods, simulator; p50/p95/max and
## the Server-Timing parts) and GetInstance latency with a Go-style gRPC client
bench-cold:
	$(CARGO) bench --bench cold_start

## bench-slow: 50 uploads dripping a byte every 5 s against 50 req/s to 10 tenants through the real
## router: when each upload ends (bound: --body-timeout and 5 s) and p99 against the idle baseline
## of the same run (bound: 2x)
bench-slow:
	$(CARGO) bench --bench slow_clients

## bench-sim: simulator figures (pool of 50 Ready, RSS per fixture pod, watch latency p50/p99)
bench-sim:
	$(CARGO) test --release --test cluster -- --ignored --nocapture --test-threads 1 bench::

## bench-controller: controller figures (cold/warm GetInstance latency; 10,000 and 100,000 idle and active functions: heap bytes per function, RSS, converge CPU per tick; at most 3 KiB per active function)
bench-controller:
	$(CARGO) test --release --test controller -- --ignored --nocapture --test-threads 1 bench::

clean:
	$(CARGO) clean
