"""Rejection sampling keeps the target's distribution: on an 8-token vocabulary, the first token after verifying
one draft (drawn from a fixed, deliberately different q) is distributed as the target p with the request's
sampling parameters applied (chi-square, fixed seed, enough draws that a wrong residual fails by far)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from brisk.model_runner.rejection_sampler import verify
from brisk.model_runner.sampler import verification_logits
from brisk.model_runner.sampling_batch import SamplingBatch
from brisk.sampling_params import SamplingParams

V = 8
N = 20_000
TARGET_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8])
Q = torch.tensor([0.02, 0.05, 0.08, 0.25, 0.25, 0.15, 0.1, 0.1])  # favours tokens p does not


def _batch(params: SamplingParams, rows: int) -> SamplingBatch:
    return SamplingBatch.build([params] * rows, [()] * rows, [()] * rows, [None] * rows, [set()] * rows, V, "cpu")


def _target_probs(params: SamplingParams) -> np.ndarray:
    _, final = verification_logits(TARGET_LOGITS[None, :], _batch(params, 1))
    assert final is not None
    return final.softmax(dim=-1)[0].double().numpy()


def _first_tokens(params: SamplingParams, one_hot_draft: int | None) -> np.ndarray:
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(1234)
    if one_hot_draft is None:
        drafts = torch.multinomial(Q, N, replacement=True, generator=gen).numpy()
        draft_probs = [Q[None, :]] * N
    else:
        drafts = np.full(N, one_hot_draft)
        draft_probs = None
    logits = TARGET_LOGITS.repeat(2 * N, 1)  # per request: the row verifying its draft, the bonus row
    verified = verify(logits, _batch(params, 2 * N), np.ones(N, dtype=np.int64), drafts, 1, draft_probs)
    return verified.token_ids[:, 0].numpy()


def _chi_square_pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    from scipy.stats import chisquare

    counts = np.bincount(tokens, minlength=V)
    support = p > 0
    assert counts[~support].sum() == 0, "a token the sampling parameters exclude was drawn"
    return float(chisquare(counts[support], len(tokens) * p[support] / p[support].sum()).pvalue)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, min_p=0.2, logit_bias={4: 1.5}),
    ],
    ids=["temperature", "top_p", "top_k", "min_p+logit_bias"],
)
@pytest.mark.parametrize("draft", ["sampled_q", "one_hot"])
def test_first_token_follows_the_target(params, draft):
    p = _target_probs(params)
    # one-hot: a fixed draft the target likes moderately (accepted with probability p(d), else p without d)
    tokens = _first_tokens(params, None if draft == "sampled_q" else 1)
    assert _chi_square_pvalue(tokens, p) > 1e-3
    if draft == "sampled_q":  # the test has power: the drafts themselves are far from p
        drafts = torch.multinomial(Q, N, replacement=True, generator=torch.Generator().manual_seed(1)).numpy()
        assert _chi_square_pvalue(drafts[np.isin(drafts, np.flatnonzero(p > 0))], p) < 1e-6


def test_greedy_rows_accept_exactly_the_argmax():
    params = SamplingParams(temperature=0.0)
    logits = TARGET_LOGITS.repeat(6, 1)  # three requests, one draft each
    drafts = np.array([0, 3, 0])
    verified = verify(logits, _batch(params, 6), np.ones(3, dtype=np.int64), drafts, 1)
    assert verified.num_tokens.tolist() == [2, 1, 2]
    assert verified.token_ids[:, :2].tolist() == [[0, 0], [0, 0], [0, 0]]


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))],
)
def test_a_request_fails_when_any_of_its_verify_rows_is_non_finite(device):
    """A speculative step's failure flag per request: any of its rows non-finite, not only its last (on CUDA a
    bool index_add_ stores instead of or-ing; the counts cross 16 rows, where its threads would race)."""
    from brisk.model_runner.sampling_stage import requests_with_a_bad_row

    counts = np.array([3, 1, 4, 2, 5, 3, 4], dtype=np.int64)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    bad_at = {0: 0, 2: 1, 4: 4, 6: 2}  # request -> which of its rows is non-finite (first, middle, last...)
    row_bad = torch.zeros(int(counts.sum()), dtype=torch.bool)
    for request, row in bad_at.items():
        row_bad[first[request] + row] = True
    flags = requests_with_a_bad_row(row_bad.to(device), counts)
    assert flags.device.type == device
    assert flags.cpu().tolist() == [i in bad_at for i in range(len(counts))]
