"""Build one rank's model runner: load the weights, bind the kernels, size and allocate the KV pool, set up the
static-buffer steps (CUDA graphs). `load_model_runner` is how the executors get a runner (interface.py says what
they may use of it).

KV pool size: `kv_cache_config.max_blocks`, else on a GPU by profiling (memory.py: one real step at
`max_num_tokens` measured on a temporary cache, the pool gets `kv_cache_free_gpu_memory_fraction` of what is
left, or what is left of `gpu_memory_utilization` of the device), else `memory_fraction` of the free memory
(kv_tensors.py); at most what `kv_cache_config.max_tokens` and `max_gpu_total_bytes` allow. Ranks agree on the
smallest.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from brisk.config import EngineConfig
from brisk.distributed.comm import agree_min
from brisk.distributed.launch import ranks_on_this_machine
from brisk.kv_cache.manager import cdiv
from brisk.layers.moe import FusedMoE
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.model_runner.binding import bind, make_kernels, prepare_for_cpu
from brisk.model_runner.cuda_graph import DecodeGraphs, GraphedModel, effective_graph_config, graph_batch_sizes
from brisk.model_runner.kv_tensors import num_kv_blocks_in_budget
from brisk.model_runner.loader import load_model
from brisk.model_runner.memory import KVGroupLayout, log_plan, measure_profile_run, plan_kv_cache, profile_batch_shape
from brisk.model_runner.runner import ModelRunner
from brisk.model_runner.startup import StartupTimes
from brisk.sampling_params import SamplingParams
from brisk.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from brisk.spec_decode.registry import make_proposer

logger = logging.getLogger(__name__)


def load_model_runner(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    max_seq_len: int,
    parallel: ParallelConfig = ParallelConfig(),
    cpu_group: dist.ProcessGroup | None = None,
) -> ModelRunner:
    startup = StartupTimes(device)  # each start-up stage's seconds (startup.py)
    model = load_model(model_config, load_format=config.load_format, device=device, parallel=parallel, seed=config.seed)
    startup.mark("weights")
    model.eval()
    kernels = make_kernels(config, device)
    bind(model, kernels)
    if device.type == "cpu":  # after binding: layers whose decode steps take the C kernels skip the prepacking
        prepare_for_cpu(model, config)
    proposer = make_proposer(config, model_config, model)
    runner = ModelRunner(config, model_config, model, kernels, device, max_seq_len, parallel, proposer)
    runner.startup = startup
    startup.mark("setup")
    if device.type == "cuda" and config.kv_cache_config.max_blocks is None:
        num_blocks = num_kv_blocks_by_profiling(runner)
    else:
        num_blocks = num_kv_blocks_in_budget(config, runner.kv_layout, device, max_seq_len)
    limit = config.kv_cache_config.block_limit(runner.kv_layout.bytes_per_block, runner.kv_layout.group_block_sizes)
    if limit is not None:  # kv_cache_config.max_tokens / max_gpu_total_bytes
        num_blocks = min(num_blocks, limit)
    if parallel.world_size > 1:  # one block id addresses the same tokens on every rank
        num_blocks = agree_min(num_blocks, cpu_group)
    startup.mark("kv_sizing")
    runner.allocate_kv_cache(num_blocks)
    runner.allocate_host_kv_cache(ranks_on_this_machine(parallel.world_size))
    logger.info("%s", runner.kv_layout.describe(num_blocks))
    startup.mark("kv_allocation")
    try:
        set_up_graphs(runner, startup)
        if device.type == "cuda":  # (CPU kernels are compiled before the model is loaded)
            warm_up_eager_steps(runner)
            startup.mark("kernel_warm_up")
    except BaseException:
        runner.close()  # unpins the host KV tier (a range left registered would refuse the next one)
        raise
    startup.log()
    return runner


INTERACTIVITY_EVERY_GRAPH_SIZE_UP_TO = 32  # vLLM's performance_mode interactivity captures sizes 1..32


def set_up_graphs(runner: ModelRunner, startup: StartupTimes) -> None:
    """The static-buffer decode steps (cuda_graph.py): captured on a GPU where the backends allow it."""
    config, device, kernels = runner.config, runner.device, runner.kernels
    graph_config = effective_graph_config(config, device)
    every_size_up_to = INTERACTIVITY_EVERY_GRAPH_SIZE_UP_TO if config.performance_mode == "interactivity" else 0
    sizes = graph_batch_sizes(graph_config, config.max_batch_size, every_size_up_to) if graph_config is not None else []
    if graph_config is not None and sizes:
        # Capture needs backends without host syncs (the Triton ones); others run the buffers uncaptured. Under
        # attention DP every rank pads to one common size per step (cuda_graph.py), so its MoE collectives have
        # the captured shapes.
        capture = device.type == "cuda" and kernels.graph_safe
        target = GraphedModel(
            runner.model,
            kernels.attention,
            device,
            runner.max_seq_len,
            tuple(table.shape[1] for table in runner.batch.block_tables),
        )
        runner.graphs = DecodeGraphs(
            target, sizes, graph_config.enable_padding, capture, 1 + runner.k, runner.parallel.dp_size
        )
        runner.graphs.capture_all()
        startup.mark("graph_capture")
        if runner.drafter is not None:  # every verification then has the static shape
            runner.drafter.pad_drafts = True


def profile_sampling_params(max_logprobs: int) -> SamplingParams:
    """The profiling step's sampling: the costliest path a full batch can take, so that its [rows, vocabulary]
    temporaries are part of the measured peak (as vLLM's dummy sampler run): temperature with top-k, top-p and
    min-p (sorts and softmaxes of the logits), the penalties, and the most logprobs a request may ask for."""
    return SamplingParams(
        max_tokens=1,
        temperature=1.0,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.1,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        logprobs=max_logprobs,
    )


def _dummy_request(
    runner: ModelRunner, req_id: str, num_tokens: int, params: SamplingParams, table: list[int]
) -> NewRequestData:
    """A start-up step's request, which no scheduler sees: a prompt of num_tokens on these blocks (`table`: blocks of
    the fewest tokens a block; every KV group takes the ones it needs of them)."""
    vocab = runner.model_config.vocab_size
    tables = [table[: cdiv(num_tokens, bs)] for bs in runner.block_sizes]
    return NewRequestData(req_id, [t % vocab for t in range(num_tokens)], params, None, tables, 0)


def _prefill_step(new: list[NewRequestData]) -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=new,
        num_scheduled_tokens={r.req_id: len(r.token_ids) for r in new},
        total_num_scheduled_tokens=sum(len(r.token_ids) for r in new),
        sampled_req_ids=[r.req_id for r in new],
    )


def _run_dummy_step(runner: ModelRunner, sched: SchedulerOutput, keep: bool = False) -> None:
    """One start-up step on every rank (each DP rank the same requests), read; its requests forgotten unless kept."""
    runner.execute_model([sched] * runner.parallel.dp_size).result()
    if not keep:
        runner.forget([*(r.req_id for r in sched.new_requests), *sched.cached_requests.req_ids])


def warm_up_eager_steps(runner: ModelRunner) -> None:
    """Compile, at start-up, the kernel variants of eager steps that neither the profiling step (a small temporary
    cache, max_num_tokens tokens) nor the graph captures (decode steps) ran: Triton compiles a missing variant in the
    step that first needs it, the whole batch waiting (0.3-1 s a kernel). Dummy steps on the real cache (block
    offsets past 2**31 elements are variants of their own): a prompt of each MoE tile tier's largest batch below
    max_num_tokens (MoEBackend.variant_token_counts), then a mixed step, a decode beside a prompt (attention's
    one-partition decode, which the graphs' split-K decodes never take). Their blocks are the pool's first ones,
    which the scheduler has not handed out yet."""
    moe = next((m for m in runner.model.modules() if isinstance(m, FusedMoE)), None)
    counts = runner.kernels.moe.variant_token_counts(moe) if moe is not None else []
    block_size = min(runner.block_sizes)
    room = (runner.num_blocks - 3) * block_size  # block 0 is the null block; the mixed step takes two
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for n in sorted({c for c in counts if 2 < c < min(runner.config.max_num_tokens, room)}):
        table = list(range(1, 1 + cdiv(n, block_size)))
        _run_dummy_step(runner, _prefill_step([_dummy_request(runner, f"warm-up-{n}", n, params, table)]))
    decoding = _dummy_request(runner, "warm-up-decode", 2, params, [1])
    _run_dummy_step(runner, _prefill_step([decoding]), keep=True)
    prompt = _dummy_request(runner, "warm-up-prompt", 2, params, [2])
    mixed = _prefill_step([prompt])
    mixed.cached_requests = CachedRequestData([decoding.req_id], [[[] for _ in runner.kv_groups]])
    mixed.num_scheduled_tokens[decoding.req_id] = 1
    mixed.total_num_scheduled_tokens += 1
    mixed.sampled_req_ids.insert(0, decoding.req_id)
    _run_dummy_step(runner, mixed)


def num_kv_blocks_by_profiling(runner: ModelRunner) -> int:
    """One forward pass at max_num_tokens on a temporary cache just big enough for it, measured; the pool gets
    kv_cache_free_gpu_memory_fraction of what is left, or what is left of gpu_memory_utilization of the device
    (memory.py). CUDA graphs are captured after the pool (they hold its addresses): their memory comes out of the
    share the sizing leaves."""
    config, device, block_size = runner.config, runner.device, min(runner.block_sizes)
    weights = torch.cuda.memory_allocated(device)
    lengths = profile_batch_shape(config.max_num_tokens, config.max_batch_size)
    tables: list[list[int]] = []
    start = 1  # block 0 is the null block
    for n in lengths:
        table = list(range(start, start + cdiv(n, block_size)))
        start += len(table)
        tables.append(table)
    runner.allocate_kv_cache(start)
    # A real step (the scheduler's message, the persistent batch, forward, logits, sampling) over dummy
    # prompts that fill max_num_tokens; their rows leave the batch afterwards.
    params = profile_sampling_params(config.max_logprobs)
    groups = runner.kv_groups
    new = [
        _dummy_request(runner, f"kv-profile-{i}", n, params, table) for i, (n, table) in enumerate(zip(lengths, tables))
    ]
    sched = _prefill_step(new)

    def profile_step() -> None:
        _run_dummy_step(runner, sched)

    measured = measure_profile_run(device, weights, profile_step)
    runner.release_kv_cache()  # the temporary cache (allocated before the profile's baseline: not counted)
    layouts = [
        KVGroupLayout(
            "sliding_attention" if g.sliding_window else "full_attention", len(g.layer_ids), bs, g.sliding_window
        )
        for g, bs in zip(groups, runner.block_sizes)
    ]
    plan = plan_kv_cache(
        measured,
        fraction=config.memory_fraction,
        bytes_per_block=runner.kv_layout.bytes_per_block,
        groups=layouts,
        max_seq_len=runner.max_seq_len,
        max_num_tokens=config.max_num_tokens,
        utilization=config.gpu_memory_utilization,
    )
    log_plan(plan)
    useful = runner.kv_layout.most_useful_blocks(runner.max_seq_len, config.max_batch_size, config.max_num_tokens)
    return min(plan.num_blocks, useful)
