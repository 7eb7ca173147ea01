#!/usr/bin/env bash
# Makes, without a registry, the images the runtime image (docker/runtime/Dockerfile) starts from,
# on this machine's Docker engine (or the one DOCKER_HOST names):
#   stagehand-base:bookworm        a minimal Debian bookworm (debootstrap + docker import): the
#                                  final stage's system, and the dev image docker/local's base;
#                                  remade when its package list changes (its label names it)
#   stagehand-build:bookworm       bookworm with g++ and libgloo-dev, this machine's Rust toolchain
#                                  at /usr/local/rust and the workspace's crates already fetched
#                                  into /usr/local/cargo (so it builds with no network: the test
#                                  bed's hosts have none); relabelled when Cargo.lock changes
#   stagehand-torch:2.11.0-cpu     torch's libraries for CPUs (libtorch_cpu and what it loads,
#                                  libcudart and libcupti among them) and its C++ headers, from the
#                                  torch venv scripts/setup.sh installs
#   stagehand-torch:2.11.0-cuda    with --cuda: the whole torch package and its nvidia wheels
# Where a registry is reachable, docker/base/ builds the same three from public images instead.
# Idempotent: an image that exists (with the current Cargo.lock, for the build image; with the
# current packages, for the base) is kept.
# Needs root (debootstrap) and a running Docker engine.
#
#   scripts/base-image.sh            base, build and the CPU torch image
#   scripts/base-image.sh --base     the base image only
#   scripts/base-image.sh --cuda     also the CUDA torch image
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")

BASE="${STAGEHAND_BASE_IMAGE:-stagehand-base:bookworm}"
BUILD=stagehand-build:bookworm
SUITE=bookworm

log() { printf 'base-image: %s\n' "$*" >&2; }
have() { docker image inspect "$1" >/dev/null 2>&1; }

only_base=0 cuda=0
for arg in "$@"; do
    case "$arg" in
    --base) only_base=1 ;;
    --cuda) cuda=1 ;;
    *)
        log "unknown argument '$arg' (use --base or --cuda)"
        exit 2
        ;;
    esac
done

if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

work="$(mktemp -d /tmp/stagehand-base.XXXXXX)"
trap 'rm -rf "$work"' EXIT

# A debootstrapped root, imported with the given `docker import --change` lines.
bootstrap() {
    local image=$1 packages=$2
    shift 2
    local dir="$work/${image//[:\/]/-}"
    mkdir -p "$dir"
    log "debootstrap $SUITE ($packages) for $image"
    debootstrap --variant=minbase --include="$packages" "$SUITE" "$dir" >"$work/debootstrap.log" 2>&1 ||
        { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    printf '%s\n' "$@" >"$work/changes"
    local changes=()
    while IFS= read -r c; do [ -n "$c" ] && changes+=(--change "$c"); done <"$work/changes"
    tar -C "$dir" -c . | docker import "${changes[@]}" - "$image" >/dev/null
    rm -rf "$dir"
    log "imported $image"
}

# The base image: its label names the packages it holds, so a base made before a package was
# added is made again. libibverbs1 and its providers are what NCCL's InfiniBand/RoCE transport
# opens at run time (without them NCCL talks TCP between hosts).
base_packages=libgomp1,ca-certificates,libibverbs1,ibverbs-providers
if [ "$(docker image inspect -f '{{index .Config.Labels "stagehand.packages"}}' "$BASE" 2>/dev/null)" = "$base_packages" ]; then
    log "$BASE already exists ($base_packages)"
else
    bootstrap "$BASE" "$base_packages" "LABEL stagehand.packages=$base_packages"
fi
((only_base)) && exit 0

# The build image: its label names the Cargo.lock whose crates it holds.
lock_hash=$(sha256sum "$root/Cargo.lock" | cut -c1-16)
if [ "$(docker image inspect -f '{{index .Config.Labels "stagehand.cargo-lock"}}' "$BUILD" 2>/dev/null)" = "$lock_hash" ]; then
    log "$BUILD already exists (crates of Cargo.lock $lock_hash)"
else
    dir="$work/build"
    mkdir -p "$dir"
    log "debootstrap $SUITE with g++ and libgloo-dev for $BUILD (about 2 minutes)"
    debootstrap --variant=minbase --include=g++,libc6-dev,libgloo-dev,ca-certificates,libgomp1 \
        "$SUITE" "$dir" >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    sysroot=$(rustc --print sysroot)
    log "copying the Rust toolchain $(rustc --version | cut -d' ' -f2) from $sysroot"
    mkdir -p "$dir/usr/local/rust"
    cp -a "$sysroot/bin" "$sysroot/lib" "$dir/usr/local/rust/"
    log "fetching the workspace's crates into the image's CARGO_HOME"
    CARGO_HOME="$dir/usr/local/cargo" cargo fetch --quiet --locked --manifest-path "$root/Cargo.toml" >&2
    rm -rf "$dir/usr/local/cargo/registry/src"
    tar -C "$dir" -c . | docker import \
        --change 'ENV PATH=/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV CARGO_HOME=/usr/local/cargo' \
        --change 'ENV CARGO_NET_OFFLINE=true' \
        --change "LABEL stagehand.cargo-lock=$lock_hash" \
        - "$BUILD" >/dev/null
    rm -rf "$dir"
    log "imported $BUILD"
fi

# The torch images, from the venv scripts/setup.sh installs.
source "$here/env.sh"
site=$("$STAGEHAND_TORCH_VENV/bin/python" -c 'import torch, pathlib; print(pathlib.Path(torch.__file__).parent.parent)')
abi=$("$STAGEHAND_TORCH_VENV/bin/python" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
torch_image() {
    local variant=$1 image="stagehand-torch:$STAGEHAND_TORCH_VERSION-$1"
    if have "$image"; then
        log "$image already exists"
        return
    fi
    local ctx="$work/torch-$variant"
    mkdir -p "$ctx/site-packages/torch"
    cp -a "$site/torch/include" "$ctx/site-packages/torch/"
    echo "$abi" >"$ctx/site-packages/torch/.cxx11_abi"
    if [ "$variant" = cpu ]; then
        # libtorch_cpu and what it loads; libtorch (a stub the linker asks for); no CUDA kernels.
        mkdir -p "$ctx/site-packages/torch/lib" "$ctx/site-packages/nvidia/cu13/lib"
        for lib in libtorch_cpu.so libc10.so libgomp.so.1 libtorch.so libtorch_global_deps.so; do
            cp -a "$site/torch/lib/$lib" "$ctx/site-packages/torch/lib/"
        done
        cp -a "$site"/nvidia/cu13/lib/libcudart.so.* "$site"/nvidia/cu13/lib/libcupti.so.* \
            "$ctx/site-packages/nvidia/cu13/lib/"
    else
        cp -a "$site/torch/lib" "$ctx/site-packages/torch/"
        cp -a "$site/nvidia" "$ctx/site-packages/"
    fi
    cat >"$ctx/Dockerfile" <<EOF
FROM $BASE
COPY site-packages /opt/site-packages
LABEL stagehand.torch=$STAGEHAND_TORCH_VERSION stagehand.variant=$variant
EOF
    log "building $image ($(du -sh "$ctx" | cut -f1))"
    docker build -q -t "$image" "$ctx" >/dev/null
    rm -rf "$ctx"
    log "built $image"
}
torch_image cpu
((cuda)) && torch_image cuda
exit 0
