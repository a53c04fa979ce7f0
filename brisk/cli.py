"""Command line: `brisk serve` (OpenAI-compatible HTTP server), `brisk generate` (offline, one prompt), `brisk bench`.

The flags of `serve` and `generate` come from the option table (brisk/config.py, docs/options.md): trtllm-serve's
and `vllm serve`'s spellings both work. A start-up error a user can act on (a bad option, a model that cannot be
found, a port in use, a layout the machine cannot run) is one line on stderr and exit code 2; `--log-level debug`
adds its traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import traceback

from brisk.config import OPTIONS, ConfigError, EngineConfig, OptionFiles
from brisk.server_config import ServerConfig

EXIT_USAGE = 2  # argparse's code for a bad command line; brisk's for every start-up error a user can act on
DEBUG_LOG_LEVELS = ("debug", "trace", "verbose")


class _Parser(argparse.ArgumentParser):
    """argparse, with a "did you mean" from the option table for an unknown flag."""

    def parse_args(self, args=None, namespace=None):
        args = _dotted_json_flags(sys.argv[1:] if args is None else list(args))
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            sub = getattr(parsed, "command", None)
            parser = self._subparser(sub) if sub else self
            flag = next((u for u in unknown if u.startswith("-")), None)
            hint = _did_you_mean(parser, flag) if flag else ""
            parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return parsed

    def error(self, message: str):
        """One line (argparse would print the whole usage first: ~60 lines for `brisk serve`)."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")

    def _subparser(self, name: str) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices[name]
        return self


_DOTTED = re.compile(r"^(--?[A-Za-z][\w-]*)\.([\w.]+)(?:=(.*))?$")


def _dotted_json_flags(args: list[str]) -> list[str]:
    """vLLM's dotted form of a JSON option, `--speculative-config.method ngram` or `-cc.cudagraph_mode=FULL`, as
    the option's JSON (`--speculative-config '{"method": "ngram", ...}'`): the dotted keys of one flag merged, each
    value read as JSON where it is JSON (3, true) and as text otherwise."""
    out: list[str] = []
    merged: dict[str, dict] = {}
    i = 0
    while i < len(args):
        match = _DOTTED.match(args[i])
        if match is None:
            out.append(args[i])
            i += 1
            continue
        flag, path, value = match.groups()
        if value is None:
            if i + 1 >= len(args):
                raise SystemExit(f"brisk: error: {args[i]} needs a value")
            value, i = args[i + 1], i + 1
        i += 1
        if flag not in merged:
            merged[flag] = {}
            out += [flag, ""]  # its JSON, filled in below, where the first dotted key was
        into = merged[flag]
        *parents, last = path.split(".")
        for key in parents:
            into = into.setdefault(key, {})
        try:
            into[last] = json.loads(value)
        except ValueError:
            into[last] = value
    for flag, value in merged.items():
        at = out.index(flag)
        if out.count(flag) > 1:
            raise SystemExit(f"brisk: error: give {flag} either as JSON or in its dotted form ({flag}.KEY VALUE)")
        out[at + 1] = json.dumps(value)
    return out


def _did_you_mean(parser: argparse.ArgumentParser, flag: str) -> str:
    import difflib

    name = flag.split("=", 1)[0]
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS]  # not the peers' options brisk refuses
    known = [s for a in shown for s in a.option_strings if s.startswith("--")]
    normal = {s.replace("_", "-"): s for s in known}
    close = difflib.get_close_matches(name.replace("_", "-"), list(normal), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="brisk", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion offline", allow_abbrev=False)
    gen.add_argument("model")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max_tokens", "--max-tokens", dest="max_tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    OPTIONS.add_arguments(gen, (OptionFiles, EngineConfig))
    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (no MODEL: the bundled demo model)",
        description="Every option and its trtllm / vLLM spellings: docs/options.md.",
        allow_abbrev=False,
    )
    serve.add_argument("model", nargs="?", help="a model folder or Hugging Face id (default: the bundled demo model)")
    serve.add_argument("--model", dest="model_option", metavar="MODEL", help="MODEL given as a flag (vLLM's spelling)")
    OPTIONS.add_arguments(serve, (OptionFiles, ServerConfig, EngineConfig))
    from brisk.bench import add_subcommands as add_bench_subcommands

    add_bench_subcommands(sub.add_parser("bench", help="benchmark a running server (`brisk bench serve --help`)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        import shlex

        from brisk.bench import run as run_bench

        return run_bench(args, "brisk " + shlex.join(sys.argv[1:] if argv is None else argv))

    if getattr(args, "model_option", None) is not None:
        if args.model is not None and args.model != args.model_option:
            parser.error(f"two models given: {args.model} and --model {args.model_option}")
        args.model = args.model_option
    given = OPTIONS.given(args)
    debug = str(given.get("log_level", "")).lower() in DEBUG_LOG_LEVELS
    try:
        if args.command == "serve":
            from brisk.server.api_servers import run

            return run(args.model, given)
        return _generate(args, given)
    except ConfigError as exc:
        # one line: what is wrong and which option to change; the traceback is for --log-level debug
        print(f"brisk {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        if debug:
            traceback.print_exc()
        return EXIT_USAGE


def _generate(args: argparse.Namespace, given: dict) -> int:
    from brisk import LLM, SamplingParams

    llm = LLM(args.model, **given)
    out = llm.generate(args.prompt, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
