"""Test-only proposers (not a test module): an oracle whose drafts are the target's own greedy continuation (every
draft is accepted) and a random one (almost every draft is rejected). Plugged into a built engine in place of its
n-gram proposer with `use_proposer(llm, proposer)`."""

from __future__ import annotations

import numpy as np

from brisk.spec_decode.proposer import DraftProposal, ModelFreeProposer, ProposeInputs


class OracleProposer(ModelFreeProposer):
    """Drafts the next k tokens of the reference sequence (prompt + greedy output, computed without speculation)
    that the request's tokens so far are a prefix of: a perfect draft head."""

    def __init__(self, references: list[list[int]]) -> None:
        self.references = references
        self.num_proposed = 0

    def propose(self, inputs: ProposeInputs) -> DraftProposal:
        drafts = []
        for row, n in zip(inputs.rows.tolist(), inputs.num_tokens.tolist()):
            known = inputs.token_ids[row, :n].tolist()
            ref = next((r for r in self.references if r[:n] == known), None)
            drafts.append([] if ref is None else ref[n : n + inputs.max_draft_len])
            self.num_proposed += len(drafts[-1])
        return DraftProposal(drafts)


class RandomProposer(ModelFreeProposer):
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def propose(self, inputs: ProposeInputs) -> DraftProposal:
        k = inputs.max_draft_len
        return DraftProposal([self.rng.integers(0, self.vocab_size, size=k).tolist() for _ in inputs.req_ids])


def use_proposer(llm, proposer) -> None:
    """Replace the (single-rank) engine's proposer."""
    drafter = llm.engine.executor.runner.drafter
    assert drafter is not None, "the engine was built without speculative_config"
    drafter.proposer = proposer
