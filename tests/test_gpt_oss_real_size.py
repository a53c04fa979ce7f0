"""gpt-oss at its real per-layer shapes on a CPU: a one-layer checkpoint of gpt-oss-20b's config (hidden 2,880, 32
experts of 2,880, 64 / 8 heads of 64, the real 201,088-token vocabulary and o200k_harmony tokenizer), its experts
MXFP4 safetensors in the public layout (tests/gpt_oss_checkpoint.py), loaded through brisk's normal loader and run
through a harmony chat prompt then greedy decode steps; every position's logits against transformers' model with
the experts dequantized by transformers' own MXFP4 code, both in fp32.

The prompt step takes the prompt path (per-expert matmuls: brisk_mxfp4_linear for lightly used experts), the
decode steps the fused MXFP4 MoE kernel; attention, norms, the 201,088 x 2,880 LM head go through brisk's CPU
kernels and torch as served. The two models run one after the other (about 6 and 8 GB), never both in memory
(transformers' from_pretrained with Mxfp4Config(dequantize=True) peaked at 15 GB: the reference is filled here).
"""

from __future__ import annotations

import gc

import pytest
import torch

from brisk.kernels.cpu_kernels import load_cpu_kernels
from brisk.model_config import ModelConfig
from brisk.model_runner.loader import checkpoint_files, load_model
from tests.gpt_oss_checkpoint import write_gpt_oss_checkpoint
from tests.harmony_tokenizer import TIKTOKEN_FILE
from tests.test_models import PagedKV, brisk_logits

DECODE_STEPS = 3
# Both sum the same exact products in fp32 (dequantized weights times activations) in other orders, through one
# layer and a 2,880-long LM head dot product: logits of about 0.3 agree to a few 1e-5.
ATOL = 2e-4

pytestmark = pytest.mark.skipif(not TIKTOKEN_FILE.is_file(), reason=f"the shared tokenizer file {TIKTOKEN_FILE}")


def dequantized_reference(path):
    """transformers' GptOssForCausalLM in fp32, its experts dequantized by transformers' convert_moe_packed_tensors,
    every other tensor as the checkpoint stores it; eager attention and experts."""
    from safetensors import safe_open
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = GptOssConfig.from_pretrained(path)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    with torch.device("meta"):
        model = GptOssForCausalLM(config)
    model.to_empty(device="cpu")  # storage only: every parameter is filled below
    model.model.rotary_emb = GptOssRotaryEmbedding(config)  # its buffers, which to_empty left unset
    params = dict(model.named_parameters())
    filled = set()
    for file in checkpoint_files(str(path)):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith("_scales"):
                    continue
                if name.endswith("_blocks"):  # [E, out, in / 32, 16] -> the HF parameter's [E, in, out]
                    name = name.removesuffix("_blocks")
                    value = convert_moe_packed_tensors(f.get_tensor(f"{name}_blocks"), f.get_tensor(f"{name}_scales"))
                else:
                    value = f.get_tensor(name)
                params[name].data.copy_(value)
                filled.add(name)
    assert filled == set(params)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss_real_size") / "model", num_layers=1)


@torch.no_grad()
def test_real_size_mxfp4_gpt_oss_matches_transformers(checkpoint, default_cpu_kernels):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": "Name three prime numbers and explain why each of them is prime."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    assert len(prompt) > 64  # more tokens than a decode step: the prompt path
    model_config = ModelConfig.from_pretrained(str(checkpoint), dtype="float32")
    assert model_config.vocab_size == 201_088 and model_config.hidden_size == 2880
    model = load_model(model_config, device="cpu")
    experts = model.model.layers[0].mlp.experts
    assert experts.quantization == "mxfp4" and experts.gate_up_proj_blocks.shape == (32, 5760, 90, 16)
    kv = PagedKV(model, block_size=16, num_blocks=16, kernels=load_cpu_kernels(default_cpu_kernels))
    seq = kv.add_sequence(len(prompt) + DECODE_STEPS)
    logits = [brisk_logits(model, *kv.step([(seq, prompt)]))]
    tokens = prompt
    for _ in range(DECODE_STEPS):  # one token a step: the fused MXFP4 MoE kernel where the kernels are bound
        token = logits[-1][-1:].argmax(-1)
        tokens = torch.cat([tokens, token])
        logits.append(brisk_logits(model, *kv.step([(seq, token)])))
    ours = torch.cat(logits)
    del model, experts, kv, logits
    gc.collect()

    reference = dequantized_reference(checkpoint)
    expected = reference(tokens[None]).logits[0].float()
    assert ours.shape == expected.shape == (len(tokens), 201_088)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert torch.equal(ours[len(prompt) - 1 :].argmax(-1), expected[len(prompt) - 1 :].argmax(-1))
