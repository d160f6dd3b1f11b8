#!/usr/bin/env bash
# Build a wheelhouse that installs megatron-train on a GPU node without a package index, keeping
# the node's own torch (and CUDA libraries).
#
#   tools/build_wheelhouse.sh [--python 3.12] [--out ./wheelhouse] [--node-freeze FILE] [--with-te cu13|cu12]
#       [--with-torchtitan VERSION]
#
# Run it where PyPI is reachable. --node-freeze takes the node's `python -m pip list --format=freeze`:
# versions the node already has are kept where the requirements allow, and their wheels left out.
# --with-te adds Transformer Engine 2.11 (the newest inside megatron-core 0.16.1's supported range):
# its prebuilt core wheel for that CUDA major version, and the source of its torch extension, which
# the node compiles against its own torch. --with-torchtitan adds that torchtitan release for
# benchmarks/throughput.py: 0.2.2 on torch 2.11, 0.3 from torch 2.12 (it imports fsdp names 2.11 lacks).
# On the node: `bash wheelhouse/install.sh`.
set -euo pipefail
PYV=3.12 OUT=wheelhouse FREEZE="" TE="" TITAN=""
TE_VERSION=2.11.0
USAGE="tools/build_wheelhouse.sh [--python 3.12] [--out DIR] [--node-freeze FILE] [--with-te cu13|cu12] [--with-torchtitan VERSION]"
# Every refusal is one line and exit code 2, before anything is downloaded or written.
refuse() { echo "error: build_wheelhouse.sh: $1. Fix: $2" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --python|--out|--node-freeze|--with-te|--with-torchtitan)
            [ $# -ge 2 ] || refuse "$1 needs a value" "$USAGE"
            case "$1" in
                --python) PYV=$2 ;;
                --out) OUT=$2 ;;
                --node-freeze) FREEZE=$2 ;;
                --with-te) TE=$2 ;;
                --with-torchtitan) TITAN=$2 ;;
            esac
            shift 2 ;;
        *) refuse "unknown argument '$1'" "$USAGE" ;;
    esac
done
if [[ ! "$PYV" =~ ^3\.([0-9]+)$ ]]; then refuse "--python wants a version such as 3.12, got '$PYV'" "give the node's 'python3 --version' without the patch number"; fi
MINOR=${BASH_REMATCH[1]}
# The floor is pyproject's requires-python, so the two cannot drift apart.
FLOOR=$(sed -n 's/^requires-python = ">=3\.\([0-9]*\)".*/\1/p' "$(dirname "$0")/../pyproject.toml")
if (( 10#$MINOR < FLOOR )); then refuse "--python $PYV: megatron-train needs Python 3.$FLOOR or newer" "build for a node Python of 3.$FLOOR or newer (NGC images have 3.12)"; fi
if [ -n "$TE" ] && [ "$TE" != cu12 ] && [ "$TE" != cu13 ]; then
    refuse "--with-te takes cu12 or cu13, got '$TE'" "give the node's CUDA major version (torch.version.cuda there)"
fi
if [ -n "$TITAN" ] && [[ ! "$TITAN" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
    refuse "--with-torchtitan wants a release such as 0.2.2, got '$TITAN'" "0.2.2 for torch 2.11, 0.3 from torch 2.12"
fi
if [ -n "$FREEZE" ]; then
    [ -f "$FREEZE" ] || refuse "--node-freeze: no file '$FREEZE'" "write it on the node with: python -m pip list --format=freeze > node.txt"
    grep -qE '^[A-Za-z0-9_.-]+==' "$FREEZE" || refuse "--node-freeze: '$FREEZE' has no name==version line" "write it on the node with: python -m pip list --format=freeze > node.txt"
fi
if [ -e "$OUT" ] || [ -L "$OUT" ]; then refuse "'$OUT' exists" "remove it or pick another --out"; fi
# The folder is made last; making it now (and removing it) checks that it can be.
{ mkdir "$OUT" && rmdir "$OUT"; } 2>/dev/null || refuse "--out '$OUT' cannot be made" "pick a folder in a writable place whose parent exists"
# Paths are the caller's; the build runs from the repository root.
[[ "$OUT" = /* ]] || OUT="$PWD/$OUT"
[[ -z "$FREEZE" || "$FREEZE" = /* ]] || FREEZE="$PWD/$FREEZE"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "" 2>/dev/null || refuse "PYTHON '$PY' does not run" "set PYTHON to a Python 3, or run make wheelhouse (it uses the venv's)"
# megatron-train's own wheel is built with this Python's setuptools (no build isolation):
# bdist_wheel is part of setuptools from 70.1 and came from the 'wheel' package before.
"$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('setuptools') and (u.find_spec('setuptools.command.bdist_wheel') or u.find_spec('wheel'))))" 2>/dev/null \
    || refuse "'$PY' cannot build a wheel: it needs setuptools >= 70.1, or an older one with the 'wheel' package" "run make wheelhouse (it uses the venv's Python), or set PYTHON to a Python that has them"
"$PY" -m uv --version >/dev/null 2>&1 || "$PY" -m pip install -q uv
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/out"

# torch is the node's: excluding it (and so everything only torch needs) from the resolution.
echo "torch; sys_platform == 'never'" >"$WORK/override.txt"
# The node's versions (local tags like +cu130 dropped) seed the output file, which uv treats as
# preferences: it keeps them unless a requirement rules one out.
if [ -n "$FREEZE" ]; then
    grep -E '^[A-Za-z0-9_.-]+==' "$FREEZE" | sed 's/+.*//' >"$WORK/node.txt"
    cp "$WORK/node.txt" "$WORK/all.txt"
fi
REQS=(pyproject.toml)
if [ -n "$TE" ]; then
    # The core wheel, plus what the torch extension (an sdist, outside this resolution) installs.
    printf '%s\n' "transformer-engine-$TE==$TE_VERSION" einops onnx onnxscript packaging pydantic >"$WORK/te.in"
    REQS+=("$WORK/te.in")
fi
if [ -n "$TITAN" ]; then
    echo "torchtitan==$TITAN" >"$WORK/titan.in"
    REQS+=("$WORK/titan.in")
fi
if ! "$PY" -m uv pip compile -q "${REQS[@]}" --python-version "$PYV" --python-platform x86_64-manylinux_2_28 \
    --override "$WORK/override.txt" --no-header --no-annotate -o "$WORK/all.txt" 2>"$WORK/compile.log"; then
    # uv explains a failed resolution over several lines; its first "Because ..." sentence names the cause.
    why=$(grep -m1 -o 'Because.*' "$WORK/compile.log" || tail -n1 "$WORK/compile.log")
    why=${why%.}
    refuse "the requirements do not resolve for Python $PYV: $why" "change the version that the cause names"
fi
# What the node already has at the resolved version needs no wheel.
if [ -n "$FREEZE" ]; then
    tr 'A-Z_' 'a-z-' <"$WORK/node.txt" | sort >"$WORK/node_norm.txt"
    while read -r line; do
        norm=$(echo "$line" | tr 'A-Z_' 'a-z-')
        grep -qxF "$norm" "$WORK/node_norm.txt" || echo "$line"
    done <"$WORK/all.txt" >"$WORK/needed.txt"
else
    cp "$WORK/all.txt" "$WORK/needed.txt"
fi
PLATFORMS=()
for n in 17 24 27 28 31 34; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
if [ -s "$WORK/needed.txt" ] && ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp "${PLATFORMS[@]}" -d "$WORK/out" -r "$WORK/needed.txt" 2>"$WORK/download.log"; then
    why=$(grep -m1 '^ERROR' "$WORK/download.log" || tail -n1 "$WORK/download.log")
    why=${why%.}
    echo "error: build_wheelhouse.sh: the wheels for Python $PYV could not be downloaded ($why). Fix: check that PyPI is reachable and that every requirement has a wheel for that Python" >&2
    exit 1
fi
# Built from the tracked files only, so no build/ or egg-info is left in the checkout.
mkdir "$WORK/src"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/out" "$WORK/src"
if [ -n "$TE" ]; then
    # The torch extension ships only as source (it must match the node's torch); pip cannot download
    # an sdist without building its metadata, so it is fetched by name from the index.
    "$PY" - "$WORK/out" "$TE_VERSION" <<'EOF'
import json, os, sys, urllib.request
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
req = urllib.request.Request(f"{index}/transformer-engine-torch/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req))["files"]
sdist = next(f for f in files if f["filename"] == f"transformer_engine_torch-{sys.argv[2]}.tar.gz")
urllib.request.urlretrieve(sdist["url"], os.path.join(sys.argv[1], sdist["filename"]))
EOF
    # Its build needs these on the node (NGC images have them): setuptools, wheel, pybind11, ninja.
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
        "${PLATFORMS[@]}" -d "$WORK/out" "transformer-engine==$TE_VERSION" pybind11 ninja
fi
cp "$WORK/needed.txt" "$WORK/out/requirements.txt"
cat >"$WORK/out/install.sh" <<'EOF'
#!/usr/bin/env bash
# Offline install into the Python that runs this (the node's, with its torch): bash install.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
"$PY" -c "import torch" 2>/dev/null || {
    echo "error: install.sh: $PY cannot import torch. Fix: run it with the node's Python that has torch: PYTHON=/path/to/python bash $0" >&2
    exit 2
}
"$PY" -m pip install -q --no-index --find-links "$HERE" "$HERE"/megatron_train-*.whl
if ls "$HERE"/torchtitan-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links "$HERE" "$HERE"/torchtitan-*.whl
fi
if ls "$HERE"/transformer_engine_torch-*.tar.gz >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links "$HERE" transformer-engine pybind11 ninja \
        "$HERE"/transformer_engine_cu*.whl
    # Compiles TE's torch extension against this node's torch (a few minutes): it needs nvcc and the
    # CUDA, NCCL and cuDNN headers. A toolkit with nvcc alone lacks some that torch's own headers
    # include (cusparse.h); the nvidia-* wheels beside torch carry them all, so they are searched too.
    NV_INCLUDE=$("$PY" -c "import glob, nvidia; print(':'.join(d for p in nvidia.__path__ for d in sorted(glob.glob(p + '/*/include'))))" 2>/dev/null || true)
    CPATH="$NV_INCLUDE${CPATH:+:$CPATH}" NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} \
        "$PY" -m pip install -q --no-index --no-build-isolation --find-links "$HERE" \
        "$HERE"/transformer_engine_torch-*.tar.gz
fi
"$PY" -c "import megatron_train, megatron.core; print('megatron-train installed with megatron-core', megatron.core.__version__)"
EOF
chmod +x "$WORK/out/install.sh"
mv "$WORK/out" "$OUT"
echo "wheelhouse: $OUT ($(ls "$OUT" | wc -l) files, $(du -sh "$OUT" | cut -f1)); on the node: bash $OUT/install.sh"
