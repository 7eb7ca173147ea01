# BUILD_IMAGE for docker/runtime/Dockerfile on a machine that reaches Docker Hub and Debian's
# mirrors: Rust on bookworm, with the C++ compiler and Gloo's headers the runtime's bridge needs.
#   docker build -t stagehand-build:bookworm -f docker/base/build.Dockerfile docker/base
# (scripts/base-image.sh makes the same image without a registry.)
FROM rust:1.95-bookworm
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ libgloo-dev \
    && rm -rf /var/lib/apt/lists/*
