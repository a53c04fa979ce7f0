"""Verification of draft tokens against the target's logits, in one pass over the step's rows: the sampling stage's
mode for speculative steps (sampling_stage.py), beside the sampler as vLLM's rejection sampler sits beside its own.

Layout: request i contributes 1 + k_i consecutive rows of `logits` (the target's distribution after its last
token and after each of its k_i drafts; a request without drafts, one row). The `SamplingBatch` has one row per
logits row, each with the request's parameters and its history up to that position (penalties, min_tokens see
the drafts before it), so every row's distribution p is what sampling without speculation would draw from.

Greedy rows: draft j is accepted while it equals the argmax of its row (the token decoding without speculation
would pick), then the argmax of the first disagreeing row (or of the last row: the bonus token) follows. The
output is token-identical to decoding without speculation.

Sampled rows (rejection sampling, Leviathan et al. 2023): draft d at a row with target p and draft distribution
q is accepted with probability min(1, p(d) / q(d)); the first rejected position draws from the normalised
residual max(0, p - q) instead, and when every draft is accepted the last row's p gives the bonus token. The
output tokens are distributed exactly as the target's. A proposer that picks its drafts deterministically (prompt
lookup, greedy drafting) has a one-hot q: d is accepted with probability p(d), the residual is p without d.
Seeded requests draw every uniform and every sample from their own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brisk.host import to_device
from brisk.model_runner.sampler import exponential_race, verification_logits
from brisk.model_runner.sampling_batch import SamplingBatch


@dataclass
class Verified:
    token_ids: torch.Tensor  # [n, K + 1] int64: request i's output tokens in token_ids[i, :num_tokens[i]]
    num_tokens: torch.Tensor  # [n] int64: accepted drafts + 1


def verify(
    logits: torch.Tensor,
    batch: SamplingBatch,
    num_drafts: np.ndarray,
    draft_token_ids: np.ndarray,
    max_draft_len: int,
    draft_probs: list[torch.Tensor | None] | None = None,
) -> Verified:
    """logits [R, V] float32 (R = sum(1 + num_drafts)); draft_token_ids: the drafts of all requests, concatenated;
    draft_probs: per request, its drafts' q ([k_i, V]) or None (one-hot)."""
    dev = logits.device
    n, k = len(num_drafts), max_draft_len
    counts = num_drafts + 1
    first_row = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=first_row[1:])
    total = int(num_drafts.sum())
    req_of_draft = np.repeat(np.arange(n), num_drafts)
    pos_of_draft = np.arange(total) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
    draft_rows_host = first_row[req_of_draft] + pos_of_draft
    draft_rows = to_device(draft_rows_host, dev)
    drafts = to_device(draft_token_ids.astype(np.int64), dev)

    greedy_ids, final_logits = verification_logits(logits, batch)
    accept = greedy_ids[draft_rows] == drafts
    probs = q_of_draft = None
    if final_logits is not None:
        is_greedy = _greedy_rows(batch, dev)
        probs = final_logits.softmax(dim=-1)
        p_of_draft = probs[draft_rows, drafts]
        q_of_draft = torch.ones(total, dtype=probs.dtype, device=dev)
        if draft_probs is not None:
            at = 0
            for i, q in enumerate(draft_probs):
                m = int(num_drafts[i])
                if q is not None and m:
                    q_of_draft[at : at + m] = q[:m].to(dev, probs.dtype).gather(1, drafts[at : at + m, None])[:, 0]
                at += m
        uniforms = _uniforms([batch.generators[r] for r in draft_rows_host.tolist()], dev)
        # u < p / q, written without the division (q(d) > 0: the drafter drew d)
        accept = torch.where(is_greedy[draft_rows], accept, uniforms * q_of_draft < p_of_draft)

    accepted = torch.zeros(n, k + 1, dtype=torch.int64, device=dev)  # column k stays 0: stops the count
    token_ids = torch.zeros(n, k + 1, dtype=torch.int64, device=dev)
    if total:
        req_t, pos_t = to_device(req_of_draft, dev), to_device(pos_of_draft, dev)
        accepted[req_t, pos_t] = accept.to(torch.int64)
        token_ids[req_t, pos_t] = drafts
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    final_rows = to_device(first_row, dev) + num_accepted
    final = greedy_ids[final_rows]
    if probs is not None:
        # A request's rows share its generator (the expanded batch repeats it): its first row's, read on the host.
        generators = [batch.generators[r] for r in first_row.tolist()]
        final = _resample(final, probs, final_rows, num_accepted, num_drafts, token_ids, draft_probs, batch, generators)
    token_ids.scatter_(1, num_accepted[:, None], final[:, None])
    return Verified(token_ids, num_accepted + 1)


def _resample(
    final: torch.Tensor,
    probs: torch.Tensor,
    final_rows: torch.Tensor,
    num_accepted: torch.Tensor,
    num_drafts: np.ndarray,
    token_ids: torch.Tensor,
    draft_probs: list[torch.Tensor | None] | None,
    batch: SamplingBatch,
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """The sampled requests' token after their accepted drafts: from the residual max(0, p - q) at a rejected
    draft, from p after all of them. generators: each request's. Computed for every request and chosen by mask, so
    that nothing waits for the device (a step's verification runs before its result is read)."""
    dev = probs.device
    is_greedy = _greedy_rows(batch, dev)[final_rows]
    dist = probs[final_rows]  # [n, V], a copy
    rejected = ((num_accepted < to_device(num_drafts, dev)) & ~is_greedy)[:, None]
    drafted = token_ids.gather(1, num_accepted[:, None])  # [n, 1]: the draft at each request's first unaccepted place
    if draft_probs is None or all(q is None for q in draft_probs):  # one-hot q: the residual is p without the draft
        dist.scatter_(1, drafted, dist.gather(1, drafted).masked_fill_(rejected, 0.0))
    else:
        q = torch.zeros_like(dist).scatter_(1, drafted, 1.0)  # one-hot where a drafter gave no q
        for i, request_q in enumerate(draft_probs):
            if request_q is not None and len(request_q):
                at = num_accepted[i : i + 1].clamp(max=len(request_q) - 1)
                q[i] = request_q.to(dev, dist.dtype).index_select(0, at)[0]
        dist = torch.where(rejected, (dist - q).clamp_(min=0.0), dist)
    # p == q: no residual (a rejection is then impossible but for rounding): p itself
    dist = torch.where(rejected & (dist.sum(dim=1, keepdim=True) <= 0), probs[final_rows], dist)
    sampled = exponential_race(dist, generators)
    return torch.where(is_greedy, final, sampled)


def _greedy_rows(batch: SamplingBatch, dev: torch.device) -> torch.Tensor:
    if batch.all_greedy:
        return torch.ones(batch.batch_size, dtype=torch.bool, device=dev)
    if batch.greedy_rows is None:
        return torch.zeros(batch.batch_size, dtype=torch.bool, device=dev)
    return batch.greedy_rows


def _uniforms(generators: list[torch.Generator | None], dev: torch.device) -> torch.Tensor:
    """One U[0, 1) per entry: from its generator where it has one (a seeded request), else the default one."""
    out = torch.rand(len(generators), device=dev)
    for i, g in enumerate(generators):
        if g is not None:
            out[i] = torch.rand((), generator=g, device=g.device)
    return out
