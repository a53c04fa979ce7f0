"""A model that computes nothing, for measuring the engine's own host-side cost per step.

`BriskNullForCausalLM` has the brisk model interface and one `Attention` module per layer, so the runner
binds KV caches to it and the scheduler, KV manager and block tables do all their usual work; but its forward
never calls them and returns a zero hidden state, and its logits are random. With `load_format="dummy"` it
needs no weights. Used by `benchmarks/engine_overhead.py`.

Random logits cost no compute either: the module keeps a pool of random logit rows (drawn from its own seeded
generator, so runs are reproducible) and each call returns a view of `num_rows` consecutive pool rows at a
random offset. Drawing fresh random numbers every step would cost more than the engine itself on a CPU
(about a second for [1024, 201088]); on a GPU it would be device time, which is not what this model is for.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from brisk.layers.attention import Attention, AttentionMetadata
from brisk.model_config import ModelConfig, ParallelConfig

DEFAULT_LOGITS_SEED = 0
# Extra pool rows beyond the largest batch seen, so that the random offset varies the rows each call returns.
LOGIT_POOL_SPARE_ROWS = 61


class BriskNullForCausalLM(nn.Module):
    """No weights, no math: zero hidden states and random logits, with the KV-cache layers a runner expects."""

    zero_hidden_row: torch.Tensor  # a buffer (register_buffer), so nn.Module's __getattr__ would type it loosely

    def __init__(
        self,
        model_config: ModelConfig,
        parallel: ParallelConfig = ParallelConfig(),
        *,
        logits_seed: int = DEFAULT_LOGITS_SEED,
    ) -> None:
        super().__init__()
        self.model_config = model_config
        self.parallel = parallel
        self.vocab_size = model_config.vocab_size
        self.hidden_size = model_config.hidden_size
        d = model_config.head_dim
        self.attention_layers = nn.ModuleList(
            Attention(
                model_config.num_heads,
                model_config.num_kv_heads,
                d,
                d**-0.5,
                layer_idx,
                sliding_window=model_config.sliding_window if kind == "sliding_attention" else None,
            )
            for layer_idx, kind in enumerate(model_config.layer_types)
        )
        # One zero row in the model dtype, broadcast to [T, hidden] by forward: no allocation per step.
        self.register_buffer("zero_hidden_row", torch.zeros(1, self.hidden_size), persistent=False)
        # A CPU generator on any device: the logits are the same on every device, and picking an offset
        # never waits for the device.
        self.generator = torch.Generator(device="cpu").manual_seed(logits_seed)
        self._logit_pool = torch.empty(0, self.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.zero_hidden_row.expand(input_ids.shape[0], self.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] float32 random logits in [0, 1). A view into the pool, shared between calls: code that
        wrote into it would change later calls' logits (brisk's Sampler copies its input before changing it)."""
        num_rows = hidden.shape[0]
        if self._logit_pool.shape[0] < num_rows or self._logit_pool.device != hidden.device:
            pool = torch.rand(
                num_rows + LOGIT_POOL_SPARE_ROWS,
                self.vocab_size,
                dtype=torch.float32,
                device="cpu",
                generator=self.generator,
            )
            self._logit_pool = pool.to(hidden.device)
        max_offset = self._logit_pool.shape[0] - num_rows
        offset = int(torch.randint(max_offset + 1, (), device="cpu", generator=self.generator))
        return self._logit_pool[offset : offset + num_rows]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The null model has no parameters: any checkpoint tensor is unexpected."""
        for name, _ in weights:
            raise ValueError(
                f"unexpected checkpoint weight '{name}': {type(self).__name__} has no parameters "
                "(load it with load_format='dummy')"
            )
        return set()
