# fencegate: multi-stage build, small non-root runtime image.
FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY crates ./crates
COPY benches ./benches
RUN cargo build --release --locked --bin fencegate

FROM debian:bookworm-slim
# curl is only for the HEALTHCHECK below.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/fencegate --create-home fencegate
COPY --from=build /src/target/release/fencegate /usr/local/bin/fencegate
COPY config/fencegate.toml /etc/fencegate/fencegate.toml
USER 10001
WORKDIR /var/lib/fencegate
# Inside a container fencegate must listen beyond loopback. Without [auth]
# that is refused unless allowed explicitly: turn authentication on (see the
# README) for anything but a private network.
ENV FENCEGATE_CONFIG=/etc/fencegate/fencegate.toml \
    FENCEGATE_LISTEN=0.0.0.0:8080 \
    FENCEGATE_DATA_DIR=/var/lib/fencegate \
    FENCEGATE_AUTH__ALLOW_UNAUTHENTICATED_NON_LOOPBACK=true
VOLUME ["/var/lib/fencegate"]
EXPOSE 8080
# Readiness on whatever port FENCEGATE_LISTEN names.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["sh", "-c", "curl -fsS -o /dev/null \"http://127.0.0.1:${FENCEGATE_LISTEN##*:}/_fence/readyz\""]
ENTRYPOINT ["fencegate"]
CMD ["serve"]
