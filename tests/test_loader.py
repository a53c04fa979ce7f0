"""Loader: sharded checkpoints, weight-name errors, Hub resolution offline, dummy weights for the real
gpt-oss configs (built on the meta device, so nothing of real size is allocated), and never through host memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode

from brisk.hub import ModelNotAvailableError, resolve_model_path
from brisk.layers.attention import Attention
from brisk.model_config import ModelConfig
from brisk.model_runner.loader import (
    DUMMY_MXFP4_SCALE_RANGE,
    DUMMY_STD,
    checkpoint_files,
    load_model,
)
from tests.tiny_models import make_tiny_model

# The gpt-oss configs as on the Hub, shipped with the GPU suite (benchmarks/suite_models.py)
GPT_OSS_CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "gpt_oss_configs"


def read_all(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def rewrite_checkpoint(path: Path, edit) -> None:
    tensors = read_all(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def split_into_two_shards(path: Path) -> None:
    tensors = read_all(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(path / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, shard_names in shards.items() for n in shard_names}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("arch, mxfp4", [("qwen3", False), ("gpt_oss", True)])
def test_sharded_checkpoint_loads_the_same_weights(tmp_path, arch, mxfp4):
    single = Path(make_tiny_model(arch, tmp_path / "single", mxfp4=mxfp4))
    sharded = Path(make_tiny_model(arch, tmp_path / "sharded", mxfp4=mxfp4))
    split_into_two_shards(sharded)
    (sharded / "stray.safetensors").write_bytes(b"not named by the index, must be ignored")
    assert [Path(f).name for f in checkpoint_files(str(sharded))] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]

    a = load_model(ModelConfig.from_pretrained(str(single)), device="cpu")
    b = load_model(ModelConfig.from_pretrained(str(sharded)), device="cpu")
    params_b = dict(b.named_parameters())
    for name, param in a.named_parameters():
        assert torch.equal(param, params_b[name]), name
    if mxfp4:
        experts = b.model.layers[0].mlp.experts
        assert experts.gate_up_proj_blocks.dtype == torch.uint8 and experts.down_proj_scales.dtype == torch.uint8


def test_missing_weight_is_an_error(tmp_path):
    path = Path(make_tiny_model("llama", tmp_path / "m"))
    rewrite_checkpoint(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        load_model(ModelConfig.from_pretrained(str(path)), device="cpu")


def test_unexpected_weight_is_an_error(tmp_path):
    path = Path(make_tiny_model("gpt_oss", tmp_path / "m"))
    rewrite_checkpoint(path, lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected checkpoint weight 'model\.layers\.0\.mlp\.shared_expert"):
        load_model(ModelConfig.from_pretrained(str(path)), device="cpu")


def test_wrong_shape_is_an_error(tmp_path):
    path = Path(make_tiny_model("qwen3", tmp_path / "m"))
    rewrite_checkpoint(path, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match="shape"):
        load_model(ModelConfig.from_pretrained(str(path)), device="cpu")


def test_unquantized_gpt_oss_experts_are_transposed_into_brisk_layout(tmp_path):
    path = Path(make_tiny_model("gpt_oss", tmp_path / "m"))
    model = load_model(ModelConfig.from_pretrained(str(path)), device="cpu")
    hf_gate_up = read_all(path / "model.safetensors")["model.layers.2.mlp.experts.gate_up_proj"]  # [E, H, 2I]
    assert torch.equal(model.model.layers[2].mlp.experts.gate_up_proj, hf_gate_up.transpose(1, 2))


def test_tied_embeddings_share_one_tensor(tmp_path):
    path = make_tiny_model("llama", tmp_path / "m")  # the tiny llama ties lm_head to embed_tokens
    model = load_model(ModelConfig.from_pretrained(path), device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_local_directory_is_returned_as_is(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelNotAvailableError, match="not a directory"):
        resolve_model_path(str(tmp_path / "nope"))


def test_unknown_repo_offline_names_the_repo_and_suggests_a_local_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError, match="brisk-tests/no-such-model.*local directory") as info:
        resolve_model_path("brisk-tests/no-such-model")
    assert isinstance(info.value, RuntimeError)


def test_bad_load_format(tmp_path):
    config = ModelConfig.from_pretrained(make_tiny_model("gpt_oss", tmp_path / "m"))
    with pytest.raises(ValueError, match="load_format"):
        load_model(config, load_format="pickle", device="cpu")


def test_dummy_weights_run_on_cpu(tmp_path):
    config = ModelConfig.from_pretrained(make_tiny_model("gpt_oss", tmp_path / "m", mxfp4=True))
    model = load_model(config, load_format="dummy", device="cpu")
    experts = model.model.layers[0].mlp.experts
    low, high = DUMMY_MXFP4_SCALE_RANGE
    assert low == experts.gate_up_proj_scales.min() and experts.gate_up_proj_scales.max() == high
    assert experts.gate_up_proj_blocks.float().std() > 50  # spread over the whole byte range
    # Dequantized, the experts spread like the other dummy weights (real checkpoints' magnitudes), not 100x wider.
    for expert in range(experts.num_local_experts):
        for weight in experts.expert_weights(expert, torch.float32):
            assert DUMMY_STD / 2 < weight.std() < DUMMY_STD * 2
    assert 0 < model.model.layers[0].self_attn.qkv_proj.weight.std() < 0.05


@pytest.mark.parametrize("name, layers, experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_dummy_gpt_oss_real_config_on_meta_has_checkpoint_shapes(name, layers, experts):
    config = ModelConfig.from_pretrained(str(GPT_OSS_CONFIGS / name), dtype="bfloat16")
    model = load_model(config, load_format="dummy", device="meta")
    params = dict(model.named_parameters())
    h, i, heads, kv_heads, d = 2880, 2880, 64, 8, 64
    expected = {
        "model.embed_tokens.weight": ((201088, h), torch.bfloat16),
        "lm_head.weight": ((201088, h), torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.weight": (((heads + 2 * kv_heads) * d, h), torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.bias": (((heads + 2 * kv_heads) * d,), torch.bfloat16),
        "model.layers.0.self_attn.o_proj.weight": ((h, heads * d), torch.bfloat16),
        "model.layers.0.self_attn.sinks": ((heads,), torch.bfloat16),
        "model.layers.0.mlp.router.weight": ((experts, h), torch.bfloat16),
        "model.layers.0.mlp.router.bias": ((experts,), torch.bfloat16),
        "model.layers.0.mlp.experts.gate_up_proj_blocks": ((experts, 2 * i, h // 32, 16), torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_scales": ((experts, 2 * i, h // 32), torch.uint8),
        "model.layers.0.mlp.experts.gate_up_proj_bias": ((experts, 2 * i), torch.bfloat16),
        "model.layers.0.mlp.experts.down_proj_blocks": ((experts, h, i // 32, 16), torch.uint8),
        "model.layers.0.mlp.experts.down_proj_scales": ((experts, h, i // 32), torch.uint8),
        "model.layers.0.mlp.experts.down_proj_bias": ((experts, h), torch.bfloat16),
        "model.norm.weight": ((h,), torch.bfloat16),
    }
    for pname, (shape, dtype) in expected.items():
        assert (tuple(params[pname].shape), params[pname].dtype) == (shape, dtype), pname
    assert all(p.device.type == "meta" for p in params.values())
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(attn) == layers
    assert [m.sliding_window for m in attn[:4]] == [128, None, 128, None]
    assert model.model.layers[0].self_attn.rotary_emb.attention_scaling == pytest.approx(1.3465735902799727)


def test_dummy_weights_follow_the_engine_seed(tmp_path):
    """EngineConfig.seed draws the dummy weights: the same seed gives the same model, another seed another one."""
    from brisk import LLM
    from tests.tiny_tokenizer import make_tiny_tokenizer

    path = make_tiny_model("gpt_oss", tmp_path / "m", mxfp4=True)
    make_tiny_tokenizer(path)
    config = ModelConfig.from_pretrained(path)
    with LLM(path, load_format="dummy", seed=7, max_num_tokens=64, device="cpu") as llm:  # CUDA draws others
        served = dict(llm.engine.executor.runner.model.named_parameters())
        assert set(llm.engine.executor.runner.startup.seconds) >= {"weights", "kv_sizing", "kv_allocation"}
    same = dict(load_model(config, load_format="dummy", device="cpu", seed=7).named_parameters())
    other = dict(load_model(config, load_format="dummy", device="cpu", seed=8).named_parameters())
    blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    for name, param in served.items():
        assert torch.equal(param, same[name]), name
    assert not torch.equal(served[blocks], other[blocks])
    assert not torch.equal(served["lm_head.weight"], other["lm_head.weight"])


class _HostAllocations(TorchDispatchMode):
    """Every tensor an operation creates or fills, by device: catches a weight built on the host and moved after."""

    def __init__(self) -> None:
        super().__init__()
        self.host_bytes: list[tuple[str, int]] = []
        self.filled_on: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self.host_bytes.append((str(func), tensor.numel() * tensor.element_size()))
        name = func.overloadpacket.__name__
        if name in ("normal_", "random_", "fill_") and isinstance(args[0], torch.Tensor):
            self.filled_on[args[0].device.type] = self.filled_on.get(args[0].device.type, 0) + 1
        return out


def test_dummy_gpt_oss_120b_for_another_device_never_passes_through_host_memory():
    """The 65 GB (61 GiB) model for a GPU: every parameter is created on the target device and its random values drawn
    there. Watched on the meta device (the same operations, no memory): no tensor over 1 MiB is made on the host,
    and every parameter gets its fill on the target."""
    config = ModelConfig.from_pretrained(str(GPT_OSS_CONFIGS / "gpt-oss-120b"), dtype="bfloat16")
    watch = _HostAllocations()
    with watch:
        model = load_model(config, load_format="dummy", device="meta", seed=3)
    params = list(model.parameters())
    assert sum(p.numel() * p.element_size() for p in params) > 60e9  # the real size, for the record
    big = [(op, n) for op, n in watch.host_bytes if n > 1 << 20]
    assert not big, big[:5]
    assert sum(n for _, n in watch.host_bytes) < 16 << 20
    assert watch.filled_on == {"meta": len(params)}
