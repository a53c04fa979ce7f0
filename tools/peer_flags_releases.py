"""Write the `vllm serve` flags of earlier vLLM releases that the recorded one (tests/data/peer_flags/vllm_serve.json)
no longer has to tests/data/peer_flags/vllm_serve_releases.json, for tests/test_options.py's check that brisk knows
each of them too (a command line written for an earlier vLLM must work unchanged), and their request fields that it
no longer has to vllm_request_fields_releases.json, for tests/test_api_fields.py's check that brisk takes each or
answers it with a reason (a client written for an earlier vLLM must work unchanged).

    python tools/peer_flags_releases.py 0.10.1.1 0.10.2 0.11.2 ...   # any Python with pip; needs PyPI

Each release's wheel is downloaded without its dependencies and only its Python files are unpacked; its parser is
built by `make_arg_parser` with what it imports but does not need for that (its compiled ops, CPU and grammar
libraries) stubbed, and the small pure-Python packages it needs installed beside it. No GPU and no vLLM install.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "peer_flags"
STUBBED = ("vllm._C", "cpuinfo", "lmformatenforcer")  # imported at module level, unused by the parser
PACKAGES = {"PIL": "pillow", "zmq": "pyzmq", "yaml": "pyyaml", "google": "protobuf"}  # module -> PyPI name

DUMP = r"""
import importlib.abc, importlib.machinery, json, sys
from unittest import mock

class Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if any(name == s or name.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module
    def exec_module(self, module):
        pass

STUBBED = sys.argv[3].split(",")
sys.meta_path.insert(0, Stubs())
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform
vllm.platforms._current_platform = CpuPlatform()  # the parser asks for a device type
try:
    from vllm.utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
for where in ("vllm.entrypoints.openai.cli_args", "vllm.entrypoints.launchers.cli_args"):
    try:
        make_arg_parser = __import__(where, fromlist=["make_arg_parser"]).make_arg_parser
        break
    except ModuleNotFoundError as exc:
        if exc.name != where:  # a module it imports is missing: installed by the caller
            raise
sys.path.insert(0, sys.argv[4])
from tools.peer_flags import parser_flags
flags = parser_flags(make_arg_parser(FlexibleArgumentParser()))
requests = {}
for route, name, places in (
    ("/v1/chat/completions", "ChatCompletionRequest", ("protocol", "chat_completion.protocol")),
    ("/v1/completions", "CompletionRequest", ("protocol", "completion.protocol")),
    ("/v1/responses", "ResponsesRequest", ("protocol", "responses.protocol")),
):
    for place in places:
        try:
            requests[route] = list(getattr(__import__("vllm.entrypoints.openai." + place, fromlist=[name]), name).model_fields)
            break
        except (ModuleNotFoundError, AttributeError):
            continue
print("FLAGS " + json.dumps(flags))
print("FIELDS " + json.dumps(requests))
"""


def release_flags(version: str, work: Path) -> tuple[list[list[str]], dict[str, list[str]]]:
    """A release's `vllm serve` flags (each a list of its spellings) and its request fields, by route."""
    wheels, site, deps = work / f"wheel-{version}", work / f"vllm-{version}", work / "deps"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "download", "--no-deps", f"vllm=={version}", "-d", str(wheels)], check=True)
    with zipfile.ZipFile(next(wheels.glob("vllm-*.whl"))) as wheel:
        wheel.extractall(site, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    for _ in range(40):  # install what the parser's imports need, one missing package at a time
        run = subprocess.run(
            [sys.executable, "-c", DUMP, str(site), str(deps), ",".join(STUBBED), str(REPO)],
            capture_output=True,
            text=True,
        )
        found = {  # vLLM logs to stdout too
            x.split(" ", 1)[0]: json.loads(x.split(" ", 1)[1])
            for x in run.stdout.splitlines()
            if x.startswith(("FLAGS ", "FIELDS "))
        }
        if "FLAGS" in found and "FIELDS" in found:
            return found["FLAGS"], found["FIELDS"]
        missing = run.stderr.rsplit("No module named '", 1)
        if len(missing) < 2:
            raise RuntimeError(f"vLLM {version}'s parser failed:\n{run.stderr[-2000:]}")
        module = missing[1].split("'", 1)[0].split(".", 1)[0]
        package = PACKAGES.get(module, module)
        # without its dependencies: a package that requires torch would put the CUDA build in `deps`, ahead of the
        # running Python's; each dependency the parser does import is missing next round and installed then
        subprocess.run([*pip, "install", "--no-deps", "--target", str(deps), package], check=True)
    raise RuntimeError(f"vLLM {version}: still missing packages after 40 installs")


def main(versions: list[str]) -> None:
    current = json.loads((DATA / "vllm_serve.json").read_text())
    known = {flag for group in current["flags"] for flag in group}
    current_fields = json.loads((DATA / "vllm_request_fields.json").read_text())
    dropped: dict[tuple[str, ...], list[str]] = {}  # spellings -> the releases that have them
    dropped_fields: dict[tuple[str, str], list[str]] = {}  # (route, field) -> the releases that have it
    with tempfile.TemporaryDirectory() as tmp:
        for version in versions:
            flags, fields = release_flags(version, Path(tmp))
            for group in flags:
                if any(flag not in known for flag in group):
                    dropped.setdefault(tuple(group), []).append(version)
            for route, names in fields.items():
                for name in names:
                    if name not in current_fields[route]:
                        dropped_fields.setdefault((route, name), []).append(version)
            print(f"vLLM {version}: {len(dropped)} dropped flags, {len(dropped_fields)} dropped request fields so far")
    header = f'{{\n "vllm": {json.dumps(versions)},\n "dropped_by": "{current["vllm"]}",\n'
    rows = [[list(group), seen[0], seen[-1]] for group, seen in sorted(dropped.items())]
    lines = ",\n".join(f"  {json.dumps(row)}" for row in rows)  # [spellings, first and last release seen]
    (DATA / "vllm_serve_releases.json").write_text(f'{header} "flags": [\n{lines}\n ]\n}}\n')
    rows = [[route, name, seen[0], seen[-1]] for (route, name), seen in sorted(dropped_fields.items())]
    lines = ",\n".join(f"  {json.dumps(row)}" for row in rows)  # [route, field, first and last release seen]
    (DATA / "vllm_request_fields_releases.json").write_text(f'{header} "fields": [\n{lines}\n ]\n}}\n')
    print(f"wrote the flags and request fields of vLLM {versions[0]}..{versions[-1]} that {current['vllm']} lacks")


if __name__ == "__main__":
    main(sys.argv[1:])
