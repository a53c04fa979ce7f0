"""ModelRunner: owns the model and the KV cache tensors; turns a SchedulerOutput into sampled tokens.

KV memory layout: layers are grouped by attention type (`kv_groups`). Slot tensor j holds the KV of the
j-th layer of every group, so one block id means the same memory in all groups and all groups share
one `BlockPool`; a block's bytes are `num_slots * 2 * block_size * kv_heads * head_dim * dtype`.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from brisk.config import EngineConfig, ModelConfig, ParallelConfig
from brisk.distributed.comm import agree_min, all_gather_rows
from brisk.kernels.cpu_kernels import CpuKernels, load_cpu_kernels
from brisk.kv_cache.manager import KVGroupSpec, cdiv
from brisk.layers.attention import Attention, AttentionMetadata, make_attention_backend
from brisk.layers.linear import prepack_weights
from brisk.layers.moe import FusedMoE
from brisk.model_runner.cuda_graph import DecodeGraphs, effective_graph_config, graph_batch_sizes
from brisk.model_runner.input_batch import InputBatch, RequestState, to_device
from brisk.model_runner.loader import load_model
from brisk.model_runner.memory import (
    KVGroupLayout,
    available_host_memory,
    log_plan,
    measure_profile_run,
    plan_kv_cache,
    profile_batch_shape,
)
from brisk.model_runner.sampler import Sampler, SamplingBatch, row_max_and_argmax
from brisk.sampling_params import SamplingParams
from brisk.scheduler.output import ModelRunnerOutput, NewRequestData, PromptLogprobs, SchedulerOutput, TokenLogprobs
from brisk.spec_decode.proposer import make_proposer
from brisk.spec_decode.runner import SpecDecodeRunner
from brisk.structured.engine import GrammarBitmaskApplier

CPU_KV_CACHE_CAP_BYTES = 2 << 30  # a CPU box runs small models; never take more than this by default
PROMPT_LOGITS_ROWS = 1024  # prompt_logprobs: positions whose full-vocabulary logits are held at once


@runtime_checkable
class UsesCpuKernels(Protocol):
    """A module that calls brisk's CPU kernels when the runner binds them (linears, LM head, norms, MoE, MLPs)."""

    cpu_kernels: CpuKernels | None


def kv_groups_for(model_config: ModelConfig) -> list[KVGroupSpec]:
    groups = []
    for kind in ("full_attention", "sliding_attention"):
        layers = tuple(i for i, t in enumerate(model_config.layer_types) if t == kind)
        if layers:
            window = model_config.sliding_window if kind == "sliding_attention" else None
            groups.append(KVGroupSpec(layers, window))
    return groups


@dataclass(frozen=True)
class KVCacheSpec:
    """What the engine core needs to know of the model side to keep the books of its KV cache."""

    groups: list[KVGroupSpec]
    num_blocks: int
    block_size: int
    dp_size: int  # one KV pool (and scheduler) per attention-DP rank
    spec_lookahead_slots: int = 0  # KV slots past a request's tokens its drafter writes (spec_decode/proposer.py)


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
        self.cpu_group = cpu_group
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
            self.cpu_kernels = load_cpu_kernels(config.cpu_kernels)
            for module in self.model.modules():  # linears, LM head, norms, MoE layers, Llama MLPs
                if isinstance(module, UsesCpuKernels):
                    module.cpu_kernels = self.cpu_kernels
            if config.cpu_weight_prepack:  # after binding: layers whose decode steps take the kernels skip it
                prepack_weights(self.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.attention_backend = make_attention_backend(config.attn_backend, device, self.cpu_kernels)
        for layer in self.attn_layers:
            layer.backend = self.attention_backend
        self.kv_groups = kv_groups_for(model_config)
        self.sampler = Sampler(self.cpu_kernels)
        self.grammar_masker = GrammarBitmaskApplier(torch.get_num_threads(), self.cpu_kernels)  # structured outputs
        self.states: dict[str, RequestState] = {}  # every request this rank holds (running or preempted)
        self.batch = InputBatch(config.max_batch_size, cdiv(max_seq_len, self.block_size), len(self.kv_groups), device)
        proposer = make_proposer(config, model_config, self.model)
        self.spec = None
        if proposer is not None and config.speculative_config is not None:
            self.spec = SpecDecodeRunner(self, proposer, config.speculative_config)
        self._sampling_key: tuple | None = None
        self._sampling_cached: SamplingBatch | None = None
        self._last_handle: StepHandle | None = None
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and config.kv_cache_config.max_blocks is None:
            self.num_blocks = self._num_kv_blocks_by_profiling()  # brisk/model_runner/memory.py
        else:
            self.num_blocks = self._num_kv_blocks()
        if parallel.world_size > 1:  # one block id addresses the same tokens on every rank
            self.num_blocks = agree_min(self.num_blocks, cpu_group)
        self._allocate_kv_cache()
        graph_config = effective_graph_config(config, device)
        if graph_config is not None:
            sizes = graph_batch_sizes(graph_config, config.max_batch_size)
            if sizes:
                # Under attention DP the ranks' padded sizes differ step by step (the MoE gathers every rank's
                # rows): their steps run on the padded buffers uncaptured.
                # Capture needs backends without host syncs (the Triton ones); others run the buffers uncaptured.
                capture = device.type == "cuda" and parallel.dp_size == 1 and self._graph_safe()
                verify_len = 1 + self.spec.k if self.spec is not None else 1
                self.graphs = DecodeGraphs(self, sizes, graph_config.enable_padding, capture, verify_len)
                self.graphs.capture_all(self)

    def _graph_safe(self) -> bool:
        moe_backends = [m.backend for m in self.model.modules() if isinstance(m, FusedMoE)]
        return self.attention_backend.graph_safe and all(b.graph_safe for b in moe_backends)

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
        draft = self.spec.proposer.kv_bytes_per_block(self.block_size) if self.spec is not None else 0
        return self.num_slots * 2 * self.block_size * self.num_kv_heads * mc.head_dim * elt + draft

    def _num_kv_blocks(self) -> int:
        if self.config.kv_cache_config.max_blocks is not None:
            return self.config.kv_cache_config.max_blocks
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.memory_fraction
        else:
            budget = min(available_host_memory() * self.config.memory_fraction, CPU_KV_CACHE_CAP_BYTES)
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
        start = 1  # block 0 is the null block
        for n in lengths:
            table = list(range(start, start + cdiv(n, self.block_size)))
            start += len(table)
            tables.append(table)
        self.num_blocks = start
        self._allocate_kv_cache()
        # A real step (the scheduler's message, the persistent batch, forward, logits, sampling) over dummy
        # prompts that fill max_num_tokens; their rows leave the batch afterwards.
        params = SamplingParams(max_tokens=1, temperature=0.0)
        vocab = self.model_config.vocab_size
        new = [
            NewRequestData(
                f"kv-profile-{i}", [t % vocab for t in range(n)], params, None, [table] * len(self.kv_groups), 0
            )
            for i, (n, table) in enumerate(zip(lengths, tables))
        ]
        sched = SchedulerOutput(
            new_requests=new,
            num_scheduled_tokens={r.req_id: len(r.token_ids) for r in new},
            total_num_scheduled_tokens=sum(lengths),
            sampled_req_ids=[r.req_id for r in new],
        )
        profile_ids = [r.req_id for r in new]

        def profile_step() -> None:
            self.execute_model([sched] * self.parallel.dp_size).result()
            self.batch.remove(profile_ids)
            for rid in profile_ids:
                self.states.pop(rid, None)
            self._last_handle = None

        measured = measure_profile_run(self.device, weights, profile_step)
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
        if self.spec is not None:
            self.spec.proposer.bind_kv(self.num_blocks, self.block_size, self.device)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        lookahead = self.spec.proposer.lookahead_slots() if self.spec is not None else 0
        return KVCacheSpec(self.kv_groups, self.num_blocks, self.block_size, self.parallel.dp_size, lookahead)

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheds: list[SchedulerOutput]) -> StepHandle:
        """Run this rank's part of a step (scheds[dp_rank]); every rank calls it with every DP rank's
        SchedulerOutput. Launches the step and returns at once: its sampled tokens stay on the device (the next
        step reads them from there) until `StepHandle.result()` brings them to the host."""
        p = self.parallel
        sched = scheds[p.dp_rank]
        self._update_batch(sched)
        step = self._prepare(sched)
        if p.dp_size > 1:  # what each rank runs (the MoE layers gather them): padded where a rank pads
            step.dp_num_tokens = [self._num_tokens_run(s) for s in scheds]
        hidden = self._forward(step)
        mine_prompt_logprobs = None
        if sched.needs_prompt_logprobs:  # only steps that compute prompt positions some request asked about
            mine_prompt_logprobs = self._prompt_logprobs(step, hidden)
        prompt_logprobs: list[dict[str, PromptLogprobs] | None] | None = None  # per DP rank
        if p.dp_size > 1 and any(s.needs_prompt_logprobs for s in scheds):
            prompt_logprobs = [None] * p.dp_size if p.rank == 0 else None
            dist.gather_object(mine_prompt_logprobs, prompt_logprobs, dst=0, group=self.cpu_group)
        elif mine_prompt_logprobs is not None:
            prompt_logprobs = [mine_prompt_logprobs]
        if self.spec is not None:  # verification, the host sync, drafts for the next step (spec_decode/runner.py)
            outputs = self.spec.sample_and_propose(scheds, step, hidden)
            if outputs is not None and self.graphs is not None:  # next step: a verification of the static shape
                for out in outputs:
                    if out.spec_token_ids is not None:
                        last = [tokens[-1] for tokens in out.sampled_token_ids]
                        out.spec_token_ids = self.graphs.pad_drafts(out.spec_token_ids, last)
            if outputs is not None and prompt_logprobs is not None:
                for out, chunk in zip(outputs, prompt_logprobs):
                    out.prompt_logprobs = chunk or None
            handle = StepHandle(self, scheds, step, None, None, None, p.rank == 0, outputs=outputs)
            self._last_handle = handle
            return handle
        num_sampled_all = [s.num_sampled_requests for s in scheds]
        token_ids, bad, logprobs = None, None, None
        samples_here = p.dp_size > 1 or p.rank == 0  # attention DP: every rank samples its own rows
        if step.num_sampled:
            logits = self.model.compute_logits(
                hidden[step.logits_indices]
            )  # vocab-parallel under TP: every rank takes part
            if samples_here:
                if sched.grammar_req_ids:  # structured outputs: before sampling, so logprobs are after masking
                    logits = logits.float()
                    self.grammar_masker(logits, sched)
                token_ids, bad, logprobs = self._sample(logits, step)
        if p.world_size > 1:
            token_ids, bad = self._share_sampled(token_ids, bad, step, num_sampled_all)
        if token_ids is not None and step.num_sampled:
            mine = token_ids
            if p.dp_size > 1:
                offset = sum(num_sampled_all[: p.dp_rank])
                mine = token_ids[offset : offset + step.num_sampled]
            self.batch.last_sampled[step.sample_rows_tensor] = mine
        dp_logprobs = None
        if p.dp_size > 1 and any(s.needs_logprobs for s in scheds):
            # Each attention-DP rank sampled (and took the logprobs of) its own rows: rank 0 reports them all.
            dp_logprobs = [None] * p.dp_size if p.rank == 0 else None
            dist.gather_object(logprobs, dp_logprobs, dst=0, group=self.cpu_group)
        handle = StepHandle(self, scheds, step, token_ids, bad, logprobs, p.rank == 0, dp_logprobs, prompt_logprobs)
        self._last_handle = handle
        return handle

    def _num_tokens_run(self, sched: SchedulerOutput) -> int:
        n = sched.total_num_scheduled_tokens
        if self.graphs is not None:
            shape = self.graphs.padded_shape_of(list(sched.num_scheduled_tokens.values()), sched.num_sampled_requests)
            if shape is not None:
                return shape[0] * shape[1]
        return n

    def _update_batch(self, sched: SchedulerOutput) -> None:
        batch = self.batch
        batch.remove(sched.finished_req_ids)
        batch.remove(sched.preempted_req_ids)
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
        for new in sched.new_requests:
            state = self.states.get(new.req_id) if new.resumed else None
            generator = state.generator if state is not None else None
            if state is None and new.seed is not None:
                generator = self.make_generator(new.seed)
            params = new.params
            stop_ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids.update(self.model_config.eos_token_ids)
            num_prompt = len(new.token_ids) - new.num_output_tokens
            needs_history = (
                params.min_tokens > 0
                or params.repetition_penalty != 1.0
                or bool(params.presence_penalty)
                or bool(params.frequency_penalty)
            )
            done = state.num_prompt_logprobs_done if state is not None else 0
            state = RequestState(
                new.req_id,
                new.token_ids,
                params,
                generator,
                frozenset(stop_ids),
                num_prompt,
                needs_history,
                output_token_ids=list(new.token_ids[num_prompt:]),
                num_prompt_logprobs_done=done,
            )
            self.states[new.req_id] = state
            batch.add(state, new.block_ids, new.num_computed_tokens)
        cached = sched.cached_requests
        row_of = batch.row_of
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids):
            batch.append_blocks(row_of[rid], block_ids)

    def _prepare(self, sched: SchedulerOutput) -> StepBatch:
        """The step's model input, from the persistent batch: vectorised over rows and tokens."""
        batch, bs, dev = self.batch, self.block_size, self.device
        nst = sched.num_scheduled_tokens
        row_of = batch.row_of
        num_rows = len(nst)
        rows = np.fromiter((row_of[rid] for rid in nst), dtype=np.int64, count=num_rows)
        counts = np.fromiter(nst.values(), dtype=np.int64, count=num_rows)
        computed = batch.num_computed[rows]
        host_len = batch.num_host_tokens[rows]
        seq_lens = computed + counts
        num_tokens = int(sched.total_num_scheduled_tokens)
        decode_only = num_tokens == num_rows
        qsl = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        if decode_only:
            positions = computed
            token_rows = rows
        else:
            token_rows = np.repeat(rows, counts)
            positions = np.repeat(computed - qsl[:-1], counts) + np.arange(num_tokens)
        samples = seq_lens >= host_len
        if batch.num_prefill_only:
            samples &= ~batch.prefill_only[rows]
        sample_idx = np.flatnonzero(samples)
        # Tokens the host knows (prompts, resumed requests) vs the row's last sampled token (on the device).
        from_host = positions < batch.num_host_tokens[token_rows]
        input_ids = np.zeros(num_tokens, dtype=np.int64)
        if from_host.any():
            for i in np.flatnonzero(computed < host_len).tolist():
                state = batch.states[rows[i]]
                lo, hi = int(computed[i]), min(int(seq_lens[i]), int(host_len[i]))
                input_ids[qsl[i] : qsl[i] + hi - lo] = state.host_token_ids[lo:hi]
        placeholder = ~from_host
        logits_indices = qsl[1:][sample_idx] - 1
        num_drafts = None
        if sched.scheduled_spec_decode_tokens:  # drafts: the last tokens of their request's query, from the host
            num_drafts = np.zeros(num_rows, dtype=np.int64)
            for i, rid in enumerate(nst):
                drafts = sched.scheduled_spec_decode_tokens.get(rid)
                if drafts:
                    num_drafts[i] = len(drafts)
                    input_ids[qsl[i + 1] - len(drafts) : qsl[i + 1]] = drafts
                    placeholder[qsl[i + 1] - len(drafts) : qsl[i + 1]] = False
            num_drafts = num_drafts[sample_idx]
            # every position of a request with drafts gives logits: its last token's and each draft's
            counts_out = num_drafts + 1
            starts = np.repeat(logits_indices - num_drafts, counts_out)
            logits_indices = starts + np.arange(len(starts)) - np.repeat(np.cumsum(counts_out) - counts_out, counts_out)
        batch.num_computed[rows] = seq_lens
        block_idx = positions // bs
        offsets = positions % bs
        slot_mappings = [table[token_rows, block_idx].astype(np.int64) * bs + offsets for table in batch.block_tables]
        width = int(batch.num_blocks[rows].max()) if num_rows else 0
        step = StepBatch(
            rows=rows,
            num_rows=num_rows,
            num_tokens=num_tokens,
            decode_only=decode_only,
            input_ids_host=input_ids,
            placeholder_idx=np.flatnonzero(placeholder),
            token_rows=token_rows,
            positions=positions,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=[table[rows, :width] for table in batch.block_tables],
            slot_mappings=slot_mappings,
            sample_idx=sample_idx,
            num_sampled=len(sample_idx),
            logits_indices=to_device(logits_indices, dev),
            sample_rows_tensor=to_device(rows[sample_idx], dev),
            num_drafts=num_drafts,
        )
        if step.num_sampled != sched.num_sampled_requests:
            raise RuntimeError(
                f"the runner samples {step.num_sampled} rows, the scheduler expects {sched.num_sampled_requests}"
            )
        return step

    def _forward(self, step: StepBatch) -> torch.Tensor:
        if self.graphs is not None:
            shape = self.graphs.padded_shape(step)
            if shape is not None:
                return self.graphs.run(self, step, shape)
        dev = self.device
        input_ids = to_device(step.input_ids_host, dev)
        if len(step.placeholder_idx):
            idx = to_device(step.placeholder_idx, dev)
            input_ids[idx] = self.batch.last_sampled[to_device(step.token_rows[step.placeholder_idx], dev)]
        meta = AttentionMetadata(
            query_start_loc=step.query_start_loc.tolist(),
            seq_lens=step.seq_lens.tolist(),
            block_tables=[to_device(t, dev) for t in step.block_tables],
            slot_mappings=[to_device(s, dev) for s in step.slot_mappings],
            block_size=self.block_size,
            dp_num_tokens=step.dp_num_tokens,
        )
        meta.attn_plan = self.attention_backend.prepare(meta)
        step.meta = meta
        return self.model(input_ids, to_device(step.positions, dev), meta)

    def _prompt_logprobs(self, step: StepBatch, hidden: torch.Tensor) -> dict[str, PromptLogprobs]:
        """For each request that asked for prompt_logprobs: the logprob (fp32 log_softmax), rank and top-k of
        every prompt token this step's positions predict (position p's logits predict prompt token p + 1).
        Every TP rank takes part (the LM head is vocab-parallel); the host copy happens here, in the few steps
        that compute such positions."""
        batch = self.batch
        counts = np.diff(step.query_start_loc)
        starts = step.seq_lens - counts
        spans = []  # (state, first position, end position, first token index)
        for i, row in enumerate(step.rows.tolist()):
            state = batch.states[row]
            if state.params.prompt_logprobs is None:
                continue
            lo = max(int(starts[i]), state.num_prompt_logprobs_done)
            hi = min(int(step.seq_lens[i]), state.num_prompt_tokens - 1)
            if lo < hi:
                spans.append((state, lo, hi, int(step.query_start_loc[i]) + lo - int(starts[i])))
        if not spans:
            return {}
        index = np.concatenate([np.arange(t, t + hi - lo) for _, lo, hi, t in spans])
        targets = np.concatenate(
            [np.asarray(st.host_token_ids[lo + 1 : hi + 1], dtype=np.int64) for st, lo, hi, _ in spans]
        )
        k = max(st.params.prompt_logprobs or 0 for st, *_ in spans)
        token_lps, ranks, top_lps, top_ids = [], [], [], []
        for a in range(0, len(index), PROMPT_LOGITS_ROWS):
            idx = to_device(index[a : a + PROMPT_LOGITS_ROWS], self.device)
            tgt = to_device(targets[a : a + PROMPT_LOGITS_ROWS], self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1)
            own = logprobs.gather(1, tgt[:, None])
            token_lps.append(own[:, 0])
            ranks.append((logprobs > own).sum(dim=1) + 1)
            if k:
                values, ids = logprobs.topk(k, dim=-1)
                top_lps.append(values)
                top_ids.append(ids)
        lp_host = torch.cat(token_lps).tolist()
        rank_host = torch.cat(ranks).tolist()
        top_v = torch.cat(top_lps).tolist() if k else None
        top_i = torch.cat(top_ids).tolist() if k else None
        out: dict[str, PromptLogprobs] = {}
        a = 0
        for state, lo, hi, _ in spans:
            b = a + hi - lo
            n = state.params.prompt_logprobs or 0
            top = (
                [list(zip(ids[:n], vals[:n])) for ids, vals in zip(top_i[a:b], top_v[a:b])]
                if top_i is not None and top_v is not None and n
                else [[] for _ in range(b - a)]
            )
            out[state.req_id] = PromptLogprobs(lo, lp_host[a:b], rank_host[a:b], top)
            state.num_prompt_logprobs_done = hi
            a = b
        return out

    def _sampling_batch(self, step: StepBatch, vocab_size: int) -> SamplingBatch:
        """The sampler's per-row tensors, reused while the sampled rows are the same requests in the same order
        and none of them samples with its history (penalties, min_tokens)."""
        batch = self.batch
        sample_rows = step.rows[step.sample_idx]
        key = (batch.version, sample_rows.tobytes(), vocab_size)
        if self._sampling_key == key and self._sampling_cached is not None:
            return self._sampling_cached
        states = [batch.states[r] for r in sample_rows.tolist()]
        needs_history = any(s.needs_history for s in states)
        if needs_history and self._last_handle is not None:
            self._last_handle.wait_for_history()  # the previous step's tokens (a host sync, only for these rows)
        built = SamplingBatch.build(
            params=[s.params for s in states],
            prompt_ids=[s.host_token_ids[: s.num_prompt_tokens] if s.needs_history else () for s in states],
            output_ids=[s.output_token_ids if s.needs_history else () for s in states],
            generators=[s.generator for s in states],
            stop_ids=[s.stop_ids for s in states],
            vocab_size=vocab_size,
            device=self.device,
        )
        self._sampling_key, self._sampling_cached = (None, None) if needs_history else (key, built)
        return built

    def _sample(self, logits: torch.Tensor, step: StepBatch):
        batch = self._sampling_batch(step, logits.shape[-1])
        logits = logits.float()
        # A row holding NaN or +inf, or nothing above -inf (-inf alone is a legitimate mask), cannot be sampled:
        # only that request fails (an argmax of it is harmless; the other paths see it zeroed). The check rides
        # on the step's one host synchronisation (with the tokens), never a sync of its own.
        if self.sampler.is_plain_greedy(batch):  # one pass over the logits finds both
            row_max, token_ids = row_max_and_argmax(logits)
            raw_logprobs, bad = None, ~torch.isfinite(row_max)
        else:
            bad = ~torch.isfinite(logits.amax(dim=-1))
            logits = torch.where(bad[:, None], 0.0, logits)
            token_ids, raw_logprobs = self.sampler.sample(logits, batch)
        token_ids = token_ids.clamp_(0, logits.shape[-1] - 1)  # a bad row's pick must still embed next step
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self.sampler.logprobs_output(token_ids, raw_logprobs, batch)
        return token_ids, bad, logprobs

    def _share_sampled(self, token_ids, bad, step: StepBatch, num_sampled_all: list[int]):
        """Every rank writes the sampled tokens into its own batch: rank 0 broadcasts them under TP; attention-DP
        ranks each sampled their own rows and gather them."""
        p = self.parallel
        if p.dp_size > 1:
            if not any(num_sampled_all):
                return None, None
            mine = torch.zeros(step.num_sampled, 2, dtype=torch.int64, device=self.device)
            if token_ids is not None:
                mine[:, 0] = token_ids
                mine[:, 1] = bad
            both = all_gather_rows(mine, num_sampled_all)
            return both[:, 0], both[:, 1].bool()
        n = num_sampled_all[0]
        if not n:
            return token_ids, bad
        buf = torch.empty(n, dtype=torch.int64, device=self.device)
        if p.rank == 0:
            buf.copy_(token_ids)
        dist.broadcast(buf, src=0)
        return (buf, bad) if p.rank != 0 else (token_ids, bad)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)


@dataclass
class StepBatch:
    """One step as the runner lays it out: host arrays (numpy) and the tensors built from them."""

    rows: np.ndarray  # [B] batch row of each scheduled request, in the scheduler's order
    num_rows: int
    num_tokens: int
    decode_only: bool  # every request computes one token
    input_ids_host: np.ndarray  # [T]; placeholders (0) where the token is a row's last sampled one
    placeholder_idx: np.ndarray  # token indices filled from the device
    token_rows: np.ndarray  # [T] batch row of each token
    positions: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B+1]
    seq_lens: np.ndarray  # [B]
    block_tables: list[np.ndarray]  # per KV group [B, width]
    slot_mappings: list[np.ndarray]  # per KV group [T]
    sample_idx: np.ndarray  # indices (into rows) of the requests that sample
    num_sampled: int
    logits_indices: torch.Tensor
    sample_rows_tensor: torch.Tensor  # batch rows of the sampled requests
    meta: AttentionMetadata | None = None
    dp_num_tokens: list[int] | None = None
    # Speculative decoding: drafts verified per sampled request (None: none this step); logits_indices then holds
    # 1 + num_drafts[i] positions for sampled request i.
    num_drafts: np.ndarray | None = None


class StepHandle:
    """A launched step. `result()` is the step's one host synchronisation: the sampled tokens (and the
    non-finite flags) in one copy, then the ModelRunnerOutput of every DP rank (on rank 0)."""

    def __init__(
        self,
        runner: ModelRunner,
        scheds,
        step: StepBatch,
        token_ids,
        bad,
        logprobs,
        is_rank0: bool,
        dp_logprobs=None,
        prompt_logprobs: list[dict[str, PromptLogprobs] | None] | None = None,
        outputs: list[ModelRunnerOutput] | None = None,
    ):
        self._runner = runner
        self._scheds = scheds
        self._step = step
        self._token_ids = token_ids
        self._bad = bad
        self._logprobs = logprobs
        self._dp_logprobs = dp_logprobs  # attention DP: every DP rank's logprobs, on rank 0
        self._is_rank0 = is_rank0
        self._prompt_logprobs = prompt_logprobs  # per DP rank (on rank 0), when some request asked for them
        self._host: tuple[list[int], list[int]] | None = None
        # Speculative decoding: the step took its tokens to the host itself (the outputs are ready; rank 0 only).
        self._history_done = runner.spec is not None
        self._outputs: list[ModelRunnerOutput] | None = outputs
        if runner.spec is not None and outputs is None:
            self._outputs = []  # a rank other than 0: nothing to report

    def _to_host(self) -> tuple[list[int], list[int]]:
        """(sampled token ids, non-finite flags) of every sampled row, in one device-to-host copy."""
        if self._host is None:
            if self._token_ids is None:
                self._host = ([], [])
            else:
                ids, bad = torch.stack([self._token_ids, self._bad.to(torch.int64)]).tolist()
                self._host = (ids, bad)
        return self._host

    def wait_for_history(self) -> None:
        """Append this step's tokens to the outputs of the rows that sample with their history."""
        if self._history_done:
            return
        self._history_done = True
        ids, _ = self._to_host()
        runner = self._runner
        d = runner.parallel.dp_rank
        offset = sum(s.num_sampled_requests for s in self._scheds[:d])
        for j, rid in enumerate(self._scheds[d].sampled_req_ids):
            state = runner.states.get(rid)
            if state is not None and state.needs_history:
                state.output_token_ids.append(ids[offset + j])

    def result(self) -> list[ModelRunnerOutput]:
        if self._outputs is not None:
            return self._outputs
        ids, bad = self._to_host()
        self.wait_for_history()
        outputs = []
        if self._is_rank0:
            any_bad = any(bad)
            offset = 0
            for d, sched in enumerate(self._scheds):
                n = sched.num_sampled_requests
                req_ids = sched.sampled_req_ids
                logprobs = self._logprobs if self._dp_logprobs is None else self._dp_logprobs[d]
                if not any_bad and logprobs is None:  # the common step: the lists as they are
                    outputs.append(ModelRunnerOutput(req_ids, [[t] for t in ids[offset : offset + n]]))
                    offset += n
                    continue
                row_logprobs: list[list[TokenLogprobs] | None] = []
                out = ModelRunnerOutput([], [], row_logprobs if logprobs is not None else None, [])
                for j, rid in enumerate(req_ids):
                    if bad[offset + j]:
                        out.failed_req_ids.append(rid)
                        continue
                    out.req_ids.append(rid)
                    out.sampled_token_ids.append([ids[offset + j]])
                    if logprobs is not None:
                        num = logprobs.num_logprobs[j] if logprobs.num_logprobs is not None else None
                        lp = None if num is None else [TokenLogprobs(logprobs.logprobs[j], logprobs.top_logprobs[j])]
                        row_logprobs.append(lp)
                offset += n
                outputs.append(out)
            if self._prompt_logprobs is not None:
                for out, prompt_logprobs in zip(outputs, self._prompt_logprobs):
                    out.prompt_logprobs = prompt_logprobs or None
        self._outputs = outputs
        return outputs
