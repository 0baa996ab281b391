# One task file for people and CI. `make test` is the README's test command; .ci/run calls it.
.PHONY: test check helm unit e2e e2e-min node chaos chaos-smoke images crds deps build release demo fuzz fuzz-build fuzz-smoke

CARGO ?= cargo

test: check helm unit e2e e2e-min node chaos-smoke fuzz-smoke

# Formatting, lints and the generated-CRD drift check (a unit test compares crds/ with the types).
# The e2e and node test crates are `test = false`, so --all-targets leaves them out: named here.
# cargo-deny holds the dependency tree to deny.toml: licences, banned crates (a second TLS stack),
# crates.io as the only source (advisories need the network: not here).
check:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --test e2e --test node -- -D warnings
	$(CARGO) deny check licenses bans sources

# The Helm chart renders the same objects as config/default, and its values change only their
# fields (helm lint + helm template against kubectl kustomize; builds helm into e2e/bin; no cluster).
helm:
	e2e/helm-test.sh

unit:
	$(CARGO) test

# The end-to-end tier: real binaries against the real local control plane.
e2e:
	e2e/run-tests.sh

# The e2e tier's tests that depend on the API server's behaviour (webhook, certs, install,
# operator, keep, slices, node_limits, relist: 30 tests) against the oldest supported Kubernetes release
# (README "Supported Kubernetes versions"): its kube-apiserver and kube-controller-manager built
# from e2e/k8s-min, on a control plane of its own (e2e/.state-min). It reuses `make e2e`'s debug
# build, so in `make test`, right after it, it costs the two Go binaries once (measured
# 2026-12-04 on 2 cores under load ~11, the Go cache holding 1.37's build: 628 s wall, 441 CPU-s,
# i.e. about 4 minutes on an idle machine) and 93 s for the run itself. The whole set, not a
# subset, is in `make test`: that is under 15 minutes on top of the ~50 of a 90-minute CI budget.
e2e-min:
	e2e/run-min-tests.sh

# The node tier: the image on a real kubelet + containerd node, installed with kubectl apply -k.
node:
	e2e/run-node-tests.sh

# The chaos tier: rounds of ADD/DEL bursts from a mixed fleet (node agent, plugin alone, upstream)
# with faults injected, invariants checked after every round (e2e/chaos/README.md). `chaos` is the
# long run whose figures are in docs/reliability.md; `chaos-smoke` is the short seeded run of
# `make test`. Seed 2 found the earlier-sandbox leak (fixed): it stays the smoke run's seed.
# Both run a network in node slices next to the plain one (--sliced: a node per fleet member);
# the long run also a second network over the first's addresses and one network_name for all
# (--overlap --shared-name; about 110 minutes on 2 cores, upstream's rounds are slow)
# (e2e/chaos/chaos.py).
CHAOS_ROUNDS ?= 20
CHAOS_SEED ?= 1
CHAOS_ARGS ?= --sliced --overlap --shared-name
chaos:
	e2e/run-chaos.sh --rounds $(CHAOS_ROUNDS) --seed $(CHAOS_SEED) --json /tmp/wa-chaos-$(CHAOS_SEED).json $(CHAOS_ARGS)

chaos-smoke:
	e2e/run-chaos.sh --rounds 3 --seed 2 --sliced

# The OCI images of the node tier (whereabouts, pause, busybox), built with buildah, no registry.
images:
	e2e/images.sh

crds:
	$(CARGO) run -q --bin whereabouts-operator -- crds --dir crds
	cp crds/ippools.yaml crds/overlappingrangeipreservations.yaml crds/nodeslicepools.yaml crds/ipamclaims.yaml config/crd/
	cp config/crd/ippools.yaml config/crd/overlappingrangeipreservations.yaml config/crd/nodeslicepools.yaml config/crd/ipamclaims.yaml charts/whereabouts/crds/

build:
	$(CARGO) build --bins

# The release binaries: static (musl), as the image and every node need them, for each platform
# of the image, with that platform's SBOM (e2e/sbom.sh: CycloneDX from Cargo.lock):
# target/image/<arch>/ is what the Dockerfile's `local` stage copies for `--platform linux/<arch>`.
# arm64 is cross-compiled (.cargo/config.toml).
RELEASE_PLATFORMS ?= amd64:x86_64-unknown-linux-musl arm64:aarch64-unknown-linux-musl
release:
	set -e; for p in $(RELEASE_PLATFORMS); do \
	  arch=$${p%%:*}; target=$${p#*:}; \
	  $(CARGO) build --release --locked --target $$target --bins; \
	  install -D -m 0755 -t target/image/$$arch target/$$target/release/whereabouts target/$$target/release/whereabouts-operator; \
	  CARGO=$(CARGO) e2e/sbom.sh $$target target/image/$$arch/sbom.cdx.json; \
	done

# The README's demo: a local control plane, the operator, the webhook, sample NADs, pods; cleans up.
demo:
	e2e/demo.sh

# Everything a fresh Debian machine needs for `make test` (apt packages, Go modules, Rust components,
# cargo tools). The supply-chain tools are pinned (and reinstalled when the pin moves): cargo-deny
# for `make check`, cargo-cyclonedx for the images' SBOMs (e2e/sbom.sh; the Dockerfile's builder
# pins the same). About 4 minutes each to build on 2 cores, once per machine.
CARGO_DENY_VERSION := 0.20.2
CARGO_CYCLONEDX_VERSION := 0.5.9
deps:
	e2e/install-deps.sh
	rustup component add clippy rustfmt
	rustup target add x86_64-unknown-linux-musl aarch64-unknown-linux-musl
	rustup toolchain install nightly --profile minimal
	$(FUZZ) --version >/dev/null 2>&1 || $(CARGO) install cargo-fuzz --locked
	$(CARGO) deny --version 2>/dev/null | grep -q ' $(CARGO_DENY_VERSION)$$' \
	  || $(CARGO) install cargo-deny --locked --version $(CARGO_DENY_VERSION)
	$(CARGO) cyclonedx --version 2>/dev/null | grep -q ' $(CARGO_CYCLONEDX_VERSION)$$' \
	  || $(CARGO) install cargo-cyclonedx --locked --version $(CARGO_CYCLONEDX_VERSION)

# Coverage-guided fuzzing of every input (cargo-fuzz, nightly; fuzz/, docs/reliability.md
# "Fuzzing"). One target at a time, one process each: the machine is shared.
FUZZ ?= cargo +nightly fuzz
FUZZ_TARGETS := cni_config flat_file nad_config admission_review agent_request
FUZZ_SECONDS ?= 300
FUZZ_SMOKE_SECONDS ?= 20
# An input running over 10 s is a hang, a process over 2 GiB a memory blow-up: both are findings.
FUZZ_FLAGS = -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
# The flat_file target's one file per fuzzing process (it cannot clean up: libFuzzer exits).
FUZZ_CLEANUP = trap 'rm -f /dev/shm/whereabouts-fuzz-flat-*.conf' EXIT

fuzz-build:
	$(FUZZ) build

# Each target for FUZZ_SECONDS. New inputs go to fuzz/corpus-grown/<target> (not committed); the
# seeds in fuzz/corpus/<target> are read only.
fuzz: fuzz-build
	set -e; $(FUZZ_CLEANUP); for t in $(FUZZ_TARGETS); do \
	  mkdir -p fuzz/corpus-grown/$$t; \
	  $(FUZZ) run $$t fuzz/corpus-grown/$$t fuzz/corpus/$$t -- -max_total_time=$(FUZZ_SECONDS) $(FUZZ_FLAGS); \
	done

# Each target for FUZZ_SMOKE_SECONDS on a throwaway copy of its seeds (CI never grows the corpus).
# Built unoptimised and without AddressSanitizer (debug assertions and overflow checks stay on, as
# the coverage guidance does): a clean clone's optimised ASan build took 899 s on 2 cores, this one
# 200 s, and a 20-second smoke run needs its targets built and their seeds run, not speed. The
# crate has no `unsafe`; `make fuzz` keeps the optimised ASan build.
FUZZ_SMOKE_BUILD := --dev --sanitizer none
fuzz-smoke:
	$(FUZZ) build $(FUZZ_SMOKE_BUILD)
	set -e; $(FUZZ_CLEANUP); for t in $(FUZZ_TARGETS); do \
	  rm -rf fuzz/target/smoke-corpus/$$t; mkdir -p fuzz/target/smoke-corpus; \
	  cp -r fuzz/corpus/$$t fuzz/target/smoke-corpus/$$t; \
	  $(FUZZ) run $(FUZZ_SMOKE_BUILD) $$t fuzz/target/smoke-corpus/$$t -- -max_total_time=$(FUZZ_SMOKE_SECONDS) $(FUZZ_FLAGS); \
	done
