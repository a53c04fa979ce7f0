"""Structured outputs enforced by the engine (issue 18), in process: the grammar compiled off the step loop, one
bitmask per constrained row applied in the sampler, matchers advanced by the sampled tokens.

Random tiny models at temperature 1 over many seeds, batched in one generate call each: a tiny Llama whose model
vocabulary is padded beyond its tokenizer's (the whole output constrained; 6 schemas x 50 seeds), and a tiny
gpt-oss with the real o200k_harmony vocabulary (reasoning free, the final answer constrained). Every output must
parse and validate with `jsonschema`; regex and choice outputs must match; n > 1, preemption and overlap on and off
keep every KV block accounted for.
"""

from __future__ import annotations

import json
import re
import shutil
import threading

import pytest
import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from brisk.config import EngineConfig
from brisk.engine.core import EngineCore
from brisk.engine.messages import EngineCoreRequest
from brisk.harmony.parser import HarmonyParser
from brisk.harmony.results import HarmonyResult
from brisk.llm import LLM
from brisk.sampling_params import InvalidRequest, SamplingParams
from brisk.structured import StrictTool, StructuredOutputs
from brisk.structured.compiler import GrammarCompiler
from tests.harmony_tokenizer import SHARED_DIR, TIKTOKEN_FILE, VOCAB_SIZE, make_gpt_oss_tokenizer
from tests.test_structured_decode import SCHEMAS
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

jsonschema = pytest.importorskip("jsonschema")
needs_o200k = pytest.mark.skipif(not TIKTOKEN_FILE.exists(), reason="needs ../shared/tokenizers/o200k_base.tiktoken")

SEEDS = 50
TOKENIZER_VOCAB = 512
MODEL_VOCAB = 544  # padded embedding, as real checkpoints pad theirs: ids 512..543 must be masked
# one whitespace character at most between JSON tokens: a random model would otherwise spend most of its tokens
# on whitespace runs (the default bound, 32 a run, is for real models)
ENGINE = dict(dtype="float32", seed=0, check_kv_invariants=True, max_seq_len=256, grammar_max_json_whitespace=1)


def as_xgrammar_reads(tokenizer, ids: list[int]) -> str:
    """The text of byte-level tokens as xgrammar 0.2.8 counts its characters: it takes an encoded surrogate (bytes
    ED A0..BF xx, which UTF-8 forbids) inside a JSON string as one character, so maxLength holds for it only when it
    is decoded as one (surrogatepass); Python's strict decoder would make it three replacement characters."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    data = bytes(byte_of[char] for token in tokenizer.convert_ids_to_tokens(ids) for char in token)
    return data.decode("utf-8", "surrogatepass")


def _all_blocks_free(engine: EngineCore) -> bool:
    idle = not engine.has_unfinished_requests() and not engine.requests
    return idle and all(kv.pool.num_used == 0 for kv in engine.kv_managers)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("structured_llama")
    make_tiny_model("llama", path, seed=0, vocab_size=MODEL_VOCAB)
    make_tiny_tokenizer(path, TOKENIZER_VOCAB)
    return str(path)


@pytest.fixture(scope="module")
def llama(llama_path):
    options = dict(ENGINE, kv_cache_config={"max_blocks": 4096})
    with LLM(llama_path, max_batch_size=SEEDS * len(SCHEMAS), max_num_tokens=4096, **options) as llm:
        yield llm


def test_llama_every_seed_of_every_schema_validates(llama):
    """6 schemas x 50 seeds at temperature 1 in one generate call: the whole output is the JSON."""
    names = list(SCHEMAS)
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs=StructuredOutputs(json=schema))
        for schema in SCHEMAS.values()
        for seed in range(SEEDS)
    ]
    outputs = llama.generate([[5, 6, 7]] * len(params), params)
    eos = set(llama.engine.model_config.eos_token_ids)
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        schema = SCHEMAS[names[i // SEEDS]]
        assert completion.finish_reason == "stop", (names[i // SEEDS], completion)
        assert all(t < TOKENIZER_VOCAB for t in completion.token_ids)  # padded ids never sampled
        ids = [t for t in completion.token_ids if t not in eos]
        # strict=False: xgrammar 0.2.8 lets a raw control-character byte into a JSON string (see test_structured_decode)
        jsonschema.validate(json.loads(as_xgrammar_reads(llama.tokenizer, ids), strict=False), schema)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs[:SEEDS]}) > 1  # sampling varied
    assert _all_blocks_free(llama.engine)


def test_llama_regex_choice_grammar_and_logprobs(llama):
    pattern = r"[0-9]{2,4}-[a-z]{3}"
    regex = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=StructuredOutputs(regex=pattern))
        for s in range(20)
    ]
    choices = ["sunny", "rainy", "snow"]
    choice = SamplingParams(
        temperature=1.0, seed=3, n=8, max_tokens=20, logprobs=2, structured_outputs=StructuredOutputs(choice=choices)
    )
    grammar = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputs(grammar='root ::= "yes" | "no"')
    )
    outputs = llama.generate([[5, 6]] * 22, [*regex, choice, grammar])
    for out in outputs[:20]:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert len(outputs[20].outputs) == 8
    for completion in outputs[20].outputs:
        assert completion.text in choices
        # logprobs are reported after masking: once the word is complete only the stop token is allowed, so its
        # logprob is 0 (probability 1) and the runner-up is a masked token (-inf)
        assert completion.logprobs is not None and abs(completion.logprobs[-1][completion.token_ids[-1]]) < 1e-4
        assert sorted(completion.logprobs[-1].values())[0] == float("-inf")
    assert outputs[21].outputs[0].text in ("yes", "no")


def test_llama_unsatisfiable_within_max_tokens_ends_with_length(llama):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 50}}, "required": ["text"]}
    (out,) = llama.generate(
        [[5]], SamplingParams(temperature=1.0, seed=0, max_tokens=6, structured_outputs=StructuredOutputs(json=schema))
    )
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 6
    assert completion.text.startswith("{")  # the partial JSON


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(json={"type": "objec"}), 'Unsupported type "objec"'),
        (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "'uniqueItems'"),
        (StructuredOutputs(regex="(ab"), "parenthesis"),
        (StructuredOutputs(grammar="root ::= foo"), 'Rule "foo" is not defined'),
    ],
)
def test_invalid_grammars_are_refused_before_admission(llama, spec, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        llama.generate([[5]], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert _all_blocks_free(llama.engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_n_preemption_and_overlap(llama_path, overlap):
    """n > 1 siblings (one compile, a matcher each), a KV pool too small for the batch (preemption keeps the
    matcher state), overlap scheduling on and off: every output validates, every block is free at the end."""
    schema = SCHEMAS["nested"]
    options = dict(ENGINE, tokens_per_block=4, max_num_tokens=64, kv_cache_config={"max_blocks": 30})
    with LLM(llama_path, max_batch_size=16, disable_overlap_scheduler=not overlap, **options) as llm:
        constrained = SamplingParams(
            temperature=1.0, seed=1, n=4, max_tokens=100, structured_outputs=StructuredOutputs(json=schema)
        )
        plain = SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=30, ignore_eos=True)
        outputs = llm.generate([[5, 6, 7, 8]] * 3, [constrained, plain, constrained])
        eos = set(llm.engine.model_config.eos_token_ids)
        for out in (outputs[0], outputs[2]):
            assert len(out.outputs) == 4
            for completion in out.outputs:
                ids = [t for t in completion.token_ids if t not in eos]
                jsonschema.validate(json.loads(as_xgrammar_reads(llm.tokenizer, ids), strict=False), schema)
        assert all(len(c.token_ids) == 30 for c in outputs[1].outputs)
        assert llm.engine.stats().num_preemptions > 0
        assert _all_blocks_free(llm.engine)


def test_attention_dp_ranks_mask_their_own_rows(llama_path):
    """tp_size 2 with attention data parallelism: the SchedulerOutputs (bitmasks included) go to the other rank
    over msgpack and each DP rank masks and samples its own constrained rows."""
    schema = SCHEMAS["nested"]
    with LLM(llama_path, tp_size=2, enable_attention_dp=True, **ENGINE) as llm:
        params = [
            SamplingParams(temperature=1.0, seed=s, max_tokens=150, structured_outputs=StructuredOutputs(json=schema))
            for s in range(8)
        ]
        outputs = llm.generate([[5, 6, 7]] * 8, params)
        eos = set(llm.engine.model_config.eos_token_ids)
        for out in outputs:
            ids = [t for t in out.outputs[0].token_ids if t not in eos]
            jsonschema.validate(json.loads(as_xgrammar_reads(llm.tokenizer, ids), strict=False), schema)
        assert len(llm.engine.schedulers) == 2  # requests go to the least loaded rank: both ranks sampled
        assert _all_blocks_free(llm.engine)


def test_compile_timeout(llama_path, monkeypatch):
    """A grammar slower than grammar_compile_timeout_s (compiles held back until the test releases them): the
    offline API refuses it; a request admitted to the engine directly fails (the server's 400) without leaking
    anything, and the requests beside it run."""
    release = threading.Event()
    compile_now = GrammarCompiler._compile

    def stalled(self, tag):
        release.wait()
        return compile_now(self, tag)

    monkeypatch.setattr(GrammarCompiler, "_compile", stalled)
    try:
        with LLM(llama_path, grammar_compile_timeout_s=0.05, **ENGINE) as llm:
            spec = StructuredOutputs(json=SCHEMAS["bounds"])
            with pytest.raises(InvalidRequest, match="longer than 0.05 s"):
                llm.generate([[5]], SamplingParams(max_tokens=4, structured_outputs=spec))
            assert _all_blocks_free(llm.engine)
        engine = EngineCore(EngineConfig.build(llama_path, None, grammar_compile_timeout_s=0.05, **ENGINE))
        try:
            params = SamplingParams(n=2, max_tokens=4, structured_outputs=StructuredOutputs(json=SCHEMAS["enum"]))
            engine.add_request(EngineCoreRequest("r1", [5, 6], params))
            engine.add_request(EngineCoreRequest("r2", [5, 6], SamplingParams(max_tokens=3)))
            outputs, failures = [], []
            while engine.has_unfinished_requests():
                step = engine.step()
                outputs += step.outputs
                failures += step.refused
            assert [rid for rid, _ in failures] == ["r1"] and "longer than 0.05 s" in failures[0][1].message
            assert {o.request_id for o in outputs if o.finished} == {"r2"}
            assert _all_blocks_free(engine)
        finally:
            engine.shutdown()
    finally:
        release.set()


@pytest.fixture(scope="module")
def gpt_oss_path(tmp_path_factory) -> str:
    if not TIKTOKEN_FILE.exists():
        pytest.skip("needs ../shared/tokenizers/o200k_base.tiktoken")
    path = tmp_path_factory.mktemp("structured_gpt_oss")
    make_tiny_model("gpt_oss", path, seed=0, vocab_size=VOCAB_SIZE)
    shutil.copy(SHARED_DIR / "models" / "gpt-oss-20b" / "generation_config.json", path / "generation_config.json")
    make_gpt_oss_tokenizer(path)
    return str(path)


def _harmony_results(llm: LLM, outputs, opened: tuple[int, ...] = ()) -> list[tuple[str, HarmonyResult]]:
    """(finish_reason, what the server's harmony parser makes of the turn) for each request's completion; `opened`:
    the turn's tokens the prompt holds after its `<|start|>assistant`."""
    return [
        (
            out.outputs[0].finish_reason,
            HarmonyParser.from_tokenizer(llm.tokenizer).parse([*opened, *out.outputs[0].token_ids]),
        )
        for out in outputs
    ]


@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_path):
    with LLM(gpt_oss_path, max_batch_size=300, max_num_tokens=4096, **dict(ENGINE, max_seq_len=512)) as llm:
        yield llm


@needs_o200k
def test_gpt_oss_reasoning_free_final_answer_validates(gpt_oss):
    """The real o200k_harmony vocabulary: every schema over 50 seeds in one generate call. The prompt opens the
    reasoning (the matcher takes up the turn there); the random model reasons (any text token of the 201k) until
    it ends the message, and a logit bias on <|end|> and the final channel's name makes that come soon; the
    answer in the final channel must validate, and it is all that `content` holds."""
    llm = gpt_oss
    tokenizer = llm.tokenizer
    opened = tokenizer.encode("<|channel|>analysis<|message|>", add_special_tokens=False)
    prompt = llm.render_chat([{"role": "user", "content": "Answer in JSON."}]) + opened
    end, final = tokenizer.encode("<|end|>final", add_special_tokens=False)
    bias = {end: 12.0, final: 15.0}  # <|end|> about one token in two: reasoning of a few tokens
    names = list(SCHEMAS)
    seeds = 50  # x 6 schemas, as one batch
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=400,
            logit_bias=bias,
            structured_outputs=StructuredOutputs(json=SCHEMAS[name]),
        )
        for name in names
        for seed in range(seeds)
    ]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params)
    ret = tokenizer.convert_tokens_to_ids("<|return|>")
    reasoning_tokens: set[int] = set()
    for i, ((finish, result), out) in enumerate(zip(_harmony_results(llm, outputs, tuple(opened)), outputs)):
        ids = out.outputs[0].token_ids
        assert finish == "stop" and ids[-1] == ret, out.outputs[0]  # the grammar ended the answer with <|return|>
        reasoning_tokens.update(ids[: ids.index(tokenizer.convert_tokens_to_ids("<|end|>"))])
        try:
            value = json.loads(result.content, strict=False)
        except ValueError as error:
            raise AssertionError(f"{names[i // seeds]} seed {i % seeds}: {result} {ids}") from error
        jsonschema.validate(value, SCHEMAS[names[i // seeds]])
        assert not result.tool_calls
    # the reasoning was sampled from the whole vocabulary, never from the JSON grammar
    assert len(reasoning_tokens - set(bias)) > 20
    assert _all_blocks_free(llm.engine)


HOT_SEEDS = 32


@needs_o200k
def test_gpt_oss_hot_sampling_never_leaves_the_answer_unconstrained(gpt_oss):
    """A hot random model pushed towards harmony's special tokens (a logit bias on all seven, and on the channel
    names) writes malformed headers, <|return|> before any final channel, unknown channels... unless the grammar
    constrains the turn's structure. Every completion that finishes must hold a final answer that validates
    (before the fix about three in four did not); running out of max_tokens is the only other outcome, and a
    request whose max_tokens is too small for any answer ends with "length", never hangs.

    Strict tools under tool_choice auto in the same batch: the bias makes some seeds call the tool; every call's
    arguments validate against its schema, and the other seeds' answers are free text."""
    llm = gpt_oss
    tokenizer = llm.tokenizer
    specials = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
    words = tokenizer.encode("final commentary analysis", add_special_tokens=False)
    words += tokenizer.encode("final", add_special_tokens=False) + tokenizer.encode(
        "commentary", add_special_tokens=False
    )
    bias = dict.fromkeys([tokenizer.convert_tokens_to_ids(t) for t in specials] + words, 12.0)
    schema = SCHEMAS["nested"]
    question = [{"role": "user", "content": "Who is the admin? Answer in JSON."}]
    answer = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=120, logit_bias=bias, structured_outputs=StructuredOutputs(json=schema)
        )
        for s in range(HOT_SEEDS)
    ]
    short = SamplingParams(
        temperature=1.0, seed=0, max_tokens=3, logit_bias=bias, structured_outputs=StructuredOutputs(json=schema)
    )
    weather = SCHEMAS["bounds"]
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather, "strict": True}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    ]
    strict = StructuredOutputs(tools=(StrictTool("get_weather", weather),), free_tools=("get_time",))
    # the call's header rather than a preamble's (its <|message|> unbiased)
    named = tokenizer.encode(" to=functions.get_weather", add_special_tokens=False)
    tool_bias = {**dict.fromkeys(named, 10.0), **bias}
    tool_bias.pop(tokenizer.convert_tokens_to_ids("<|message|>"))
    calls = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=120, logit_bias=tool_bias, structured_outputs=strict)
        for s in range(HOT_SEEDS // 2)
    ]
    chat = {"prompt_token_ids": llm.render_chat(question)}
    with_tools = {"prompt_token_ids": llm.render_chat(question, tools=tools)}
    outputs = llm.generate([chat] * (HOT_SEEDS + 1) + [with_tools] * len(calls), [*answer, short, *calls])
    results = _harmony_results(llm, outputs)

    finished = 0
    for finish, result in results[:HOT_SEEDS]:
        assert finish in ("stop", "length"), finish
        if finish == "stop":
            finished += 1
            jsonschema.validate(json.loads(result.content, strict=False), schema)
            assert not result.tool_calls
    assert finished >= HOT_SEEDS // 2  # most reach the answer: the check above is not vacuous
    assert results[HOT_SEEDS][0] == "length" and len(outputs[HOT_SEEDS].outputs[0].token_ids) == 3

    weather_calls = 0
    for finish, result in results[HOT_SEEDS + 1 :]:
        assert finish in ("stop", "length"), finish
        for call in result.tool_calls:
            assert call.name in ("get_weather", "get_time")
            if call.name == "get_weather" and finish == "stop":
                weather_calls += 1
                jsonschema.validate(json.loads(call.arguments, strict=False), weather)
    assert weather_calls >= HOT_SEEDS // 4
    assert _all_blocks_free(llm.engine)


@needs_o200k
def test_gpt_oss_prompt_the_turn_grammar_cannot_continue_is_refused(gpt_oss):
    """A raw prompt that opened the assistant's message with a header harmony does not have: the request fails with
    a 400-style error when its matcher is made, nothing leaks, and the engine goes on."""
    opened = gpt_oss.tokenizer.encode("<|channel|>banter<|message|>", add_special_tokens=False)
    prompt = gpt_oss.render_chat([{"role": "user", "content": "Hi"}]) + opened
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json=SCHEMAS["enum"]))
    with pytest.raises(InvalidRequest, match="cannot continue"):
        gpt_oss.generate([{"prompt_token_ids": prompt}], params)
    assert _all_blocks_free(gpt_oss.engine)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
)
def test_bitmask_rows_follow_the_sampled_order(device):
    """The runner's apply: bitmask rows for some sampled requests (in any order), the others untouched; ids past
    the bitmask (an LM head wider than the vocabulary) are masked on the constrained rows. On a GPU the bitmask
    goes up through pinned memory and covers every row (all allowed on the unconstrained ones)."""
    import msgspec

    from brisk.scheduler.output import SchedulerOutput
    from brisk.structured.matcher import GrammarBitmaskApplier, apply_grammar_bitmask

    vocab, wide = 64, 70
    allowed = {"c": [3, 40], "a": [0, 63]}
    bitmask = torch.zeros(2, vocab // 32, dtype=torch.int32)
    for row, rid in enumerate(["c", "a"]):
        for token in allowed[rid]:
            bitmask[row, token // 32] |= 1 << (token % 32)
    sched = SchedulerOutput(sampled_req_ids=["a", "b", "c"], grammar_req_ids=["c", "a"])
    sched.grammar_bitmask = bitmask.numpy().tobytes()
    # what the other ranks receive (tensor / expert parallelism): the same message through msgpack
    sched = msgspec.msgpack.decode(msgspec.msgpack.encode(sched), type=SchedulerOutput)
    for applier in (apply_grammar_bitmask, GrammarBitmaskApplier(num_threads=2)):
        if isinstance(applier, GrammarBitmaskApplier):
            applier.MIN_ELEMENTS_PER_THREAD = 1  # rows split over the threads even at this size
        logits = torch.randn(3, wide).to(device)
        before = logits.clone()
        applier(logits, sched)
        logits, before = logits.cpu(), before.cpu()
        for row, rid in ((0, "a"), (2, "c")):
            finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
            assert finite == allowed[rid]
            assert torch.equal(logits[row, finite], before[row, finite])
        assert torch.equal(logits[1], before[1])


def test_closing_the_engine_stops_the_mask_threads(llama_path):
    """The runner's grammar masker splits big batches over a thread pool; closing the LLM shuts that pool down."""
    llm = LLM(llama_path, **ENGINE)
    masker = llm.engine.executor.runner.sampling.grammar_masker
    masker.MIN_ELEMENTS_PER_THREAD = 1  # every constrained step splits its rows over the threads
    masker.num_threads = 2
    masker.cpu_kernels = None  # xgrammar's kernel, on the masker's threads (brisk's C kernel uses OpenMP's)
    params = SamplingParams(n=2, max_tokens=4, structured_outputs=StructuredOutputs(json=SCHEMAS["enum"]))
    llm.generate([{"prompt_token_ids": [5, 6]}], params)
    pool = masker._pool
    assert pool is not None and not pool._shutdown
    llm.close()
    assert pool._shutdown


def _decode_json(llm: LLM, token_ids: list[int]):
    """The output's JSON as xgrammar read it (an encoded surrogate is one character of a maxLength-bounded string,
    not the three replacement characters tokenizer.decode makes of it: as_xgrammar_reads)."""
    eos = set(llm.engine.model_config.eos_token_ids)
    return json.loads(as_xgrammar_reads(llm.tokenizer, [t for t in token_ids if t not in eos]), strict=False)


@pytest.mark.parametrize("proposer", ["oracle", "random", "ngram"])
def test_speculative_drafts_follow_the_grammar(llama_path, proposer):
    """Speculation beside structured outputs: drafts the grammar refuses are dropped before verification, every
    verified position is masked by the grammar state after the drafts before it, and the matcher advances by the
    accepted run. Greedy: token-identical to decoding without speculation, with a perfect drafter (every draft
    accepted: a mask on the wrong position would change an argmax) and a random one (drafts cut by the grammar).
    Sampled: every output still validates."""
    from tests.spec_proposers import OracleProposer, RandomProposer, use_proposer

    names = ["nested", "array", "enum", "pattern"]
    prompts = [[5 + i, 6, 7 + 2 * i] for i in range(len(names) + 2)]
    specs = [StructuredOutputs(json=SCHEMAS[n]) for n in names] + [StructuredOutputs(regex="(ab|cd){2,6}"), None]
    greedy = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=s) for s in specs]
    options = dict(ENGINE, kv_cache_config={"max_blocks": 512})
    with LLM(llama_path, **options) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    ngram = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}
    with LLM(llama_path, **options, speculative_config=ngram) as llm:
        if proposer == "oracle":
            use_proposer(llm, OracleProposer([p + r for p, r in zip(prompts, reference)]))
        elif proposer == "random":
            use_proposer(llm, RandomProposer(MODEL_VOCAB))
        structured, fill = llm.engine.structured, llm.engine.structured.fill_bitmasks
        masked_positions: list[int] = []

        def recording_fill(sched, requests):
            fill(sched, requests)
            masked_positions.extend(sched.grammar_positions)

        structured.fill_bitmasks = recording_fill
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == reference
        stats = llm.engine.scheduler.spec_stats
        if proposer != "random":  # constrained rows had drafts: masks past their next token
            assert max(masked_positions, default=0) > 0
        if proposer == "oracle":  # every draft accepted
            assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
        sampled = [
            SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=StructuredOutputs(json=s))
            for s in (SCHEMAS[n] for n in names)
            for seed in range(4)
        ]
        for i, out in enumerate(llm.generate([[5, 6, 7]] * len(sampled), sampled)):
            assert out.outputs[0].finish_reason == "stop", out.outputs[0]
            jsonschema.validate(_decode_json(llm, out.outputs[0].token_ids), SCHEMAS[names[i // 4]])
        assert _all_blocks_free(llm.engine)
