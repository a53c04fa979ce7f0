"""prompt_logprobs: the logprobs of prompt tokens, in the few steps that compute prompt positions some request asked
about (SchedulerOutput.needs_prompt_logprobs)."""

from __future__ import annotations

import numpy as np
import torch

from brisk.host import to_device
from brisk.model_runner.input_batch import InputBatch
from brisk.model_runner.layout import StepBatch
from brisk.models.registry import BriskModel
from brisk.scheduler.output import PromptLogprobs

PROMPT_LOGITS_ROWS = 1024  # positions whose full-vocabulary logits are held at once


def prompt_logprobs(
    model: BriskModel, batch: InputBatch, step: StepBatch, hidden: torch.Tensor, device: torch.device
) -> dict[str, PromptLogprobs]:
    """For each request that asked for prompt_logprobs: the logprob (fp32 log_softmax), rank and top-k of
    every prompt token this step's positions predict (position p's logits predict prompt token p + 1).
    Every TP rank takes part (the LM head is vocab-parallel); the host copy happens here, in the few steps
    that compute such positions."""
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
        idx = to_device(index[a : a + PROMPT_LOGITS_ROWS], device)
        tgt = to_device(targets[a : a + PROMPT_LOGITS_ROWS], device)
        logprobs = torch.log_softmax(model.compute_logits(hidden[idx]).float(), dim=-1)
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
