"""ModelRunner: one rank's model, KV cache and persistent batch; a SchedulerOutput in, a launched step out.

One step pipeline, for plain and speculative steps alike (`execute_model`):
0. the host KV tier's block copies the scheduler decided (kv_offload.py), launched first; the forward waits for them;
1. update the persistent batch (requests that joined, left or grew; input_batch.py);
2. lay out the step (layout.py) and advance the batch's computed tokens by it;
3. forward (on the static buffers / CUDA graphs of cuda_graph.py where the step fits them);
4. sample or verify the drafts (sampling_stage.py): one packed result tensor;
5. publish: one TP broadcast / attention-DP gather of it, each row's last token into the batch on the device; with
   speculation the host copy now and the drafter's turn (spec_decode/drafter.py); the StepResult (step_output.py)
   builds the ModelRunnerOutputs.

setup.py builds the runner (weights, kernels, KV pool, graphs); interface.py is what the rest of brisk sees of it.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from brisk.config import EngineConfig
from brisk.host import on_device, to_device
from brisk.kv_cache.manager import cdiv
from brisk.layers.attention import Attention, AttentionMetadata
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.model_runner.binding import Kernels
from brisk.model_runner.cuda_graph import DecodeGraphs
from brisk.model_runner.input_batch import InputBatch, RequestState
from brisk.model_runner.interface import KVCacheSpec, kv_groups_for
from brisk.model_runner.kv_offload import HostKVCache
from brisk.model_runner.kv_tensors import (
    KVTensorLayout,
    allocate_kv_cache,
    group_block_sizes,
    kv_group_dtypes,
    release_kv_cache,
)
from brisk.model_runner.layout import StepBatch, lay_out_step
from brisk.model_runner.prompt_logprobs import prompt_logprobs
from brisk.model_runner.sampling_batch import needs_history
from brisk.model_runner.sampling_stage import SamplingStage
from brisk.model_runner.startup import StartupTimes
from brisk.model_runner.step_output import (
    ExtrasGather,
    RankExtras,
    StepResult,
    host_rows,
    last_tokens,
    rows_of_rank,
    share_packed,
)
from brisk.models.registry import BriskModel
from brisk.scheduler.output import SchedulerOutput
from brisk.spec_decode.drafter import Drafter
from brisk.spec_decode.proposer import Proposer


class ModelRunner:
    """One rank's model and KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model: BriskModel,
        kernels: Kernels,
        device: torch.device,
        max_seq_len: int,
        parallel: ParallelConfig = ParallelConfig(),
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.model = model
        self.kernels = kernels
        self.device = device
        self.max_seq_len = max_seq_len
        self.parallel = parallel
        self.startup: StartupTimes | None = None  # its start-up stages' seconds, filled by setup.py
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_groups = kv_groups_for(model_config)
        kv_dtypes = kv_group_dtypes(config.kv_cache_config, model_config.dtype, self.kv_groups)
        self.block_sizes = group_block_sizes(config.block_size, kv_dtypes)  # per KV group: the tokens a block holds
        widths = [cdiv(max_seq_len, bs) for bs in self.block_sizes]
        self.batch = InputBatch(config.max_batch_size, widths, device)
        self.states: dict[str, RequestState] = {}  # every request this rank holds (running or preempted)
        self.drafter: Drafter | None = None
        if proposer is not None and config.speculative_config is not None:
            self.drafter = Drafter(
                proposer, config.speculative_config, self.batch, self.block_sizes, parallel, max_seq_len
            )
        self.k = self.drafter.k if self.drafter is not None else 0  # drafts verified per request at most
        self.sampling = SamplingStage(device, self.k, kernels.cpu)
        self.kv_layout = KVTensorLayout(
            self.kv_groups,
            config.block_size,
            self.attn_layers[0].num_kv_heads,
            model_config.head_dim,
            model_config.dtype,
            # the drafter's KV: blocks of the first (full-attention) group's tokens, whose table it reads
            proposer.kv_bytes_per_block(self.block_sizes[0]) if self.drafter is not None and proposer else 0,
            kv_dtypes,
        )
        self.num_blocks = 0  # set by allocate_kv_cache (setup.py)
        self.host_kv: HostKVCache | None = None  # the host KV tier (kv_cache_config.host_cache_size; setup.py)
        self.graphs: DecodeGraphs | None = None  # set by setup.py where cuda_graph_config is in effect
        self._previous: StepResult | None = None  # the step launched last (its tokens may be on the device still)
        self.extras_gather = ExtrasGather(parallel, device) if parallel.dp_size > 1 else None

    # ---- KV cache ------------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        proposer = self.drafter.proposer if self.drafter is not None else None
        allocate_kv_cache(self.kv_layout, num_blocks, self.attn_layers, self.device, proposer)

    def release_kv_cache(self) -> None:
        release_kv_cache(self.attn_layers)

    def allocate_host_kv_cache(self, ranks_on_this_machine: int = 1) -> None:
        """The host tier for the KV pool allocated last, where kv_cache_config.host_cache_size asks for one (each of
        this machine's ranks pins one of that size)."""
        size = self.config.kv_cache_config.host_cache_size
        if size and self.config.enable_prefix_caching:
            draft_kv = self.drafter.proposer.kv_caches() if self.drafter is not None else []
            self.host_kv = HostKVCache.for_layers(self.attn_layers, draft_kv, size, self.device, ranks_on_this_machine)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        lookahead = self.drafter.proposer.lookahead_slots() if self.drafter is not None else 0
        host = self.host_kv
        return KVCacheSpec(
            self.kv_groups,
            self.num_blocks,
            self.block_sizes,
            self.parallel.dp_size,
            lookahead,
            self.kv_layout.kv_dtypes,
            num_host_blocks=host.num_blocks if host is not None else 0,
            # a block's bytes on every rank holding a share of this pool (TP ranks split the KV heads)
            host_bytes_per_block=host.bytes_per_block * self.parallel.world_size // self.parallel.dp_size
            if host is not None
            else 0,
        )

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheds: list[SchedulerOutput]) -> StepResult:
        """Run this rank's part of a step (scheds[dp_rank]); every rank calls it with every DP rank's
        SchedulerOutput. Launches the step and returns at once: its tokens stay on the device (the next step reads
        them from there) until `StepResult.result()` brings them to the host (with speculation: before it returns,
        for the drafter)."""
        with on_device(self.device):
            return self._execute_model(scheds)

    def _execute_model(self, scheds: list[SchedulerOutput]) -> StepResult:
        p = self.parallel
        sched = scheds[p.dp_rank]
        if sched.kv_block_copies and self.host_kv is not None:  # host tier: before the forward (it waits for them)
            self.host_kv.start(sched.kv_block_copies)
        # 1. the persistent batch
        self._update_batch(sched)
        # 2. the step's layout; the batch's computed tokens advance by it
        step = lay_out_step(self.batch, sched, self.block_sizes, self.device)
        self.batch.num_computed[step.rows] = step.seq_lens
        shape = self._static_shape(step, scheds)  # None: eager
        if p.dp_size > 1:  # what each rank runs (the MoE layers gather them)
            if self.graphs is not None and shape is not None:
                step.dp_num_tokens = self.graphs.dp_num_tokens(*shape)
            else:
                step.dp_num_tokens = [s.total_num_scheduled_tokens for s in scheds]
        # 3. forward
        hidden = self._forward(step, shape)
        mine_prompt_logprobs = None
        if sched.needs_prompt_logprobs:  # only steps that compute prompt positions some request asked about
            mine_prompt_logprobs = prompt_logprobs(self.model, self.batch, step, hidden, self.device)
        # 4. sample or verify (the ranks that sample: rank 0, or every attention-DP rank its own rows)
        packed, logprobs, built_on_host = None, None, None
        if step.num_sampled:
            logits = self.model.compute_logits(hidden[step.logits_indices])  # vocab-parallel: every TP rank
            if p.dp_size > 1 or p.rank == 0:
                if self._previous is not None and self.sampling.needs_history(step, self.batch):
                    self._previous.record_history()  # the previous step's tokens: a host sync, for these rows only
                draft_probs = None
                if self.drafter is not None and step.num_drafts is not None:
                    draft_probs = self.drafter.take_draft_probs(sched.sampled_req_ids)
                picked = self.sampling.pick(logits, sched, step, self.batch, draft_probs)
                packed, logprobs, built_on_host = picked.packed, picked.logprobs, picked.host
        # 5. publish
        num_sampled_all = [s.num_sampled_requests for s in scheds]
        if p.world_size > 1:
            packed = share_packed(packed, self.sampling.width, num_sampled_all, p, self.device)
        if packed is not None and step.num_sampled:
            mine = packed
            if p.dp_size > 1:
                offset = sum(num_sampled_all[: p.dp_rank])
                mine = packed[offset : offset + step.num_sampled]
            self.batch.last_sampled[step.sample_rows_tensor] = last_tokens(mine, self.k)
        # The packed rows are final: on a GPU their copy to the host starts now, behind this step's kernels only
        # (rows the sampling stage built on the host are read there: every rank's rows are this rank's, p.dp_size 1).
        rows = host_rows(packed, built_on_host if p.dp_size == 1 else None)
        host, drafts = None, None
        if self.drafter is not None:
            host = rows.get()  # the step's host sync: the drafter needs the tokens
            mine_rows = rows_of_rank(host, scheds, p.dp_rank)
            drafts = []
            if mine_rows or self.drafter.needs_every_step:  # it records the tokens (history too) and rolls back
                drafts = self.drafter.record_and_propose(step, hidden, sched.sampled_req_ids, mine_rows)
        extras = self._extras_of_every_rank(scheds, RankExtras(logprobs, drafts, mine_prompt_logprobs))
        result = StepResult(
            scheds, rows, self.k, p.dp_rank, extras, self.states, host, self.batch.num_needs_history > 0
        )
        if self._previous is not None and p.dp_size > 1 and p.rank != 0 and self.batch.num_needs_history:
            # No result() reads this rank's steps: the previous one's tokens join the outputs of the requests that
            # sample with their history now, whether or not this step sampled one of them.
            self._previous.record_history()
        self._previous = result
        return result

    def _extras_of_every_rank(
        self, scheds: list[SchedulerOutput], mine: RankExtras
    ) -> list[RankExtras] | Future[list[RankExtras] | None] | None:
        """What rank 0 reports of every attention-DP rank beside the tokens (None on the other ranks): under attention
        DP, when some rank has something to report, their gather, under way on its own thread."""
        p = self.parallel
        if p.dp_size == 1:
            return [mine] if p.rank == 0 else None
        if self.drafter is None and not any(s.needs_logprobs or s.needs_prompt_logprobs for s in scheds):
            return [RankExtras(None, None, None)] * p.dp_size if p.rank == 0 else None
        assert self.extras_gather is not None  # made at the start wherever dp_size > 1
        return self.extras_gather.submit(mine)

    def _update_batch(self, sched: SchedulerOutput) -> None:
        batch = self.batch
        left = [*sched.finished_req_ids, *sched.preempted_req_ids]
        batch.remove(left)
        self.sampling.forget(left)
        if self.drafter is not None:
            self.drafter.forget(left)
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
        for new in sched.new_requests:
            state = self.states.get(new.req_id) if new.resumed else None
            generator = state.generator if state is not None else None
            if state is None and new.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(new.seed)
            params = new.params
            stop_ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids.update(self.model_config.eos_token_ids)
            num_prompt = len(new.token_ids) - new.num_output_tokens
            done = state.num_prompt_logprobs_done if state is not None else 0
            state = RequestState(
                new.req_id,
                new.token_ids,
                params,
                generator,
                frozenset(stop_ids),
                num_prompt,
                needs_history(params),
                output_token_ids=list(new.token_ids[num_prompt:]),
                num_prompt_logprobs_done=done,
            )
            self.states[new.req_id] = state
            batch.add(state, new.block_ids, new.num_computed_tokens)
        cached = sched.cached_requests
        row_of = batch.row_of
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids):
            batch.append_blocks(row_of[rid], block_ids)

    def _static_shape(self, step: StepBatch, scheds: list[SchedulerOutput]) -> tuple[int, int] | None:
        """The (padded requests, tokens per request) this step runs at on the static buffers; None: eagerly.
        Under attention DP every rank takes the one shape (cuda_graph.py), an idle rank included."""
        if self.graphs is None:
            return None
        if self.parallel.dp_size > 1:
            return self.graphs.common_shape(scheds)
        return self.graphs.padded_shape(step)

    def _forward(self, step: StepBatch, shape: tuple[int, int] | None) -> torch.Tensor:
        if self.host_kv is not None:
            self.host_kv.wait()
        if self.graphs is not None and shape is not None:
            return self.graphs.run(step, self.batch.last_sampled, shape)
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
            dp_num_tokens=step.dp_num_tokens,
            decode_only=step.decode_only,  # the backends' plans skip their per-sequence scan of the query lengths
        )
        meta.plan_for(self.kernels.attention)  # once a step: every layer reads it
        step.meta = meta
        return self.model(input_ids, to_device(step.positions, dev), meta)

    def forget(self, req_ids: list[str]) -> None:
        """Drop requests this rank holds without a scheduler having finished them (the start-up steps)."""
        self.batch.remove(req_ids)
        self.sampling.forget(req_ids)
        if self.drafter is not None:
            self.drafter.forget(req_ids)
        for rid in req_ids:
            self.states.pop(rid, None)
        self._previous = None

    def close(self) -> None:
        if self.extras_gather is not None:
            self.extras_gather.close()
        self.sampling.close()
        if self.host_kv is not None:
            self.host_kv.close()
