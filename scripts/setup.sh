#!/usr/bin/env bash
# Installs what the project needs, idempotently, and builds it. Quick when everything is there.
#   - Debian packages the build and the tests use
#   - a Python venv with torch (libtorch for tch), shared by every clone on this machine
#   - the workspace, in release mode
#   - the local base image for containers, when a Docker engine answers
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
source "$here/env.sh"

log() { printf 'setup: %s\n' "$*" >&2; }

# Debian packages: gcc/g++ build the C++ parts, debootstrap makes the local base image,
# openssh-server gives the tests a real sshd.
apt_packages=(g++ debootstrap openssh-server openssh-client libgloo-dev)
missing=()
for pkg in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    sudo_cmd=()
    [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The torch venv. A lock keeps two concurrent set-ups (a developer and CI) from racing.
# The runtime's CUDA half (NCCL groups, devices) compiles against the CUDA headers of the nvidia
# wheels torch brings; two header sets ProcessGroupNCCL.hpp needs are not among them, and come
# from these header-only packages, pinned to torch's CUDA 13.0.
cuda_headers=("nvidia-cuda-crt==13.0.88" "nvidia-cuda-cccl==13.0.85")
venv_ok() {
    [ -x "$STAGEHAND_TORCH_VENV/bin/python" ] &&
        "$STAGEHAND_TORCH_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$STAGEHAND_TORCH_VERSION')" 2>/dev/null &&
        "$STAGEHAND_TORCH_VENV/bin/python" -m pip show -q nvidia-cuda-crt nvidia-cuda-cccl >/dev/null 2>&1
}
if ! venv_ok; then
    mkdir -p "$(dirname "$STAGEHAND_TORCH_VENV")"
    exec 9>"$STAGEHAND_TORCH_VENV.lock"
    flock 9
    if ! venv_ok; then
        log "installing torch==$STAGEHAND_TORCH_VERSION into $STAGEHAND_TORCH_VENV (about 4.7 GB, once per machine)"
        [ -x "$STAGEHAND_TORCH_VENV/bin/python" ] || python3 -m venv "$STAGEHAND_TORCH_VENV"
        "$STAGEHAND_TORCH_VENV/bin/python" -m pip install -q --upgrade pip
        "$STAGEHAND_TORCH_VENV/bin/python" -m pip install -q "torch==$STAGEHAND_TORCH_VERSION" numpy "${cuda_headers[@]}"
    fi
    flock -u 9
fi

log "building the workspace (release)"
cd "$root"
cargo build --release --workspace --quiet

# The local base image for containers (no registry here: debootstrap + docker import).
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    "$here/base-image.sh"
else
    log "no Docker engine answering: skipping the base image (the driver's process backend still works)"
fi
