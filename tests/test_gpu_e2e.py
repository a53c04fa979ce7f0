"""On a GPU: greedy generations through the Triton kernels equal those of the torch reference backends.

Skipped without CUDA (CI has none); the kernels themselves are checked on CPU under TRITON_INTERPRET in
tests/test_triton_attention.py and tests/test_triton_moe.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from brisk import LLM, SamplingParams
from tests.tiny_models import make_tiny_model
from tests.tiny_tokenizer import make_tiny_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "bf16-experts"])
def test_triton_path_matches_torch_path(tmp_path, mxfp4):
    path = make_tiny_model("gpt_oss", tmp_path / "m", seed=0, mxfp4=mxfp4)
    make_tiny_tokenizer(path)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 512) for _ in range(n)]} for n in (3, 9, 17, 40, 70, 5, 33, 12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            path,
            device="cuda",
            dtype="float32",
            attn_backend=backend,
            moe_config={"backend": backend},
            tokens_per_block=16,
            max_num_tokens=64,
        )
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outputs["triton"] == outputs["torch"]
