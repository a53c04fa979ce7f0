"""Turns engine-core token outputs into text: incremental detokenization, stop strings, logprobs.

Runs on the front-end side (offline LLM, API server process). A stop string found here finishes the
completion and asks the engine core to abort it, so the core only ever sees token-level stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from brisk.detokenizer import IncrementalDetokenizer, TokenDecoder
from brisk.engine.messages import EngineCoreOutput
from brisk.outputs import CompletionOutput, Logprob, RequestOutput
from brisk.sampling_params import SamplingParams


@dataclass
class CompletionDelta:
    """What one completion gained in one engine step (what a stream chunk carries)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    output: RequestOutput = field(repr=False)  # the cumulative result so far
    num_steps: int = 1  # engine steps that produced these tokens (the arrival of each is the metrics' business)

    def merged(self, later: CompletionDelta) -> CompletionDelta:
        """One delta carrying what this one and the `later` one of the same completion carry."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = (self.logprobs or []) + (later.logprobs or [])
        return CompletionDelta(
            self.request_id,
            self.index,
            self.text + later.text,
            self.token_ids + later.token_ids,
            logprobs,
            later.finish_reason,
            later.stop_reason,
            later.output,
            self.num_steps + later.num_steps,
        )


@dataclass
class _RequestState:
    output: RequestOutput
    detokenizers: list[IncrementalDetokenizer] | None  # None: the consumer wants token ids only


@dataclass
class ProcessedOutputs:
    deltas: list[CompletionDelta]
    finished: list[RequestOutput]  # requests whose completions are all done
    aborts: list[tuple[str, int]]  # completions the engine core must stop (stop string hit)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self._decoders: dict[bool, TokenDecoder] = {}  # by skip_special_tokens, shared by all requests

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenize: bool = True,
    ) -> None:
        """`detokenize` False: the deltas carry no text (a harmony parser decodes the tokens itself); stop strings
        then are the consumer's."""
        with_logprobs = params.logprobs is not None
        outputs = [
            CompletionOutput(
                index=i, logprobs=[] if with_logprobs else None, cumulative_logprob=0.0 if with_logprobs else None
            )
            for i in range(params.n)
        ]
        output = RequestOutput(request_id, prompt, list(prompt_token_ids), outputs)
        if params.prompt_logprobs is not None:
            output.prompt_logprobs = [None]
        detokenizers = None
        if detokenize:
            skip = params.skip_special_tokens
            decoder = self._decoders.get(skip) or self._decoders.setdefault(skip, TokenDecoder(self.tokenizer, skip))
            detokenizers = [
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, decoder) for _ in range(params.n)
            ]
        self.states[request_id] = _RequestState(output, detokenizers)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs([], [], [])
        for eo in engine_outputs:
            state = self.states.get(eo.request_id)
            if state is None:
                continue  # already finished here (stop string) while the core was still producing
            comp = state.output.outputs[eo.index]
            if comp.finished:
                continue
            if eo.prompt_logprobs is not None and state.output.prompt_logprobs is not None:
                self._add_prompt_logprobs(state.output, eo)
                if not eo.new_token_ids and not eo.finished:
                    continue  # a prompt chunk: nothing for the completion yet
            detok = state.detokenizers[eo.index] if state.detokenizers is not None else None
            new_ids = eo.new_token_ids  # a fresh list per message: the delta may keep it
            if detok is None:
                text = ""
            else:
                text = detok.update(new_ids).text_delta
                if detok.stop_reason is not None:
                    # A stop string inside several new tokens (speculative decoding): the tokens after it are not
                    # output.
                    new_ids = new_ids[: len(detok.output_token_ids) - len(comp.token_ids)]
            comp.token_ids.extend(new_ids)
            new_logprobs = None
            if eo.logprobs is not None and comp.logprobs is not None:
                token_lps = eo.logprobs[: len(new_ids)]
                new_logprobs = [{lp.token_id: lp.logprob, **dict(lp.top)} for lp in token_lps]
                comp.logprobs.extend(new_logprobs)
                assert comp.cumulative_logprob is not None  # add_request sets it together with comp.logprobs
                comp.cumulative_logprob += sum(lp.logprob for lp in token_lps)
            if detok is not None and eo.finished:
                text += detok.flush()  # may still reveal a stop string held back as incomplete text
            if detok is not None and detok.stop_reason is not None:
                comp.finish_reason, comp.stop_reason = "stop", detok.stop_reason
                if not eo.finished:
                    result.aborts.append((eo.request_id, eo.index))
            elif eo.finished:
                comp.finish_reason, comp.stop_reason = eo.finish_reason, eo.stop_reason
            if detok is not None and comp.finished:
                comp.text = detok.output_text  # once, at the end: copying it at every token would be quadratic
            state.output.num_cached_tokens = eo.num_cached_tokens
            state.output.scheduled_time = state.output.scheduled_time or eo.scheduled_time
            result.deltas.append(
                CompletionDelta(
                    eo.request_id,
                    eo.index,
                    text,
                    new_ids,
                    new_logprobs,
                    comp.finish_reason,
                    comp.stop_reason,
                    state.output,
                    eo.num_steps,
                )
            )
            if comp.finished and state.output.finished:
                result.finished.append(state.output)
                del self.states[eo.request_id]
        return result

    @staticmethod
    def _add_prompt_logprobs(output: RequestOutput, eo: EngineCoreOutput) -> None:
        lps = eo.prompt_logprobs
        assert lps is not None and output.prompt_logprobs is not None
        prompt = output.prompt_token_ids
        for i, (lp, rank, top) in enumerate(zip(lps.logprobs, lps.ranks, lps.top)):
            entry = {t: Logprob(v, r) for r, (t, v) in enumerate(top, start=1)}
            entry[prompt[lps.start + i + 1]] = Logprob(lp, rank)
            output.prompt_logprobs.append(entry)

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)
