"""The null model (brisk/models/null.py) and the engine-overhead benchmark (benchmarks/engine_overhead.py).

The null model must drive the engine like a real one (KV blocks allocated, released past the sliding window and
freed, all accounted for) without ever running attention, and its random logits must be reproducible.
The benchmark's in-process part runs for two steps; timings are never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from brisk.config import EngineConfig
from brisk.engine.core import EngineCore
from brisk.engine.messages import EngineCoreRequest
from brisk.kv_cache.block_pool import NULL_BLOCK
from brisk.layers.attention import Attention
from brisk.model_config import ModelConfig
from brisk.models.null import BriskNullForCausalLM
from brisk.sampling_params import SamplingParams

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_overhead.py"
VOCAB = 512
NUM_LAYERS = 4
SLIDING_WINDOW = 8  # short, so a few decode steps release blocks that fall out of the window
BLOCK_SIZE = 4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def null_model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("null-model")
    config = {
        "architectures": ["BriskNullForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * (NUM_LAYERS // 2),
        "eos_token_id": 0,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_overhead_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_null_model_runs_through_the_engine_with_exact_kv_accounting(null_model_dir):
    config = EngineConfig.build(
        null_model_dir,
        load_format="dummy",
        device="cpu",
        max_batch_size=8,
        max_num_tokens=24,  # prompts below need chunked prefill
        kv_cache_config={"tokens_per_block": BLOCK_SIZE, "max_blocks": 200},
    )
    engine = EngineCore(config)
    attention_layers = [m for m in engine.executor.runner.model.modules() if isinstance(m, Attention)]
    assert len(attention_layers) == NUM_LAYERS
    assert all(layer.k_cache.numel() > 0 for layer in attention_layers)  # the runner bound KV caches

    def no_attention_math(module, args):
        raise AssertionError("the null model must not run attention")

    for layer in attention_layers:
        layer.register_forward_pre_hook(no_attention_math)

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(8):
        engine.add_request(EngineCoreRequest(f"r{i}", list(range(1, 3 + 2 * i)), params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(8)}
    finish_reasons = {}
    window_released_blocks = False
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish_reasons[out.request_id] = out.finish_reason
        engine.kv.check_invariants()
        sliding_tables = [tables[1] for tables in engine.kv.tables.values()]  # groups: full, then sliding
        window_released_blocks |= any(table and table[0] == NULL_BLOCK for table in sliding_tables)
    assert window_released_blocks
    assert all(len(ids) == MAX_TOKENS and all(0 <= t < VOCAB for t in ids) for ids in tokens.values())
    assert set(finish_reasons.values()) == {"length"} and len(finish_reasons) == 8
    assert engine.kv.pool.num_free == engine.kv.pool.num_usable  # every block came back


def test_null_model_logits_are_reproducible_for_a_seed(null_model_dir):
    model_config = ModelConfig.from_pretrained(null_model_dir)

    def logits_sequence(seed: int) -> list[torch.Tensor]:
        model = BriskNullForCausalLM(model_config, logits_seed=seed)
        hidden = model(torch.zeros(5, dtype=torch.long), torch.arange(5), meta=None)
        assert hidden.shape == (5, model_config.hidden_size)
        return [model.compute_logits(hidden[:rows]).clone() for rows in (3, 5, 1, 5)]

    first, again, other = logits_sequence(7), logits_sequence(7), logits_sequence(8)
    assert [t.shape for t in first] == [(3, VOCAB), (5, VOCAB), (1, VOCAB), (5, VOCAB)]
    assert all(t.dtype == torch.float32 for t in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_null_model_has_no_weights_to_load(null_model_dir):
    model = BriskNullForCausalLM(ModelConfig.from_pretrained(null_model_dir))
    assert model.load_weights([]) == set()
    with pytest.raises(ValueError, match="no parameters"):
        model.load_weights([("lm_head.weight", torch.zeros(1))])


def test_synthetic_tokenizer_decodes_every_id(benchmark, tmp_path):
    from transformers import AutoTokenizer

    benchmark.write_synthetic_tokenizer(str(tmp_path), 1000)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) == 1000 and tokenizer.eos_token_id == 999
    assert tokenizer.decode(tokenizer.encode("the quick brown fox")) == "the quick brown fox"
    assert all(tokenizer.decode([i]) for i in range(256, 999))  # each merged token is 2-3 printable characters


def test_benchmark_engine_part_writes_json(benchmark, tmp_path):
    out = tmp_path / "result.json"
    assert benchmark.main(["--steps", "2", "--batch-sizes", "2", "--skip-http", "--profile", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"date", "machine", "command", "settings", "results", "profiles", "table"} <= set(report)
    assert "--batch-sizes 2" in report["command"]
    [row] = report["results"]
    assert row["batch"] == 2 and row["http_tokens_per_s"] is None and row["offline_tokens_per_s"] > 0
    assert {"step_ms_median", "step_ms_p90", "tokens_per_s", "steps"} <= set(row["engine"])
    assert row["engine"]["steps"] == 2
    engine_profile = report["profiles"]["2"]["engine core"]
    assert set(engine_profile["group_ms_per_step"]) == set(benchmark.GROUP_ORDER)
    assert engine_profile["top_functions"]
