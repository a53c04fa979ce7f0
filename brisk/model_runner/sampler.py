"""Batched sampling of the next token, with per-request sampling parameters.

Each step the model runner builds a `SamplingBatch` from the requests' `SamplingParams` and token histories,
then calls `Sampler()(logits, batch)`. The work is vectorised over the batch; the only Python loop over rows
draws the noise of seeded requests from their own generators. Steps that no row needs are skipped: the
batch holds `None` for them, so e.g. a batch without penalties builds no penalty tensors.

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

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np
import torch

from brisk.host import to_device
from brisk.kernels.cpu_kernels import CpuKernels
from brisk.sampling_params import SamplingParams

# Temperatures below this sample greedily (as in vLLM): dividing by them can overflow float32 logits.
MIN_SAMPLING_TEMPERATURE = 1e-5


def needs_history(params: SamplingParams) -> bool:
    """Whether sampling this request reads its past tokens (the penalties). min_tokens reads only how many there
    are, which the runner knows without them (its computed tokens less the prompt's)."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def samples_plain_greedy(params: SamplingParams) -> bool:
    """Greedy on the raw logits: nothing changes them (no logit_bias, min_tokens or penalties) and no logprobs are
    asked for, so the token is an argmax of the model's logits (the sampler's and verification's fast path)."""
    return (
        (params.greedy or params.temperature < MIN_SAMPLING_TEMPERATURE)
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.min_tokens
        and not needs_history(params)
        and params.logprobs is None
    )


@dataclass
class LogitBias:
    """logits[rows[i], token_ids[i]] += values[i]: the requests' logit_bias entries, flattened."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


@dataclass
class AllowedTokens:
    """Rows restricted to some tokens (allowed_token_ids): every other logit of those rows -inf."""

    rows: torch.Tensor  # [R] int64, the restricted rows
    flat_allowed: torch.Tensor  # [A] int64, row * vocab_size + token of each allowed (row, token)


@dataclass
class MaskedStopTokens:
    """Stop ids banned (logit -inf) while a row is shorter than its min_tokens, flattened."""

    rows: torch.Tensor  # [M] int64
    token_ids: torch.Tensor  # [M] int64


@dataclass
class ChosenLogprobIds:
    """Rows whose logprob alternatives are token ids the request chose (vLLM's logprob_token_ids), in its order,
    instead of the likeliest tokens."""

    rows: torch.Tensor  # [B, 1] bool: the row's alternatives are its chosen ids
    token_ids: torch.Tensor  # [B, max_num_logprobs] int64: a row's chosen ids, 0 past them (cut by its count)


@dataclass
class RepetitionPenalty:
    penalty: torch.Tensor  # [B, 1]; 1.0 where disabled
    seen_token_mask: torch.Tensor  # [B, V] bool: token occurs in the prompt or the output


@dataclass
class OutputPenalties:
    """OpenAI presence and frequency penalties, over output tokens only."""

    presence: torch.Tensor  # [B, 1]
    frequency: torch.Tensor  # [B, 1]
    output_token_counts: torch.Tensor  # [B, V] float32: occurrences of each token in the output


@dataclass
class SamplingBatch:
    """How to sample each row of one step's logits. A tensor (or group of tensors) is None when no row needs that
    processing step."""

    batch_size: int
    vocab_size: int
    all_greedy: bool
    greedy_rows: torch.Tensor | None  # [B] bool; None when no row (or every row) is greedy
    temperature: torch.Tensor | None  # [B, 1]; 1.0 on greedy rows
    top_k: torch.Tensor | None  # [B] int64; vocab_size where disabled
    max_top_k: int  # largest enabled top_k, kept on the host so that applying top_k needs no device sync
    top_p: torch.Tensor | None  # [B]; inf where disabled, so float rounding of cumulative sums never cuts there
    min_p: torch.Tensor | None  # [B, 1]; 0.0 where disabled
    logit_bias: LogitBias | None
    allowed: AllowedTokens | None
    masked_stops: MaskedStopTokens | None
    repetition: RepetitionPenalty | None
    output_penalties: OutputPenalties | None
    generators: list[torch.Generator | None]  # per row; only used on sampled (non-greedy) rows
    num_logprobs: list[int | None]  # per row: params.logprobs
    max_num_logprobs: int | None  # None when no row asked for logprobs
    chosen_logprob_ids: ChosenLogprobIds | None = None  # None when no row chose its logprob token ids
    plain_greedy: bool = False  # every row samples_plain_greedy: an argmax of the raw logits

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        stop_ids: Sequence[AbstractSet[int]],
        vocab_size: int,
        device: torch.device | str,
        num_output_tokens: Sequence[int] | None = None,
        prompt_seen: torch.Tensor | None = None,
        pending_tokens: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """Gather the per-row parameters into tensors on `device`.

        prompt_seen: [B, V] bool, the tokens of each row's prompt where it has a repetition penalty (else none),
        built once by the caller and kept while the rows are the same requests; prompt_ids are then not read.
        pending_tokens: [B] int64 on `device`, each row's latest output where output_ids does not hold it yet (the
        previous step's token, still on the device under overlap scheduling), vocab_size where none: the penalties
        count it from there, so the host never waits for it.

        output_ids[i]: request i's outputs so far, read by the penalties (empty where it has none).
        num_output_tokens[i]: how many outputs request i has before this row's token (default len(output_ids[i])):
        stop_ids[i] holds the token ids that end request i (eos unless ignore_eos, plus stop_token_ids); they are
        masked while num_output_tokens[i] < params[i].min_tokens. generators[i] is the request's seeded generator
        (on `device`), or None to share the default generator.
        """
        batch_size = len(params)
        if num_output_tokens is None:
            num_output_tokens = [len(out) for out in output_ids]
        if not (
            len(prompt_ids)
            == len(output_ids)
            == len(generators)
            == len(stop_ids)
            == len(num_output_tokens)
            == batch_size
        ):
            raise ValueError(
                "params, prompt_ids, output_ids, generators, stop_ids and num_output_tokens must have the same length"
            )
        device = torch.device(device)

        def row_tensor(values: list, dtype: np.dtype | type) -> torch.Tensor:
            # Pinned and asynchronous on a GPU: a pageable copy would make the host wait for the step in flight.
            with np.errstate(over="ignore"):  # a float beyond float32 becomes inf, as torch.tensor makes it
                array = np.array(values, dtype=dtype)
            return to_device(array, device)

        def column(values: list[float]) -> torch.Tensor:
            return row_tensor(values, np.float32).unsqueeze(1)

        greedy = [p.greedy or p.temperature < MIN_SAMPLING_TEMPERATURE for p in params]
        sampled = [not g for g in greedy]
        all_greedy = all(greedy)
        # Sampling parameters only matter on sampled rows; disabled values make a step a no-op for a row.
        temperatures = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]
        top_ks = [p.top_k if s and 0 < p.top_k < vocab_size else vocab_size for p, s in zip(params, sampled)]
        enabled_top_ks = [k for k in top_ks if k < vocab_size]
        top_ps = [p.top_p if s and p.top_p < 1.0 else float("inf") for p, s in zip(params, sampled)]
        min_ps = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]

        bias_rows, bias_token_ids, bias_values = [], [], []
        for row, p in enumerate(params):
            for token_id, bias in (p.logit_bias or {}).items():
                bias_rows.append(row)
                bias_token_ids.append(_checked_token_id(int(token_id), vocab_size, "logit_bias"))
                bias_values.append(float(bias))

        allowed_rows, flat_allowed = [], []
        for row, p in enumerate(params):
            if p.allowed_token_ids is not None:
                allowed_rows.append(row)
                ids = sorted({_checked_token_id(t, vocab_size, "allowed_token_ids") for t in p.allowed_token_ids})
                flat_allowed += [row * vocab_size + t for t in ids]

        stop_rows, stop_token_ids = [], []
        for row, (p, num_out, row_stop_ids) in enumerate(zip(params, num_output_tokens, stop_ids)):
            if num_out < p.min_tokens:
                for token_id in sorted(row_stop_ids):
                    stop_rows.append(row)
                    stop_token_ids.append(_checked_token_id(token_id, vocab_size, "stop_ids"))

        repetition_penalties = [p.repetition_penalty for p in params]
        seen_token_mask = None
        if any(r != 1.0 for r in repetition_penalties):
            # Rows without the penalty contribute no tokens: their penalty of 1.0 would be a no-op anyway.
            if prompt_seen is None:
                prompt_seen = prompt_token_mask(
                    [prompt if penalty != 1.0 else () for prompt, penalty in zip(prompt_ids, repetition_penalties)],
                    vocab_size,
                    device,
                )
            outputs = [out if penalty != 1.0 else () for out, penalty in zip(output_ids, repetition_penalties)]
            seen_token_mask = prompt_seen | (_token_occurrences(outputs, vocab_size, device, pending_tokens) > 0)

        presence_penalties = [p.presence_penalty for p in params]
        frequency_penalties = [p.frequency_penalty for p in params]
        output_token_counts = None
        if any(presence_penalties) or any(frequency_penalties):
            counted = [
                list(out) if presence or frequency else []
                for out, presence, frequency in zip(output_ids, presence_penalties, frequency_penalties)
            ]
            output_token_counts = _token_occurrences(counted, vocab_size, device, pending_tokens)

        logit_bias = None
        if bias_rows:
            rows, token_ids = row_tensor(bias_rows, np.int64), row_tensor(bias_token_ids, np.int64)
            logit_bias = LogitBias(rows, token_ids, row_tensor(bias_values, np.float32))
        masked_stops = None
        if stop_rows:
            masked_stops = MaskedStopTokens(row_tensor(stop_rows, np.int64), row_tensor(stop_token_ids, np.int64))
        output_penalties = None
        if output_token_counts is not None:
            presence, frequency = column(presence_penalties), column(frequency_penalties)
            output_penalties = OutputPenalties(presence, frequency, output_token_counts)
        num_logprobs = [p.logprobs for p in params]
        requested_logprobs = [n for n in num_logprobs if n is not None]
        chosen_logprob_ids = None
        if any(p.logprob_token_ids for p in params):
            chosen = np.zeros((batch_size, max(requested_logprobs)), dtype=np.int64)
            for row, p in enumerate(params):
                ids = [_checked_token_id(t, vocab_size, "logprob_token_ids") for t in p.logprob_token_ids or ()]
                chosen[row, : len(ids)] = ids
            has_chosen = np.array([p.logprob_token_ids is not None for p in params])[:, None]
            chosen_logprob_ids = ChosenLogprobIds(to_device(has_chosen, device), to_device(chosen, device))
        return cls(
            batch_size=batch_size,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy_rows=row_tensor(greedy, np.bool_) if any(greedy) and not all_greedy else None,
            temperature=column(temperatures) if any(t != 1.0 for t in temperatures) else None,
            top_k=row_tensor(top_ks, np.int64) if enabled_top_ks else None,
            max_top_k=max(enabled_top_ks, default=vocab_size),
            top_p=row_tensor(top_ps, np.float32) if any(p != float("inf") for p in top_ps) else None,
            min_p=column(min_ps) if any(min_ps) else None,
            logit_bias=logit_bias,
            allowed=AllowedTokens(row_tensor(allowed_rows, np.int64), row_tensor(flat_allowed, np.int64))
            if allowed_rows
            else None,
            masked_stops=masked_stops,
            repetition=RepetitionPenalty(column(repetition_penalties), seen_token_mask)
            if seen_token_mask is not None
            else None,
            output_penalties=output_penalties,
            generators=[g if s else None for g, s in zip(generators, sampled)],
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested_logprobs) if requested_logprobs else None,
            chosen_logprob_ids=chosen_logprob_ids,
            plain_greedy=all(map(samples_plain_greedy, params)),
        )


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


def prompt_token_mask(prompts: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[B, V] bool: the tokens each prompt holds (what the repetition penalty sees of it)."""
    return _token_occurrences(prompts, vocab_size, torch.device(device)) > 0


def _token_occurrences(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device, extra: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, V] float32 count of each token id in each row, by scatter_add over a padded [B, L] id tensor; extra
    ([B] on `device`, vocab_size for none): one more token a row, counted where it is."""
    width = max(map(len, rows), default=0)
    # Padding uses the extra column vocab_size, dropped at the end, so pads are counted nowhere.
    # Built on the host and copied pinned, asynchronously (a pageable copy would wait for the step in flight).
    padded_host = np.full((len(rows), width), vocab_size, dtype=np.int64)  # keeps the shape [B, 0] when all are empty
    for i, row in enumerate(rows):
        padded_host[i, : len(row)] = row
    padded = to_device(padded_host, torch.device(device))
    if extra is not None:
        padded = torch.cat((padded, extra[:, None]), dim=1)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _checked_token_id(token_id: int, vocab_size: int, what: str) -> int:
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"{what} token id {token_id} is outside the vocabulary [0, {vocab_size})")
    return token_id
