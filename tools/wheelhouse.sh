#!/usr/bin/env bash
# Build a wheelhouse for installing brisk on an air-gapped Linux x86-64 machine (a GPU box: CUDA builds of torch and
# triton are gigabytes and come with the machine's image), holding only what that machine lacks.
#
#   tools/wheelhouse.sh --python 3.12 --out wheels/                   # on a machine that reaches PyPI
#   tools/wheelhouse.sh --python 3.12 --have tools/gpu_image_packages.txt --out .whl   # for the lent GPU box: ~15 MB
#   # there, with the Python that holds torch:
#   python3 -m pip install --no-index --no-deps --target /tmp/brisk-site .whl/*.whl   # with --have: what it lacks
#   export PYTHONPATH=/tmp/brisk-site:$PWD                                            # brisk from the checkout
#   python3 -m pip install --no-index --find-links wheels/ -r wheels/requirements.txt .   # without --have: brisk too
#
# What it holds: manylinux x86-64 wheels (binary only, for CPython --python) of every runtime dependency in
# pyproject.toml and what they need in turn, plus what benchmarks/gpu_suite.py needs beyond them: httpx (the load
# generator of `brisk bench serve`), pytest and hypothesis (the GPU tests), and setuptools and wheel (pip builds
# brisk itself from the checkout, offline). Never torch, triton or NVIDIA's nvidia-* CUDA libraries, nor anything
# only they need: the target has them. --have FILE|NAMES leaves out, with all they alone need, the projects the
# target already has: a file of `pip list --format=freeze` lines or names (one a line, # comments), or a
# comma-separated list. Versions given there are held against every range that asks for the project (a mismatch is
# printed as a WARNING and listed); projects named without one are trusted, and the suite's env step checks the
# ranges on the target. The rest of the [bench] extra (matplotlib, +23 MB) only with --extras bench. Everything
# left out is listed in OUT/SKIPPED.txt. Fails if the wheelhouse exceeds --max-mb (64: a full one, without --have, is ~61 MB).
#
# How: one `pip download --no-deps` per level of the dependency tree, reading each wheel's Requires-Dist for the
# next level (markers evaluated for the target), so nothing the target has is ever downloaded.
set -euo pipefail

py_version=3.12
out=wheels
max_mb=64
extras=
have=
python=${PYTHON:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo "options: --python X.Y (target CPython, default $py_version)  --out DIR (default $out)"
    echo "         --max-mb N (size limit, default $max_mb)  --extras a,b (pyproject extras, default none)"
    echo "         --have FILE|a,b,c (what the target has: leave it out)"
    echo "environment: PYTHON, the interpreter that runs pip here (default python3)"
}

while [[ $# -gt 0 ]]; do
    case $1 in
        --python) py_version=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --max-mb) max_mb=$2; shift 2 ;;
        --extras) extras=$2; shift 2 ;;
        --have) have=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "wheelhouse.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
if ! [[ $py_version =~ ^3\.[0-9]+$ ]]; then
    echo "wheelhouse.sh: --python wants a CPython version like 3.12, got '$py_version'" >&2
    exit 2
fi
mkdir -p "$out"
rm -f "$out"/*.whl "$out"/SKIPPED.txt  # an earlier build's wheels would travel and install too (two versions: no install)

"$python" - "$here/pyproject.toml" "$py_version" "$out" "$extras" "$have" <<'EOF'
import os
import re
import subprocess
import sys
import zipfile

from pip._vendor.packaging.markers import InvalidMarker
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors a TOML reader
    from pip._vendor import tomli as tomllib

pyproject, py_version, out, extras, have_arg = sys.argv[1:6]
with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
wanted = list(project["dependencies"])
optional = project.get("optional-dependencies", {})
for extra in filter(None, extras.split(",")):
    if extra not in optional:
        sys.exit(f"wheelhouse.sh: pyproject.toml has no extra '{extra}' (it has: {', '.join(optional)})")
    wanted += optional[extra]
# benchmarks/gpu_suite.py runs the GPU tests (pytest, hypothesis; jsonschema, which the structured-output tests
# import) and `brisk bench serve` (httpx): the dev extra's versions of these; matplotlib, the rest of [bench], only
# with --extras bench.
wanted += [r for r in optional.get("dev", []) if re.match(r"(pytest|hypothesis|httpx|jsonschema)\b", r)]
bench_rest = [r for r in optional.get("bench", []) if r not in wanted]
wanted += ["setuptools>=68", "wheel"]  # pip builds brisk from the checkout, offline, with these

# What the target has: name -> version ("" when not given). torch, triton and the CUDA libraries always.
have = {}
if have_arg:
    lines = open(have_arg).read().splitlines() if os.path.isfile(have_arg) else have_arg.split(",")
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            name = re.split(r"[\s<>=!~;\[@]", name.strip(), maxsplit=1)[0]
            have[canonicalize_name(name)] = version.strip()


def preinstalled(name):
    return name in ("torch", "triton") or name.startswith("nvidia-") or name in have


skipped_bench = [r for r in bench_rest if not preinstalled(canonicalize_name(Requirement(r).name))]


major, minor = py_version.split(".")
environment = dict(
    python_version=py_version, python_full_version=f"{py_version}.0", implementation_name="cpython",
    platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
    platform_machine="x86_64", os_name="posix", implementation_version=f"{py_version}.0",
)


def applies(req, extras_of_parent):
    if req.marker is None:
        return True
    try:
        return any(req.marker.evaluate(dict(environment, extra=e)) for e in extras_of_parent or [""])
    except InvalidMarker:
        return False


platforms = []
for tag in ("manylinux_2_17", "manylinux2014", "manylinux_2_24", "manylinux_2_26", "manylinux_2_27",
            "manylinux_2_28", "manylinux_2_31", "manylinux_2_34", "manylinux_2_35", "manylinux1", "manylinux2010",
            "manylinux_2_5", "manylinux_2_12"):
    platforms += ["--platform", f"{tag}_x86_64"]


def download(reqs):
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", py_version, "--implementation", "cp", *platforms,
               "--dest", out, *reqs]
    done = subprocess.run(command)
    if done.returncode != 0:
        sys.exit(f"wheelhouse.sh: pip download failed for: {' '.join(reqs)}")


def wheels():
    found = {}
    for file in os.listdir(out):
        if file.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(file)
            found[canonicalize_name(name)] = (str(version), file)
    return found


def requires(file):
    with zipfile.ZipFile(os.path.join(out, file)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines() if line.startswith("Requires-Dist:")]


specs = {}  # name -> list of (requirement, who asked)
extras_of = {}  # name -> extras asked for
skipped = []  # (requirement, who asked, why)
warnings = []
level = [(Requirement(r), "brisk (pyproject.toml)") for r in dict.fromkeys(wanted)]
for _ in range(20):
    fetch = {}
    for req, who in level:
        name = canonicalize_name(req.name)
        if preinstalled(name):
            version = have.get(name, "")
            why = f"the target has it{f' ({version})' if version else ''}"
            if version and not req.specifier.contains(version, prereleases=True):
                warnings.append(f"{who} wants {req}, the target has {name} {version}")
                why += f"; WARNING: outside {who}'s range {req.specifier}"
            skipped.append((str(req), who, why))
            continue
        specs.setdefault(name, []).append((req, who))
        new_extras = set(req.extras) - extras_of.get(name, set())
        extras_of[name] = extras_of.get(name, set()) | set(req.extras)
        got = wheels().get(name)
        if got is None or new_extras or not all(r.specifier.contains(got[0], prereleases=True) for r, _ in specs[name]):
            fetch[name] = got
    if not fetch:
        break
    for name, got in fetch.items():
        if got is not None:
            os.remove(os.path.join(out, got[1]))  # a range that excludes it came up: fetch one inside every range
    combined = []
    for name in fetch:
        ranges = ",".join(str(r.specifier) for r, _ in specs[name] if str(r.specifier))
        extras_part = f"[{','.join(sorted(extras_of[name]))}]" if extras_of[name] else ""
        combined.append(f"{name}{extras_part}{ranges}")
    download(combined)
    found = wheels()
    level = []
    for name in fetch:
        version, file = found[name]
        for req in requires(file):
            if applies(req, sorted(extras_of[name])):
                req.marker = None
                level.append((req, f"{name} {version}"))
else:
    sys.exit("wheelhouse.sh: the dependency tree did not settle in 20 levels")

with open(os.path.join(out, "requirements.txt"), "w") as f:  # `pip install ... -r` it for the suite's tools too
    f.write("\n".join(r for r in dict.fromkeys(wanted) if not preinstalled(canonicalize_name(Requirement(r).name))) + "\n")
with open(os.path.join(out, "SKIPPED.txt"), "w") as f:
    f.write("# not in this wheelhouse: the target machine must already have these (requirement, who wants it, why)\n")
    for req, who, why in sorted(set(skipped)):
        f.write(f"{req}  <- {who}: {why}\n")
    if skipped_bench:
        f.write("# the rest of the [bench] extra (brisk bench serve's plots); add with --extras bench\n")
        f.write("\n".join(skipped_bench) + "\n")
for line in warnings:
    print(f"wheelhouse.sh: WARNING: {line}", file=sys.stderr)
EOF

echo "left out (the target has them; $out/SKIPPED.txt says who wants each):"
grep -v '^#' "$out/SKIPPED.txt" | sed -E 's/[ ;<>=!~\[].*//' | sort -u | tr '\n' ' ' | fold -s -w 110 | sed 's/^/  /'
echo
count=$(ls "$out"/*.whl | wc -l)
bytes=$(cat "$out"/*.whl | wc -c)
mb=$(( (bytes + 999999) / 1000000 ))
echo "wheelhouse: $count wheels, $mb MB in $out"
if (( bytes > max_mb * 1000000 )); then
    echo "wheelhouse.sh: $mb MB is over the limit of $max_mb MB (--max-mb)" >&2
    ls -S "$out"/*.whl | head -5 | sed 's/^/  largest: /' >&2
    exit 1
fi
