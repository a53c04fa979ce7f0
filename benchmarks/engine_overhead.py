"""Engine overhead: the host time brisk's Python side costs per step, measured with a model that computes nothing.

    python benchmarks/engine_overhead.py [--batch-sizes 1,64,256,1024] [--steps 32] [--skip-http] [--profile]
                                         [--overlap] [--out engine_overhead.json]

The model is `BriskNullForCausalLM` (brisk/models/null.py) at gpt-oss-120b's shape where it matters to the
host: 36 layers alternating sliding-window / full attention (two KV groups, two block tables per request) and
gpt-oss's 201,088-token vocabulary. With no model math, what is left of a step is the engine: scheduling, KV
block accounting, building the step's input tensors, sampling, and turning tokens into outputs and text.

    a) engine core: `EngineCore.step()` in-process, `batch` requests all decoding: host time per step (median,
       p90) and the token rate it allows, batch / step time. `--profile` adds where that time goes (cProfile).
       `--overlap` runs the overlap scheduler as on a GPU (step N+1 laid out before step N's tokens are read;
       off by default on a CPU).
    b) offline: `LLM.generate` (detokenization included) of `batch` requests: output tokens/s.
    c) HTTP: `brisk serve` in a subprocess, streamed /v1/completions requests at each concurrency: tokens/s.

On a CPU-only machine the sampler's tensor work over [batch, 201088] logits (a copy and an argmax) runs on the
host too and grows with batch x vocab; on a GPU it is device time. `--profile` shows it apart ("sampler"), and
`--vocab-size` shrinks the vocabulary to see the Python cost alone. torch runs one intra-op thread
(`--torch-threads`, also for the server): the engine's host-side tensors are small, and on a machine whose cores
are busy, OpenMP's thread barriers turn a 0.1 ms op into 10 ms of waiting, which is not the engine's cost.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import itertools
import json
import math
import os
import platform
import pstats
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import brisk
import brisk.host
from brisk import LLM, SamplingParams
from brisk.detokenizer import byte_level_alphabet
from brisk.engine.core import EngineCore
from brisk.engine.messages import EngineCoreRequest
from brisk.host import cpu_info

DEFAULT_BATCH_SIZES = (1, 64, 256, 1024)
DEFAULT_HTTP_CONCURRENCY = (1, 64, 256)
DEFAULT_STEPS = 32
DEFAULT_TORCH_THREADS = 1
PROMPT_LEN = 16  # short prompts: the decode steps are what is measured
BLOCK_SIZE = 32  # brisk's default tokens per KV block
MAX_NUM_TOKENS = 8192  # brisk's default token budget per step: a 1024-request prefill takes two chunked steps
SEED = 0
SERVER_STARTUP_TIMEOUT_S = 300
TOP_FUNCTIONS = 10
EOS_TOKEN = "<|endoftext|>"

# Where a profiled function's own time is charged: the first rule whose path (relative to the brisk package) starts
# with the prefix and whose function name (None: any) matches. Time spent in functions outside brisk (torch ops,
# builtins) is charged to the brisk code that called them.
PROFILE_GROUPS: tuple[tuple[str, str | None, str], ...] = (
    ("scheduler/", None, "scheduler"),
    ("kv_cache/", None, "KV manager"),
    ("model_runner/sampler.py", None, "sampler"),
    ("model_runner/sampling_stage.py", None, "sampler"),  # the sampling stage, verification included
    ("model_runner/rejection_sampler.py", None, "sampler"),
    ("model_runner/", None, "runner input preparation"),
    ("models/", None, "model (null)"),
    ("layers/", None, "model (null)"),
    ("detokenizer.py", None, "output processing / detokenizer"),
    ("engine/", None, "output processing / detokenizer"),  # EngineCore's own code builds the step's outputs
    ("outputs.py", None, "output processing / detokenizer"),
    ("llm.py", None, "output processing / detokenizer"),
)
BRISK_DIR = os.path.dirname(os.path.abspath(brisk.__file__)) + os.sep
GROUP_ORDER = (
    "scheduler",
    "KV manager",
    "runner input preparation",
    "sampler",
    "model (null)",
    "output processing / detokenizer",
    "other",
)


@dataclass(frozen=True)
class NullModelShape:
    """The null model's config.json. Only the host-visible parts of gpt-oss-120b are kept."""

    num_layers: int = 36
    # gpt-oss's is 2880, but the only use of the null model's hidden state is the runner's gather of the rows to
    # sample: a device op on a GPU, and on a CPU a [batch, hidden] copy (3.5 ms at 1024 x 2880) that is not overhead.
    hidden_size: int = 64
    num_heads: int = 64
    # gpt-oss has 8 KV heads. The null model never reads its KV cache and block accounting does not depend on the
    # head count, so 1 head keeps the cache of 1024 requests under a gigabyte on a CPU box.
    num_kv_heads: int = 1
    head_dim: int = 64
    vocab_size: int = 201088
    sliding_window: int = 128

    def config_json(self) -> dict[str, Any]:
        # model_type "llama" so transformers' AutoConfig reads it; LlamaConfig keeps layer_types / sliding_window.
        return {
            "architectures": ["BriskNullForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": 131072,
            "sliding_window": self.sliding_window,
            "layer_types": ["sliding_attention", "full_attention"] * (self.num_layers // 2)
            + ["sliding_attention"] * (self.num_layers % 2),
            "rms_norm_eps": 1e-5,
            "eos_token_id": self.vocab_size - 1,
            "bos_token_id": self.vocab_size - 1,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
        }


# ---- the model directory -----------------------------------------------------------------------------------------
def write_synthetic_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids: 256 bytes, then every 2- and 3-character string
    of printable ASCII (space included) as merges, then the end-of-text token as the last id.

    Why synthetic, not trained or copied: the null model samples token ids uniformly over the whole vocabulary,
    so every id must decode, and the vocabulary must keep gpt-oss's size for the logits and sampler to have
    their real shape. brisk/demo_model's tokenizer has 4,106 ids; training 200k merges needs a large corpus.
    Tokens of printable ASCII decode to 1-3 characters, about as much text per token as a real vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes and the end-of-text token), got {vocab_size}")
    alphabet = byte_level_alphabet()
    vocab = {alphabet[b]: b for b in range(256)}
    ascii_chars = [alphabet[b] for b in range(0x20, 0x7F)]
    pairs = (a + b for a, b in itertools.product(ascii_chars, ascii_chars))
    merges: list[tuple[str, str]] = []
    candidates = itertools.chain(
        ((a, b) for a, b in itertools.product(ascii_chars, ascii_chars)),
        ((ab, c) for ab, c in itertools.product(pairs, ascii_chars)),
    )
    for left, right in itertools.islice(candidates, vocab_size - 1 - len(vocab)):
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    if len(vocab) != vocab_size - 1:
        raise ValueError(f"vocab_size {vocab_size} is larger than this tokenizer can make ({len(vocab) + 1})")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)  # the special token: last id
    fast.save_pretrained(path)


def write_null_model(path: str, shape: NullModelShape) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(shape.config_json(), f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": shape.vocab_size - 1}, f)
    write_synthetic_tokenizer(path, shape.vocab_size)


def engine_options(
    shape: NullModelShape, max_batch_size: int, max_seq_len: int, overlap: bool = False
) -> dict[str, Any]:
    """EngineConfig options: dummy weights, and a KV cache that holds `max_batch_size` requests of `max_seq_len`;
    `overlap`: the overlap scheduler on (a CPU's default is off)."""
    num_groups = 2 if shape.num_layers > 1 else 1  # sliding-window layers and full-attention layers
    kv_blocks = num_groups * math.ceil(max_seq_len / BLOCK_SIZE) * max_batch_size + 1  # + the null block
    return {
        "load_format": "dummy",
        "dtype": "bfloat16",  # the null model does no math; bf16 halves the KV cache's memory
        "device": "cpu",
        "seed": SEED,
        "max_batch_size": max_batch_size,
        "max_num_tokens": MAX_NUM_TOKENS,
        "max_seq_len": max_seq_len,
        "kv_cache_config": {"tokens_per_block": BLOCK_SIZE, "max_blocks": kv_blocks},
        **({"disable_overlap_scheduler": False} if overlap else {}),
    }


# ---- timing ------------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run with `num_threads` intra-op threads, then restore the caller's setting."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def random_prompts(batch: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size - 1) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class EnginePoint:
    batch: int
    step_ms: list[float]
    # This process's CPU time per step: on a shared machine, wall time also counts the waits for a core.
    step_cpu_ms: list[float]
    gc_ms: float = 0.0  # the garbage collector's pauses during the timed steps, in all
    profile: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        median = statistics.median(self.step_ms)
        return {
            "step_ms_median": median,
            "step_ms_p90": percentile(self.step_ms, 90),
            "step_cpu_ms_median": statistics.median(self.step_cpu_ms),
            # the throughput-relevant figure: a median leaves out the rare long steps (full GC collections)
            "step_cpu_ms_mean": statistics.mean(self.step_cpu_ms),
            "gc_ms_per_step": self.gc_ms / len(self.step_ms),
            "tokens_per_s": self.batch / (median / 1000),
            "steps": len(self.step_ms),
        }


@contextlib.contextmanager
def collector_pauses() -> Iterator[list[float]]:
    """Milliseconds the garbage collector ran inside the block (a one-element list, filled as it runs)."""
    total, started = [0.0], [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            total[0] += (time.perf_counter() - started[0]) * 1000

    gc.callbacks.append(callback)
    try:
        yield total
    finally:
        gc.callbacks.remove(callback)


def step_outputs(engine: EngineCore) -> list[Any]:
    """One step's outputs; engine_step_ab.py also runs this script against trees from before the model-side
    renovation (5b2e1c0), whose step() returned the list itself."""
    result: Any = engine.step()
    return result if isinstance(result, list) else result.outputs


def measure_engine(engine: EngineCore, batch: int, steps: int, profile: bool, max_tokens: int) -> EnginePoint:
    """Time `steps` engine steps with `batch` requests all decoding; then (with `profile`) as many under cProfile."""
    rids = [f"engine-b{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(rids, random_prompts(batch, engine.model_config.vocab_size, seed=batch)):
        engine.add_request(EngineCoreRequest(rid, prompt, greedy(max_tokens)))
    # Not measured: the chunked prefill, and one full decode step (which sizes the null model's logit pool).
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in step_outputs(engine))
    engine.step()

    def one_step() -> None:
        outputs = step_outputs(engine)
        if len(outputs) != batch or any(out.finished for out in outputs):
            raise RuntimeError(f"expected {batch} decoding requests, got {len(outputs)} outputs; raise max_tokens")

    step_ms, step_cpu_ms = [], []
    with collector_pauses() as gc_ms:
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            one_step()
            step_ms.append((time.perf_counter() - start) * 1000)
            step_cpu_ms.append((time.process_time() - start_cpu) * 1000)
    point = EnginePoint(batch, step_ms, step_cpu_ms, gc_ms[0])
    if profile:
        profiler = cProfile.Profile()
        for _ in range(steps):
            profiler.enable()
            one_step()
            profiler.disable()
        point.profile = summarize_profile(profiler, steps)
    for rid in rids:
        engine.abort_request(rid)
    engine.kv.check_invariants()
    return point


def measure_offline(llm: LLM, batch: int, max_tokens: int, profile: bool) -> tuple[float, dict[str, Any] | None]:
    """Output tokens/s of one `LLM.generate` of `batch` requests (prefill included); then, with `profile`,
    the same generate again under cProfile."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(batch, llm.engine.model_config.vocab_size, seed=batch)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(max_tokens))
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    summary = None
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(llm.generate, prompts, greedy(max_tokens))
        summary = summarize_profile(profiler, num_engine_steps(profiler))
    return tokens / elapsed, summary


def num_engine_steps(profiler: cProfile.Profile) -> int:
    """How many times the profiled code called `EngineCore.step`."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    return sum(
        calls
        for (filename, _, name), (_, calls, *_) in stats.items()
        if name == "step" and _brisk_path(filename) == "engine/core.py"
    )


# ---- HTTP --------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerProcess:
    url: str
    pid: int  # the API-server process


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, work_dir: str, env: dict[str, str]) -> Iterator[ServerProcess]:
    """`cmd` (an OpenAI-compatible server listening on `port`) as a subprocess in `work_dir` (not this directory:
    `python -m` puts its working directory first on sys.path, ahead of a PYTHONPATH in `env`), its output in
    work_dir/server.log; yields it once /health answers; SIGTERM (then SIGKILL) at the end."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(work_dir, "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=work_dir)
        try:
            deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    with open(log_path) as f:
                        raise RuntimeError(f"{shlex.join(cmd)} did not come up:\n{f.read()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.2)  # polling for readiness
            yield ServerProcess(url, proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def running_server(
    model_dir: str,
    options: dict[str, Any],
    work_dir: str,
    num_threads: int,
    env: dict[str, str] | None = None,
    entry: tuple[str, ...] = ("-m", "brisk.cli"),
) -> Iterator[ServerProcess]:
    """`brisk serve` on a free port as a subprocess (`env` added to its environment; `entry`: the python arguments
    that run brisk's command line with the arguments after them)."""
    import yaml

    options_path = os.path.join(work_dir, "engine_options.yaml")
    flags = ("load_format", "max_batch_size", "dtype", "device", "api_server_count")
    cli_keys = [k for k in flags if k in options]  # flags; the rest YAML
    with open(options_path, "w") as f:
        yaml.safe_dump({k: v for k, v in options.items() if k not in cli_keys}, f)
    port = free_port()
    cmd = [
        sys.executable,
        *entry,
        "serve",
        model_dir,
        "--port",
        str(port),
        "--served-model-name",
        "null",
        "--extra_llm_api_options",
        options_path,
        *(arg for key in cli_keys for arg in (f"--{key}", str(options[key]))),
    ]
    # OMP_NUM_THREADS is read by torch in both server processes
    env = {"OMP_NUM_THREADS": str(num_threads), **(env or {})}
    with server_process(cmd, port, work_dir, env) as server:
        yield server


def measure_http(url: str, concurrency: int, max_tokens: int) -> float:
    """Output tokens/s of two waves of `concurrency` streamed completions (at least 4 requests)."""
    from brisk.bench.client import Target, run_point
    from brisk.bench.metrics import summarize_point
    from brisk.bench.workload import RequestSpec

    target = Target(url, "completions", "null", ignore_eos=True, temperature=0.0)
    specs = [
        RequestSpec(f"request {i}: the quick brown fox jumps over the lazy dog", PROMPT_LEN, max_tokens)
        for i in range(max(4, 2 * concurrency))
    ]
    results, duration = run_point(target, specs, concurrency, None)
    point = summarize_point(results, duration, concurrency, None, num_gpus=1)
    if point["failed"]:
        raise RuntimeError(f"{point['failed']} HTTP requests failed at concurrency {concurrency}: {point['errors']}")
    return point["output_throughput"]


def warm_up_http(url: str, concurrency: int) -> None:
    """First requests pay one-time costs (imports, the null model's logit pool at the largest batch)."""
    from brisk.bench.client import Target, run_point
    from brisk.bench.workload import RequestSpec

    target = Target(url, "completions", "null", ignore_eos=True, temperature=0.0)
    run_point(target, [RequestSpec(f"warm-up {i}", PROMPT_LEN, 4) for i in range(concurrency)], concurrency, None)


# ---- profile summary ---------------------------------------------------------------------------------------------
FunctionKey = tuple[str, int, str]


def _brisk_path(filename: str) -> str | None:
    """The path inside the brisk package, with / separators; None for files outside it."""
    return filename[len(BRISK_DIR) :].replace(os.sep, "/") if filename.startswith(BRISK_DIR) else None


def _own_group(func: FunctionKey) -> str | None:
    filename, _, name = func
    if filename.replace(os.sep, "/").endswith("torch/nn/modules/module.py"):
        return "model (null)"  # nn.Module.__call__ around the model's forward
    path = _brisk_path(filename)
    if path is None:
        return None
    # Other brisk code (e.g. SamplingParams properties) is charged, like torch's, to its callers.
    return next(
        (group for prefix, function, group in PROFILE_GROUPS if path.startswith(prefix) and function in (None, name)),
        None,
    )


def group_times(
    stats: dict[FunctionKey, tuple],
    own_group: Callable[[FunctionKey], str | None] = _own_group,
    order: tuple[str, ...] = GROUP_ORDER,
) -> dict[str, float]:
    """Seconds of own time per group (`order`, which ends with "other"). A function `own_group` places in no
    group is charged to its callers' groups, in proportion to the time it spent under each caller (recursively,
    through callers that are themselves in no group)."""
    shares: dict[FunctionKey, dict[str, float]] = {}

    def share(func: FunctionKey, visiting: frozenset[FunctionKey]) -> dict[str, float]:
        """How `func`'s time divides among the groups (fractions summing to 1)."""
        if func in shares:
            return shares[func]
        own = own_group(func)
        if own is not None:
            return {own: 1.0}
        callers = stats[func][4] if func in stats else {}
        weights: dict[str, float] = {}
        for caller, (_, _, _, cum) in callers.items():
            if caller in visiting:
                continue  # recursion: already being attributed further up
            for group, fraction in share(caller, visiting | {func}).items():
                weights[group] = weights.get(group, 0.0) + cum * fraction
        total = sum(weights.values())
        result = {g: w / total for g, w in weights.items()} if total > 0 else {"other": 1.0}
        shares[func] = result
        return result

    times = {group: 0.0 for group in order}
    for func, (_, _, own_time, _, callers) in stats.items():
        group = own_group(func)
        if group is not None:
            times[group] += own_time
            continue
        if not callers:  # the profiled entry point
            times["other"] += own_time
            continue
        for caller, (_, _, edge_own_time, _) in callers.items():
            for g, fraction in share(caller, frozenset({func})).items():
                times[g] += edge_own_time * fraction
    return times


def _function_name(func: FunctionKey) -> str:
    filename, line, name = func
    if filename == "~":
        return name  # a builtin, e.g. "<method 'argmax' of 'torch._C.TensorBase' objects>"
    path = _brisk_path(filename)
    return f"{'brisk/' + path if path else os.path.basename(filename)}:{line} {name}"


def _worth_listing(func: FunctionKey) -> bool:
    """brisk's functions and the builtins (torch ops) they call; not the wrappers around them (this script's
    loop, torch's inference_mode decorator, nn.Module.__call__, the profiler's own switch)."""
    filename, _, name = func
    if filename == "~":
        return not name.startswith("<method 'disable'")
    return _brisk_path(filename) is not None


def summarize_profile(profiler: cProfile.Profile, num_steps: int) -> dict[str, Any]:
    """Per engine step: ms per group, and the top functions by cumulative time."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    per_step = 1000 / max(num_steps, 1)
    groups = {group: seconds * per_step for group, seconds in group_times(stats).items()}
    ranked = sorted(stats.items(), key=lambda item: item[1][3], reverse=True)
    top = [
        {
            "function": _function_name(func),
            "cum_ms": cum * per_step,
            "own_ms": own * per_step,
            "calls": calls / max(num_steps, 1),
        }
        for func, (_, calls, own, cum, _) in ranked
        if _worth_listing(func)
    ][:TOP_FUNCTIONS]
    return {
        "steps": num_steps,
        "group_ms_per_step": groups,
        "total_ms_per_step": sum(groups.values()),
        "top_functions": top,
    }


# ---- report ------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    batch: int
    engine: dict[str, Any] | None = None
    offline_tokens_per_s: float | None = None
    http_tokens_per_s: float | None = None
    profiles: dict[str, Any] = field(default_factory=dict)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: list[Row]) -> str:
    header = (
        "| batch / concurrency | engine step ms (median / p90) | engine step CPU ms | engine tok/s | offline tok/s "
        "| HTTP tok/s |"
    )
    lines = [header, "|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        engine = row.engine or {}
        step = f"{engine['step_ms_median']:.2f} / {engine['step_ms_p90']:.2f}" if engine else "-"
        lines.append(
            f"| {row.batch} | {step} | {_cell(engine.get('step_cpu_ms_median'), '.2f')} | "
            f"{_cell(engine.get('tokens_per_s'), ',.0f')} | "
            f"{_cell(row.offline_tokens_per_s, ',.0f')} | {_cell(row.http_tokens_per_s, ',.0f')} |"
        )
    return "\n".join(lines)


def format_profiles(rows: list[Row], path: str) -> str:
    """Group ms per step for each batch size, then the top functions at the largest batch, for one path."""
    profiled = [row for row in rows if path in row.profiles]
    if not profiled:
        return ""
    lines = [
        f"where the time goes, {path} (cProfile, ms per engine step; profiling inflates Python time):",
        "| group | " + " | ".join(f"batch {row.batch}" for row in profiled) + " |",
        "|---|" + "---:|" * len(profiled),
    ]
    for group in (*GROUP_ORDER, "total"):
        values = [
            row.profiles[path]["total_ms_per_step"]
            if group == "total"
            else row.profiles[path]["group_ms_per_step"][group]
            for row in profiled
        ]
        lines.append(f"| {group} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    largest = profiled[-1]
    lines += [
        "",
        f"top {TOP_FUNCTIONS} functions by cumulative time, {path}, batch {largest.batch} (ms per step):",
        "| cum ms | own ms | calls | function |",
        "|---:|---:|---:|---|",
    ]
    for entry in largest.profiles[path]["top_functions"]:
        lines.append(
            f"| {entry['cum_ms']:.2f} | {entry['own_ms']:.2f} | {entry['calls']:.3g} | `{entry['function']}` |"
        )
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    import torch

    memory_gb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    cpu = cpu_info().model_name
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(memory_gb, 1),
        "torch_threads": torch.get_num_threads(),
    }


# ---- main --------------------------------------------------------------------------------------------------------
def _positive_ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine_overhead.py", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--batch-sizes",
        type=_positive_ints,
        default=list(DEFAULT_BATCH_SIZES),
        help="concurrent decode requests, comma-separated (default 1,64,256,1024)",
    )
    p.add_argument(
        "--http-concurrency",
        type=_positive_ints,
        default=list(DEFAULT_HTTP_CONCURRENCY),
        help="HTTP concurrencies, comma-separated (default 1,64,256)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help="timed engine steps per batch size; also the output tokens of each offline / HTTP request",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=NullModelShape.vocab_size,
        help="vocabulary of the null model (default gpt-oss's 201088)",
    )
    p.add_argument("--layers", type=int, default=NullModelShape.num_layers, help="attention layers (default 36)")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=DEFAULT_TORCH_THREADS,
        help="torch intra-op threads, here and in the server (default 1)",
    )
    p.add_argument("--skip-http", action="store_true", help="no `brisk serve` measurement")
    p.add_argument("--overlap", action="store_true", help="overlap scheduling on (in-process engine and server)")
    p.add_argument("--skip-offline", action="store_true", help="no `LLM.generate` measurement")
    p.add_argument("--profile", action="store_true", help="also profile the engine and offline steps (cProfile)")
    p.add_argument("--out", help="write the results as JSON to this path")
    args = p.parse_args(argv)
    if args.steps < 1 or args.torch_threads < 1:
        p.error("--steps and --torch-threads must be >= 1")
    return args


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    shape = NullModelShape(num_layers=args.layers, vocab_size=args.vocab_size)
    rows = {
        batch: Row(batch) for batch in sorted({*args.batch_sizes, *([] if args.skip_http else args.http_concurrency)})
    }
    # Output room: chunked-prefill warm-up steps, the timed steps, and as many again under the profiler.
    max_output_tokens = 2 * args.steps + math.ceil(max(args.batch_sizes) * PROMPT_LEN / MAX_NUM_TOKENS) + 4
    with tempfile.TemporaryDirectory(prefix="brisk-engine-overhead-") as work_dir:
        model_dir = os.path.join(work_dir, "null-model")
        os.makedirs(model_dir)
        print(
            f"writing the null model ({shape.num_layers} layers, vocab {shape.vocab_size}) to {model_dir}",
            file=sys.stderr,
        )
        write_null_model(model_dir, shape)

        # One LLM for both in-process paths: its `engine` is the EngineCore measured on its own in (a).
        max_seq_len = PROMPT_LEN + max_output_tokens
        llm = LLM(model_dir, **engine_options(shape, max(args.batch_sizes), max_seq_len, args.overlap))
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(2))  # first-call costs
        # What the server's engine process does after start-up (brisk.host.freeze_startup_heap; older trees, which
        # engine_step_ab.py runs this script against, lack it: the same done here, so both trees are measured alike).
        freeze = getattr(brisk.host, "freeze_startup_heap", None)
        if freeze is not None:
            freeze()
        else:
            gc.collect()
            gc.freeze()
        for batch in args.batch_sizes:
            point = measure_engine(llm.engine, batch, args.steps, args.profile, max_output_tokens)
            engine = rows[batch].engine = point.summary()
            if point.profile:
                rows[batch].profiles["engine core"] = point.profile
            if not args.skip_offline:
                offline, offline_profile = measure_offline(llm, batch, args.steps, args.profile)
                rows[batch].offline_tokens_per_s = offline
                if offline_profile:
                    rows[batch].profiles["offline LLM.generate"] = offline_profile
            print(
                f"batch {batch}: engine step {engine['step_ms_median']:.2f} ms, "
                f"offline {_cell(rows[batch].offline_tokens_per_s, ',.0f')} tok/s",
                file=sys.stderr,
            )
        del llm
        gc.collect()  # the server below needs the memory

        if not args.skip_http:
            # `--max_batch_size 1024` as a deployment would have; HTTP prompts are text, so leave them room.
            server_options = engine_options(
                shape, max(1024, *args.http_concurrency), 4 * PROMPT_LEN + args.steps, args.overlap
            )
            with running_server(model_dir, server_options, work_dir, args.torch_threads) as server:
                url = server.url
                warm_up_http(url, max(args.http_concurrency))
                for concurrency in args.http_concurrency:
                    rows[concurrency].http_tokens_per_s = measure_http(url, concurrency, args.steps)
                    print(
                        f"HTTP concurrency {concurrency}: {rows[concurrency].http_tokens_per_s:,.0f} tok/s",
                        file=sys.stderr,
                    )

    ordered = [rows[b] for b in sorted(rows)]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": command,
        "settings": {
            "model": asdict(shape),
            "prompt_len": PROMPT_LEN,
            "steps": args.steps,
            "output_tokens_per_request": args.steps,
            "batch_sizes": args.batch_sizes,
            "http_concurrency": None if args.skip_http else args.http_concurrency,
            "sampling": "greedy, ignore_eos",
            "torch_threads": args.torch_threads,
            "profile": args.profile,
            "overlap": args.overlap,
        },
        "results": [
            {
                "batch": row.batch,
                "engine": row.engine,
                "offline_tokens_per_s": row.offline_tokens_per_s,
                "http_tokens_per_s": row.http_tokens_per_s,
            }
            for row in ordered
        ],
        "profiles": {str(row.batch): row.profiles for row in ordered if row.profiles},
        "table": format_table(ordered),
        "profile_text": "\n\n".join(
            filter(None, (format_profiles(ordered, path) for path in ("engine core", "offline LLM.generate")))
        ),
    }


def print_report(report: dict[str, Any], out: str | None) -> None:
    """The table (and profile) on stdout; the whole report as JSON into `out` where given."""
    print(report["table"])
    if report["profile_text"]:
        print("\n" + report["profile_text"])
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        print(f"\nwrote {out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    with torch_threads(args.torch_threads):
        report = run(args, "python benchmarks/engine_overhead.py " + shlex.join(argv))
    print_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
