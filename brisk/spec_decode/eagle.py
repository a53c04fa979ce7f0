"""EAGLE3 drafting: the draft head (brisk/models/eagle3.py) behind the drafter's `Proposer` interface.

Each step (after verification, the accepted tokens in the runner's token buffer):
1. First pass, over every token the target computed this step (prompt chunks too, so the draft KV covers the
   prompt): draft position p reads the token at p + 1 (EAGLE's shift: the target's hidden state at p sits with the
   token it led to) and fc(the target's three aux hidden states at p); it writes the draft KV of position p into the
   draft layer's own cache at the target's slot for p. Positions past a request's last accepted one (rejected
   drafts) read stale tokens: their draft KV is garbage that the next step's first pass overwrites, and the causal
   mask keeps it from the positions that matter this step.
2. The draft logits at each speculating request's last position (num_tokens - 2, whose target output was the last
   token) give draft 1; passes 2..k feed each request's previous draft and the previous pass's pre-norm output
   back in, one token per request, at positions num_tokens - 1 .. num_tokens + k - 3 (lookahead slots the
   scheduler allocates). Drafting is greedy over the draft vocabulary, mapped to target ids by d2t; a greedy draft
   is a one-hot q, so rejection sampling stays exact for sampled requests.

The draft KV is one more layer indexed by the target's block ids through the full-attention group's block table
(group 0 of the runner's KV groups).
"""

from __future__ import annotations

import numpy as np
import torch

from brisk.config import EngineConfig
from brisk.errors import ConfigError
from brisk.host import to_device
from brisk.layers.attention import Attention, AttentionMetadata
from brisk.layers.linear import prepack_weights
from brisk.model_config import ModelConfig
from brisk.model_runner.binding import UsesCpuKernels
from brisk.models.eagle3 import Eagle3CheckpointError, Eagle3DraftModel, load_eagle3_head
from brisk.models.llama import CausalLM
from brisk.spec_decode.proposer import DraftProposal, ProposeInputs

FULL_ATTENTION_GROUP = 0  # model_runner.interface.kv_groups_for lists the full-attention layers first


class Eagle3Proposer:
    def __init__(self, head: Eagle3DraftModel, target: CausalLM, max_draft_len: int, cpu_weight_prepack: bool) -> None:
        self.head = head
        self.target = target
        self.k = max_draft_len
        self.cpu_weight_prepack = cpu_weight_prepack
        # Under TP the head's layers are sharded like the target's: every rank runs every pass.
        self.on_every_rank = target.parallel.tp_size > 1
        # The first pass writes the draft KV of every token the target computed: called on every step.
        self.needs_every_step = True
        target.model.aux_layer_ids = head.config.aux_layer_ids

    def kv_bytes_per_block(self, block_size: int) -> int:
        attn = self.head.attn
        elt = self.head.lm_head.weight.element_size()
        return 2 * block_size * attn.num_kv_heads * attn.head_dim * elt

    def lookahead_slots(self) -> int:
        return self.k

    def kv_caches(self) -> list[torch.Tensor]:
        return [self.head.attn.k_cache, self.head.attn.v_cache]

    def bind_kv(self, num_blocks: int, block_size: int, device: torch.device) -> None:
        """The draft layer's KV cache, and the target's attention backend and CPU kernels (bound by now)."""
        attn = self.head.attn
        dtype = self.head.lm_head.weight.dtype
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        attn.kv_group = FULL_ATTENTION_GROUP
        target_attn = next(m for m in self.target.modules() if isinstance(m, Attention))
        attn.backend = target_attn.backend
        self.block_size = block_size
        if device.type == "cpu":
            if self.cpu_weight_prepack:
                prepack_weights(self.head)
            kernels = self.target.model.norm.cpu_kernels  # what the runner bound to the target (None: torch paths)
            for module in self.head.modules():
                if isinstance(module, UsesCpuKernels):
                    module.cpu_kernels = kernels

    @torch.inference_mode()
    def propose(self, inputs: ProposeInputs) -> DraftProposal:
        step, head = inputs.step, self.head
        meta = step.meta
        if meta is None:  # the runner always records it; a step without it computed nothing
            return DraftProposal([[] for _ in inputs.req_ids])
        dev = head.lm_head.weight.device
        t = step.num_tokens
        token_buf = inputs.token_ids
        # 1. every computed position reads the token after it (prompt chunks: the next prompt token)
        nxt = np.minimum(step.positions + 1, token_buf.shape[1] - 1)
        ids = to_device(token_buf[step.token_rows, nxt].astype(np.int64), dev)
        positions = to_device(step.positions, dev)
        aux = [a[:t] for a in self.target.model.aux_hidden_states]
        hidden = head.combine_hidden_states(aux)
        normed, pre_norm = head(ids, positions, hidden, meta)
        n = len(inputs.req_ids)
        if n == 0:
            return DraftProposal([])
        # 2. draft 1 at each request's last position, then one token per request per pass
        first = step.query_start_loc[inputs.sample_pos]
        last_pos = inputs.num_tokens - 2
        index = first + (last_pos - step.positions[first])
        idx = to_device(index, dev)
        drafts = [self._greedy(normed[idx])]
        hidden = pre_norm[idx]
        bs = self.block_size
        table_width = inputs.block_table.shape[1]
        max_pos = table_width * bs - 1
        tables = to_device(inputs.block_table[inputs.rows, :table_width].astype(np.int32), dev)
        for j in range(1, self.k):
            pos = last_pos + j
            beyond = pos > max_pos  # at the model's length limit: no KV kept, the drafts past it are cut below
            pos_c = np.minimum(pos, max_pos)
            slots = inputs.block_table[inputs.rows, pos_c // bs].astype(np.int64) * bs + pos_c % bs
            slots[beyond] = -1
            step_meta = AttentionMetadata(
                query_start_loc=list(range(n + 1)),
                seq_lens=(pos_c + 1).tolist(),
                block_tables=[tables],
                slot_mappings=[to_device(slots, dev)],
                decode_only=True,
            )
            normed, hidden = head(drafts[-1], to_device(pos_c, dev), hidden, step_meta)
            drafts.append(self._greedy(normed))
        host = torch.stack(drafts, dim=1).tolist()
        limit = np.minimum(self.k, np.maximum(0, max_pos + 2 - inputs.num_tokens)).tolist()
        return DraftProposal([row[:m] for row, m in zip(host, limit)])

    def _greedy(self, normed: torch.Tensor) -> torch.Tensor:
        head = self.head
        return head.draft_to_target(head.compute_draft_logits(normed).argmax(dim=-1))


def make_eagle_proposer(config: EngineConfig, model_config: ModelConfig, model: torch.nn.Module) -> Eagle3Proposer:
    spec = config.speculative_config
    assert spec is not None and spec.speculative_model_dir is not None  # SpeculativeConfig checks both
    if "full_attention" not in model_config.layer_types:
        raise ConfigError(
            "speculative_config: EAGLE3 keeps its draft KV in the full-attention layers' blocks; "
            f"{model_config.path} has sliding-window layers only"
        )
    if not isinstance(model, CausalLM):
        raise ConfigError(f"speculative_config: {model_config.architecture} does not expose hidden states for EAGLE3")
    device = next(model.parameters()).device
    try:
        head = load_eagle3_head(
            spec.speculative_model_dir,
            model_config,
            model.model.embed_tokens,
            device=device,
            parallel=model.parallel,
        )
    except Eagle3CheckpointError as exc:
        raise ConfigError(f"speculative_config.speculative_model_dir: {exc}") from None
    return Eagle3Proposer(head, model, spec.max_draft_len, config.cpu_weight_prepack)
