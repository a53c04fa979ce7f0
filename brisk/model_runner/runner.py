"""ModelRunner: owns the model and the KV cache tensors; turns a SchedulerOutput into sampled tokens.

KV memory layout: layers are grouped by attention type (`kv_groups`). Slot tensor j holds the KV of the
j-th layer of every group, so one block id means the same memory in all groups and all groups share
one `BlockPool`; a block's bytes are `num_slots * 2 * block_size * kv_heads * head_dim * dtype`.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist

from brisk.config import EngineConfig, ModelConfig, ParallelConfig
from brisk.distributed.comm import agree_min, all_gather_rows
from brisk.kernels.cpu_kernels import load_cpu_kernels
from brisk.kv_cache.manager import KVCacheManager, KVGroupSpec, cdiv
from brisk.layers.attention import Attention, AttentionMetadata, make_attention_backend
from brisk.layers.linear import prepack_weights
from brisk.model_runner.loader import load_model
from brisk.model_runner.memory import KVGroupLayout, log_plan, measure_profile_run, plan_kv_cache, profile_batch_shape
from brisk.model_runner.sampler import Sampler, SamplerOutput, SamplingBatch
from brisk.scheduler.request import Request
from brisk.scheduler.scheduler import SchedulerOutput

CPU_KV_CACHE_CAP_BYTES = 2 << 30  # a CPU box runs small models; never take more than this by default


def kv_groups_for(model_config: ModelConfig) -> list[KVGroupSpec]:
    groups = []
    for kind in ("full_attention", "sliding_attention"):
        layers = tuple(i for i, t in enumerate(model_config.layer_types) if t == kind)
        if layers:
            window = model_config.sliding_window if kind == "sliding_attention" else None
            groups.append(KVGroupSpec(layers, window))
    return groups


class StepInput(msgspec.Struct, array_like=True):
    """One step's model input for one (data-parallel) rank: flat tokens plus the paged-KV addressing.
    Rank 0 builds it and, with several ranks, publishes it to them: plain lists encode fast with msgspec."""

    input_ids: list[int]
    positions: list[int]
    query_start_loc: list[int]  # [B+1]
    seq_lens: list[int]  # [B]
    block_tables: list[list[list[int]]]  # per KV group, per sequence (ragged)
    slot_mappings: list[list[int]]  # per KV group: [T]
    logits_indices: list[int]  # rows of the hidden states that sample a token


@dataclass
class StepResult:
    sampled: dict[Request, int]
    sampler_output: SamplerOutput | None
    rows: list[Request]  # request of each sampler row
    failed: list[Request] = field(default_factory=list)  # rows whose logits were not finite


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """torch threads for one CPU rank of a served model (see EngineConfig.num_cpu_threads): the cores but one,
    shared among the ranks. The one left is the API server's (and a local client's): when every core runs an
    OpenMP thread, each token the server streams preempts one of them while the others spin at the next barrier
    (measured: docs/performance.md)."""
    if config.num_cpu_threads is not None:
        return config.num_cpu_threads
    return max(1, ((os.cpu_count() or 1) - 1) // config.tp_size)


def keep_freed_memory_in_the_heap() -> bool:
    """glibc returns big freed blocks to the OS (mmap / trim), so each step's big activations are faulted in
    page by page again: on CPU that doubled the first matmul at a new shape and slowed served prefill steps
    (docs/performance.md). Raise both thresholds to 1 GiB, once, for this process. glibc only (False elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


class ModelRunner:
    """One rank's model and KV cache. `cpu_group` (a gloo group) is where ranks agree on the KV size."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        max_seq_len: int,
        parallel: ParallelConfig = ParallelConfig(),
        cpu_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.model_config = model_config
        self.device = device
        self.parallel = parallel
        self.block_size = config.block_size
        self.model = load_model(
            model_config,
            load_format=config.load_format,
            device=device,
            moe_backend=config.moe_config.backend,
            parallel=parallel,
        )
        self.model.eval()
        self.cpu_kernels = None
        if device.type == "cpu":
            keep_freed_memory_in_the_heap()
            if config.cpu_weight_prepack:
                prepack_weights(self.model)
            self.cpu_kernels = load_cpu_kernels(config.cpu_kernels)
            for module in self.model.modules():  # linears, LM head, norms, MoE layers
                if hasattr(module, "cpu_kernels"):
                    module.cpu_kernels = self.cpu_kernels
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        attention_backend = make_attention_backend(config.attn_backend, device, self.cpu_kernels)
        for layer in self.attn_layers:
            layer.backend = attention_backend
        self.kv_groups = kv_groups_for(model_config)
        if device.type == "cuda" and config.kv_cache_config.max_blocks is None:
            self.num_blocks = self._num_kv_blocks_by_profiling()  # brisk/model_runner/memory.py
        else:
            self.num_blocks = self._num_kv_blocks()
        if parallel.world_size > 1:  # one block id addresses the same tokens on every rank
            self.num_blocks = agree_min(self.num_blocks, cpu_group)
        self._allocate_kv_cache()
        self.sampler = Sampler(self.cpu_kernels)

    # ---- KV cache ------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return max(len(g.layer_ids) for g in self.kv_groups)

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (a share of them under TP, one when they are replicated)."""
        return self.attn_layers[0].num_kv_heads

    @property
    def bytes_per_block(self) -> int:
        mc = self.model_config
        elt = torch.empty((), dtype=mc.dtype).element_size()
        return self.num_slots * 2 * self.block_size * self.num_kv_heads * mc.head_dim * elt

    def _num_kv_blocks(self) -> int:
        if self.config.kv_cache_config.max_blocks is not None:
            return self.config.kv_cache_config.max_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.memory_fraction
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(available * self.config.memory_fraction, CPU_KV_CACHE_CAP_BYTES)
        # More blocks than a full batch of max-length requests could ever hold is wasted memory.
        most_useful = len(self.kv_groups) * cdiv(self.max_seq_len, self.block_size) * self.config.max_batch_size + 1
        return max(2, min(int(budget // self.bytes_per_block), most_useful))

    def _num_kv_blocks_by_profiling(self) -> int:
        """One forward pass at max_num_tokens on a temporary cache just big enough for it, measured; the pool gets
        kv_cache_free_gpu_memory_fraction of what is left (memory.py). Graph capture joins the profile once the
        runner captures graphs."""
        weights = torch.cuda.memory_allocated(self.device)
        lengths = profile_batch_shape(self.config.max_num_tokens, self.config.max_batch_size)
        tables: list[list[int]] = []
        slots: list[int] = []
        start = 1  # block 0 is the null block
        for n in lengths:
            table = list(range(start, start + cdiv(n, self.block_size)))
            start += len(table)
            tables.append(table)
            slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size for p in range(n))
        self.num_blocks = start
        self._allocate_kv_cache()
        ends = list(itertools.accumulate(lengths))
        step = StepInput(
            input_ids=[i % self.model_config.vocab_size for i in range(ends[-1])],
            positions=[p for n in lengths for p in range(n)],
            query_start_loc=[0, *ends],
            seq_lens=lengths,
            block_tables=[tables for _ in self.kv_groups],  # every group's layers write the same blocks' slots
            slot_mappings=[slots for _ in self.kv_groups],
            logits_indices=[e - 1 for e in ends],
        )
        measured = measure_profile_run(self.device, weights, lambda: self.forward([step] * self.parallel.dp_size))
        for (
            layer
        ) in self.attn_layers:  # free the temporary cache (allocated before the profile's baseline: not counted)
            layer.k_cache = layer.v_cache = torch.empty(0)
        groups = [
            KVGroupLayout(
                "sliding_attention" if g.sliding_window else "full_attention", len(g.layer_ids), g.sliding_window
            )
            for g in self.kv_groups
        ]
        plan = plan_kv_cache(
            measured,
            fraction=self.config.memory_fraction,
            bytes_per_block=self.bytes_per_block,
            block_size=self.block_size,
            groups=groups,
            max_seq_len=self.max_seq_len,
            max_num_tokens=self.config.max_num_tokens,
        )
        log_plan(plan)
        most_useful = len(self.kv_groups) * cdiv(self.max_seq_len, self.block_size) * self.config.max_batch_size + 1
        return min(plan.num_blocks, most_useful)

    def _allocate_kv_cache(self) -> None:
        mc = self.model_config
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, mc.head_dim)
        slots = [
            (
                torch.zeros(shape, dtype=mc.dtype, device=self.device),
                torch.zeros(shape, dtype=mc.dtype, device=self.device),
            )
            for _ in range(self.num_slots)
        ]
        for g, group in enumerate(self.kv_groups):
            for j, layer_id in enumerate(group.layer_ids):
                layer = self.attn_layers[layer_id]
                layer.k_cache, layer.v_cache = slots[j]
                layer.kv_group = g

    def make_kv_manager(self) -> KVCacheManager:
        return KVCacheManager(self.kv_groups, self.num_blocks, self.block_size, self.config.enable_prefix_caching)

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, kv: KVCacheManager) -> tuple[StepInput, list[Request]]:
        """Flatten a scheduled batch into the step's model input; also returns the request of each sampled row."""
        step = StepInput([], [], [0], [], [[] for _ in self.kv_groups], [[] for _ in self.kv_groups], [])
        rows: list[Request] = []
        bs = self.block_size
        for s in sched.scheduled:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            step.input_ids.extend(req.all_token_ids[start:end])
            step.positions.extend(range(start, end))
            step.query_start_loc.append(step.query_start_loc[-1] + s.num_new_tokens)
            step.seq_lens.append(end)
            for g, table in enumerate(kv.tables[req.request_id]):
                step.block_tables[g].append(table)
                step.slot_mappings[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.samples:
                step.logits_indices.append(step.query_start_loc[-1] - 1)
                rows.append(req)
        return step, rows

    @torch.inference_mode()
    def forward(self, inputs: list[StepInput]) -> torch.Tensor | None:
        """Run this rank's part of a step (inputs[dp_rank]); every rank calls it with the same inputs.

        Returns the logits of the sampled rows, all DP ranks' rows in order, on rank 0; None elsewhere
        or when no row samples.
        """
        p, dev = self.parallel, self.device
        step = inputs[p.dp_rank]
        meta = AttentionMetadata(
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_tables=[_pad_2d(t, dev) for t in step.block_tables],
            slot_mappings=[torch.tensor(s, dtype=torch.int64, device=dev) for s in step.slot_mappings],
            block_size=self.block_size,
            dp_num_tokens=[len(i.input_ids) for i in inputs] if p.dp_size > 1 else None,
        )
        hidden = self.model(
            torch.tensor(step.input_ids, dtype=torch.long, device=dev),
            torch.tensor(step.positions, dtype=torch.long, device=dev),
            meta,
        )
        hidden = hidden[torch.tensor(step.logits_indices, dtype=torch.long, device=dev)]
        if p.dp_size > 1:
            # The LM head is replicated under attention DP: rank 0 computes every rank's logits.
            counts = [len(i.logits_indices) for i in inputs]
            if not any(counts):
                return None
            hidden = all_gather_rows(hidden, counts)
            return self.model.compute_logits(hidden) if p.rank == 0 else None
        if not step.logits_indices:
            return None
        logits = self.model.compute_logits(hidden)  # vocab-parallel under TP: every rank takes part
        return logits if p.rank == 0 else None

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor | None, rows: list[Request]) -> StepResult:
        if logits is None:
            return StepResult({}, None, [])
        logits = logits.float()
        # A row holding NaN or +inf, or nothing above -inf (-inf alone is a legitimate mask), cannot be
        # sampled: zero it so the sampler never sees it, and fail only that request. One reduction over
        # the logits finds such rows; only those rows are rewritten.
        bad = ~torch.isfinite(logits.amax(dim=-1))
        if bad.any():
            logits[bad] = 0.0
        batch = SamplingBatch.build(
            params=[r.params for r in rows],
            prompt_ids=[r.prompt_token_ids for r in rows],
            output_ids=[r.output_token_ids for r in rows],
            generators=[r.generator for r in rows],
            stop_ids=[set(r.stop_token_ids) for r in rows],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, batch)
        failed = [rows[i] for i in bad.nonzero().flatten().tolist()]
        return StepResult({r: t for r, t in zip(rows, out.token_ids) if r not in failed}, out, rows, failed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


def _pad_2d(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)
