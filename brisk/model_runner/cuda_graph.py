"""Decode steps on static buffers: CUDA graphs on a GPU, the same padded buffers without capture on a CPU.

trtllm's semantics for `cuda_graph_config`: decode-only steps (every request computes one token and samples)
of up to the largest of `batch_sizes` requests run on static input buffers, padded up to the next size when
`enable_padding` (else only exact sizes); larger or mixed (prefill) steps run eagerly. On a GPU each size is
captured once at start-up (warm-up run, then `torch.cuda.CUDAGraph` capture into one shared memory pool) and a
step is a copy of its inputs into the buffers plus one replay; on a CPU the padded buffers are all there is,
which is what CI tests of this path run.

Padding rows read and write only the null block: input token 0 at position 0, one slot of block 0, a context of
one token, block table rows of zeros. Whatever a padding row computes is never sampled and lands in block 0,
which no request owns.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from brisk.config import CudaGraphConfig, EngineConfig
from brisk.layers.attention import AttentionMetadata
from brisk.model_runner.input_batch import to_device

if TYPE_CHECKING:
    from brisk.model_runner.runner import ModelRunner, StepBatch

logger = logging.getLogger(__name__)


def effective_graph_config(config: EngineConfig, device: torch.device) -> CudaGraphConfig | None:
    """The cuda_graph_config in effect. On a CPU only one given explicitly runs decode steps on the padded static
    buffers: there is nothing to capture, and padding rows cost real compute (gpt-oss: the experts they route to)."""
    if device.type != "cuda" and "cuda_graph_config" not in config.model_fields_set:
        return None
    return config.cuda_graph_config


def graph_batch_sizes(config: CudaGraphConfig, max_rows: int) -> list[int]:
    """The captured batch sizes: the configured list, or trtllm's default ladder up to max_batch_size."""
    if config.batch_sizes:
        sizes = set(config.batch_sizes)
    else:
        top = min(config.max_batch_size, max_rows)
        sizes = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | ({top} if top else set())
    return sorted(s for s in sizes if 0 < s <= max_rows)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, sizes: list[int], enable_padding: bool, capture: bool) -> None:
        self.sizes = sizes
        self.enable_padding = enable_padding
        self.capture = capture
        self.max_size = sizes[-1]
        dev = runner.device
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.slot_mappings = [torch.zeros(n, dtype=torch.int64, device=dev) for _ in runner.kv_groups]
        self.max_blocks = runner.batch.block_tables[0].shape[1]
        self.block_tables = [torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev) for _ in runner.kv_groups]
        # What padding rows compute (tests poison these): their slots stay in the null block whatever they are.
        self.pad_input_id = 0
        self.pad_position = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_hidden: dict[int, torch.Tensor] = {}
        self._graph_meta: dict[int, AttentionMetadata] = {}

    def padded_size(self, step: StepBatch) -> int | None:
        """The static size this step runs at, or None to run it eagerly."""
        return self.padded_size_of(step.num_rows, step.num_tokens, step.num_sampled)

    def padded_size_of(self, num_rows: int, num_tokens: int, num_sampled: int) -> int | None:
        """The same from a SchedulerOutput's counts: every attention-DP rank knows every rank's padded size."""
        b = num_rows
        if num_tokens != b or num_sampled != b or b > self.max_size or not b:
            return None
        i = bisect.bisect_left(self.sizes, b)
        if self.sizes[i] == b or self.enable_padding:
            return self.sizes[i]
        return None

    def _meta(
        self, runner: ModelRunner, b: int, padded: int, width: int, dp_num_tokens: list[int] | None = None
    ) -> AttentionMetadata:
        meta = AttentionMetadata(
            query_start_loc=list(range(padded + 1)),
            seq_lens=[],  # filled below on the host path; the graph path reads the tensors
            block_tables=[t[:padded, :width] for t in self.block_tables],
            slot_mappings=[s[:padded] for s in self.slot_mappings],
            block_size=runner.block_size,
            seq_lens_tensor=self.seq_lens[:padded],
            query_start_loc_tensor=self.query_start_loc[: padded + 1],
            max_seq_len=runner.max_seq_len,
            decode_only=True,
            dp_num_tokens=dp_num_tokens,
        )
        return meta

    def run(self, runner: ModelRunner, step: StepBatch, padded: int) -> torch.Tensor:
        """Copy the step into the buffers, pad, run (replay on a GPU); returns the real rows' hidden states."""
        b, dev = step.num_rows, runner.device
        self.input_ids[:b].copy_(to_device(step.input_ids_host, dev), non_blocking=True)
        if len(step.placeholder_idx):
            idx = to_device(step.placeholder_idx, dev)
            rows = to_device(step.token_rows[step.placeholder_idx], dev)
            self.input_ids[idx] = runner.batch.last_sampled[rows]
        self.positions[:b].copy_(to_device(step.positions, dev), non_blocking=True)
        self.seq_lens[:b].copy_(to_device(step.seq_lens, dev), non_blocking=True)
        width = self.max_blocks if self.capture else max(1, step.block_tables[0].shape[1])
        for g in range(len(self.slot_mappings)):
            self.slot_mappings[g][:b].copy_(to_device(step.slot_mappings[g], dev), non_blocking=True)
            table = step.block_tables[g]
            self.block_tables[g][:b, : table.shape[1]].copy_(to_device(table, dev), non_blocking=True)
        if padded > b:
            self.input_ids[b:padded] = self.pad_input_id
            self.positions[b:padded] = self.pad_position
            self.seq_lens[b:padded] = 1
            for g in range(len(self.slot_mappings)):
                self.slot_mappings[g][b:padded] = 0  # slot 0 of the null block
                self.block_tables[g][b:padded, :width] = 0
        if self.capture:
            self._graphs[padded].replay()
            return self._graph_hidden[padded][:b]
        meta = self._meta(runner, b, padded, width, step.dp_num_tokens)
        meta.seq_lens = step.seq_lens.tolist() + [1] * (padded - b)
        meta.attn_plan = runner.attention_backend.prepare(meta)
        step.meta = meta
        return runner.model(self.input_ids[:padded], self.positions[:padded], meta)[:b]

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def capture_all(self, runner: ModelRunner) -> None:
        """Capture one graph per size, largest first, sharing one memory pool; log the time and memory."""
        if not self.capture:
            return
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(runner.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=runner.device)
        for size in reversed(self.sizes):
            meta = self._meta(runner, size, size, self.max_blocks)
            meta.seq_lens = [1] * size
            meta.attn_plan = runner.attention_backend.prepare(meta)
            self._graph_meta[size] = meta
            args = (self.input_ids[:size], self.positions[:size], meta)
            stream.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: autotuning, lazy allocations, workspace sizes
                    runner.model(*args)
            torch.cuda.current_stream(runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._graph_hidden[size] = runner.model(*args)
            self._graphs[size] = graph
        torch.cuda.synchronize(runner.device)
        free_after, _ = torch.cuda.mem_get_info(runner.device)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s, %.1f MiB of graph memory",
            len(self.sizes),
            self.sizes,
            time.perf_counter() - start,
            (free_before - free_after) / 2**20,
        )
