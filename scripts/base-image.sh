#!/usr/bin/env bash
# Makes the local base image `stagehand-base:bookworm` without a registry: a minimal Debian
# bookworm root from debootstrap, imported with `docker import`. Idempotent: does nothing when the
# image already exists. Needs root (debootstrap) and a running Docker engine.
set -euo pipefail

IMAGE="${STAGEHAND_BASE_IMAGE:-stagehand-base:bookworm}"
SUITE=bookworm

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "base-image: $IMAGE already exists, nothing to do" >&2
    exit 0
fi

if ! command -v debootstrap >/dev/null 2>&1; then
    echo "base-image: installing debootstrap" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

ROOT="$(mktemp -d /tmp/stagehand-base.XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT

echo "base-image: debootstrap $SUITE into $ROOT (about 30 s)" >&2
debootstrap --variant=minbase --include=libgomp1,ca-certificates "$SUITE" "$ROOT" >&2
tar -C "$ROOT" -c . | docker import - "$IMAGE" >/dev/null
echo "base-image: imported $IMAGE" >&2
