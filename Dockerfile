# kvgate container image: the wheel is built with maturin in a Python + Rust stage, then
# installed alone into a slim Python runtime that runs as a non-root user.
#
#   docker build -t kvgate .
#   docker run --rm -p 8080:8080 -v "$PWD/kvgate.yaml:/etc/kvgate/kvgate.yaml:ro" kvgate
#
# The configuration file is mounted at /etc/kvgate/kvgate.yaml (deploy/kubernetes/ mounts it
# from a ConfigMap); it must listen on 0.0.0.0:8080 (`listen:`), the port of the HEALTHCHECK.
# kvgate is PID 1: on SIGTERM (`docker stop`, Kubernetes) it stops accepting, lets streams
# finish for --grace seconds, then closes them and exits 0. Give `docker stop -t` (Kubernetes:
# terminationGracePeriodSeconds) more than --grace. tests/deploy/ runs this file's build and run
# steps (the maturin build, the pip install, the CMD, the HEALTHCHECK) outside Docker.

FROM python:3.11-bookworm AS build
# rustup itself; `rustup toolchain install` below installs the toolchain rust-toolchain.toml names
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --profile minimal --default-toolchain none
ENV PATH=/root/.cargo/bin:$PATH
RUN pip install --no-cache-dir "maturin>=1.9.4,<2"
WORKDIR /src
COPY Cargo.toml Cargo.lock rust-toolchain.toml pyproject.toml README.md ./
RUN rustup toolchain install
COPY rust ./rust
COPY python ./python
RUN maturin build --release --out /wheels

FROM python:3.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
# the `redis` extra: the Redis client that a `store` (limits shared by replicas, as in
# deploy/kubernetes/) needs; add `otel` (`[redis,otel]`) for `tracing`
RUN pip install "$(echo /wheels/*.whl)[redis]" && rm -rf /wheels
RUN groupadd --system --gid 10001 kvgate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvgate
USER 10001:10001
EXPOSE 8080
# /readyz answers 200 while at least one backend is in routing (503 otherwise); the slim image
# has no curl, and urlopen raises (exit 1) on a 503 or a refused connection
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=2)"]
STOPSIGNAL SIGTERM
CMD ["kvgate", "serve", "--config", "/etc/kvgate/kvgate.yaml", "--grace", "25"]
