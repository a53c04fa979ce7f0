"""One step as the runner lays it out (`StepBatch`), from the persistent batch and the step's SchedulerOutput.

Each scheduled request computes `num_scheduled_tokens` tokens from its computed ones on; the tokens come from the
host (prompts, a resumed request's outputs, drafts) or, for the one token after them a decode computes, from the
row's last sampled token on the device (a placeholder here, filled by the forward). Requests whose tokens reach
their known ones sample (`sample_idx`); with drafts every verified position gives logits (`logits_indices`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brisk.host import to_device
from brisk.layers.attention import AttentionMetadata
from brisk.model_runner.input_batch import InputBatch
from brisk.scheduler.output import SchedulerOutput


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


def lay_out_step(
    batch: InputBatch, sched: SchedulerOutput, block_sizes: tuple[int, ...], device: torch.device
) -> StepBatch:
    """The step's model input, from the persistent batch: vectorised over rows and tokens (block_sizes: the tokens
    a block of each KV group holds). The batch is read, not changed (the runner advances its computed tokens by the
    step's)."""
    dev = device
    nst = sched.num_scheduled_tokens
    row_of = batch.row_of
    num_rows = len(nst)
    rows = np.fromiter(map(row_of.__getitem__, nst), dtype=np.int64, count=num_rows)
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
    slot_mappings = [
        table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        for table, bs in zip(batch.block_tables, block_sizes)
    ]
    widths = batch.num_blocks[:, rows].max(axis=1).tolist() if num_rows else [0] * len(block_sizes)
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
        block_tables=[table[rows, :width] for table, width in zip(batch.block_tables, widths)],
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
