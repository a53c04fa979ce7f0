"""Batched sampling of the next token, with per-request sampling parameters.

Each step the model runner builds a `SamplingBatch` (sampling_batch.py) from the requests' `SamplingParams` and
token histories, then calls `Sampler()(logits, batch)`. The work is vectorised over the batch; the only Python
loop over rows draws the noise of seeded requests from their own generators. Steps that no row needs are skipped
(the batch holds `None` for them).

Order of operations (as in vLLM):
    allowed_token_ids (the rest -inf) -> logit_bias -> min_tokens (mask stop ids) -> repetition penalty
    -> presence/frequency penalties
    -> greedy rows: argmax
    -> other rows: temperature -> top_k -> top_p -> min_p -> exponential race (argmax of probs / Exp(1) noise),
       or on CPU with brisk's kernels, inverse transform sampling (one uniform draw per row instead of V)
Logprobs are the log_softmax of the raw model logits, before any of the above.
Structured outputs: the runner masks the tokens a grammar forbids (-inf) before calling the sampler, so the
logprobs of constrained rows are after masking; masking first equals masking after logit_bias/min_tokens/penalties
(each leaves -inf at -inf) and before temperature/top-k/top-p, and the greedy fast path sees the mask too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.kernels.cpu_kernels import CpuKernels
from brisk.model_runner.sampling_batch import ChosenLogprobIds, SamplingBatch


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B] sampled token per row
    logprobs: list[float] | None  # [B] raw logprob of the sampled token; None when no row asked for logprobs
    top_logprobs: list[list[tuple[int, float]]] | None  # [B] params.logprobs best (token, logprob), best first
    num_logprobs: list[int | None] | None = None  # [B] params.logprobs of each row


class Sampler:
    """Picks one token per row of `logits` [B, V] according to `batch`; `logits` is left unchanged. With brisk's
    CPU kernels, random rows are drawn by the C sampler (same distribution, other draws for a given seed)."""

    def __init__(self, cpu_kernels: CpuKernels | None = None) -> None:
        self.cpu_kernels = cpu_kernels

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        token_ids, raw_logprobs = self.sample(logits, batch)
        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist(), logprobs=None, top_logprobs=None)
        return _with_logprobs(token_ids, raw_logprobs, batch)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled token ids [B] int64, left on the logits' device (no host synchronisation), and the raw
        logprobs [B, V] when some row asked for them (LogprobTensors, then `logprobs_output` on the host)."""
        if logits.dim() != 2 or logits.shape != (batch.batch_size, batch.vocab_size):
            raise ValueError(
                f"logits must have shape ({batch.batch_size}, {batch.vocab_size}), got {tuple(logits.shape)}"
            )
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)

        if batch.all_greedy and not _processes_logits(batch):  # the common decode batch: no copy of the [B, V] logits
            return greedy_argmax(logits, self.cpu_kernels), raw_logprobs

        logits = _penalized_copy(logits, batch)  # processed in place from here on
        if batch.all_greedy:
            token_ids = greedy_argmax(logits, self.cpu_kernels)
        else:
            greedy_rows = batch.greedy_rows
            # before _sample overwrites the logits
            greedy_token_ids = greedy_argmax(logits, self.cpu_kernels) if greedy_rows is not None else None
            token_ids = _sample(logits, batch, self.cpu_kernels)
            if greedy_rows is not None and greedy_token_ids is not None:
                token_ids = torch.where(greedy_rows, greedy_token_ids, token_ids)
        return token_ids, raw_logprobs


def _processes_logits(batch: SamplingBatch) -> bool:
    processing = (batch.logit_bias, batch.allowed, batch.masked_stops, batch.repetition, batch.output_penalties)
    return any(t is not None for t in processing)


# Columns per block of the CPU argmax: a multiple of the vocabularies brisk serves (gpt-oss: 201,088 = 64 x 3,142).
ARGMAX_BLOCK = 64


def row_max_and_argmax(
    logits: torch.Tensor, cpu_kernels: CpuKernels | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, index of the first max) of each row of [B, V] logits, without copying them: torch.max(dim=-1)'s pair,
    NaN counting as the max.

    On CPUs torch's argmax costs ~4.5 ns an element (18 ms for 1024 x 4096 on one core) against ~0.35 ns for a
    max. brisk's C kernel takes both in about one read of the logits. Without it the row is cut into blocks of
    ARGMAX_BLOCK columns, the blocks' maxima found in one vectorised pass, and argmax runs only over the [B, V / 64]
    maxima and the one winning block of each row. The first block holding the row's max, then the first max in it,
    is the first max of the row. GPUs, and vocabularies that are not a multiple of the block, use torch's ops.
    """
    b, v = logits.shape
    if cpu_kernels is not None and b and v and cpu_kernels.sample_accepts(logits):
        return cpu_kernels.row_max_argmax(logits)
    if logits.is_cuda or v % ARGMAX_BLOCK or not logits.is_contiguous() or b == 0:
        values, indices = logits.max(dim=-1)
        return values, indices
    blocks = logits.view(b, v // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block_max = blocks.amax(dim=-1)
    row_max, best_block = block_max.max(dim=-1)
    inner = blocks[torch.arange(b, device=logits.device), best_block].argmax(dim=-1)
    return row_max, best_block * ARGMAX_BLOCK + inner


def greedy_argmax(logits: torch.Tensor, cpu_kernels: CpuKernels | None = None) -> torch.Tensor:
    return row_max_and_argmax(logits, cpu_kernels)[1]


def _penalized_copy(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """An fp32 copy of `logits` with logit_bias, min_tokens and the penalties applied: what greedy rows argmax, and
    what temperature and truncation then process for the sampled ones."""
    logits = logits.to(torch.float32, copy=True)
    _apply_allowed_tokens(logits, batch)
    _apply_logit_bias(logits, batch)
    _apply_min_tokens(logits, batch)
    _apply_repetition_penalty(logits, batch)
    _apply_presence_frequency_penalties(logits, batch)
    return logits


def _apply_allowed_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    allowed = batch.allowed
    if allowed is not None:  # the allowed logits kept, their rows -inf, the kept ones put back: no [R, V] mask
        flat = logits.view(-1)
        kept = flat[allowed.flat_allowed]
        logits[allowed.rows] = float("-inf")
        flat[allowed.flat_allowed] = kept


def _apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> None:
    bias = batch.logit_bias
    if bias is not None:
        # index_add_ over the flat logits (no pair repeats: one entry per token of a request's dict). An
        # index_put_ with accumulate=True checks its indices' range on the host on CUDA (.item() of their max and
        # min): the host would wait for the step's forward, which undoes overlap scheduling.
        flat = bias.rows * logits.shape[1] + bias.token_ids
        logits.view(-1).index_add_(0, flat, bias.values)


def _apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    stops = batch.masked_stops
    if stops is not None:
        logits[stops.rows, stops.token_ids] = float("-inf")


def _apply_repetition_penalty(logits: torch.Tensor, batch: SamplingBatch) -> None:
    # HF semantics: seen tokens get less likely whatever the sign of their logit.
    repetition = batch.repetition
    if repetition is not None:
        penalty = repetition.penalty
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(repetition.seen_token_mask, penalized, logits))


def _apply_presence_frequency_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    # OpenAI semantics: logit -= frequency * count + presence * (count > 0), over output tokens only.
    penalties = batch.output_penalties
    if penalties is not None:
        counts = penalties.output_token_counts
        logits -= penalties.frequency * counts + penalties.presence * (counts > 0)


def verification_logits(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What sampling each row draws from, for speculative decoding's verification (rejection_sampler.py):
    the greedy pick of every row (argmax after logit_bias, min_tokens and penalties: the token `sample` gives a
    greedy row), and the final logits of the sampled rows (temperature, top_k, top_p, min_p applied too; None when
    every row is greedy). `logits` is left unchanged."""
    if batch.all_greedy and not _processes_logits(batch):
        return greedy_argmax(logits), None
    logits = _penalized_copy(logits, batch)
    greedy_token_ids = greedy_argmax(logits)
    if batch.all_greedy:
        return greedy_token_ids, None
    _temper_and_truncate(logits, batch)
    return greedy_token_ids, logits.clamp_(max=torch.finfo(logits.dtype).max)


def _sample(logits: torch.Tensor, batch: SamplingBatch, cpu_kernels: CpuKernels | None) -> torch.Tensor:
    """Random token per row from the processed `logits` (overwritten); greedy rows get a meaningless token."""
    _temper_and_truncate(logits, batch)
    if cpu_kernels is not None and cpu_kernels.sample_accepts(logits):
        return cpu_kernels.sample_rows(logits, _uniforms(batch.generators))
    # A logit_bias or a tiny repetition_penalty can overflow a logit to +inf, which softmax turns into NaN: the
    # largest float keeps that token the certain pick (the C sampler gives a +inf logit the row by itself).
    return exponential_race(logits.clamp_(max=torch.finfo(logits.dtype).max).softmax(dim=-1), batch.generators)


def _temper_and_truncate(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if batch.temperature is not None:
        logits.div_(batch.temperature)
    if batch.top_p is not None:
        _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    elif batch.top_k is not None:
        _apply_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.min_p is not None:
        # p < min_p * p_max, in logits: x < x_max + log(min_p) (min_p 0: log 0 = -inf keeps every token)
        logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + batch.min_p.log(), float("-inf"))


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) draw per row: seeded rows from their own generator (their tokens do not depend on the batch),
    the others from the default generator."""
    uniforms = torch.rand(len(generators), dtype=torch.float64)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row] = torch.rand((), dtype=torch.float64, generator=generator)
    return uniforms


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep the top_k largest logits per row (and any tied with the k-th); cheaper than a full sort."""
    top_values = logits.topk(max_top_k, dim=-1).values
    kth_value = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth_value.masked_fill_(top_k.unsqueeze(1) >= logits.shape[1], float("-inf"))  # disabled rows keep all
    logits.masked_fill_(logits < kth_value, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> None:
    """top_k, then nucleus: keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, sorted_token_ids = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # A token is kept while the tokens before it have not reached top_p, so the top token is always kept.
    probability_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits.masked_fill_(probability_before >= top_p.unsqueeze(1), float("-inf"))
    logits.scatter_(1, sorted_token_ids, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(probs / q) with q ~ Exp(1) per token draws a token with probability proportional to probs.

    Seeded rows draw q from their own generator, so their tokens do not depend on the rest of the batch; the other
    rows share one draw from the default generator. probs need not be normalised.
    """
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # An Exp(1) draw of exactly 0 would turn a zero probability into 0/0 = nan, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


@dataclass
class LogprobTensors:
    """Each row's raw logprob of its sampled token and its best alternatives, on the logits' device (copied to the
    host where the step's outputs are built: no host synchronisation in the step)."""

    sampled: torch.Tensor  # [B] float32
    top_values: torch.Tensor | None  # [B, max_num_logprobs] best first; None when no row asked for alternatives
    top_token_ids: torch.Tensor | None  # [B, max_num_logprobs]

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        if self.top_values is None or self.top_token_ids is None:
            return (self.sampled,)
        return (self.sampled, self.top_values, self.top_token_ids)

    @classmethod
    def of(cls, token_ids: torch.Tensor, raw_logprobs: torch.Tensor, batch: SamplingBatch) -> LogprobTensors:
        sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if not batch.max_num_logprobs:
            return cls(sampled, None, None)
        top_values, top_token_ids = top_alternatives(raw_logprobs, batch.max_num_logprobs, batch.chosen_logprob_ids)
        return cls(sampled, top_values, top_token_ids)


def top_alternatives(
    raw_logprobs: torch.Tensor, width: int, chosen: ChosenLogprobIds | None, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, token ids) [B, width] of each row's alternatives: the likeliest first, or a row's chosen ids in its
    order. `rows` picks the batch rows of raw_logprobs' rows (verification gathers some positions)."""
    top_values, top_token_ids = raw_logprobs.topk(width, dim=-1)  # sorted, best first
    if chosen is None:
        return top_values, top_token_ids
    has_chosen, chosen_ids = (
        (chosen.rows, chosen.token_ids) if rows is None else (chosen.rows[rows], chosen.token_ids[rows])
    )
    top_token_ids = torch.where(has_chosen, chosen_ids[:, :width], top_token_ids)
    return raw_logprobs.gather(1, top_token_ids), top_token_ids


def logprobs_output(
    token_ids: list[int], host: tuple[torch.Tensor, ...], num_logprobs: list[int | None]
) -> SamplerOutput:
    """A SamplerOutput from the tokens and LogprobTensors.as_tuple() on the host."""
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if len(host) == 3:
        rows = zip(host[2].tolist(), host[1].tolist(), num_logprobs)
        for row, (token_ids_by_rank, values, count) in enumerate(rows):
            if count:
                top_logprobs[row] = list(zip(token_ids_by_rank[:count], values[:count]))
    return SamplerOutput(token_ids, host[0].tolist(), top_logprobs, num_logprobs)


def _with_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    tensors = LogprobTensors.of(token_ids, raw_logprobs, batch)
    return logprobs_output(token_ids.tolist(), tuple(t.cpu() for t in tensors.as_tuple()), batch.num_logprobs)
