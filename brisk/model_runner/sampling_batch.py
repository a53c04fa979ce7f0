"""`SamplingBatch`: how to sample each row of one step's logits, gathered from the requests' `SamplingParams` and
token histories into tensors on the device (vLLM's sampling metadata). The model runner builds it each step
(sampling_stage.py); the sampler (sampler.py) and the rejection sampler read it. A processing step that no row
needs is None, so e.g. a batch without penalties builds no penalty tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np
import torch

from brisk.host import to_device
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
