"""The proposer interface: what the model runner gives a drafter after each step, and what it gets back.

Each step that samples, after verification (the step's accepted tokens are on the host and written into the
persistent batch's token buffer), the drafter (drafter.py) calls `proposer.propose(inputs)` once for the requests that sampled and may
speculate. The drafts come back in `ModelRunnerOutput.spec_token_ids`; the scheduler schedules them with each
request's next token (1 + k query tokens), where the target verifies them. A proposer never sees rejected drafts:
the drafter has rolled back its computed tokens (and the KV slots past them) before it calls `propose`.

Draft KV (a proposer with its own attention layers, e.g. EAGLE3): the runner asks `kv_bytes_per_block()` when it
sizes the KV pool and calls `bind_kv(num_blocks, block_size, device)` once after allocating the target's cache.
The proposer keeps its KV in its own tensors indexed by the target's block ids: block b holds the same positions
for the draft as for the target (`ProposeInputs.block_table`, the full-attention group's table). Positions up to
`num_tokens + lookahead_slots() - 1` of each request have a block (the scheduler allocates that many slots more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from brisk.model_runner.layout import StepBatch


@dataclass
class ProposeInputs:
    """One step's requests that may speculate next, in the order of `req_ids` (a subset of the step's sampled
    requests, in row order)."""

    req_ids: list[str]
    rows: np.ndarray  # [n] int64: their rows in the persistent batch
    # Every token of each row known after this step (prompt + outputs, the accepted ones included), on the host:
    # token_ids[rows[i], :num_tokens[i]]. The buffer is the runner's; read it, never write it.
    token_ids: np.ndarray  # [max_rows, max_seq_len] int32
    num_tokens: np.ndarray  # [n] int64
    num_accepted: np.ndarray  # [n] int64: tokens this step appended to each request (1 + accepted drafts)
    max_draft_len: int  # k: drafts per request at most (the scheduler may send fewer)
    # For model-based drafters: the step's layout and the target's last hidden states [num_tokens, hidden] of
    # every token the step computed. The accepted tokens of request i sit at token indices
    # step.query_start_loc[j] .. + num_accepted[i] - 1 where j = sample_pos[i] (its index among step.rows).
    step: StepBatch
    hidden_states: torch.Tensor
    sample_pos: np.ndarray  # [n] int64: index of each request in step.rows
    block_table: np.ndarray  # [max_rows, max_blocks] int32: the full-attention KV group's table of every row


@dataclass
class DraftProposal:
    """Drafts per request of `ProposeInputs.req_ids` (0..max_draft_len tokens each; empty: none this time).

    `probs`: the drafter's distribution q at each draft position ([len(drafts[i]), vocab] float32, on the
    runner's device, the request's sampling parameters applied as to the target), used by rejection sampling.
    None (for all or one request): each draft was picked deterministically (greedy drafting, prompt lookup), so q
    is one-hot on it."""

    token_ids: list[list[int]]
    probs: list[torch.Tensor | None] | None = None


class Proposer(Protocol):
    # True: every rank calls propose (e.g. a drafter sharded over TP ranks); False: only the ranks that sample
    # (rank 0; each attention-DP rank for its own rows), whose drafts reach the scheduler.
    on_every_rank: bool

    def propose(self, inputs: ProposeInputs) -> DraftProposal: ...

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of draft KV per KV block (0: no KV)."""
        ...

    def bind_kv(self, num_blocks: int, block_size: int, device: torch.device) -> None: ...

    def kv_caches(self) -> list[torch.Tensor]:
        """The draft KV tensors bound by bind_kv (block-major, like the target's): the host KV tier copies them too."""
        ...

    def lookahead_slots(self) -> int:
        """KV slots past a request's tokens its next drafting writes (0 for a drafter without KV)."""
        ...


class ModelFreeProposer:
    """The KV side of a drafter without a model of its own (n-gram, the tests' proposers): no KV, no lookahead."""

    on_every_rank = False

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0

    def bind_kv(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        pass

    def kv_caches(self) -> list[torch.Tensor]:
        return []

    def lookahead_slots(self) -> int:
        return 0
