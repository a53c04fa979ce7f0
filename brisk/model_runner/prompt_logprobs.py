"""prompt_logprobs: the logprobs of prompt tokens, in the few steps that compute prompt positions some request asked
about (SchedulerOutput.needs_prompt_logprobs); read on the host with the step's outputs."""

from __future__ import annotations

import numpy as np
import torch

from brisk.host import HostCopy, HostResult, to_device
from brisk.model_runner.input_batch import InputBatch
from brisk.model_runner.layout import StepBatch
from brisk.models.registry import BriskModel
from brisk.scheduler.output import PromptLogprobs

PROMPT_LOGITS_ROWS = 1024  # positions whose full-vocabulary logits are held at once


def prompt_logprobs(
    model: BriskModel, batch: InputBatch, step: StepBatch, hidden: torch.Tensor, device: torch.device
) -> HostResult[dict[str, PromptLogprobs]] | None:
    """For each request that asked for prompt_logprobs: the logprob (fp32 log_softmax), rank and top-k of
    every prompt token this step's positions predict (position p's logits predict prompt token p + 1).
    Every TP rank takes part (the LM head is vocab-parallel). Computed on the device in the few steps that compute
    such positions; their copy to the host starts here and the per-request lists are built when the step's outputs
    are read (HostResult: no host wait inside the step). None: no such position in this step."""
    counts = np.diff(step.query_start_loc)
    starts = step.seq_lens - counts
    spans = []  # (request id, first position, end position, first token index, top-k asked)
    for i, row in enumerate(step.rows.tolist()):
        state = batch.states[row]
        if state.params.prompt_logprobs is None:
            continue
        lo = max(int(starts[i]), state.num_prompt_logprobs_done)
        hi = min(int(step.seq_lens[i]), state.num_prompt_tokens - 1)
        if lo < hi:
            first = int(step.query_start_loc[i]) + lo - int(starts[i])
            targets = np.asarray(state.host_token_ids[lo + 1 : hi + 1], dtype=np.int64)
            spans.append((state.req_id, lo, hi, first, targets, state.params.prompt_logprobs or 0))
            state.num_prompt_logprobs_done = hi
    if not spans:
        return None
    index = np.concatenate([np.arange(t, t + hi - lo) for _, lo, hi, t, _, _ in spans])
    targets = np.concatenate([tg for *_, tg, _ in spans])
    k = max(n for *_, n in spans)
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
    tensors = [torch.cat(token_lps), torch.cat(ranks)]
    if k:
        tensors += [torch.cat(top_lps), torch.cat(top_ids)]

    def build(lps: torch.Tensor, rank: torch.Tensor, *top: torch.Tensor) -> dict[str, PromptLogprobs]:
        lp_host, rank_host = lps.tolist(), rank.tolist()
        top_v, top_i = (top[0].tolist(), top[1].tolist()) if top else (None, None)
        out: dict[str, PromptLogprobs] = {}
        a = 0
        for req_id, lo, hi, _, _, n in spans:
            b = a + hi - lo
            rows = (
                [list(zip(ids[:n], vals[:n])) for ids, vals in zip(top_i[a:b], top_v[a:b])]
                if top_i is not None and top_v is not None and n
                else [[] for _ in range(b - a)]
            )
            out[req_id] = PromptLogprobs(lo, lp_host[a:b], rank_host[a:b], rows)
            a = b
        return out

    return HostResult(HostCopy.start(*tensors), build)
