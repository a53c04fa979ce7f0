"""The runner's persistent batch: one row per running request, kept between steps and changed incrementally.

A request gets a row when it is first scheduled (or resumes after a preemption) and loses it when it finishes
or is preempted; the last row then moves into the hole (condense), so rows 0..num_rows-1 are always in use.
Per-row state lives in preallocated arrays (numpy on the host, where the step's index arithmetic is vectorised,
plus one device tensor: the token each row sampled last), so a decode step costs a few array operations
whatever the batch, not a Python list per token.

Where a step's input tokens come from: a row's `host_token_ids` (the prompt; a resumed request's prompt and
outputs) for positions below `num_host_tokens`, and the row's last sampled token on the device for the one
position after them that a decode step computes. The runner never waits for a sampled token to reach the host
before the next step (overlap scheduling).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from brisk.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the runner keeps of a request, also while it is preempted (its generator must go on where it was)."""

    req_id: str
    host_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    num_prompt_tokens: int
    # Outputs kept on the host only for rows whose sampling reads them (penalties; min_tokens needs their count only).
    needs_history: bool
    output_token_ids: list[int] = field(default_factory=list)
    # prompt_logprobs: the prompt positions whose logprobs were reported (kept across a preemption: a resumed
    # request recomputes its prompt, and those are not reported twice).
    num_prompt_logprobs_done: int = 0


class InputBatch:
    def __init__(self, max_rows: int, max_blocks_per_row: list[int], device: torch.device) -> None:
        """max_blocks_per_row: per KV group (groups differ in tokens a block)."""
        self.max_rows = max_rows
        self.device = device
        self.req_ids: list[str] = []  # row -> request id
        self.states: list[RequestState] = []  # row -> state
        self.row_of: dict[str, int] = {}
        self.num_computed = np.zeros(max_rows, dtype=np.int64)
        self.num_host_tokens = np.zeros(max_rows, dtype=np.int64)
        self.num_blocks = np.zeros((len(max_blocks_per_row), max_rows), dtype=np.int64)  # per group and row
        # Rows of prefill-only requests (max_tokens 0): they never sample. Counted, so steps without any skip the mask.
        self.prefill_only = np.zeros(max_rows, dtype=bool)
        self.num_prefill_only = 0
        self.num_needs_history = 0  # rows whose sampling reads their outputs: steps without any never look
        self.block_tables = [np.zeros((max_rows, width), dtype=np.int32) for width in max_blocks_per_row]
        self.last_sampled = torch.zeros(max_rows, dtype=torch.int64, device=device)
        # Bumped whenever rows join, leave or move: the sampler's per-row tensors are rebuilt only then.
        self.version = 0
        # Speculative decoding: every token of each row on the host (prompt + outputs), for the proposer.
        self.token_ids: np.ndarray | None = None
        self.num_tokens = np.zeros(max_rows, dtype=np.int64)

    def enable_token_buffer(self, max_seq_len: int) -> None:
        self.token_ids = np.zeros((self.max_rows, max_seq_len), dtype=np.int32)

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    def add(self, state: RequestState, block_ids: list[list[int]], num_computed: int) -> int:
        row = len(self.req_ids)
        if row >= self.max_rows:
            raise RuntimeError(f"the batch holds {self.max_rows} rows; the scheduler admitted more")
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.row_of[state.req_id] = row
        self.num_computed[row] = num_computed
        self.num_host_tokens[row] = len(state.host_token_ids)
        self.num_blocks[:, row] = 0
        if self.token_ids is not None:
            self.num_tokens[row] = len(state.host_token_ids)
            self.token_ids[row, : len(state.host_token_ids)] = state.host_token_ids
        self.prefill_only[row] = state.params.max_tokens == 0
        self.num_prefill_only += int(self.prefill_only[row])
        self.num_needs_history += state.needs_history
        self.append_blocks(row, block_ids)
        self.version += 1
        return row

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        for g, (table, ids) in enumerate(zip(self.block_tables, block_ids)):
            if ids:
                start = int(self.num_blocks[g, row])
                table[row, start : start + len(ids)] = ids
                self.num_blocks[g, row] = start + len(ids)

    def remove(self, req_ids: list[str]) -> None:
        """Drop these requests' rows (unknown ids are ignored), moving the last rows into the holes."""
        for rid in req_ids:
            row = self.row_of.pop(rid, None)
            if row is None:
                continue
            last = len(self.req_ids) - 1
            self.num_prefill_only -= int(self.prefill_only[row])
            self.num_needs_history -= self.states[row].needs_history
            if row != last:
                moved = self.req_ids[last]
                self.req_ids[row] = moved
                self.states[row] = self.states[last]
                self.row_of[moved] = row
                for arr in (
                    self.num_computed,
                    self.num_host_tokens,
                    self.prefill_only,
                    self.num_tokens,
                ):
                    arr[row] = arr[last]
                if self.token_ids is not None:
                    self.token_ids[row, : self.num_tokens[row]] = self.token_ids[last, : self.num_tokens[row]]
                for g, table in enumerate(self.block_tables):
                    width = int(self.num_blocks[g, last])
                    table[row, :width] = table[last, :width]
                    self.num_blocks[g, row] = width
                self.last_sampled[row] = self.last_sampled[last]
            self.req_ids.pop()
            self.states.pop()
            self.version += 1
