"""The served engine process gets the server's config, given fields included: on a CPU a cuda_graph_config nobody
gave must not turn on the padded static-buffer decode path there (offline and served must run the same steps)."""

from __future__ import annotations

import torch

from brisk.config import EngineConfig
from brisk.engine.process import encode_config
from brisk.model_runner.cuda_graph import effective_graph_config

CPU = torch.device("cpu")


def test_engine_process_config_keeps_what_was_given():
    plain = EngineConfig(model="m", device="cpu", max_batch_size=16, dtype="float32")
    sent = EngineConfig.model_validate_json(encode_config(plain))
    assert sent == plain and sent.model_fields_set == plain.model_fields_set
    assert effective_graph_config(plain, CPU) is None and effective_graph_config(sent, CPU) is None

    padded = EngineConfig(model="m", device="cpu", cuda_graph_config={"batch_sizes": [1, 8]})
    sent = EngineConfig.model_validate_json(encode_config(padded))
    graphs = effective_graph_config(sent, CPU)
    assert graphs is not None and graphs.batch_sizes == [1, 8]
