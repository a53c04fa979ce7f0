"""Phase d of benchmarks/gpu_suite.py: offline latency and throughput of brisk on a dummy gpt-oss, the bandwidth
roofline, the transformers `generate` baseline, and where a decode step's time goes.

    python benchmarks/suite_offline.py brisk --model gpt-oss-20b --out d_20b.json --bandwidth-gbps 3000
    python benchmarks/suite_offline.py hf --model gpt-oss-20b --out d_hf.json

Each run writes its JSON after every measurement, so a run stopped by its time budget keeps what it measured.
--time-budget S (the quick plan's speed steps) fits the run to S seconds instead: latency batches are skipped once
the throughput point needs the rest (batch 1, a few seconds, always runs: its step time sizes the point), and that
point is cut (output tokens first, then sequences) to what the latency rows say fits, or without any row to a
quarter of its sequences and output tokens, each with a note.

Cold start: python imports, then the runner's own stages (brisk/model_runner/startup.py: weights built and drawn on
the device, set-up, KV sizing by profiling, KV allocation, CUDA graph capture), the rest of LLM(), and how many
Triton kernels were compiled (or loaded from Triton's disk cache) in how long, inside those stages.

Latency, batch B: B random prompts of --input-len tokens, each generating --output-len tokens (greedy, EOS
ignored); the same with one output token times the prefill. tokens/s/user = (output_len - 1) / (total - prefill).
Long context (--long-context L): one decode row at --long-batch sequences of L-token prompts, where reading the KV
is a large part of a step (FP8 KV against bf16: the kv_fp8 step of the quick plan runs both).
Throughput: the largest batch the KV pool holds at --throughput-len in and out (a request's peak: all its tokens
in full-attention layers, the window plus its prompt in sliding ones), all at once; output tokens / time.
--kv-cache-dtype (auto, fp8, ...: brisk's option) picks the KV storage; the meta records what it stored.
Roofline: the bytes one decode step must read at batch B (`step_bytes`: the dense weights, the experts the batch
touches in MXFP4, the LM head, the KV of every sequence) over the measured copy bandwidth (phase a) gives the
fastest possible step; the fraction is that over the measured step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

MXFP4_BYTES_PER_WEIGHT = 4.25 / 8  # 4-bit values plus one 8-bit scale per 32
KV_BYTES = 2  # bf16 cache; FP8 KV: 1


def step_bytes(config: dict[str, Any], batch: int, context: int, kv_bytes: float = KV_BYTES) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences, each `context` tokens long, must read from GPU memory, with
    `kv_bytes` bytes a KV element."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    experts, k, inter = config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]
    vocab, window = config["vocab_size"], config.get("sliding_window")
    mxfp4 = (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    attention = (
        layers * 2 * (h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + heads * hd + 2 * kv_heads * hd + h)
    )
    router = layers * 2 * (h * experts + experts)
    expert_weights = 3 * inter * h  # gate_up (2I x H) and down (H x I)
    per_expert = expert_weights * (MXFP4_BYTES_PER_WEIGHT if mxfp4 else 2) + 2 * (2 * inter + h)
    touched = experts * (1 - (1 - k / experts) ** batch)  # expected distinct experts per layer, uniform routing
    kv_per_token_layer = 2 * kv_heads * hd * kv_bytes
    types = config.get("layer_types") or ["full_attention"] * layers
    kv = sum(batch * (context if t == "full_attention" else min(context, window or context)) for t in types)
    parts = {
        "attention": attention,
        "router": router,
        "experts": layers * touched * per_expert,
        "lm_head": 2 * vocab * h,
        "kv": kv * kv_per_token_layer,
    }
    parts["total"] = sum(parts.values())
    return parts


class Results:
    def __init__(self, path: str, **meta: Any) -> None:
        self.path, self.data = path, {"meta": meta, "rows": {}}
        self.save()

    def note(self, text: str) -> None:
        self.data.setdefault("notes", []).append(text)
        self.save()
        print("note:", text, flush=True)

    def add(self, table: str, row: dict[str, Any]) -> None:
        self.data["rows"].setdefault(table, []).append(row)
        self.save()
        print(table, json.dumps(row), flush=True)

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".tmp", self.path)


def random_prompts(count: int, length: int, vocab: int, rng: random.Random) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(length)]} for _ in range(count)]


def timed(fn) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


class TritonCompileTimer:
    """Counts and times Triton's compilations (each kernel specialisation compiled, or loaded from Triton's disk
    cache) by wrapping `triton.compiler.compile`, which every @triton.jit kernel looks up at its first launch."""

    def __init__(self) -> None:
        self.kernels = 0
        self.seconds = 0.0
        self.installed = False

    def install(self) -> TritonCompileTimer:
        try:
            import triton.compiler
        except ImportError:
            return self
        original = triton.compiler.compile

        def timed_compile(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.kernels += 1
                self.seconds += time.perf_counter() - start

        triton.compiler.compile = timed_compile
        self.installed = True
        return self


STARTUP_STAGES = {  # brisk/model_runner/startup.py's stages, as the report names them
    "weights": "weights: built on the device, dummy values drawn there",
    "setup": "runner set-up (kernels, backends, batch buffers)",
    "kv_sizing": "KV sizing (a profiling step at max_num_tokens on a GPU)",
    "kv_allocation": "KV cache allocation",
    "graph_capture": "CUDA graph capture",
    "kernel_warm_up": "kernel warm-up (eager steps' Triton variants: MoE tiers, mixed decode)",
}


def startup_rows(imports_s: float, load_s: float, runner, compiles: TritonCompileTimer, cuda: bool) -> list[dict]:
    """The cold start, stage by stage: the runner's own record, the rest of LLM(), and the Triton compilations
    that happened inside those stages."""
    rows = [dict(stage="python imports (torch, brisk)", s=imports_s)]
    stages = runner.startup.seconds
    for key, seconds in stages.items():
        name = STARTUP_STAGES.get(key, key)
        if key == "graph_capture" and runner.graphs is not None:
            name += f" ({len(runner.graphs.sizes) * len(runner.graphs.query_lens)} graphs)"
        rows.append(dict(stage=name, s=seconds))
    rows.append(dict(stage="the rest of LLM() (config, tokenizer, engine, processes)", s=load_s - sum(stages.values())))
    rows.append(dict(stage="LLM() in all", s=load_s))
    if compiles.installed:
        note = "" if compiles.kernels or not cuda else " (none seen: this Triton may not compile through the hook)"
        stage = f"of which Triton compilations ({compiles.kernels} kernels, inside the stages above){note}"
        rows.append(dict(stage=stage, s=compiles.seconds))
    return rows


def run_brisk(args: argparse.Namespace, config: dict[str, Any], model_dir: str) -> None:
    import torch

    compiles = TritonCompileTimer().install()  # before the first kernel launch
    from brisk import LLM, SamplingParams
    from brisk.kv_cache.manager import cdiv
    from brisk.model_runner.memory import KVGroupLayout, blocks_for_one_request

    imports_s = time.perf_counter() - args.started - getattr(args, "model_dir_s", 0.0)
    deadline = args.started + args.time_budget if args.time_budget else None
    cuda = torch.cuda.is_available()
    res = Results(
        args.out, model=args.model, engine="brisk", device=_device_name(torch), bandwidth_gbps=args.bandwidth_gbps
    )
    options: dict[str, Any] = dict(
        load_format="dummy",
        max_batch_size=args.max_batch,
        kv_cache_config={"enable_block_reuse": False},
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.max_num_tokens:
        options["max_num_tokens"] = args.max_num_tokens
    if args.kv_cache_bytes:
        options["kv_cache_config"]["max_gpu_total_bytes"] = args.kv_cache_bytes
    if args.graph_sizes and cuda:  # on a CPU an explicit graph config would run padded buffers, not graphs
        options["cuda_graph_config"] = {"batch_sizes": args.graph_sizes}
    load_s, llm = timed(lambda: LLM(model_dir, **options))
    runner = llm.engine.executor.runner
    kv_dtype = runner.kv_layout.kv_dtypes[0]  # the full-attention group's, which holds the context (kv_tensors.py)
    kv_bytes = kv_dtype.itemsize
    res.data["meta"].update(
        load_s=load_s,
        num_kv_blocks=runner.num_blocks,
        block_size=runner.config.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_stored_as=str(kv_dtype).removeprefix("torch."),
        kv_tokens=runner.num_blocks * runner.block_sizes[0],  # the full-attention group's
    )
    if getattr(args, "model_dir_s", None):  # the suite's own set-up, before the cold start
        res.add("startup", dict(stage="(not cold start) the dummy model's folder written", s=args.model_dir_s))
    for row in startup_rows(imports_s, load_s, runner, compiles, cuda):
        res.add("startup", row)
    rng = random.Random(0)
    vocab = config["vocab_size"]

    def generate(prompts, n: int):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return llm.generate(prompts, params, use_tqdm=False)

    def left() -> float:
        return float("inf") if deadline is None else deadline - time.perf_counter()

    generate(random_prompts(2, 16, vocab, rng), 4)  # warm-up: kernel compilation, allocator
    # What the throughput point and the profile need of the step's time: the latency rows stop before it.
    reserve = 0.45 * args.time_budget if args.time_budget else 0.0

    def latency_row(batch: int, input_len: int, output_len: int) -> dict[str, Any]:
        # This shape's first launches, at the measured prompt length: the MoE's tiles follow the tokens per expert, so
        # a 16-token warm-up would leave the prefill's kernels to compile (or load) inside the timed prefill, and the
        # decode time (the whole run minus it) off by a second either way.
        generate(random_prompts(batch, input_len, vocab, rng), 2)
        prefill_s, _ = timed(lambda: generate(random_prompts(batch, input_len, vocab, rng), 1))
        total_s, outs = timed(lambda: generate(random_prompts(batch, input_len, vocab, rng), output_len))
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        decode_s = total_s - prefill_s
        # Under a quarter of the run, the difference of two runs is mostly their noise: no figure rather than one
        # that means something else (the whole run's rate would be prefill-bound, several times too low).
        unmeasured = decode_s < 0.25 * total_s
        per_user = None if unmeasured else (output_len - 1) / decode_s
        bytes_ = step_bytes(config, batch, input_len + output_len // 2, kv_bytes)["total"]
        row = dict(
            batch=batch,
            input_len=input_len,
            output_len=output_len,
            total_s=total_s,
            prefill_s=prefill_s,
            tok_s_user=per_user,
            output_tok_s=produced / total_s,
            step_gb=bytes_ / 1e9,
        )
        if unmeasured:
            row["decode_not_measured"] = "the decode was under a quarter of the run (prefill dominates): more output"
        _flag_short_outputs(row, produced, batch * output_len)
        if args.bandwidth_gbps:
            roofline = args.bandwidth_gbps * 1e9 / bytes_
            row.update(roofline_tok_s_user=roofline, roofline_fraction=per_user and per_user / roofline)
        return row

    for batch in args.batches:
        if left() < reserve and batch != 1:  # batch 1 always: a measured step time to size the throughput point
            res.note(f"latency at batch {batch} not run: the step's time was kept for the throughput point")
            continue
        res.add("latency", latency_row(batch, args.input_len, args.output_len))
    if args.long_context:
        if left() < reserve:
            res.note("the long-context row not run: the step's time was kept for the throughput point")
        else:
            res.add("long_context", latency_row(args.long_batch, args.long_context, args.output_len))

    groups = [
        KVGroupLayout("sliding" if g.sliding_window else "full", len(g.layer_ids), bs, g.sliding_window)
        for g, bs in zip(runner.kv_groups, runner.block_sizes)
    ]
    seq = 2 * args.throughput_len
    chunk = min(args.throughput_len, runner.config.max_num_tokens)  # the most of one prompt a step computes
    # Blocks a sequence holds at its end (the whole context in full-attention groups, the window in sliding ones),
    # and above that while its prompt is computed (a sliding group holds the whole chunk until the step is done);
    # at most a step's worth of prompts are computed at once, so only they hold the peak.
    steady = blocks_for_one_request(groups, seq, 1) - 1
    peak = blocks_for_one_request(groups, seq, chunk) - 1
    prefilling = cdiv(runner.config.max_num_tokens, chunk) + 1
    batch = max(1, min(args.max_batch, (runner.num_blocks - 1 - prefilling * (peak - steady)) // steady))
    limited_by = "kv blocks" if batch < args.max_batch else "max_batch"
    # Kept back for the profile (when it runs: a step short of the roofline, where it tells most) and the exit.
    profile_s = min(20.0, 0.2 * args.time_budget) if args.time_budget and args.profile != "never" else 0.0
    after = profile_s + min(5.0, 0.05 * args.time_budget) if args.time_budget else 0.0
    measured = res.data["rows"].get("latency", []) + res.data["rows"].get("long_context", [])
    batch, output_len, cut = fit_throughput_point(
        config, measured, batch, args.throughput_len, left() - after, kv_bytes
    )
    if cut:
        res.note(cut)
    preempted_before = llm.engine.stats().num_preemptions
    total_s, outs = timed(lambda: generate(random_prompts(batch, args.throughput_len, vocab, rng), output_len))
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    row = dict(batch=batch, input_len=args.throughput_len, output_len=output_len, total_s=total_s)
    row["preemptions"] = llm.engine.stats().num_preemptions - preempted_before  # 0: the batch fit the pool
    row.update(output_tok_s_gpu=produced / total_s, limited_by=limited_by if not cut else "the step's time")
    _flag_short_outputs(row, produced, batch * output_len)
    if args.bandwidth_gbps:
        bytes_ = step_bytes(config, batch, args.throughput_len + output_len // 2, kv_bytes)["total"]
        roofline = args.bandwidth_gbps * 1e9 / bytes_ * batch  # decode steps only: prefill is not counted
        row.update(step_gb=bytes_ / 1e9, roofline_tok_s=roofline, roofline_fraction=row["output_tok_s_gpu"] / roofline)
        # The run includes the prompts' prefill, which the decode roofline does not: the fraction over the decode
        # time alone, with the prefill timed at the latency rows' best prefill rate (an estimate).
        prefill_s = estimated_prefill_s(measured, batch * args.throughput_len)
        if prefill_s is not None and total_s > prefill_s:
            row.update(
                prefill_s_estimated=prefill_s,
                roofline_fraction_decode=produced / (total_s - prefill_s) / roofline,
            )
    res.add("throughput", row)

    latency = res.data["rows"].get("latency", [])
    short = args.profile == "short" and bool(latency) and _short_of_roofline(latency[0])
    if args.profile == "always" or short:
        if left() < profile_s:
            res.note("per-kernel profile not run: no time left in the step")
        else:
            for row in profile_decode(llm, vocab, torch):
                res.add("profile", row)


def estimated_prefill_s(latency: list[dict[str, Any]], tokens: int) -> float | None:
    """Seconds to prefill `tokens` at the best prefill rate the latency rows measured (None: no row measured one)."""
    rates = [r["batch"] * r["input_len"] / r["prefill_s"] for r in latency if r.get("prefill_s", 0) > 0]
    return tokens / max(rates) if rates else None


def fit_throughput_point(
    config: dict[str, Any],
    latency: list[dict[str, Any]],
    batch: int,
    length: int,
    seconds: float,
    kv_bytes: float = KV_BYTES,
) -> tuple[int, int, str]:
    """(sequences, output tokens, note) of a throughput point of `batch` x `length` in / `length` out that fits in
    `seconds`, estimated from the latency rows: prefill at their best tokens/s, decode steps at the largest batch's
    step time scaled by the bytes a step reads (the roofline's proportion). Output tokens are cut first (down to
    128), then sequences (halved, down to 8). No limit: the point as asked; no latency rows to estimate from: a
    quarter of its sequences (down to 8) and of its output tokens (down to 128) rather than the whole point."""
    rows = [r for r in latency if r["total_s"] > r["prefill_s"] and r["prefill_s"] > 0]
    if seconds == float("inf"):
        return batch, length, ""
    if not rows:
        b, out = max(min(batch, 8), batch // 4), max(min(length, 128), length // 4)
        if (b, out) == (batch, length):
            return batch, length, ""
        return (
            b,
            out,
            (
                f"throughput point cut from {batch} x {length}/{length} to {b} sequences x {length} in / {out} out "
                f"(a quarter of each): no latency row to estimate its time from, {max(seconds, 0):.0f} s left"
            ),
        )
    last = max(rows, key=lambda r: r["batch"])
    step_s = (last["total_s"] - last["prefill_s"]) / max(1, last["output_len"] - 1)
    last_bytes = step_bytes(config, last["batch"], last["input_len"], kv_bytes)["total"]

    def estimate(b: int, out: int) -> float:
        step = step_s * step_bytes(config, b, length + out // 2, kv_bytes)["total"] / last_bytes
        prefill_s = estimated_prefill_s(rows, b * length)
        assert prefill_s is not None  # rows all measured a prefill
        return prefill_s + out * step

    wanted = estimate(batch, length)
    b, out = batch, length
    while estimate(b, out) > seconds and out > 128:
        out = max(128, out // 2)
    while estimate(b, out) > seconds and b > 8:
        b = max(8, b // 2)
    if (b, out) == (batch, length):
        return batch, length, ""
    return (
        b,
        out,
        (
            f"throughput point cut from {batch} x {length}/{length} (estimated {wanted:.0f} s) to {b} sequences x "
            f"{length} in / {out} out, to fit the {max(seconds, 0):.0f} s the step had left"
        ),
    )


def _flag_short_outputs(row: dict[str, Any], produced: int, expected: int) -> None:
    """A request that ends early (non-finite logits end it with an error) makes every rate of its row wrong."""
    if produced != expected:
        row["missing_tokens"] = expected - produced


def _short_of_roofline(row: dict[str, Any], target: float = 0.7) -> bool:
    return row.get("roofline_fraction", 0.0) < target


def profile_decode(llm, vocab: int, torch, steps: int = 16, top: int = 15) -> list[dict[str, Any]]:
    """Per-kernel share of decode steps at batch 1 (torch profiler; an 8-token prompt so decode dominates)."""
    from torch.profiler import ProfilerActivity, profile

    from brisk import SamplingParams

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prompt = [{"prompt_token_ids": list(range(10, 18))}]
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    with profile(activities=activities) as prof:
        llm.generate(prompt, params, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()

    def self_us(event) -> float:
        if cuda:
            device_us = getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0)
            return float(device_us or 0.0)
        return float(event.self_cpu_time_total)

    events = [e for e in prof.key_averages() if self_us(e) > 0]
    if cuda:  # kernels only: events with device time and no CPU op wrapped around them are the kernels themselves
        events = [e for e in events if getattr(e, "device_type", None) is None or "CUDA" in str(e.device_type)]
    total = sum(self_us(e) for e in events) or 1.0
    rows = sorted(events, key=self_us, reverse=True)[:top]
    return [
        dict(
            kernel=e.key[:80],
            calls=e.count,
            us_per_step=self_us(e) / steps,
            share=self_us(e) / total,
            time="device" if cuda else "cpu",
        )
        for e in rows
    ]


def run_hf(args: argparse.Namespace, config: dict[str, Any], model_dir: str) -> None:
    """transformers' generate on the same dummy model at batch 1: the naive baseline (bf16 experts on a GPU:
    transformers' MXFP4 path needs the `kernels` package and a hub download)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    res = Results(args.out, model=args.model, engine="transformers", device=_device_name(torch))
    hf_config = AutoConfig.from_pretrained(model_dir)
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        load_s, model = timed(lambda: AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval())
    res.data["meta"].update(load_s=load_s, weights="bf16" if dtype == torch.bfloat16 else "fp32")
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(10, config["vocab_size"] - 10) for _ in range(args.input_len)]], device=device)

    def generate(n: int):
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    generate(2)
    prefill_s, _ = timed(lambda: generate(1))
    total_s, out = timed(lambda: generate(args.output_len))
    produced = out.shape[1] - ids.shape[1]
    res.add(
        "latency",
        dict(
            batch=1,
            input_len=args.input_len,
            output_len=produced,
            total_s=total_s,
            prefill_s=prefill_s,
            tok_s_user=(produced - 1) / max(total_s - prefill_s, 1e-9),
            output_tok_s=produced / total_s,
        ),
    )


def _device_name(torch) -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", choices=["brisk", "hf"])
    p.add_argument("--model", required=True, help="gpt-oss-20b, gpt-oss-120b or tiny-gpt-oss")
    p.add_argument("--models-dir", default="/tmp/brisk-suite-models", help="where the dummy model folders are written")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=_ints, default=[1, 4, 8, 16])
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--long-context", type=int, default=0, help="prompt tokens of the long-context row (0: none)")
    p.add_argument("--long-batch", type=int, default=16, help="sequences of the long-context row")
    p.add_argument("--throughput-len", type=int, default=1024, help="tokens in and out of the throughput run")
    p.add_argument("--kv-cache-dtype", default="auto", help="brisk's kv_cache_dtype (auto: the model's)")
    p.add_argument(
        "--kv-cache-bytes", type=int, help="the KV pool's bytes (kv_cache_config.max_gpu_total_bytes; RAM on a CPU)"
    )
    p.add_argument("--max-batch", type=int, default=512, help="max_batch_size of the engine")
    p.add_argument("--max-num-tokens", type=int, help="engine max_num_tokens (default: brisk's)")
    p.add_argument("--bandwidth-gbps", type=float, help="measured copy bandwidth (phase a) for the roofline")
    p.add_argument("--profile", choices=["never", "short", "always"], default="short")
    p.add_argument("--graph-sizes", type=_ints, help="CUDA graph batch sizes (default: brisk's ladder)")
    p.add_argument(
        "--time-budget",
        type=float,
        help="seconds this run may take from its start: batches are skipped and the throughput point cut to fit",
    )
    args = p.parse_args(argv)
    args.started = started
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from suite_models import model_config, write_model_dir

    written = time.perf_counter()
    model_dir = write_model_dir(args.model, args.models_dir)
    args.model_dir_s = time.perf_counter() - written  # a row of its own, not the cold start's imports
    (run_brisk if args.engine == "brisk" else run_hf)(args, model_config(args.model), model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
