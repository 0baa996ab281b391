# syntax=docker/dockerfile:1
# One image, both binaries:
#   /usr/local/bin/whereabouts-operator  the operator (`run`) and the node installer (`install-cni`)
#   /usr/local/bin/whereabouts           the CNI plugin, copied onto each node by `install-cni`
# Build: docker build -t REGISTRY/whereabouts:TAG .

# Builder: the toolchain of Cargo.toml's rust-version on Debian 12, so the binaries link against
# the same glibc as the runtime image (and the plugin runs on any glibc >= 2.36 host).
FROM docker.io/library/rust:1.89-bookworm AS build
WORKDIR /src
# Dependencies first, in their own layer: a source change does not refetch the registry.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src/bin \
 && echo 'fn main() {}' > src/bin/whereabouts.rs \
 && echo 'fn main() {}' > src/bin/whereabouts-operator.rs \
 && touch src/lib.rs \
 && cargo fetch --locked
COPY src ./src
RUN cargo build --release --locked --bins \
 && install -D -m 0755 target/release/whereabouts /out/whereabouts \
 && install -D -m 0755 target/release/whereabouts-operator /out/whereabouts-operator

# Runtime: distroless (glibc, CA certificates, no shell, no package manager), non-root by default.
# The CNI DaemonSet overrides the user to root for its hostPath writes (config/cni); the operator
# runs as 65532 with a read-only root filesystem (config/operator).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/whereabouts /out/whereabouts-operator /usr/local/bin/
USER 65532:65532
EXPOSE 8080 8443
ENTRYPOINT ["/usr/local/bin/whereabouts-operator"]
CMD ["run"]
