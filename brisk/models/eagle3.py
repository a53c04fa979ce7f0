"""EAGLE3 draft head: one Llama decoder layer fed with the target's hidden states, as the public heads define it.

Checkpoint layout (nvidia/gpt-oss-120b-Eagle3, yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; what vLLM's, SGLang's and
TensorRT-LLM's EAGLE3 loaders read):

- config.json: `architectures` `LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM`, a Llama config of the one
  layer (`hidden_size`, heads, `intermediate_size`, rope), `draft_vocab_size`, optional `target_hidden_size`,
  `norm_before_residual`, and `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`).
- safetensors: `fc.weight` [H, 3 * target H], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
  `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v take 2 * H inputs), `midlayer.mlp.{gate,up,down}_proj.weight`,
  `norm.weight`, `lm_head.weight` [draft vocab, H], `d2t` [draft vocab] (target id = draft id + d2t[draft id]),
  `t2d` [vocab] bool (which target ids the draft vocabulary holds), optionally `embed_tokens.weight`: without it
  the head shares the target's embedding.

Step (per token, flat like the target): h = fc(concat(aux hidden states)) on the first draft pass, the previous
draft pass's pre-norm output after it; x = concat(input_layernorm(embed(token)), hidden_norm(h)); the layer's
attention reads x (2H -> q/k/v), the residual is h; `norm` of the layer's output gives the draft logits.
Aux ids follow vLLM: id j is the residual stream entering target layer j; default (2, L // 2, L - 3).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from brisk.layers.attention import Attention, AttentionMetadata
from brisk.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from brisk.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear, get_weight_loader
from brisk.layers.norm import RMSNorm
from brisk.layers.rotary import RotaryEmbedding
from brisk.model_config import ModelConfig, ParallelConfig
from brisk.models.llama import CausalLM, LlamaMLP, fully_loaded, fused_target

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_HIDDEN_STATES = 3


class Eagle3CheckpointError(ValueError):
    """The EAGLE3 head's directory, config or weights do not fit (the message names the file, key or size)."""


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's default choice for a head that pins none (low, middle, high)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    path: str
    hf_config: Any  # transformers.LlamaConfig of the draft layer (rope parameters, eps)
    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool
    attention_bias: bool
    mlp_bias: bool

    @classmethod
    def from_pretrained(cls, path: str, target: ModelConfig) -> Eagle3Config:
        """Read `path`/config.json and check it against the target model."""
        from transformers import LlamaConfig

        file = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise Eagle3CheckpointError(f"EAGLE3 head path '{path}' is not a directory")
        if not os.path.isfile(file):
            raise Eagle3CheckpointError(f"EAGLE3 head directory '{path}' has no config.json")
        with open(file) as f:
            raw = json.load(f)
        archs = raw.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise Eagle3CheckpointError(
                f"{file}: architectures {archs} is not an EAGLE3 head (expected one of {', '.join(EAGLE3_ARCHITECTURES)})"
            )
        eagle_config = raw.get("eagle_config") or {}
        if not eagle_config.get("use_aux_hidden_state", True):
            raise Eagle3CheckpointError(
                f"{file}: eagle_config.use_aux_hidden_state false (EAGLE-1/2 heads) is not supported"
            )
        if raw.get("num_hidden_layers", 1) != 1:
            raise Eagle3CheckpointError(f"{file}: num_hidden_layers {raw['num_hidden_layers']}; EAGLE3 heads have 1")
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in raw:
                raise Eagle3CheckpointError(f"{file} lacks '{key}'")
        hidden = int(raw["hidden_size"])
        target_hidden = int(raw.get("target_hidden_size") or hidden)
        if target_hidden != target.hidden_size:
            raise Eagle3CheckpointError(
                f"EAGLE3 head {path} expects a target hidden size of {target_hidden} "
                f"({'target_hidden_size' if 'target_hidden_size' in raw else 'hidden_size'}), "
                f"the target model {target.path} has hidden_size {target.hidden_size}"
            )
        if int(raw["vocab_size"]) != target.vocab_size:
            raise Eagle3CheckpointError(
                f"EAGLE3 head {path} has vocab_size {raw['vocab_size']}, the target model has {target.vocab_size}"
            )
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(i) for i in ids) if ids else default_aux_layer_ids(target.num_layers)
        if len(aux) != NUM_AUX_HIDDEN_STATES or not all(0 <= i < target.num_layers for i in aux):
            raise Eagle3CheckpointError(
                f"{file}: eagle_aux_hidden_state_layer_ids {list(aux)} must be {NUM_AUX_HIDDEN_STATES} layer ids "
                f"of the target's {target.num_layers} layers"
            )
        heads = int(raw["num_attention_heads"])
        draft_vocab = int(raw.get("draft_vocab_size") or raw["vocab_size"])
        known = {k: v for k, v in raw.items() if k not in ("architectures", "eagle_config", "model_type")}
        hf = LlamaConfig(**known)
        return cls(
            path=path,
            hf_config=hf,
            hidden_size=hidden,
            target_hidden_size=target_hidden,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            hidden_act=str(raw.get("hidden_act", "silu")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=draft_vocab,
            aux_layer_ids=aux,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
        )


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read 2 * hidden inputs. Paged (brisk's Attention, the runner binds its KV)
    when given metadata; dense causal over one batch of equal-length sequences without (training)."""

    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding, parallel: ParallelConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            2 * cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads, bias=cfg.attention_bias, parallel=parallel
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.attention_bias, parallel=parallel)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = d
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d**-0.5, layer_idx=0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb.rotate(positions, qk).split([self.q_size, self.kv_size], dim=-1)
        if meta is not None:
            out = self.attn(q, k, v.contiguous(), meta)
        else:
            out = self._dense_causal(q, k, v, positions)
        return self.o_proj(out)

    def _dense_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """q/k/v [B * S, ...]: B sequences of S tokens back to back, each at positions 0..S-1 (a training batch)."""
        n = int((positions == 0).sum())
        seq = q.shape[0] // n
        d, h, kvh = self.head_dim, self.num_heads, self.num_kv_heads
        qh = q.view(n, seq, h, d).transpose(1, 2)
        kh = k.reshape(n, seq, kvh, d).transpose(1, 2).repeat_interleave(h // kvh, dim=1)
        vh = v.reshape(n, seq, kvh, d).transpose(1, 2).repeat_interleave(h // kvh, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        return out.transpose(1, 2).reshape(n * seq, h * d)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, rotary: RotaryEmbedding, parallel: ParallelConfig) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = Eagle3Attention(cfg, rotary, parallel)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata | None
    ) -> torch.Tensor:
        """The layer's output before the final norm (the next draft pass's `hidden`)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = residual + self.self_attn(positions, x, meta)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3DraftModel(nn.Module):
    """The head. Parameter names are the checkpoint's (q/k/v and gate/up fused as in the target models)."""

    stacked_params_mapping = CausalLM.stacked_params_mapping

    d2t: torch.Tensor

    def __init__(self, cfg: Eagle3Config, *, own_embedding: bool, parallel: ParallelConfig = ParallelConfig()) -> None:
        super().__init__()
        self.config = cfg
        self.rotary_emb = RotaryEmbedding(cfg.hf_config, cfg.head_dim)
        self.fc = ReplicatedLinear(
            NUM_AUX_HIDDEN_STATES * cfg.target_hidden_size, cfg.hidden_size, bias=False, parallel=parallel
        )
        self.midlayer = Eagle3DecoderLayer(cfg, self.rotary_emb, parallel)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, cfg.hidden_size, parallel)
        # Without its own embedding the head uses the target's (`share_embedding`), which is no parameter of it.
        self.embed_tokens: VocabParallelEmbedding | None = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel) if own_embedding else None
        )
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), persistent=False)
        # The target's embedding when the head has none; in a tuple so that it is no submodule (the target owns it).
        self._shared_embedding: tuple[VocabParallelEmbedding, ...] = ()

    @property
    def attn(self) -> Attention:
        """The paged attention layer the runner binds the draft KV cache to."""
        return self.midlayer.self_attn.attn

    def share_embedding(self, embedding: VocabParallelEmbedding) -> None:
        if self.embed_tokens is not None:
            return
        if embedding.weight.shape[-1] != self.config.hidden_size:
            raise Eagle3CheckpointError(
                f"EAGLE3 head {self.config.path} has no embed_tokens.weight and its hidden_size "
                f"{self.config.hidden_size} differs from the target's embedding width {embedding.weight.shape[-1]}"
            )
        self._shared_embedding = (embedding,)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        if not self._shared_embedding:
            raise RuntimeError("EAGLE3 head without an embedding: call share_embedding(target embedding) first")
        return self._shared_embedding[0](input_ids)

    def combine_hidden_states(self, aux_hidden_states: list[torch.Tensor]) -> torch.Tensor:
        """The target's three aux hidden states [T, target H] each -> the head's input hidden [T, H]."""
        return self.fc(torch.cat(aux_hidden_states, dim=-1))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the logits, pre-norm output for the next draft pass), both [T, H]."""
        embeds = self.embed(input_ids)
        pre_norm = self.midlayer(positions, embeds.to(hidden.dtype), hidden, meta)
        return self.norm(pre_norm), pre_norm

    def compute_draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [N, draft vocab] (fp32)."""
        return self.lm_head(normed).float()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint-named tensors -> this head's parameters; returns the names fully loaded (d2t included)."""
        params = dict(self.named_parameters())
        seen: dict[str, set] = {}
        t2d: torch.Tensor | None = None
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "d2t":
                self._load_d2t(tensor)
                seen["d2t"] = {None}
                continue
            if name == "t2d":
                t2d = tensor
                continue
            if name == "embed_tokens.weight" and self.embed_tokens is None:
                continue  # the loader decides own vs shared before building; here only for a shared head
            target, shard_id = fused_target(name, self.stacked_params_mapping)
            param = params.get(target)
            if param is None:
                raise Eagle3CheckpointError(f"EAGLE3 head {self.config.path}: unexpected weight '{name}'")
            try:
                get_weight_loader(param)(param, tensor, shard_id)
            except ValueError as exc:
                raise Eagle3CheckpointError(f"EAGLE3 head {self.config.path}: weight '{name}': {exc}") from None
            seen.setdefault(target, set()).add(shard_id)
        if t2d is not None:
            self._check_t2d(t2d)
        return fully_loaded(seen, self.stacked_params_mapping)

    def _load_d2t(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != (self.config.draft_vocab_size,):
            raise Eagle3CheckpointError(
                f"EAGLE3 head {self.config.path}: d2t has shape {tuple(tensor.shape)}, "
                f"expected ({self.config.draft_vocab_size},) (draft_vocab_size)"
            )
        d2t = tensor.to(torch.int64)
        targets = torch.arange(len(d2t)) + d2t.cpu()
        if bool((targets < 0).any()) or bool((targets >= self.config.vocab_size).any()):
            raise Eagle3CheckpointError(
                f"EAGLE3 head {self.config.path}: d2t maps draft ids outside the target vocabulary "
                f"(0..{self.config.vocab_size - 1})"
            )
        self.d2t.copy_(d2t)

    def _check_t2d(self, t2d: torch.Tensor) -> None:
        """t2d is redundant with d2t (vLLM ignores it): checked, so a head whose two maps disagree fails loudly."""
        if tuple(t2d.shape) != (self.config.vocab_size,):
            raise Eagle3CheckpointError(
                f"EAGLE3 head {self.config.path}: t2d has shape {tuple(t2d.shape)}, expected ({self.config.vocab_size},)"
            )
        targets = torch.arange(self.config.draft_vocab_size) + self.d2t.cpu()
        if not bool(t2d.bool().cpu()[targets].all()) or int(t2d.bool().sum()) != self.config.draft_vocab_size:
            raise Eagle3CheckpointError(f"EAGLE3 head {self.config.path}: t2d and d2t name different target ids")


def checkpoint_names(path: str) -> set[str]:
    from safetensors import safe_open

    from brisk.model_runner.loader import checkpoint_files

    names: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            names.update(n.removeprefix("model.") for n in f.keys())
    return names


def load_eagle3_head(
    path: str,
    target_config: ModelConfig,
    target_embedding: VocabParallelEmbedding,
    *,
    device: torch.device | str,
    parallel: ParallelConfig = ParallelConfig(),
) -> Eagle3DraftModel:
    """Build the head in the target's dtype on `device` from `path`; without its own embedding it shares the
    target's."""
    from brisk.model_runner.loader import default_dtype, iterate_checkpoint

    cfg = Eagle3Config.from_pretrained(path, target_config)
    device = torch.device(device)
    try:
        names = checkpoint_names(path)
    except FileNotFoundError as exc:
        raise Eagle3CheckpointError(f"EAGLE3 head {path}: {exc}") from None
    own_embedding = "embed_tokens.weight" in names
    with default_dtype(target_config.dtype), device:
        model = Eagle3DraftModel(cfg, own_embedding=own_embedding, parallel=parallel)
    model.eval()
    model.share_embedding(target_embedding)
    if cfg.draft_vocab_size != cfg.vocab_size and "d2t" not in names:
        raise Eagle3CheckpointError(
            f"EAGLE3 head {path} is missing weights: d2t (draft_vocab_size {cfg.draft_vocab_size} != vocab_size "
            f"{cfg.vocab_size} needs the draft->target map)"
        )
    loaded = model.load_weights(iterate_checkpoint(path))
    if "d2t" not in names:
        loaded.add("d2t")  # same vocabulary: the identity map (zero offsets)
    required = {name for name, _ in model.named_parameters()} | {"d2t"}
    missing = sorted(required - loaded)
    if missing:
        raise Eagle3CheckpointError(f"EAGLE3 head {path} is missing weights: {', '.join(missing)}")
    return model
