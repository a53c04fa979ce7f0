"""Decode steps on static buffers: CUDA graphs on a GPU, the same padded buffers without capture on a CPU.

trtllm's semantics for `cuda_graph_config`: decode-only steps (every request computes one token and samples)
of up to the largest of `batch_sizes` requests run on static input buffers, padded up to the next size when
`enable_padding` (else only exact sizes); larger or mixed (prefill) steps run eagerly. With speculative decoding
the verification steps join them: every request computes its last token and k drafts (k = max_draft_len; the
runner pads shorter draft lists to k, as trtllm does, since any draft keeps the output exact), so a step of B
requests is B x (k + 1) tokens on its own set of buffers and graphs. On a GPU each size is
captured once at start-up (warm-up run, then `torch.cuda.CUDAGraph` capture into one shared memory pool) and a
step is a copy of its inputs into the buffers plus one replay; on a CPU the padded buffers are all there is,
which is what CI tests of this path run. tests/test_rehearsed_gpu_path.py also rehearses the GPU's way on the CPU:
the Triton backends bound, each shape's capture call (`capture_args`) made once and repeated as its replay, and
no host synchronisation inside it.

Under attention data parallelism the MoE layers gather every DP rank's rows, so the ranks' steps must have one
shape for a captured graph to hold: a decode step runs on the static buffers only when every rank's does, at the
largest of their padded sizes (`common_shape`; each rank knows every rank's SchedulerOutput, so they agree without
exchanging anything), and every rank's MoE gathers and scatters that many rows. A rank with nothing scheduled
joins with padding rows only; while any rank runs a mixed or oversized step, every rank runs eagerly.

Padding rows read and write only the null block: input token 0 at position 0, one slot of block 0, a context of
as many tokens as the row computes, block table rows of zeros. Whatever a padding row computes is never sampled and lands in block 0,
which no request owns.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from brisk.config import EngineConfig
from brisk.host import to_device
from brisk.layers.attention import AttentionBackend, AttentionMetadata
from brisk.model_runner.layout import StepBatch
from brisk.model_runner.memory import out_of_memory_as
from brisk.option_groups import CudaGraphConfig
from brisk.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from brisk.models.registry import BriskModel

logger = logging.getLogger(__name__)


def effective_graph_config(config: EngineConfig, device: torch.device) -> CudaGraphConfig | None:
    """The cuda_graph_config in effect. On a CPU only one given explicitly runs decode steps on the padded static
    buffers: there is nothing to capture, and padding rows cost real compute (gpt-oss: the experts they route to)."""
    if device.type != "cuda" and "cuda_graph_config" not in config.model_fields_set:
        return None
    return config.cuda_graph_config


def graph_batch_sizes(config: CudaGraphConfig, max_rows: int, every_size_up_to: int = 0) -> list[int]:
    """The captured batch sizes: the configured list, or trtllm's default ladder up to max_batch_size, with every
    size up to `every_size_up_to` besides (vLLM's performance_mode interactivity: no padding at low concurrency)."""
    if config.batch_sizes:
        sizes = set(config.batch_sizes)
    else:
        top = min(config.max_batch_size, max_rows)
        sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | ({top} if top else set())
        sizes |= set(range(1, min(every_size_up_to, top) + 1))
    return sorted(s for s in sizes if 0 < s <= max_rows)


@dataclass(frozen=True)
class GraphedModel:
    """What the static-buffer steps run: the model, its bound attention backend, and the KV layout's shape."""

    model: BriskModel
    attention: AttentionBackend
    device: torch.device
    max_seq_len: int
    max_blocks_per_row: tuple[int, ...]  # per KV group (groups differ in tokens a block)


def aux_hidden_states(model: BriskModel) -> list[torch.Tensor] | None:
    """EAGLE3 targets: the hidden states entering three layers that the last forward kept (None for others)."""
    aux = getattr(getattr(model, "model", None), "aux_hidden_states", None)
    return list(aux) if aux else None


class Replayable(Protocol):
    def replay(self) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Run the captured step again on the static buffers' current contents: (hidden states of every padded
        row, EAGLE3's aux hidden states or None)."""
        ...


@dataclass(frozen=True)
class CapturedGraph:
    """One captured CUDA graph and the outputs its replay refills in place."""

    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor
    aux: list[torch.Tensor] | None
    meta: AttentionMetadata  # held: the attention plans the graph reads live on it

    def replay(self) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        self.graph.replay()
        return self.hidden, self.aux


class DecodeGraphs:
    def __init__(
        self,
        target: GraphedModel,
        sizes: list[int],
        enable_padding: bool,
        capture: bool,
        verify_len: int = 1,
        dp_size: int = 1,
    ) -> None:
        """verify_len: tokens a speculative verification step computes per request (1 + max_draft_len; 1: none).
        dp_size: attention-DP ranks (each captures its graphs with every rank's MoE rows at the graph's size)."""
        self.target = target
        self.dp_size = dp_size
        self.sizes = sizes
        self.enable_padding = enable_padding
        self.capture = capture
        self.max_size = sizes[-1]
        self.query_lens = [1] + ([verify_len] if verify_len > 1 else [])  # tokens per request of a static step
        dev = target.device
        n = self.max_size
        tokens = n * self.query_lens[-1]
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = {
            t: torch.arange(0, (n + 1) * t, t, dtype=torch.int32, device=dev) for t in self.query_lens
        }
        self.slot_mappings = [torch.zeros(tokens, dtype=torch.int64, device=dev) for _ in target.max_blocks_per_row]
        self.max_blocks = target.max_blocks_per_row
        self.block_tables = [torch.zeros(n, width, dtype=torch.int32, device=dev) for width in self.max_blocks]
        # What padding rows compute (tests poison these): their slots stay in the null block whatever they are.
        self.pad_input_id = 0
        self.pad_position = 0
        self.captured: dict[tuple[int, int], Replayable] = {}  # by (requests, tokens per request)

    def padded_shape(self, step: StepBatch) -> tuple[int, int] | None:
        """(padded requests, tokens per request) this step runs at, or None to run it eagerly."""
        return self.padded_shape_of(np.diff(step.query_start_loc), step.num_sampled)

    def padded_shape_of(self, query_lens: Sequence[int] | np.ndarray, num_sampled: int) -> tuple[int, int] | None:
        """The same from a SchedulerOutput's counts: every attention-DP rank knows every rank's padded shape."""
        b = len(query_lens)
        if num_sampled != b or b > self.max_size or not b:
            return None
        t = int(query_lens[0])
        if t not in self.query_lens or any(int(n) != t for n in query_lens):
            return None
        i = bisect.bisect_left(self.sizes, b)
        if self.sizes[i] == b or self.enable_padding:
            return self.sizes[i], t
        return None

    def common_shape(self, scheds: list[SchedulerOutput]) -> tuple[int, int] | None:
        """Attention DP: the shape every rank's step runs at, the largest of the working ranks' padded shapes (ranks
        with nothing scheduled join with padding rows), or None: every rank runs eagerly (some rank's step does not
        fit the buffers, or the ranks' steps compute different tokens per request)."""
        shapes = [
            self.padded_shape_of(list(s.num_scheduled_tokens.values()), s.num_sampled_requests)
            for s in scheds
            if s.num_scheduled_tokens
        ]
        if not shapes or None in shapes or len({shape[1] for shape in shapes if shape is not None}) > 1:
            return None
        return max(shape for shape in shapes if shape is not None)

    def dp_num_tokens(self, padded: int, t: int) -> list[int] | None:
        """Every DP rank's rows at a static shape (None without attention DP)."""
        return [padded * t] * self.dp_size if self.dp_size > 1 else None

    def _meta(self, padded: int, t: int, widths: Sequence[int]) -> AttentionMetadata:
        meta = AttentionMetadata(
            query_start_loc=list(range(0, (padded + 1) * t, t)),
            seq_lens=[],  # filled below on the host path; the graph path reads the tensors
            block_tables=[table[:padded, :width] for table, width in zip(self.block_tables, widths)],
            slot_mappings=[s[: padded * t] for s in self.slot_mappings],
            seq_lens_tensor=self.seq_lens[:padded],
            query_start_loc_tensor=self.query_start_loc[t][: padded + 1],
            max_seq_len=self.target.max_seq_len,
            decode_only=t == 1,
            static_query_len=t,
            dp_num_tokens=self.dp_num_tokens(padded, t),
        )
        return meta

    def run(self, step: StepBatch, last_sampled: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """Copy the step into the buffers (placeholders from `last_sampled`, the batch's last token per row), pad,
        run (replay on a GPU); returns the real tokens' hidden states (the real requests come first, each with t
        tokens: their layout is the step's own). A step of no rows (an idle attention-DP rank) runs padding only."""
        (padded, t), b, dev = shape, step.num_rows, self.target.device
        n = b * t  # the step's tokens
        self.input_ids[:n].copy_(to_device(step.input_ids_host, dev), non_blocking=True)
        if len(step.placeholder_idx):
            idx = to_device(step.placeholder_idx, dev)
            rows = to_device(step.token_rows[step.placeholder_idx], dev)
            self.input_ids[idx] = last_sampled[rows]
        self.positions[:n].copy_(to_device(step.positions, dev), non_blocking=True)
        self.seq_lens[:b].copy_(to_device(step.seq_lens, dev), non_blocking=True)
        widths = self.max_blocks if self.capture else [max(1, table.shape[1]) for table in step.block_tables]
        for g in range(len(self.slot_mappings)):
            self.slot_mappings[g][:n].copy_(to_device(step.slot_mappings[g], dev), non_blocking=True)
            table = step.block_tables[g]
            self.block_tables[g][:b, : table.shape[1]].copy_(to_device(table, dev), non_blocking=True)
        if padded > b:
            self.input_ids[n : padded * t] = self.pad_input_id
            self.positions[n : padded * t] = self.pad_position
            self.seq_lens[b:padded] = t
            for g in range(len(self.slot_mappings)):
                self.slot_mappings[g][n : padded * t] = 0  # slot 0 of the null block
                self.block_tables[g][b:padded, : widths[g]] = 0
        # What an EAGLE3 drafter reads of the step (its first pass runs over the step's own tokens): the metadata
        # of the real requests as an eager step has it, on these buffers.
        step.meta = AttentionMetadata(
            query_start_loc=step.query_start_loc.tolist(),
            seq_lens=step.seq_lens.tolist(),
            block_tables=[table[:b, : real.shape[1]] for table, real in zip(self.block_tables, step.block_tables)],
            slot_mappings=[s[:n] for s in self.slot_mappings],
        )
        if self.capture:
            hidden, aux = self.captured[padded, t].replay()
            if aux is not None:  # the replay refilled the captured aux tensors
                decoder: Any = self.target.model.model  # llama.py's DecoderModel (EAGLE3 targets are CausalLMs)
                decoder.aux_hidden_states = aux
            return hidden[:n]
        meta = self._meta(padded, t, widths)
        meta.seq_lens = step.seq_lens.tolist() + [t] * (padded - b)
        meta.plan_for(self.target.attention)
        return self.target.model(self.input_ids[: padded * t], self.positions[: padded * t], meta)[:n]

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def graph_shapes(self) -> list[tuple[int, int]]:
        """(requests, tokens per request) of every graph, in capture order: most tokens first (a verify graph of
        k + 1 tokens a request before the decode graphs it outgrows), so that the smaller ones reuse the pool's
        memory."""
        shapes = [(size, t) for t in self.query_lens for size in self.sizes]
        return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape[1]), reverse=True)

    def capture_args(self, size: int, t: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The model's arguments that one graph captures: views of the static buffers and metadata whose attention
        plan is built from the shape alone (the backend's plans are made at the first layer of the warm-up call and
        hold for the capture and every replay)."""
        meta = self._meta(size, t, self.max_blocks)
        meta.seq_lens = [t] * size
        self.seq_lens[:size] = t
        meta.plan_for(self.target.attention)
        return self.input_ids[: size * t], self.positions[: size * t], meta

    def capture_all(self) -> None:
        """Capture one graph per size, largest first, sharing one memory pool; log the time and memory."""
        if not self.capture:
            return
        model, device = self.target.model, self.target.device
        start = time.perf_counter()
        # What torch's allocator caches (the profiling step's KV, freed since) counts as free: each capture empties
        # the cache anyway, so "graph memory" measured from a full cache would come out short.
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info(device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        shapes = self.graph_shapes()
        advice = (
            f"capturing CUDA graphs of batch sizes {self.sizes} ran out of GPU memory left beside the KV pool "
            f"({free_before / 2**30:.2f} GiB free before the first capture): lower kv_cache_free_gpu_memory_fraction "
            "(vLLM: --gpu-memory-utilization), capture fewer or smaller sizes (cuda_graph_config.batch_sizes, "
            "max_batch_size), or run without graphs (cuda_graph_config: null; vLLM: --enforce-eager)"
        )
        with out_of_memory_as(lambda: advice):
            for size, t in shapes:
                args = self.capture_args(size, t)
                meta = args[2]
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: autotuning, lazy allocations, workspace sizes
                        model(*args)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    hidden = model(*args)
                self.captured[size, t] = CapturedGraph(graph, hidden, aux_hidden_states(model), meta)
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s, tokens per request %s) in %.1f s, %.1f MiB of graph memory",
            len(shapes),
            self.sizes,
            self.query_lens,
            time.perf_counter() - start,
            (free_before - free_after) / 2**20,
        )
