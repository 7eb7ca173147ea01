# BASE_IMAGE for docker/runtime/Dockerfile on a machine that reaches Docker Hub and Debian's
# mirrors: bookworm with what the runtime loads beside torch's libraries (libgomp1), and the verbs
# libraries NCCL's InfiniBand/RoCE transport opens at run time.
#   docker build -t stagehand-base:bookworm -f docker/base/base.Dockerfile docker/base
# (scripts/base-image.sh makes the same image without a registry.)
FROM debian:bookworm-slim
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libgomp1 ca-certificates libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*
LABEL stagehand.packages=libgomp1,ca-certificates,libibverbs1,ibverbs-providers
