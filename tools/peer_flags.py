"""Write what an installed vLLM's `vllm serve` takes to tests/data/peer_flags/, for the tests that hold brisk to it:
- vllm_serve.json: every flag, for tests/test_options.py's check that brisk knows each (as an option, or as a
  peer's option it refuses with a reason: brisk/peer_options.py);
- vllm_serve_defaults.json: each flag spelled out at its default value, for tests/test_options.py's check that a
  command line stating vLLM's defaults starts brisk (launchers and deployment charts often write every flag out);
- vllm_request_fields.json: the fields of its chat, completion and Responses requests, for
  tests/test_api_fields.py's check that docs/api.md lists each;
- vllm_request_defaults.json: each of those requests written out whole at vLLM's defaults, which
  tests/test_api_fields.py sends to a live server;
- vllm_routes.json: its HTTP routes, for tests/test_peer_routes.py's check that brisk serves each or answers it
  with a reason (brisk/server/peer_routes.py).

    python tools/peer_flags.py        # run with the Python of a venv where vLLM is installed

(on a machine without a GPU, with VLLM_TARGET_DEVICE=cpu in the environment: vLLM's CUDA wheel cannot tell its
device otherwise, and its parser's defaults do not depend on it)

trtllm-serve's flags (tests/data/peer_flags/trtllm_serve.txt) are copied by hand from the click options of
tensorrt_llm/commands/serve.py, its routes (trtllm_serve_routes.txt) from tensorrt_llm/serve/openai_server.py:
TensorRT-LLM does not install on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "peer_flags"
OUT = DATA / "vllm_serve.json"


def main() -> None:
    import vllm
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # vLLM >= 0.33
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser

    parser = make_arg_parser(FlexibleArgumentParser())
    flags = parser_flags(parser)
    lines = ",\n".join(f"  {json.dumps(group)}" for group in flags)  # one flag (its spellings) a line
    OUT.write_text(f'{{\n "vllm": "{vllm.__version__}",\n "flags": [\n{lines}\n ]\n}}\n')
    print(f"wrote {len(flags)} flags of vLLM {vllm.__version__} to {OUT}")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    fields = {
        "vllm": vllm.__version__,
        "/v1/chat/completions": list(ChatCompletionRequest.model_fields),
        "/v1/completions": list(CompletionRequest.model_fields),
        "/v1/responses": list(ResponsesRequest.model_fields),
    }
    (DATA / "vllm_request_fields.json").write_text(json.dumps(fields, indent=1) + "\n")
    # Each request as vLLM's own models write it out whole (proxies and routers built on vLLM's protocol classes
    # send every field, at its default): tests/test_api_fields.py sends each to brisk
    minimal = {
        "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}]}),
        "/v1/completions": (CompletionRequest, {"prompt": "Hi"}),
        "/v1/responses": (ResponsesRequest, {"input": "Hi"}),
    }
    bodies = {"vllm": vllm.__version__}
    for route, (model, body) in minimal.items():
        bodies[route] = json.loads(model(model="m", **body).model_dump_json())
        bodies[route].pop("request_id")  # a fresh random id each time: the test sends its own
    (DATA / "vllm_request_defaults.json").write_text(json.dumps(bodies, indent=1) + "\n")
    write_defaults(parser)
    write_routes(parser)


def parser_flags(parser) -> list[list[str]]:
    """Each flag of an argparse parser as the list of its spellings: every one the parser takes, those hidden from
    --help too (vLLM >= 0.33 pairs --enable-x with --disable-x and still takes --no-enable-x, unlisted)."""
    flags = []
    for action in parser._actions:
        spellings = [s for s, a in parser._option_string_actions.items() if a is action and s not in ("-h", "--help")]
        if spellings:
            flags.append(spellings)
    return flags


def write_defaults(parser) -> None:
    """Each flag as a command line states its default: a switch by the spelling that sets its default, an option by
    its default value as text. Kept only where vLLM's own parser reads the words back to the default, so every line
    means "vLLM's default, said out loud"; config objects (--eplb-config...) and empty values have no such words."""
    import vllm

    lines = []
    for action in parser._actions:
        spellings = [s for s in action.option_strings if s.startswith("--") and s != "--help"]
        if not spellings or action.default in (None, argparse.SUPPRESS) or action.dest == "model":
            continue
        for argv in _default_words(action, spellings):
            read = getattr(parser.parse_args(argv), action.dest)
            if read == action.default or getattr(read, "value", read) == getattr(action.default, "value", None):
                lines.append(argv)
                break
    text = ",\n".join(f"  {json.dumps(argv)}" for argv in lines)
    (DATA / "vllm_serve_defaults.json").write_text(f'{{\n "vllm": "{vllm.__version__}",\n "argv": [\n{text}\n ]\n}}\n')


def _default_words(action, spellings: list[str]) -> list[list[str]]:
    """The command lines that might state an action's default: each spelling alone (a switch), or the first with the
    default as text (a list as its items, a mapping as JSON)."""
    default = action.default
    if action.nargs == 0:
        return [[s] for s in spellings] if isinstance(default, bool) else []
    if isinstance(default, bool):
        return [[spellings[0], str(default).lower()]]
    if isinstance(default, (list, set, tuple)):
        return [[spellings[0], *map(str, default)]] if default and action.nargs in ("+", "*") else []
    if isinstance(default, dict):
        return [[spellings[0], json.dumps(default)]]
    value = getattr(default, "value", default)  # an enum (--mamba-backend, --optimization-level) by its value
    return [[spellings[0], str(value)]] if isinstance(value, (str, int, float)) else []


def write_routes(parser) -> None:
    """Every route `vllm serve` can have: the app built with its development, LoRA-updating, tokenizer-info,
    profiler and fault-tolerance routes on, for generation and speech models, plus the pooling models' routers."""
    import vllm
    from vllm.entrypoints.launchers.app import build_app

    os.environ.update(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    args = parser.parse_args(
        [
            "--model",
            "m",
            "--enable-tokenizer-info-endpoint",
            "--profiler-config",
            '{"profiler": "torch", "torch_profiler_dir": "/tmp"}',
        ]
    )
    args.enable_fault_tolerance = True
    app = build_app(args, ("generate", "transcription", "realtime"))
    for name in ("pooling.pooling", "pooling.classify", "pooling.embed", "pooling.scoring"):
        app.include_router(importlib.import_module(f"vllm.entrypoints.{name}.api_router").router)
    routes: dict[str, set[str]] = {"/cohere/v2/chat": {"POST"}, "/cohere/v2/chat/render": {"POST"}}  # need its SDK
    for path, methods in _paths_and_methods(app.routes):
        methods = methods or {"GET"}  # a mount (/metrics) or a websocket (/v1/realtime)
        routes.setdefault(path, set()).update(methods - {"HEAD"})
    lines = ",\n".join(f"  {json.dumps([path, sorted(routes[path])])}" for path in sorted(routes))
    (DATA / "vllm_routes.json").write_text(f'{{\n "vllm": "{vllm.__version__}",\n "routes": [\n{lines}\n ]\n}}\n')


def _paths_and_methods(routes):
    """Each route's path and methods; FastAPI >= 0.165 keeps an included router as one entry of `app.routes`,
    walked by `iter_route_contexts`."""
    from fastapi import routing

    contexts = getattr(routing, "iter_route_contexts", None)
    for route in contexts(routes) if contexts is not None else routes:
        yield route.path, getattr(route, "methods", None)


if __name__ == "__main__":
    main()
