# TORCH_IMAGE for docker/runtime/Dockerfile on a machine that reaches Docker Hub and PyPI: torch's
# package at /opt/site-packages/torch (lib/ and include/, its nvidia wheels beside it) and the C++
# ABI it was built with.
#   docker build -t stagehand-torch:2.11.0-cuda -f docker/base/torch.Dockerfile docker/base
#   docker build -t stagehand-torch:2.11.0-cpu --build-arg VARIANT=cpu -f docker/base/torch.Dockerfile docker/base
# The CPU variant keeps libtorch_cpu and what it loads (libcudart and libcupti among them), about
# a fifth of the CUDA one. (scripts/base-image.sh makes the same images without a registry.)
FROM python:3.11-slim-bookworm AS pip
ARG TORCH_VERSION=2.11.0
ARG VARIANT=cuda
RUN pip install --no-cache-dir --target /opt/site-packages "torch==${TORCH_VERSION}" \
        nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 \
    && python3 -c 'import sys; sys.path.insert(0, "/opt/site-packages"); import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))' \
        > /opt/site-packages/torch/.cxx11_abi \
    && if [ "$VARIANT" = cpu ]; then \
        cd /opt/site-packages \
        && mkdir -p /tmp/keep/torch/lib /tmp/keep/nvidia/cu13/lib \
        && cp -a torch/.cxx11_abi torch/include /tmp/keep/torch/ \
        && cp -a torch/lib/libtorch_cpu.so torch/lib/libc10.so torch/lib/libgomp.so.1 \
              torch/lib/libtorch.so torch/lib/libtorch_global_deps.so /tmp/keep/torch/lib/ \
        && cp -a nvidia/cu13/lib/libcudart.so.* nvidia/cu13/lib/libcupti.so.* /tmp/keep/nvidia/cu13/lib/ \
        && rm -rf /opt/site-packages && mv /tmp/keep /opt/site-packages; \
    fi

FROM debian:bookworm-slim
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libgomp1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=pip /opt/site-packages /opt/site-packages
