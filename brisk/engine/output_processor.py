"""Turns engine-core token outputs into text: incremental detokenization, stop strings, logprobs.

Runs on the front-end side (offline LLM, API server process). A stop string found here finishes the
completion and asks the engine core to abort it, so the core only ever sees token-level stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from brisk.detokenizer import IncrementalDetokenizer
from brisk.engine.messages import EngineCoreOutput
from brisk.outputs import CompletionOutput, RequestOutput
from brisk.sampling_params import SamplingParams


@dataclass
class _RequestState:
    output: RequestOutput
    detokenizers: list[IncrementalDetokenizer]
    text_deltas: list[str] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]  # requests that changed this step
    text_deltas: dict[tuple[str, int], str]  # (request id, index) -> new text this step
    aborts: list[tuple[str, int]]  # completions the engine core must stop (stop string hit)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams):
        outputs = [
            CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                             cumulative_logprob=0.0 if params.logprobs is not None else None)
            for i in range(params.n)
        ]
        self.states[request_id] = _RequestState(
            RequestOutput(request_id, prompt, list(prompt_token_ids), outputs),
            [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) for _ in range(params.n)],
        )

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        changed: dict[str, RequestOutput] = {}
        deltas: dict[tuple[str, int], str] = {}
        aborts: list[tuple[str, int]] = []
        for eo in engine_outputs:
            state = self.states.get(eo.request_id)
            if state is None:
                continue  # already finished here (stop string) while the core was still producing
            comp = state.output.outputs[eo.index]
            if comp.finished:
                continue
            detok = state.detokenizers[eo.index]
            comp.token_ids.extend(eo.new_token_ids)
            if eo.logprobs is not None and comp.logprobs is not None:
                for lp in eo.logprobs:
                    comp.logprobs.append({lp.token_id: lp.logprob, **dict(lp.top)})
                    comp.cumulative_logprob += lp.logprob
            delta = detok.update(eo.new_token_ids).text_delta
            if eo.finished:
                delta += detok.flush()  # may still reveal a stop string held back as incomplete text
            if detok.stop_reason is not None:
                comp.finish_reason, comp.stop_reason = "stop", detok.stop_reason
                if not eo.finished:
                    aborts.append((eo.request_id, eo.index))
            elif eo.finished:
                comp.finish_reason, comp.stop_reason = eo.finish_reason, eo.stop_reason
            comp.text = detok.output_text
            state.output.num_cached_tokens = eo.num_cached_tokens
            deltas[(eo.request_id, eo.index)] = deltas.get((eo.request_id, eo.index), "") + delta
            changed[eo.request_id] = state.output
            if state.output.finished:
                del self.states[eo.request_id]
        return ProcessedOutputs(list(changed.values()), deltas, aborts)

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)
