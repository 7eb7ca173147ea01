# Sourced by the other scripts: where the torch venv lives and how cargo finds libtorch.
# STAGEHAND_TORCH_VENV overrides the venv's place; by default it is shared by every clone of the
# project on this machine (CI's fresh clone included), keyed by the torch version.
STAGEHAND_TORCH_VERSION=2.11.0
STAGEHAND_TORCH_VENV=${STAGEHAND_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/stagehand/torch-$STAGEHAND_TORCH_VERSION}
export STAGEHAND_TORCH_VERSION STAGEHAND_TORCH_VENV
export LIBTORCH_USE_PYTORCH=1
export PATH="$STAGEHAND_TORCH_VENV/bin:$PATH"

# For the benchmark scripts. `stagehand_bench_setup NAME`: sets up and builds this checkout
# (scripts/setup.sh), or, where STAGEHAND_RUNTIME names a runtime binary to use instead, only
# checks that the torch venv exists (NAME, the script, says who asks).
stagehand_bench_setup() {
    if [ -z "${STAGEHAND_RUNTIME:-}" ]; then
        "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
    elif [ ! -x "$STAGEHAND_TORCH_VENV/bin/python" ]; then
        echo "$1: no torch venv at $STAGEHAND_TORCH_VENV; run scripts/setup.sh once" >&2
        return 1
    fi
}

# `stagehand_torchvision`: torchvision (the PyTorch side's reference models and image decoders)
# and pillow in the torch venv, installed if missing, in the release that goes with this torch.
STAGEHAND_TORCHVISION_VERSION=0.26.0
stagehand_torchvision() {
    python -c 'import sys, torchvision, PIL; sys.exit(torchvision.__version__.split("+")[0] != sys.argv[1])' \
        "$STAGEHAND_TORCHVISION_VERSION" 2>/dev/null ||
        python -m pip install -q "torchvision==$STAGEHAND_TORCHVISION_VERSION" pillow
}
