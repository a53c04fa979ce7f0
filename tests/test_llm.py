"""Offline API semantics on a tiny Llama with a real (tiny) BPE tokenizer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from brisk import LLM, SamplingParams
from brisk.sampling_params import InvalidRequest
from tests.tiny_models import make_tiny_llama_with_tokenizer

PROMPTS = ["The quick brown fox", "Once upon a time there was", "A", "def main():\n    return"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_llama_with_tokenizer(path)
    return LLM(str(path), seed=0, tokens_per_block=4)


def _tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_text_and_token_prompts_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_text = llm.generate(PROMPTS, params)
    by_ids = llm.generate([llm.tokenizer.encode(p) for p in PROMPTS], params)
    assert _tokens(by_text) == _tokens(by_ids)
    for o in by_text:
        c = o.outputs[0]
        assert len(c.token_ids) == 8 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_seed_gives_same_tokens_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded)
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batched = llm.generate(PROMPTS, [others, seeded, others, others])
    assert alone[0].outputs[0].token_ids == batched[1].outputs[0].token_ids
    other_seed = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=10, seed=4321, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_n_completions_share_the_prompt(llm):
    hits_before = llm.engine.kv.prefix_hits
    prompt = "shared prompt " * 6
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.kv.prefix_hits - hits_before >= 2 * 4 * (len(out.prompt_token_ids) // 4 - 1)
    assert llm.engine.kv.pool.num_used == 0


def _straddling_stop(llm, token_ids: list[int]) -> str | None:
    """A 3-character string made of the end of one output token and the start of the next (plain ASCII)."""
    pieces = [llm.tokenizer.decode([t]) for t in token_ids]
    for a, b in zip(pieces[1:], pieces[2:]):
        if len(a) >= 2 and b and (a + b).isascii() and (a + b).isprintable():
            return a[-2:] + b[:1]
    return None


def test_stop_string_spanning_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    found = [(p, o.outputs[0]) for p, o in zip(PROMPTS, llm.generate(PROMPTS, params))]
    prompt, full, stop = next((p, c, s) for p, c in found if (s := _straddling_stop(llm, c.token_ids)))
    expected = full.text[: full.text.index(stop)]
    c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert c.text == expected and c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.token_ids) < len(full.token_ids)  # the engine stopped generating
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == expected + stop
    assert llm.engine.kv.pool.num_used == 0


def test_stop_token_ids_and_eos(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    # min_tokens: the stop counts once that many tokens precede it, and is never sampled before
    def held_back(min_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id], min_tokens=min_tokens)
        return llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids

    assert held_back(first) == full.token_ids[: first + 1]
    late = held_back(first + 1)
    assert len(late) > first + 1 and stop_id not in late[: first + 1]


def test_logprobs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and len(lp) <= 4
        assert lp[tok] == pytest.approx(max(lp.values()))  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)))


def test_logprob_token_ids(llm):
    """Each output position lists the sampled token's logprob, then the chosen ids' in their order, with the values
    the top-n alternatives would show; the tokens are those sampled without them."""
    params = dict(temperature=0, max_tokens=5, ignore_eos=True)
    full = llm.generate(PROMPTS[0], SamplingParams(**params, logprobs=20))[0].outputs[0]
    chosen = [t for t in reversed(full.logprobs[0]) if t != full.token_ids[0]][:3]  # position 0's least likely first
    out = llm.generate(PROMPTS[0], SamplingParams(**params, logprob_token_ids=chosen))[0].outputs[0]
    assert out.token_ids == full.token_ids
    for tok, lps, reference in zip(out.token_ids, out.logprobs, full.logprobs):
        assert list(lps) == [tok, *(t for t in chosen if t != tok)]
        assert lps[tok] == pytest.approx(reference[tok], abs=1e-5)
        for t in set(lps) & set(reference):
            assert lps[t] == pytest.approx(reference[t], abs=1e-5)
    assert all(out.logprobs[0][t] == pytest.approx(full.logprobs[0][t], abs=1e-5) for t in chosen)


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    expected = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) == 4
    # vLLM's continue_final_message: the template's rendering with the last message open, as transformers writes it
    begun = [*messages, {"role": "assistant", "content": "Once upon"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    out = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)[0]
    expected = llm.tokenizer.apply_chat_template(begun, continue_final_message=True, tokenize=True)
    assert out.prompt_token_ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


def test_too_long_prompt_is_rejected_without_leaking(llm):
    used = llm.engine.kv.pool.num_used
    # checked before anything is queued: a ValueError naming the field, as the server's 400 does
    with pytest.raises(InvalidRequest, match="maximum context length") as err:
        llm.generate([1] * (llm.engine.max_seq_len + 1), SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequest, match="max_tokens asks for") as err:
        llm.generate([[1, 2], [1] * 10], SamplingParams(max_tokens=llm.engine.max_seq_len - 5))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as err:
        llm.generate([1, 2, 10**6], SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    assert llm.engine.kv.pool.num_used == used and not llm.engine.has_unfinished_requests()


def test_abort_releases_blocks(llm):
    from brisk.engine.messages import EngineCoreRequest

    engine = llm.engine
    engine.add_request(EngineCoreRequest("x", [5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_used > 0
    outs = engine.abort_request("x")
    assert [o.finish_reason for o in outs] == ["abort"]
    assert engine.kv.pool.num_used == 0 and not engine.has_unfinished_requests()


# ---- lifecycle ---------------------------------------------------------------------------------------------------
def _child_pids() -> set[int]:
    """This process's live children (Linux /proc), e.g. the worker ranks of a tp_size > 1 engine."""
    pids: set[int] = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            pids.update(int(p) for p in f.read().split())
    return pids


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads children from Linux /proc")


@needs_proc
@pytest.mark.parametrize("tp_size", [1, 2])
def test_an_llm_dropped_without_close_releases_everything(tmp_path, tp_size):
    # Created, dropped (no close, no `with`), created again: the first one's workers and process group are gone
    # before the second joins its own world ("default process group twice" before the finalizer existed).
    path = str(make_tiny_llama_with_tokenizer(tmp_path / "llama"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = _child_pids()
    llm = LLM(path, tp_size=tp_size, max_num_tokens=64)
    workers = _child_pids() - before
    assert len(workers) == tp_size - 1  # rank 0 is this process
    first = _tokens(llm.generate(PROMPTS[:2], params))
    del llm
    assert _child_pids() == before and not dist.is_initialized()
    with LLM(path, tp_size=tp_size, max_num_tokens=64) as again:
        assert _tokens(again.generate(PROMPTS[:2], params)) == first
    assert _child_pids() == before and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        again.generate(PROMPTS[0], params)
    again.close()  # a second close does nothing


@needs_proc
def test_a_second_world_while_the_first_is_open_is_a_clear_error(tmp_path):
    path = str(make_tiny_llama_with_tokenizer(tmp_path / "llama"))
    before = _child_pids()
    with LLM(path, tp_size=2, max_num_tokens=64):
        with pytest.raises(RuntimeError, match="another engine with tp_size > 1 is still open here"):
            LLM(path, tp_size=2, max_num_tokens=64)
        assert len(_child_pids() - before) == 1  # the refused one spawned nothing
    assert _child_pids() == before


@needs_proc
def test_workers_are_stopped_at_interpreter_exit(tmp_path):
    # A script that never closes its LLM: at exit its worker is stopped (not orphaned) and the script exits 0.
    path = make_tiny_llama_with_tokenizer(tmp_path / "llama")
    script = (
        "import os\n"
        "from brisk import LLM\n"
        f"llm = LLM({str(path)!r}, tp_size=2, max_num_tokens=64)\n"
        "print(*(p.pid for p in llm.engine.executor._workers), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (worker,) = (int(p) for p in done.stdout.split())
    assert not os.path.exists(f"/proc/{worker}")  # exited and reaped by the script before it exited
