# Sourced by the other scripts: where the torch venv lives and how cargo finds libtorch.
# STAGEHAND_TORCH_VENV overrides the venv's place; by default it is shared by every clone of the
# project on this machine (CI's fresh clone included), keyed by the torch version.
STAGEHAND_TORCH_VERSION=2.11.0
STAGEHAND_TORCH_VENV=${STAGEHAND_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/stagehand/torch-$STAGEHAND_TORCH_VERSION}
export STAGEHAND_TORCH_VERSION STAGEHAND_TORCH_VENV
export LIBTORCH_USE_PYTORCH=1
export PATH="$STAGEHAND_TORCH_VENV/bin:$PATH"
