"""The GPU side of structured outputs' mask: on CUDA logits brisk's `apply_token_bitmask` hands the batch to
xgrammar's Triton kernel (brisk/structured/matcher.py). Without a GPU the kernel runs in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET before any kernel is defined) and is checked against a torch reference and
against the CPU kernel the CPU path uses, on brisk's shapes: a subset of rows (the constrained ones), a bitmask over
the model's vocabulary narrower than the LM head's padded logits, the o200k_harmony vocabulary's width."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from brisk.structured.matcher import apply_token_bitmask

triton_kernels = pytest.importorskip("xgrammar.kernels.apply_token_bitmask_inplace_triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel compiled on a GPU, interpreted on a CPU

HARMONY_VOCAB = 201_088  # gpt-oss's vocab_size; its LM head pads to 201,088 too (the tiny case pads below)


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> torch.Tensor:
    """-inf where the row's bit is 0, for the listed rows and the first `vocab` columns (torch ops only)."""
    out = logits.clone()
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [B, W, 32], bit j of word w
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    for row in rows:
        out[row, :vocab] = torch.where(allowed[row], logits[row, :vocab], float("-inf"))
    return out


@pytest.mark.parametrize("vocab, width, rows", [(5_000, 5_120, [0, 2, 5]), (HARMONY_VOCAB, HARMONY_VOCAB, [1, 3])])
def test_gpu_mask_kernel_matches_reference_and_cpu_kernel(vocab, width, rows):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, width, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    expected = _reference(logits, bitmask, rows, vocab)
    cpu = logits.clone()
    xgr.apply_token_bitmask_inplace(cpu, bitmask, vocab_size=vocab, indices=rows)
    gpu = logits.to(DEVICE)
    # xgrammar's launch (apply_token_bitmask_inplace_triton) with the SM count of a small GPU: it asks CUDA for it
    indices = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    triton_kernels.apply_token_bitmask_inplace_kernel[(4,)](
        gpu, bitmask.to(DEVICE), indices, len(rows), vocab, gpu.stride(0), bitmask.stride(0), NUM_SMS=4, BLOCK_SIZE=4096
    )
    gpu = gpu.cpu()
    # brisk's call, as the runner makes it on the device's logits (xgrammar picks its kernel by the device)
    via_brisk = logits.to(DEVICE)
    apply_token_bitmask(via_brisk, bitmask, rows, vocab)
    assert torch.equal(cpu, expected)
    assert torch.equal(gpu, expected)
    assert torch.equal(via_brisk.cpu(), expected)
    assert (gpu[rows, :vocab] == float("-inf")).any() and torch.isfinite(gpu[:, vocab:]).all()
