#!/usr/bin/env bash
# Build a wheelhouse for installing brisk on an air-gapped Linux x86-64 machine that already has torch and triton
# (a GPU box: CUDA builds of torch and triton are gigabytes and come with the machine's image).
#
#   tools/wheelhouse.sh --python 3.12 --out wheels/          # on a machine that reaches PyPI
#   # copy wheels/ and the brisk checkout to the GPU box, then there:
#   python3 -m pip install --no-index --find-links wheels/ .            # brisk, into the Python that holds torch
#   python3 -m pip install --no-index --find-links wheels/ -r wheels/requirements.txt .   # + the GPU suite's tools
#   python3 -m pip install --no-index --find-links wheels/ --target /tmp/site .   # or into a folder on PYTHONPATH
#
# What it downloads: manylinux x86-64 wheels (binary only, for CPython --python) of every runtime dependency in
# pyproject.toml (about 55 MB for CPython 3.12), plus what benchmarks/gpu_suite.py needs beyond them: httpx (the
# load generator of `brisk bench serve`), pytest and hypothesis (the GPU tests), and setuptools and wheel (pip builds
# brisk itself from the checkout, offline). Skipped: torch, triton and NVIDIA's nvidia-* CUDA libraries, which the
# target already has, and the rest of the [bench] extra (matplotlib and its dependencies, +23 MB: `brisk bench serve`
# draws its plots with it; GPU images usually have it, else add `--extras bench --max-mb 90`). The skipped names are
# listed in OUT/SKIPPED.txt and printed. Fails if the wheelhouse exceeds --max-mb (60). --skip-file FILE (the
# target's `pip list --format=freeze`) also leaves out every project the target has, for a smaller wheelhouse.
set -euo pipefail

py_version=3.12
out=wheels
max_mb=60
extras=
skip_file=
python=${PYTHON:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo "options: --python X.Y (target CPython, default $py_version)  --out DIR (default $out)"
    echo "         --max-mb N (size limit, default $max_mb)  --extras a,b (pyproject extras, default none)"
    echo "         --skip-file FILE (the target's \`pip list --format=freeze\`: leave out what it already has)"
    echo "environment: PYTHON, the interpreter that runs pip here (default python3)"
}

while [[ $# -gt 0 ]]; do
    case $1 in
        --python) py_version=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --max-mb) max_mb=$2; shift 2 ;;
        --extras) extras=$2; shift 2 ;;
        --skip-file) skip_file=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "wheelhouse.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
if ! [[ $py_version =~ ^3\.[0-9]+$ ]]; then
    echo "wheelhouse.sh: --python wants a CPython version like 3.12, got '$py_version'" >&2
    exit 2
fi

mkdir -p "$out"
reqs_file="$out/requirements.txt"  # all it holds: `pip install ... -r` it to get the suite's tools too
skipped_file="$out/SKIPPED.txt"

# The requirement list from pyproject.toml, minus what the target already has.
"$python" - "$here/pyproject.toml" "$extras" "$reqs_file" "$skipped_file" <<'EOF'
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors a TOML reader
    from pip._vendor import tomli as tomllib

pyproject, extras, reqs_out, skipped_out = sys.argv[1:5]
with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
wanted = list(project["dependencies"])
optional = project.get("optional-dependencies", {})
for extra in filter(None, extras.split(",")):
    if extra not in optional:
        sys.exit(f"wheelhouse.sh: pyproject.toml has no extra '{extra}' (it has: {', '.join(optional)})")
    wanted += optional[extra]
# benchmarks/gpu_suite.py runs the GPU tests (pytest, hypothesis) and `brisk bench serve` (httpx): the dev extra's
# versions of these; matplotlib, the rest of [bench], only with --extras bench.
suite = [r for r in optional.get("dev", []) if re.match(r"(pytest|hypothesis|httpx)\b", r)]
wanted += suite
skipped_extra = [r for r in optional.get("bench", []) if r not in wanted]
wanted += ["setuptools>=68", "wheel"]  # pip builds brisk from the checkout, offline, with these


def name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def preinstalled(req: str) -> bool:
    n = name(req)
    return n in ("torch", "triton") or n.startswith("nvidia-")


keep, skip = [], []
for req in dict.fromkeys(wanted):
    (skip if preinstalled(req) else keep).append(req)
with open(reqs_out, "w") as f:
    f.write("\n".join(keep) + "\n")
with open(skipped_out, "w") as f:
    f.write("# not in this wheelhouse: the target machine must already have these\n")
    f.write("\n".join(skip) + "\n")
    if skipped_extra:
        f.write("# the rest of the [bench] extra (brisk bench serve's plots); add with --extras bench\n")
        f.write("\n".join(skipped_extra) + "\n")
EOF

platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${tag}_x86_64")
done
platforms+=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux_2_12_x86_64)

echo "wheelhouse: CPython $py_version, manylinux x86-64, into $out"
"$python" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version "$py_version" --implementation cp "${platforms[@]}" \
    --dest "$out" -r "$reqs_file"

# A dependency of a dependency may still pull one of the skipped packages: take it out and list it.
shopt -s nullglob
torch_pulled=("$out"/torch-*.whl)
for wheel in "$out"/torch-*.whl "$out"/triton-*.whl "$out"/nvidia_*.whl; do
    echo "$(basename "$wheel") (pulled in by a dependency)" >>"$skipped_file"
    rm -f "$wheel"
done
# xgrammar requires torch, and pip then brings torch's own dependencies: the target's torch has them already.
if ((${#torch_pulled[@]})); then
    for wheel in "$out"/sympy-*.whl "$out"/mpmath-*.whl "$out"/networkx-*.whl; do
        echo "$(basename "$wheel") (torch's dependency: the target's torch has it)" >>"$skipped_file"
        rm -f "$wheel"
    done
fi

# Wheels of projects the target already has (--skip-file): pip there keeps its own copies.
if [[ -n $skip_file ]]; then
    have=$(sed -E 's/[ =<>@;].*//' "$skip_file" | tr 'A-Z_.' 'a-z--' | sort -u)
    echo "# on the target already ($skip_file; its versions must satisfy brisk's ranges)" >>"$skipped_file"
    for wheel in "$out"/*.whl; do
        project=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
        if grep -qx "$project" <<<"$have"; then
            echo "$(basename "$wheel") (the target has $project: $skip_file)" >>"$skipped_file"
            rm -f "$wheel"
        fi
    done
fi

echo "skipped (the target already has them):"
grep -v '^#' "$skipped_file" | sed 's/^/  /'
count=$(ls "$out"/*.whl | wc -l)
bytes=$(cat "$out"/*.whl | wc -c)
mb=$(( (bytes + 999999) / 1000000 ))
echo "wheelhouse: $count wheels, $mb MB in $out"
if (( bytes > max_mb * 1000000 )); then
    echo "wheelhouse.sh: $mb MB is over the limit of $max_mb MB (--max-mb)" >&2
    ls -S "$out"/*.whl | head -5 | sed 's/^/  largest: /' >&2
    exit 1
fi
