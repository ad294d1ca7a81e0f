#!/usr/bin/env bash
# Installs tomerge with the command line's stack and the tests' (`-e ".[experiments,test]"`) into the current
# Python environment. (`pip install tomerge` alone is the library: torch, timm, diffusers, safetensors.)
# A torch that is already installed (a CUDA build, say) is kept: the project is installed
# under a constraint pinning that exact version, so no dependency can swap it.
# With no torch, the CPU-machine pair torch==2.14.1 / torchvision==0.29.1 is installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import torch, torchvision" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
fi
# Fashion-MNIST (reference model training and FD-EffNetLite0 of `tomerge ablate`) from Debian's package.
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
        || echo "setup.sh: could not install dataset-fashion-mnist; pass data_root=... to tomerge ablate" >&2
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" - >"$constraints" <<'PYEOF'
import importlib.metadata as m
for name in ("torch", "torchvision"):
    print(f"{name}=={m.version(name)}")
PYEOF
# Skip the install when this exact checkout is already installed with its experiments and test extras.
stamp=".tomerge-installed"
want="$(cat setup.cfg pyproject.toml "$constraints" | sha1sum | cut -d' ' -f1) $(pwd)"
# The import check runs outside the checkout (from its root, `import tomerge` finds the source folder even
# when nothing is installed) and asks that the tomerge found be this checkout (not another clone's install).
installed() {
    (cd / && "$PY" -c 'import pathlib, sys, tomesd, pytest, tomerge.experiments.cli as cli
sys.exit(pathlib.Path(cli.__file__).resolve().parent != pathlib.Path(sys.argv[1]).resolve() / "experiments"
         or bool(cli.missing_extra()))' "$1")
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! installed "$(pwd)" >/dev/null 2>&1; then
    "$PY" -m pip install -q -c "$constraints" -e ".[experiments,test]"
    echo "$want" >"$stamp"
fi
