"""Tests for the batched sampler: every parameter must change the outcome when it is set. Every test runs twice:
with the torch sampler and with brisk's CPU kernels bound (random rows then drawn by the C sampler)."""

from __future__ import annotations

import math
import sys
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from brisk.errors import InvalidRequest
from brisk.kernels.cpu_kernels import load_cpu_kernels
from brisk.model_runner.sampler import Sampler, SamplerOutput
from brisk.model_runner.sampling_batch import SamplingBatch, _token_occurrences
from brisk.sampling_params import SamplingParams
from tests.conftest import skip_unless_isa_under_test

EOS = 0


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    *,
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
    stop_ids: list[set[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplerOutput:
    batch_size = len(params)
    if generators is None:
        generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    batch = SamplingBatch.build(
        params,
        prompt_ids or [[] for _ in range(batch_size)],
        output_ids or [[] for _ in range(batch_size)],
        generators,
        stop_ids or [{EOS} for _ in range(batch_size)],
        vocab_size=logits.shape[1],
        device="cpu",
    )
    return SAMPLER(logits, batch)


def draws(logits_row: list[float], params: SamplingParams, num_draws: int = 4000, **kwargs) -> Counter[int]:
    """Token counts of `num_draws` independent samples (one batch of identical rows, sharing one noise draw)."""
    logits = torch.tensor([logits_row] * num_draws, dtype=torch.float32)
    return Counter(sample(logits, [params] * num_draws, **kwargs).token_ids)


SAMPLER = Sampler()  # set per test by `sampler_kind`


@pytest.fixture(autouse=True, params=["torch", "avx512", "avx2"])
def sampler_kind(request, monkeypatch) -> str:
    """The torch sampler and the C sampler of each kernel build this run tests."""
    kernels = None
    if request.param != "torch":
        skip_unless_isa_under_test(request.config, request.param)
        kernels = load_cpu_kernels(request.param)
        assert kernels is not None
    monkeypatch.setattr(sys.modules[__name__], "SAMPLER", Sampler(kernels))
    return request.param


@pytest.fixture(autouse=True)
def fixed_default_generator() -> None:
    torch.manual_seed(0)  # unseeded rows use torch's default generator: make every test deterministic


# Distinct probabilities used by several tests: token 0 is the most likely.
PROBS = [0.5, 0.3, 0.15, 0.05]
PROB_LOGITS = [math.log(p) for p in PROBS]


def test_temperature_zero_is_argmax_and_positive_temperature_samples() -> None:
    logits = torch.randn(64, 100)
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 64)
    assert greedy.token_ids == logits.argmax(dim=-1).tolist()

    flat = [0.0] * 10
    assert draws(flat, SamplingParams(temperature=0.0)).keys() == {0}
    assert draws(flat, SamplingParams(temperature=1.0)).keys() == set(range(10))


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(64, 100)
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_only_emits_the_top_k_tokens() -> None:
    logits_row = (torch.randn(50) * 0.5).tolist()  # flat enough that every token would show up without top_k
    top5 = set(torch.tensor(logits_row).topk(5).indices.tolist())
    assert draws(logits_row, SamplingParams(top_k=5)).keys() == top5
    assert len(draws(logits_row, SamplingParams(top_k=0))) > 40


def test_tiny_top_p_equals_greedy() -> None:
    logits = torch.randn(64, 100)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 64)
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_p_keeps_smallest_set_reaching_top_p() -> None:
    # Cumulative probabilities 0.5, 0.8, 0.95, 1.0: top_p=0.7 needs the first two tokens.
    assert draws(PROB_LOGITS, SamplingParams(top_p=0.7)).keys() == {0, 1}
    assert draws(PROB_LOGITS, SamplingParams(top_p=0.9)).keys() == {0, 1, 2}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    # min_p=0.2 of the top probability 0.5 is 0.1: only the 0.05 token goes.
    assert draws(PROB_LOGITS, SamplingParams(min_p=0.2)).keys() == {0, 1, 2}
    assert draws(PROB_LOGITS, SamplingParams(min_p=0.0)).keys() == {0, 1, 2, 3}


def test_top_k_top_p_and_min_p_combine() -> None:
    # top_k=3 renormalises to 0.53, 0.32, 0.16: top_p=0.9 then needs all three; min_p=0.4 drops the third.
    assert draws(PROB_LOGITS, SamplingParams(top_k=3, top_p=0.9)).keys() == {0, 1, 2}
    assert draws(PROB_LOGITS, SamplingParams(top_k=3, top_p=0.9, min_p=0.4)).keys() == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    greedy_penalized = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    # Positive: 2.0 / 1.2 = 1.67 < 1.9. The token only occurs in the prompt: the penalty covers prompt tokens too.
    positive = torch.tensor([[0.0, 2.0, 1.9]])
    assert sample(positive, [greedy_penalized], prompt_ids=[[1]]).token_ids == [2]
    assert sample(positive, [SamplingParams(temperature=0.0)], prompt_ids=[[1]]).token_ids == [1]
    # Negative: -1.0 * 1.2 = -1.2 < -1.1. The token occurs in the output.
    negative = torch.tensor([[-5.0, -1.0, -1.1]])
    assert sample(negative, [greedy_penalized], output_ids=[[1]]).token_ids == [2]
    assert sample(negative, [SamplingParams(temperature=0.0)], output_ids=[[1]]).token_ids == [1]


def test_presence_penalty_applies_once_to_output_tokens_only() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.5]])
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert sample(logits, [params], output_ids=[[1]]).token_ids == [2]  # 2.0 - 1.0 < 1.5
    assert sample(logits, [params], prompt_ids=[[1]]).token_ids == [1]  # prompt tokens are not penalised
    assert sample(logits, [SamplingParams(temperature=0.0)], output_ids=[[1]]).token_ids == [1]


def test_frequency_penalty_scales_with_the_count() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.5]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert sample(logits, [params], output_ids=[[1, 1]]).token_ids == [1]  # 2.0 - 0.4 > 1.5
    assert sample(logits, [params], output_ids=[[1, 1, 1]]).token_ids == [2]  # 2.0 - 0.6 < 1.5
    assert sample(logits, [params], prompt_ids=[[1, 1, 1]]).token_ids == [1]


def test_penalties_only_touch_their_own_rows() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.5]] * 2)
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(temperature=0.0)]
    assert sample(logits, params, output_ids=[[1], [1]]).token_ids == [2, 1]


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.randn(8, 100)
    forced = sample(logits, [SamplingParams(logit_bias={7: 100.0})] * 8)
    assert forced.token_ids == [7] * 8
    argmax = logits.argmax(dim=-1).tolist()
    banned = sample(logits[:1], [SamplingParams(temperature=0.0, logit_bias={argmax[0]: -100.0})])
    assert banned.token_ids != argmax[:1]


def test_allowed_token_ids_are_the_only_ones_drawn() -> None:
    logits = torch.randn(4, 64)
    argmax = logits.argmax(dim=-1).tolist()
    allowed = [t for t in range(64) if t != argmax[0]][:5]
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0),  # a row without: its argmax
        SamplingParams(temperature=0.0, allowed_token_ids=[argmax[2], 63]),
        SamplingParams(temperature=0.0, allowed_token_ids=allowed, logit_bias={allowed[-1]: 50.0}),
    ]
    got = sample(logits, params).token_ids
    assert got[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert got[1:3] == argmax[1:3] and got[3] == allowed[-1]
    counts = draws([0.0] * 64, SamplingParams(temperature=1.0, allowed_token_ids=[3, 9, 40]), num_draws=3000)
    assert set(counts) == {3, 9, 40} and min(counts.values()) > 800  # uniform among the allowed
    with pytest.raises(ValueError, match="allowed_token_ids"):
        sample(logits[:1], [SamplingParams(allowed_token_ids=[64])])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 1.0, 2.0, 4.0]])  # eos (0) is the argmax, then token 3
    params = SamplingParams(temperature=0.0, min_tokens=2)
    assert sample(logits, [params], output_ids=[[1]]).token_ids == [3]
    assert sample(logits, [params], output_ids=[[1, 1]]).token_ids == [EOS]
    # Every stop id is masked (stop_token_ids included), and only those: ignore_eos leaves eos out of stop_ids.
    assert sample(logits, [params], output_ids=[[1]], stop_ids=[{EOS, 3}]).token_ids == [2]
    assert sample(logits, [params], output_ids=[[1]], stop_ids=[set()]).token_ids == [EOS]
    # Sampled rows never draw a masked stop id either.
    assert EOS not in draws([1.0, 1.0, 1.0, 1.0], SamplingParams(min_tokens=1))


def test_logprobs_are_raw_log_softmax_and_top_logprobs_sorted() -> None:
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.7, logit_bias={3: 5.0}),  # no logprobs asked
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.5),  # sampled token only
        SamplingParams(temperature=2.0, logprobs=5, top_k=10),
    ]
    out = sample(logits, params, prompt_ids=[[1, 2], [3, 4], [5]])
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs == pytest.approx([expected[row, t].item() for row, t in enumerate(out.token_ids)], abs=1e-5)
    assert out.top_logprobs is not None
    assert out.top_logprobs[0] == [] and out.top_logprobs[1] == []
    top = out.top_logprobs[2]
    values, token_ids = expected[2].topk(5)
    assert [t for t, _ in top] == token_ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)

    without = sample(logits, [SamplingParams()] * 3)
    assert without.logprobs is None and without.top_logprobs is None


def test_logprob_token_ids_replace_the_likeliest_alternatives_of_their_row_only() -> None:
    """A row that chose its logprob token ids gets those ids' raw logprobs in its order; a row beside it still gets
    its own top-n, though the batch's width is the chosen row's."""
    logits = torch.randn(3, 50)
    chosen = [7, 2, 40]
    params = [
        SamplingParams(temperature=1.0, logprob_token_ids=chosen),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, params)
    expected = torch.log_softmax(logits, dim=-1)
    assert params[0].logprobs == 3
    assert out.top_logprobs is not None
    assert [t for t, _ in out.top_logprobs[0]] == chosen
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(expected[0, chosen].tolist(), abs=1e-5)
    values, token_ids = expected[1].topk(2)
    assert [t for t, _ in out.top_logprobs[1]] == token_ids.tolist()
    assert [v for _, v in out.top_logprobs[1]] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.top_logprobs[2] == []
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingBatch.build([SamplingParams(logprob_token_ids=[50])], [[]], [[]], [None], [set()], 50, "cpu")


def test_logprob_token_ids_are_checked() -> None:
    with pytest.raises(InvalidRequest, match="must equal"):
        SamplingParams(logprobs=1, logprob_token_ids=[1, 2])
    with pytest.raises(InvalidRequest, match="1 to 128"):
        SamplingParams(logprob_token_ids=list(range(129)))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        SamplingParams(logprob_token_ids=[3, 60]).check_for_model([1], vocab_size=50, max_seq_len=100)
    SamplingParams(logprob_token_ids=list(range(128))).check_max_logprobs(20)  # vLLM's bound, not max_logprobs


def test_logits_are_not_modified() -> None:
    logits = torch.randn(2, 20)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.5, top_p=0.5, min_p=0.1, top_k=5, logit_bias={1: 3.0})] * 2)
    assert torch.equal(logits, before)


def test_unused_processing_steps_build_nothing() -> None:
    batch = SamplingBatch.build([SamplingParams()] * 2, [[1], [2]], [[3], [4]], [None, None], [{0}, {0}], 10, "cpu")
    unused = [
        batch.greedy_rows, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.logit_bias,
        batch.masked_stops, batch.repetition, batch.output_penalties,
    ]  # fmt: skip
    assert all(step is None for step in unused)
    assert batch.max_num_logprobs is None


def test_invalid_token_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingBatch.build([SamplingParams(logit_bias={10: 1.0})], [[]], [[]], [None], [set()], 10, "cpu")
    with pytest.raises(ValueError, match="stop_ids"):
        SamplingBatch.build([SamplingParams(min_tokens=1)], [[]], [[]], [None], [{12}], 10, "cpu")
    with pytest.raises(ValueError, match="same length"):
        SamplingBatch.build([SamplingParams()], [[]], [], [None], [set()], 10, "cpu")


def seeded_tokens(seed: int, own_logits: torch.Tensor, position: int, others: list[SamplingParams]) -> list[int]:
    """Tokens of a seeded request over 20 steps, placed at `position` among `others` in every step."""
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(seed=seed)
    tokens = []
    for step in range(20):
        torch.manual_seed(1000 + step + len(others))  # the default generator must not matter
        rows = [*others[:position], params, *others[position:]]
        generators = [generator if p is params else None for p in rows]
        logits = torch.randn(len(rows), own_logits.shape[0])
        logits[position] = own_logits
        tokens.append(sample(logits, rows, generators=generators).token_ids[position])
    return tokens


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    own_logits = torch.zeros(32)  # uniform: the noise alone picks the token
    alone = seeded_tokens(1234, own_logits, 0, [])
    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=7, top_k=3)]
    assert seeded_tokens(1234, own_logits, 2, others) == alone
    assert seeded_tokens(1234, own_logits, 0, others[:1]) == alone
    assert seeded_tokens(4321, own_logits, 0, []) != alone


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_follows_softmax_of_scaled_logits(temperature: float) -> None:
    logits_row = [1.0, 0.5, 0.0, -0.5, -1.0, -2.0]
    num_draws = 60_000
    counts = draws(logits_row, SamplingParams(temperature=temperature), num_draws=num_draws)
    expected = torch.softmax(torch.tensor(logits_row) / temperature, dim=0) * num_draws
    chi_square = sum((counts[t] - e) ** 2 / e for t, e in enumerate(expected.tolist()))
    # 5 degrees of freedom: P(chi2 > 35) ~ 1.5e-6 for a correct sampler, and the default generator is seeded
    # anyway; an ignored temperature or a wrong distribution gives a chi-square in the hundreds or more.
    assert chi_square < 35


@st.composite
def logits_and_params(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingParams]]:
    vocab_size = draw(st.integers(2, 24))
    batch_size = draw(st.integers(1, 4))
    rows = []
    for _ in range(batch_size):
        # Distinct logits 0.01 apart, so that top_k and top_p have no ties to break; some are -inf (masked).
        values = draw(st.lists(st.integers(-2000, 2000), min_size=vocab_size, max_size=vocab_size, unique=True))
        row = [v / 100 for v in values]
        for index in draw(st.lists(st.integers(0, vocab_size - 1), max_size=vocab_size - 1, unique=True)):
            row[index] = float("-inf")
        if all(math.isinf(v) for v in row):
            row[0] = 0.0
        rows.append(row)
    params = [
        SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0, 3.0])),
            top_k=draw(st.integers(-1, vocab_size + 2)),
            top_p=draw(st.floats(0.01, 1.0)),
            min_p=draw(st.floats(0.0, 1.0)),
            seed=draw(st.none() | st.integers(0, 2**31)),
        )
        for _ in range(batch_size)
    ]
    return torch.tensor(rows, dtype=torch.float32), params


def allowed_tokens(logits_row: list[float], params: SamplingParams) -> set[int]:
    """Tokens the sampler may pick, computed independently in float64 and with a little slack for rounding."""
    finite = [t for t, v in enumerate(logits_row) if math.isfinite(v)]
    if params.temperature == 0:
        return {max(finite, key=lambda t: logits_row[t])}
    scaled = {t: logits_row[t] / params.temperature for t in finite}
    kept = sorted(scaled, key=scaled.get, reverse=True)
    if params.top_k > 0:
        kept = kept[: params.top_k]
    top = scaled[kept[0]]
    weights = {t: math.exp(scaled[t] - top) for t in kept}
    total = sum(weights.values())
    # top_p: the probability of the more likely kept tokens must be below top_p.
    kept = [t for i, t in enumerate(kept) if sum(weights[s] for s in kept[:i]) / total < params.top_p + 1e-4]
    # min_p: probability relative to the most likely token (weights[top] == 1).
    return {t for t in kept if weights[t] >= params.min_p * (1 - 1e-4)}


@settings(max_examples=300, deadline=None)
@given(logits_and_params())
def test_sampled_tokens_stay_in_the_support(case: tuple[torch.Tensor, list[SamplingParams]]) -> None:
    logits, params = case
    out = sample(logits, params)
    for row, token in enumerate(out.token_ids):
        assert math.isfinite(logits[row, token].item()), "sampled a masked (-inf) token"
        assert token in allowed_tokens(logits[row].tolist(), params[row])


def test_sampling_over_a_large_vocabulary_follows_the_distribution() -> None:
    # Likely tokens spread over a vocabulary of several of the C sampler's 1,024-token chunks, the last one at the
    # vocabulary's end; everything else masked.
    vocab, picked = 5000, [3, 1500, 2047, 4999]
    row = [float("-inf")] * vocab
    for token, logit in zip(picked, PROB_LOGITS):
        row[token] = logit
    num_draws = 40_000
    counts = draws(row, SamplingParams(), num_draws=num_draws)
    assert counts.keys() == set(picked)
    chi_square = sum((counts[t] - p * num_draws) ** 2 / (p * num_draws) for t, p in zip(picked, PROBS))
    assert chi_square < 30  # 3 degrees of freedom: P(chi2 > 30) ~ 1.4e-6


def test_the_c_sampler_draws_by_inverse_transform(request, sampler_kind) -> None:
    # The token where the running sum of probabilities passes u: u just below each cumulative boundary picks that
    # token, just above it the next; u = 0 the first weighted token; masked tokens are never picked.
    if sampler_kind == "torch":
        pytest.skip("a test of the C sampler (the torch sampler draws by exponential race)")
    kernels = load_cpu_kernels(sampler_kind)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(7, 1)  # log 0 = -inf: masked
    uniforms = torch.tensor([0.0, 0.499, 0.501, 0.799, 0.801, 0.951, 0.999999], dtype=torch.float64)
    tokens = kernels.sample_rows(logits, uniforms).tolist()
    assert tokens == [1, 1, 3, 3, 4, 5, 5]
    # A +inf logit takes the row; a row of nothing but -inf still gets an id of the vocabulary.
    odd = torch.tensor([[0.0, float("inf"), 1.0, float("-inf")], [float("-inf")] * 4])
    assert kernels.sample_rows(odd, torch.tensor([0.5, 0.5], dtype=torch.float64)).tolist() == [1, 0]


def test_overflowing_logit_biases_still_give_tokens_of_the_vocabulary() -> None:
    # logit_bias values are any float: +1e300 makes a logit +inf (that token takes the row), -1e300 on every token
    # leaves nothing finite; the token must still be a valid id (an out-of-range id would crash the next step).
    logits = torch.randn(3, 20)
    boosted = SamplingParams(logit_bias={7: 1e300})
    everything_banned = SamplingParams(logit_bias={t: -1e300 for t in range(20)})
    out = sample(logits, [boosted, everything_banned, SamplingParams(temperature=1e-4, logit_bias={3: 100.0})])
    assert out.token_ids[0] == 7 and out.token_ids[2] == 3
    assert 0 <= out.token_ids[1] < 20


@pytest.mark.parametrize("shape", [(1, 64), (5, 4096), (3, 201088), (4, 100), (70, 37), (9, 7)], ids=str)
def test_greedy_argmax_is_torch_max(shape, sampler_kind):
    """The CPU argmax (the C kernel of each build; torch's by blocks) gives torch.max's pair: the first maximum
    (ties), NaN the max (its first one), +inf and -inf as numbers, -0.0 equal to 0.0, any width: vector tails, rows
    shorter than a vector, enough rows for the kernel's threads."""
    from brisk.model_runner.sampler import row_max_and_argmax

    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-2, 3, shape, generator=g).float()  # many ties
    last = shape[1] - 1
    if shape[0] > 3:
        logits[1] = float("-inf")
        logits[2, shape[1] // 2] = float("nan")
        logits[2, last] = float("nan")
        logits[3, last] = float("inf")  # in the tail of a width that is not a multiple of the vector
    if shape[0] > 5:
        logits[4] = -0.0
        logits[4, last] = 0.0
        logits[5, :] = float("-inf")
        logits[5, last] = -1e30
    for strided in (False, True):  # a row stride wider than the row (a view of a wider buffer)
        x = torch.cat([logits, torch.zeros(shape[0], 3)], dim=1)[:, : shape[1]] if strided else logits
        values, ids = row_max_and_argmax(x, SAMPLER.cpu_kernels)
        expected_values, expected_ids = logits.max(dim=-1)
        assert torch.equal(ids, expected_ids)
        assert torch.equal(values.isnan(), expected_values.isnan())
        finite = ~expected_values.isnan()
        assert torch.equal(values[finite], expected_values[finite])
        assert torch.equal(values[finite].signbit(), expected_values[finite].signbit())


def test_token_occurrences_count_each_rows_tokens_and_keep_empty_rows() -> None:
    counts = _token_occurrences([[1, 1, 3], [], [4]], 5, torch.device("cpu"))
    expected = [[0, 2, 0, 1, 0], [0] * 5, [0, 0, 0, 0, 1]]
    assert counts.dtype == torch.float32 and counts.tolist() == expected
    assert _token_occurrences([[], []], 5, torch.device("cpu")).tolist() == [[0.0] * 5] * 2
