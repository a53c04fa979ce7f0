"""Llama, plus the decoder pieces the other Llama-family models (Qwen3, gpt-oss) reuse.

Module names mirror the HF checkpoint names (`model.layers.N.self_attn...`) so loading is a rename at
most: q/k/v are fused into `qkv_proj` and gate/up into `gate_up_proj` (see `stacked_params_mapping`).
Tokens are flat: input_ids/positions [T], hidden [T, H]; sequence boundaries live in the attention metadata.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from brisk.kernels.cpu_kernels import CpuKernels
from brisk.layers.attention import Attention, AttentionMetadata
from brisk.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from brisk.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
    get_weight_loader,
    set_weight_loader,
)
from brisk.layers.norm import RMSNorm
from brisk.layers.rotary import RotaryEmbedding
from brisk.model_config import ModelConfig, ParallelConfig


def text_config(model_config: ModelConfig):
    return model_config.text_config


class DecoderAttention(nn.Module):
    """QKV projection -> (optional per-head q/k RMSNorm) -> RoPE -> paged attention -> output projection."""

    def __init__(
        self,
        model_config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        parallel: ParallelConfig,
        *,
        bias: bool = False,
        qk_norm: bool = False,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        cfg = text_config(model_config)
        d = model_config.head_dim
        self.qkv_proj = QKVParallelLinear(
            model_config.hidden_size, d, model_config.num_heads, model_config.num_kv_heads, bias=bias, parallel=parallel
        )
        self.o_proj = RowParallelLinear(
            model_config.num_heads * d, model_config.hidden_size, bias=bias, parallel=parallel
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = d
        self.rotary_emb = rotary  # shared by all layers
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        if sinks:
            self.sinks: nn.Parameter | None = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
            set_weight_loader(self.sinks, self._load_sinks)
        else:
            self.sinks = None
        is_sliding = model_config.layer_types[layer_idx] == "sliding_attention"
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            d,
            d**-0.5,
            layer_idx,
            sliding_window=model_config.sliding_window if is_sliding else None,
            first_kv_head=self.qkv_proj.first_kv_head,
            model_num_kv_heads=model_config.num_kv_heads,
        )

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        rank = self.qkv_proj.tp_rank
        copy_checked(param.data, loaded_weight.narrow(0, rank * self.num_heads, self.num_heads), "sinks")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None and self.k_norm is not None:  # built together (qk_norm)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
            q, k = self.rotary_emb(positions, q, k)
        else:  # q and k heads are adjacent in the fused projection: rotate them in one pass
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary_emb.rotate(positions, qk).split([self.q_size, self.kv_size], dim=-1)
        out = self.attn(q, k, v.contiguous(), meta, sinks=self.sinks)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act '{hidden_act}' (supported: silu)")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, parallel=parallel
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, parallel=parallel)
        self.cpu_kernels: CpuKernels | None = None  # bound by the CPU model runner (cpu_kernels: true)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.cpu_kernels is not None and self.cpu_kernels.swiglu_accepts(gate_up):
            return self.down_proj(self.cpu_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, norm_weight_in_fp32: bool = False
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, norm_weight_in_fp32)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, norm_weight_in_fp32)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), meta)


class DecoderModel(nn.Module):
    def __init__(
        self,
        model_config: ModelConfig,
        layers: list[nn.Module],
        parallel: ParallelConfig,
        rotary: RotaryEmbedding,
        norm_weight_in_fp32: bool = False,
    ) -> None:
        super().__init__()
        cfg = text_config(model_config)
        self.rotary_emb = rotary  # shared with every layer's attention
        self.embed_tokens = VocabParallelEmbedding(model_config.vocab_size, model_config.hidden_size, parallel)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(model_config.hidden_size, cfg.rms_norm_eps, norm_weight_in_fp32)
        # EAGLE3 drafting: the residual stream entering these layers (vLLM's indexing), kept by reference each
        # forward (every layer makes a new tensor, so no copy); empty when no proposer asks for them.
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        self.rotary_emb.set_step_positions(positions, hidden.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layer_ids:
                captured[i] = hidden
            hidden = layer(positions, hidden, meta)
        if self.aux_layer_ids:
            self.aux_hidden_states = [captured[i] for i in self.aux_layer_ids]
        return self.norm(hidden)


def fused_target(name: str, mapping: tuple[tuple[str, str, object], ...]) -> tuple[str, object]:
    """The parameter a checkpoint tensor loads into and its shard id (None: not fused), by a stacked_params_mapping."""
    for param_part, ckpt_part, shard_id in mapping:
        if ckpt_part in name:
            return name.replace(ckpt_part, param_part), shard_id
    return name, None


def fully_loaded(shards_seen: dict[str, set], mapping: tuple[tuple[str, str, object], ...]) -> set[str]:
    """The parameters whose every shard was loaded (a fused parameter needs all its checkpoint parts)."""
    loaded = set()
    for target, seen in shards_seen.items():
        needed = {sid for part, _, sid in mapping if part in target} or {None}
        if needed <= seen:
            loaded.add(target)
    return loaded


class CausalLM(nn.Module):
    """Common causal-LM shell: subclasses build `self.model` via `make_layer` and may extend the mapping."""

    # (brisk parameter part, checkpoint part, shard id): checkpoint tensors fused into one brisk parameter.
    stacked_params_mapping: tuple[tuple[str, str, object], ...] = (
        (".qkv_proj.", ".q_proj.", "q"),
        (".qkv_proj.", ".k_proj.", "k"),
        (".qkv_proj.", ".v_proj.", "v"),
        (".gate_up_proj.", ".gate_proj.", 0),
        (".gate_up_proj.", ".up_proj.", 1),
    )
    norm_weight_in_fp32 = False

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig = ParallelConfig()) -> None:
        super().__init__()
        self.model_config = model_config
        self.parallel = parallel
        cfg = text_config(model_config)
        rotary = RotaryEmbedding(cfg, model_config.head_dim)
        layers = [self.make_layer(i, rotary) for i in range(model_config.num_layers)]
        self.model = DecoderModel(model_config, layers, parallel, rotary, self.norm_weight_in_fp32)
        self.tie_word_embeddings = bool(
            getattr(cfg, "tie_word_embeddings", False) or getattr(model_config.hf_config, "tie_word_embeddings", False)
        )
        self.lm_head = ParallelLMHead(model_config.vocab_size, model_config.hidden_size, parallel)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors that have no brisk parameter on purpose."""
        return "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the brisk parameter names fully loaded (all shards of fused ones)."""
        params = dict(self.named_parameters())
        shards_seen: dict[str, set] = defaultdict(set)
        for name, tensor in weights:
            if self.skip_weight(name):
                continue
            target, shard_id = fused_target(name, self.stacked_params_mapping)
            param = params.get(target)
            if param is None:
                raise ValueError(
                    f"unexpected checkpoint weight '{name}': {type(self).__name__} has no parameter '{target}'"
                )
            get_weight_loader(param)(param, tensor, shard_id)
            shards_seen[target].add(shard_id)
        return fully_loaded(shards_seen, self.stacked_params_mapping)


class LlamaForCausalLM(CausalLM):
    qk_norm = False

    def make_layer(self, layer_idx: int, rotary: RotaryEmbedding) -> nn.Module:
        mc, cfg = self.model_config, text_config(self.model_config)
        attn = DecoderAttention(
            mc, layer_idx, rotary, self.parallel, bias=getattr(cfg, "attention_bias", False), qk_norm=self.qk_norm
        )
        mlp = LlamaMLP(
            mc.hidden_size, cfg.intermediate_size, cfg.hidden_act, getattr(cfg, "mlp_bias", False), self.parallel
        )
        return DecoderLayer(attn, mlp, mc.hidden_size, cfg.rms_norm_eps)
