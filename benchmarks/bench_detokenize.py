"""Per-token cost of turning output tokens into text in the API process: the plain detokenizer and gpt-oss's harmony
parser, each with byte-level tokens decoded by their bytes (brisk's path for byte-level BPE tokenizers) and by
decoding windows of ids (the path of every other tokenizer, and of both before the byte path), same run; the harmony
parser also as it was before (windows decoded by the tokenizer's Python wrapper, `tokenizer.decode`).

    python benchmarks/bench_detokenize.py [--tokens 4000] [--rounds 5] [--out bench_detokenize.json]

The text is this repository's README (English prose, code and tables), tokenized with gpt-oss's o200k_harmony
tokenizer (built offline from ../shared/tokenizers, as the tests do) and with the bundled demo model's; each token is
fed alone, as a stream at stream_interval 1 feeds them. The harmony parser reads a final-channel message holding the
same tokens. Figures: µs per token, the best of `--rounds` (a shared machine's noise only ever adds time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # tests/ builds the o200k tokenizer; engine_overhead beside

from engine_overhead import machine_info  # noqa: E402

from brisk.detokenizer import IncrementalDetokenizer, TokenDecoder  # noqa: E402
from brisk.harmony import HarmonyParser, HarmonySpecialTokens  # noqa: E402
from brisk.sampling_params import SamplingParams  # noqa: E402


def best_us_per_token(run: Callable[[], None], num_tokens: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best / num_tokens * 1e6


def window_decoder(tokenizer: Any, skip_special_tokens: bool) -> TokenDecoder:
    decoder = TokenDecoder(tokenizer, skip_special_tokens)
    decoder.token_bytes = None  # as for a tokenizer that is not byte-level
    return decoder


def detokenizer_cost(tokenizer: Any, ids: list[int], rounds: int) -> dict[str, float]:
    out = {}
    for path, decoder in (
        ("bytes", TokenDecoder(tokenizer, True)),
        ("windows", window_decoder(tokenizer, True)),
    ):

        def run(decoder: TokenDecoder = decoder) -> None:
            detokenizer = IncrementalDetokenizer(tokenizer, ids[:5], SamplingParams(), decoder)
            for token_id in ids:
                detokenizer.update([token_id])
            detokenizer.flush()

        run()  # the byte table fills once per server, not per request
        out[path] = best_us_per_token(run, len(ids), rounds)
    return out


def harmony_cost(tokenizer: Any, ids: list[int], rounds: int) -> dict[str, float]:
    special = HarmonySpecialTokens.from_tokenizer(tokenizer)
    message = tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False) + ids + [special.end]

    def transformers_decode(token_ids: Any) -> str:  # what the parser called before: the tokenizer's Python wrapper
        return tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    bytes_decoder, windows_decoder = TokenDecoder(tokenizer, True), window_decoder(tokenizer, True)
    paths: dict[str, tuple[Callable[[Any], str], Any]] = {
        "bytes": (lambda t: bytes_decoder.decode(list(t)), bytes_decoder.token_bytes),
        "windows": (lambda t: windows_decoder.decode(list(t)), None),
        "windows, transformers decode": (transformers_decode, None),
    }
    out = {}
    for path, (decode, token_bytes) in paths.items():

        def run(decode: Callable[[Any], str] = decode, token_bytes: Any = token_bytes) -> None:
            parser = HarmonyParser(special, decode, token_bytes=token_bytes)
            for token_id in message:
                parser.feed([token_id])
            parser.finish()

        run()
        out[path] = best_us_per_token(run, len(message), rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_detokenize.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4000, help="tokens of README text fed (default 4000)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from tests.harmony_tokenizer import make_gpt_oss_tokenizer

    text = (ROOT / "README.md").read_text()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        tokenizers = {
            "o200k_harmony (gpt-oss)": make_gpt_oss_tokenizer(os.path.join(work, "o200k")),
            "demo model": AutoTokenizer.from_pretrained(str(ROOT / "brisk" / "demo_model")),
        }
        for name, tokenizer in tokenizers.items():
            ids = tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
            rows.append({"tokenizer": name, "what": "detokenizer", **detokenizer_cost(tokenizer, ids, args.rounds)})
            if name.startswith("o200k"):
                rows.append({"tokenizer": name, "what": "harmony parser", **harmony_cost(tokenizer, ids, args.rounds)})
    lines = [
        "| tokenizer | what | µs/token, windows (transformers decode) | windows | bytes | windows / bytes |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        before = row.get("windows, transformers decode")
        lines.append(
            f"| {row['tokenizer']} | {row['what']} | {'-' if before is None else f'{before:.2f}'} | "
            f"{row['windows']:.2f} | {row['bytes']:.2f} | {row['windows'] / row['bytes']:.1f}x |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        report = {"machine": machine_info(), "command": " ".join(sys.argv), "results": rows, "table": table}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
