"""The drafting side of a speculative step, after the runner verified the drafts and took the tokens to the host.

1. record: each request's accepted tokens go into the persistent batch's token buffer (and the history of requests
   sampling with it);
2. roll back: its computed tokens drop by the rejected drafts, and its blocks past them (plus the lookahead slots)
   leave the batch's table, as the scheduler's books do (`roll_back_drafts`);
3. propose: the proposer drafts for the requests that may speculate; the drafts go back in ModelRunnerOutput.

The drafter holds the persistent batch and the proposer, never the runner. It also keeps what verification needs
of the last proposal: each request's q (drafters that sample) and whether its last drafts were all accepted
(adaptive draft length).
"""

from __future__ import annotations

import numpy as np
import torch

from brisk.model_config import ParallelConfig
from brisk.model_runner.input_batch import InputBatch
from brisk.model_runner.layout import StepBatch
from brisk.scheduler.output import roll_back_drafts
from brisk.spec_decode.config import SpeculativeConfig
from brisk.spec_decode.proposer import ProposeInputs, Proposer


class Drafter:
    def __init__(
        self,
        proposer: Proposer,
        config: SpeculativeConfig,
        batch: InputBatch,
        block_sizes: tuple[int, ...],
        parallel: ParallelConfig,
        max_seq_len: int,
    ) -> None:
        self.proposer = proposer
        self.k = config.max_draft_len
        self.disable_by_batch_size = config.disable_by_batch_size
        self.batch = batch
        self.block_sizes = np.array(block_sizes)  # per KV group: the tokens a block holds
        self.parallel = parallel
        batch.enable_token_buffer(max_seq_len)
        # Pad every request's drafts to k (cuda_graph_config: the next step is then a verification of the static
        # shape; any draft keeps the output exact). Set by the runner when it has verify graphs.
        self.pad_drafts = False
        # Drafters that sample: each request's q for its pending drafts, until the step that verifies them.
        self._draft_probs: dict[str, torch.Tensor] = {}
        # Adaptive draft length (config.draft_len_after_rejection): requests whose last verified drafts were not all
        # accepted, drafting this many tokens until a step accepts all of them.
        self.draft_len_after_rejection = config.draft_len_after_rejection
        self._short_drafts: set[str] = set()

    @property
    def needs_every_step(self) -> bool:
        """A drafter with its own KV (EAGLE3) sees every step, also one that sampled nothing."""
        return getattr(self.proposer, "needs_every_step", False)

    def forget(self, req_ids: list[str]) -> None:
        """Requests that left the batch (finished, preempted)."""
        if self._draft_probs or self._short_drafts:
            for rid in req_ids:
                self._draft_probs.pop(rid, None)
                self._short_drafts.discard(rid)

    def take_draft_probs(self, req_ids: list[str]) -> list[torch.Tensor | None] | None:
        """The q of each request's drafts being verified now (None: every draft one-hot)."""
        if not self._draft_probs:
            return None
        return [self._draft_probs.pop(rid, None) for rid in req_ids]

    def record_and_propose(
        self, step: StepBatch, hidden: torch.Tensor, req_ids: list[str], host: list[list[int]]
    ) -> list[list[int]]:
        """host: this rank's packed result rows (sampling_stage.py), one per sampled request of `req_ids`. Returns
        the drafts of each (empty: none)."""
        k, batch = self.k, self.batch
        token_buf = batch.token_ids
        assert token_buf is not None  # enable_token_buffer in __init__
        rows = step.rows[step.sample_idx]
        num_drafts = step.num_drafts
        lookahead = self.proposer.lookahead_slots()
        eligible: list[int] = []  # indices into the sampled requests
        for i, (row, packed_row) in enumerate(zip(rows.tolist(), host)):
            count, bad = packed_row[k + 1], packed_row[k + 2]
            if bad:
                continue
            tokens = packed_row[:count]
            state = batch.states[row]
            nt = int(batch.num_tokens[row])
            token_buf[row, nt : nt + count] = tokens
            batch.num_tokens[row] = nt + count
            if state.needs_history:
                state.output_token_ids.extend(tokens)
            verified = int(num_drafts[i]) if num_drafts is not None else 0
            if self.draft_len_after_rejection is not None and verified:
                if count - 1 < verified:
                    self._short_drafts.add(req_ids[i])
                else:
                    self._short_drafts.discard(req_ids[i])
            if count - 1 < verified:
                computed, slots = roll_back_drafts(int(batch.num_computed[row]), verified, count - 1, lookahead)
                batch.num_computed[row] = computed
                kept = -(-slots // self.block_sizes)  # each group's blocks that hold the kept slots
                np.minimum(batch.num_blocks[:, row], kept, out=batch.num_blocks[:, row])
            eligible.append(i)
        drafts: list[list[int]] = [[] for _ in host]
        if self.disable_by_batch_size is not None and batch.num_rows >= self.disable_by_batch_size:
            eligible = []
        p = self.parallel
        # only the ranks whose drafts reach the scheduler propose, unless the proposer runs on every rank
        if not (eligible or self.needs_every_step) or not (self.proposer.on_every_rank or p.dp_size > 1 or p.rank == 0):
            return drafts
        idx = np.asarray(eligible, dtype=np.int64)
        sel_rows = rows[idx]
        counts = np.asarray([host[i][k + 1] for i in eligible], dtype=np.int64)
        inputs = ProposeInputs(
            req_ids=[req_ids[i] for i in eligible],
            rows=sel_rows,
            token_ids=token_buf,
            num_tokens=batch.num_tokens[sel_rows].copy(),
            num_accepted=counts,
            max_draft_len=k,
            step=step,
            hidden_states=hidden,
            sample_pos=step.sample_idx[idx],
            block_table=batch.block_tables[0],
        )
        proposal = self.proposer.propose(inputs)
        short = self.draft_len_after_rejection
        for j, (i, d) in enumerate(zip(eligible, proposal.token_ids)):
            drafts[i] = list(d) if short is None or req_ids[i] not in self._short_drafts else list(d[:short])
            q = proposal.probs[j] if proposal.probs is not None else None
            if q is not None and drafts[i]:
                self._draft_probs[req_ids[i]] = q[: len(drafts[i])]
            else:
                self._draft_probs.pop(req_ids[i], None)
        # Under attention DP a rank pads even when none of its requests drafted: every rank's next step is then a
        # verification, and the ranks share one static shape (cuda_graph.py's common_shape).
        if self.pad_drafts and (any(drafts) or (p.dp_size > 1 and eligible)):
            # repeating each request's last token: every request's next step verifies k drafts
            drafts = [d + [row[row[k + 1] - 1]] * (k - len(d)) for d, row in zip(drafts, host)]
        return drafts
