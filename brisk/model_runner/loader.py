"""Find a model's files and build the model with its weights.

Weights are streamed one tensor at a time from the safetensors shards (never the whole checkpoint in
memory) into `model.load_weights`, which maps HF names onto brisk parameters and slices them per TP rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from glob import glob

import torch
from torch import nn

from brisk.layers.attention import Attention
from brisk.layers.kv_fp8 import split_kv_scales
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.models.registry import BriskModel, get_model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")
INDEX_FILE = "model.safetensors.index.json"
DUMMY_STD = 0.02
# MXFP4 dummy experts spread like the other dummy weights: random E2M1 codes have an RMS of 2.93, times E8M0 scales
# 2^-9 .. 2^-6 (bytes 118 .. 121) an RMS of about 0.026. Scales up to 2^1 (RMS 2) made every expert's output ~100x
# the residual stream (and would overflow fp16).
DUMMY_MXFP4_SCALE_RANGE = (118, 121)


def checkpoint_files(path: str) -> list[str]:
    """The safetensors shards: those named by model.safetensors.index.json, else every *.safetensors."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in names]
        for file in files:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{INDEX_FILE} names {os.path.basename(file)}, which is not in {path}")
        return files
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def iterate_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time across all shards, with a progress bar over tensors."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = checkpoint_files(path)
    total = 0
    for file in files:  # reads only the headers
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", leave=False) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update(1)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_config: ModelConfig,
    *,
    load_format: str = "auto",
    device: torch.device | str,
    parallel: ParallelConfig = ParallelConfig(),
    seed: int = 0,
) -> BriskModel:
    """Build the model in model_config.dtype on `device` and fill its weights (or random ones for 'dummy', drawn
    from `seed`). Every parameter is created on `device` itself (torch's device context): a model for a GPU never
    passes through host memory, and dummy weights are drawn there too, so dummy gpt-oss-120b's 65 GB (61 GiB) start
    in seconds."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format '{load_format}'; choose one of: {', '.join(LOAD_FORMATS)}")
    device = torch.device(device)
    model_class = get_model_class(model_config.architecture)
    with default_dtype(model_config.dtype), device:
        model = model_class(model_config, parallel=parallel)
    model.eval()
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
        return model
    if device.type == "meta":
        raise ValueError("real weights cannot be loaded on the meta device; use load_format='dummy'")
    kv_scales: dict[tuple[int, str], torch.Tensor] = {}
    loaded = model.load_weights(split_kv_scales(iterate_checkpoint(model_config.path), kv_scales))
    set_kv_scales(model, kv_scales)
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {model_config.path} is missing weights: {shown}")
    return model


@torch.no_grad()
def set_kv_scales(model: nn.Module, kv_scales: dict[tuple[int, str], torch.Tensor]) -> None:
    """The checkpoint's FP8 KV scales ({(layer index, 'k_scale' | 'v_scale'): tensor}) into the attention layers: one
    per tensor (vLLM / ModelOpt checkpoints) for every KV head, or one per KV head of the model (this rank's, under
    tensor parallelism)."""
    layers = {m.layer_idx: m for m in model.modules() if isinstance(m, Attention)}
    for (layer_idx, kind), value in sorted(kv_scales.items()):
        layer = layers.get(layer_idx)
        if layer is None:
            raise ValueError(f"checkpoint has a KV {kind} for layer {layer_idx}, which the model does not have")
        target: torch.Tensor = getattr(layer, kind)
        value = value.float().flatten()
        if value.numel() == layer.model_num_kv_heads:
            value = value[layer.first_kv_head : layer.first_kv_head + target.numel()]
        elif value.numel() != 1:
            raise ValueError(
                f"checkpoint's {kind} of layer {layer_idx} has {value.numel()} values; brisk reads one per tensor or "
                f"one per KV head of the model ({layer.model_num_kv_heads})"
            )
        if not bool((value > 0).all()) or not bool(value.isfinite().all()):
            raise ValueError(f"checkpoint's {kind} of layer {layer_idx} is not a positive finite scale: {value}")
        target.copy_(value.expand(target.shape))


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes and dtypes, drawn in place on each parameter's device from a generator
    seeded with `seed` (no host copy). On the meta device the same operations run without values (and without a
    generator, which meta has not), so tests can watch what a real device would be asked to do."""
    generators: dict[torch.device, torch.Generator | None] = {}
    for name, param in model.named_parameters():
        if param.device not in generators:
            meta = param.device.type == "meta"
            generators[param.device] = None if meta else torch.Generator(device=param.device).manual_seed(seed)
        gen = generators[param.device]
        if param.dtype == torch.uint8:  # MXFP4: any byte is two valid E2M1 codes; scales kept moderate
            low, high = DUMMY_MXFP4_SCALE_RANGE if name.endswith("_scales") else (0, 255)
            param.random_(low, high + 1, generator=gen)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)  # keeps activations at unit scale through the stack
        else:
            param.normal_(0.0, DUMMY_STD, generator=gen)
