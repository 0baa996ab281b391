# syntax=docker/dockerfile:1
# One image, both binaries, statically linked (musl), nothing else:
#   /usr/local/bin/whereabouts-operator  the operator (`run`), the node installer (`install-cni`)
#                                        and the node agent (`agent`)
#   /usr/local/bin/whereabouts           the CNI plugin, copied onto each node by `install-cni`
#   /usr/share/doc/whereabouts/sbom.cdx.json  the SBOM: the crates the binaries are built from
#                                        (CycloneDX JSON from Cargo.lock for the platform's target,
#                                        e2e/sbom.sh)
#
# The plugin runs on the host, on whatever libc the node has (RHEL 8, Ubuntu 20.04, ...): it must
# need none, as upstream's Go plugin needs none. The image has no base image for the same reason.
# Platforms: linux/amd64 and linux/arm64 (TARGETARCH, set by --platform).
#
# Two ways to build it:
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/whereabouts:TAG --push .
#       the default (last) stage: compiles in a Rust builder image on the build machine's own
#       platform, cross-compiling for each target platform, then copies into `scratch`.
#   make release, then per platform: buildah bud --platform linux/ARCH --target local ...
#       packages the binaries and the SBOM `make release` made on this machine (target/image/ARCH/);
#       pulls no image at all. e2e/images.sh (linux/amd64) and e2e/multiarch-image.sh (both, joined
#       in one image index) do this; the README shows the commands.

# Builder: the toolchain of Cargo.toml's rust-version, with musl for a static build (musl-gcc
# compiles ring's C and assembly for amd64, Debian's aarch64 cross gcc for arm64: .cargo/).
FROM --platform=$BUILDPLATFORM docker.io/library/rust:1.89-bookworm AS build
ARG TARGETARCH
RUN apt-get update \
 && apt-get install -y --no-install-recommends musl-tools gcc-aarch64-linux-gnu \
 && rm -rf /var/lib/apt/lists/* \
 && rustup target add x86_64-unknown-linux-musl aarch64-unknown-linux-musl \
 && cargo install --locked cargo-cyclonedx@0.5.9
WORKDIR /src
# Dependencies first, in their own layer: a source change does not refetch the registry.
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
RUN mkdir -p src/bin \
 && echo 'fn main() {}' > src/bin/whereabouts.rs \
 && echo 'fn main() {}' > src/bin/whereabouts-operator.rs \
 && touch src/lib.rs \
 && cargo fetch --locked
COPY src ./src
COPY e2e/sbom.sh ./e2e/sbom.sh
# The SBOM's time stamp (no .git here): BuildKit passes SOURCE_DATE_EPOCH when it is set.
ARG SOURCE_DATE_EPOCH=0
RUN case "$TARGETARCH" in \
      amd64) target=x86_64-unknown-linux-musl ;; \
      arm64) target=aarch64-unknown-linux-musl ;; \
      *) echo "unsupported platform linux/$TARGETARCH (linux/amd64 and linux/arm64 are)" >&2; exit 1 ;; \
    esac \
 && cargo build --release --locked --target "$target" --bins \
 && install -D -m 0755 "target/$target/release/whereabouts" /out/whereabouts \
 && install -D -m 0755 "target/$target/release/whereabouts-operator" /out/whereabouts-operator \
 && e2e/sbom.sh "$target" /out/sbom.cdx.json

# The image from binaries built on the host by `make release`. No shell, no libc, no CA bundle:
# every TLS peer (the API server, the webhook's clients) is verified against the cluster's CA.
# Non-root by default: the node DaemonSet runs as root for its hostPath writes (config/cni); the
# operator runs as 65532 with a read-only root filesystem (config/operator).
FROM scratch AS local
ARG TARGETARCH
COPY target/image/${TARGETARCH}/whereabouts target/image/${TARGETARCH}/whereabouts-operator /usr/local/bin/
COPY target/image/${TARGETARCH}/sbom.cdx.json /usr/share/doc/whereabouts/sbom.cdx.json
USER 65532:65532
EXPOSE 8080 8443
ENTRYPOINT ["/usr/local/bin/whereabouts-operator"]
CMD ["run"]

# The default: the same image from the builder stage.
FROM scratch AS image
COPY --from=build /out/whereabouts /out/whereabouts-operator /usr/local/bin/
COPY --from=build /out/sbom.cdx.json /usr/share/doc/whereabouts/sbom.cdx.json
USER 65532:65532
EXPOSE 8080 8443
ENTRYPOINT ["/usr/local/bin/whereabouts-operator"]
CMD ["run"]
