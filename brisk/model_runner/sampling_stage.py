"""The step's sampling stage: the logits of the sampled requests become one packed result tensor, by sampling, or in
a speculative step by verifying the drafts (rejection_sampler.py: greedy accept and rejection sampling).

Packed result, int64, a row per sampled request: with speculation (k = max_draft_len drafts at most) [n, k + 3], the
output tokens in columns 0..k (the accepted drafts and the target's own next token: `count` of them), `count` in
column k + 1; without it [n, 2], the token in column 0 (the count is 1). The last column says whether the request's
logits were not finite (it fails; its tokens are never output).
The runner shares it between ranks in one collective and the host takes it in one copy (step_output.py).

Structured outputs: the grammar masks (-inf) are applied first, at every verified position, so logprobs are after
masking. A row holding NaN or +inf, or nothing above -inf (-inf alone is a legitimate mask), cannot be sampled: only
its request fails (an argmax of it is harmless; the other paths see it zeroed). The check rides on the step's one
host synchronisation (with the tokens), never a sync of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brisk.host import HostCopy, HostResult, to_device
from brisk.kernels.cpu_kernels import CpuKernels
from brisk.model_runner.input_batch import InputBatch, RequestState
from brisk.model_runner.layout import StepBatch
from brisk.model_runner.rejection_sampler import Verified, verify
from brisk.model_runner.sampler import (
    LogprobTensors,
    Sampler,
    SamplerOutput,
    logprobs_output,
    row_max_and_argmax,
    top_alternatives,
)
from brisk.model_runner.sampling_batch import SamplingBatch, prompt_token_mask, samples_plain_greedy
from brisk.scheduler.output import SchedulerOutput, TokenLogprobs
from brisk.structured.matcher import GrammarBitmaskApplier

RowLogprobs = list[TokenLogprobs] | None  # a sampled request's logprobs, one per output token (None: not asked)


@dataclass
class Picked:
    """What this rank's sampled requests produced (in the scheduler's sampled order)."""

    packed: torch.Tensor  # [n, k + 3] int64, on the device: see the module's docstring
    # per request, when some asked for logprobs: pending (a sampling step) or on the host (a verification)
    logprobs: list[RowLogprobs] | HostResult[list[RowLogprobs]] | None
    host: np.ndarray | None = None  # the packed rows where they were built on the host (greedy verification)


class SamplingStage:
    def __init__(self, device: torch.device, max_draft_len: int, cpu_kernels: CpuKernels | None) -> None:
        self.device = device
        self.k = max_draft_len
        self.width = max_draft_len + 3 if max_draft_len else 2
        self.sampler = Sampler(cpu_kernels)
        self.grammar_masker = GrammarBitmaskApplier(torch.get_num_threads(), cpu_kernels)  # structured outputs
        self._cached_key: tuple | None = None
        self._cached: SamplingBatch | None = None
        # The repetition penalty's view of prompts: each request's prompt tokens as a [V] bool row, read from its
        # prompt once (not every step), and the sampled rows' stack of them, kept while the rows are the same
        # requests in the same order.
        self._prompt_masks: dict[str, torch.Tensor] = {}
        self._prompt_seen_key: tuple | None = None
        self._prompt_seen: torch.Tensor | None = None

    def close(self) -> None:
        self.grammar_masker.close()

    def forget(self, req_ids: list[str]) -> None:
        """Requests that left the batch (finished, preempted, dropped): their prompts' rows are freed."""
        for req_id in req_ids:
            if self._prompt_masks.pop(req_id, None) is not None:
                self._prompt_seen_key = self._prompt_seen = None

    @staticmethod
    def needs_history(step: StepBatch, batch: InputBatch) -> bool:
        """Whether some request this step verifies reads its past outputs (penalties): they must be on the host
        before `pick`. (A sampling step counts the previous step's tokens on the device: `_pending_tokens`.)"""
        if not batch.num_needs_history or step.num_drafts is None:
            return False
        return any(batch.states[r].needs_history for r in step.rows[step.sample_idx].tolist())

    def pick(
        self,
        logits: torch.Tensor,
        sched: SchedulerOutput,
        step: StepBatch,
        batch: InputBatch,
        draft_probs: list[torch.Tensor | None] | None = None,
    ) -> Picked:
        """logits: a row per verified position of each sampled request (one without drafts). draft_probs: the
        drafter's q per request of a verification (None: one-hot drafts)."""
        logits = logits.float()
        if sched.grammar_req_ids:  # before sampling or verifying, so logprobs are after masking
            first_rows = None
            if step.num_drafts is not None:
                first_rows = np.concatenate(([0], np.cumsum(step.num_drafts + 1)[:-1])).tolist()
            self.grammar_masker(logits, sched, first_rows)
        if step.num_drafts is None:
            return self._sample(logits, step, batch)
        return self._verify(logits, sched, step, batch, draft_probs)

    # ---- sampling ------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, step: StepBatch, batch: InputBatch) -> Picked:
        sampling = self._sampling_batch(step, batch, logits.shape[-1])
        if sampling.plain_greedy:  # one pass over the logits finds both
            row_max, token_ids = row_max_and_argmax(logits, self.sampler.cpu_kernels)
            raw_logprobs, bad = None, ~torch.isfinite(row_max)
        else:
            bad = ~torch.isfinite(logits.amax(dim=-1))
            logits = torch.where(bad[:, None], 0.0, logits)
            token_ids, raw_logprobs = self.sampler.sample(logits, sampling)
        token_ids = token_ids.clamp_(0, logits.shape[-1] - 1)  # a bad row's pick must still embed next step
        if self.k == 0:
            packed = torch.stack((token_ids, bad.to(torch.int64)), dim=1)
        else:  # a speculative step without drafts: one token each
            packed = torch.zeros(len(token_ids), self.width, dtype=torch.int64, device=logits.device)
            packed[:, 0] = token_ids
            packed[:, self.k + 1] = 1
            packed[:, self.k + 2] = bad
        if raw_logprobs is None:
            return Picked(packed, None)
        tensors = LogprobTensors.of(token_ids, raw_logprobs, sampling)
        num_logprobs = sampling.num_logprobs

        def rows(token_ids: torch.Tensor, *host: torch.Tensor) -> list[RowLogprobs]:
            return _per_request(logprobs_output(token_ids.tolist(), host, num_logprobs))

        return Picked(packed, HostResult(HostCopy.start(token_ids, *tensors.as_tuple()), rows))

    def _sampling_batch(self, step: StepBatch, batch: InputBatch, vocab_size: int) -> SamplingBatch:
        """The sampler's per-row tensors, reused while the sampled rows are the same requests in the same order,
        none of them samples with its history (penalties) and none is still short of its min_tokens."""
        sample_rows = step.rows[step.sample_idx]
        key = _rows_key(batch, sample_rows, vocab_size)
        if self._cached_key == key and self._cached is not None:
            return self._cached
        states = [batch.states[r] for r in sample_rows.tolist()]
        num_outputs = _outputs_before(batch, sample_rows, states, 0)
        pending = self._pending_tokens(step, batch, states, num_outputs, vocab_size)
        built = SamplingBatch.build(
            params=[s.params for s in states],
            prompt_ids=[()] * len(states),  # prompt_seen holds what the penalty reads of them
            output_ids=[s.output_token_ids if s.needs_history else () for s in states],
            generators=[s.generator for s in states],
            stop_ids=[s.stop_ids for s in states],
            vocab_size=vocab_size,
            device=self.device,
            num_output_tokens=num_outputs,
            prompt_seen=self._prompts_seen(batch, states, vocab_size, key),
            pending_tokens=pending,
        )
        reusable = not any(s.needs_history or n < s.params.min_tokens for s, n in zip(states, num_outputs))
        self._cached_key, self._cached = (key, built) if reusable else (None, None)
        return built

    def _pending_tokens(
        self, step: StepBatch, batch: InputBatch, states: list[RequestState], num_outputs: list[int], vocab_size: int
    ) -> torch.Tensor | None:
        """[B]: the output a request's history lacks on the host, where it lacks one: under overlap scheduling the
        previous step's token, read by nobody yet, which is the row's last sampled token on the device; vocab_size
        for the others. None where no history lacks one. (At most one: a step's result is read before the step after
        next is launched.)"""
        lacking = [s.needs_history and len(s.output_token_ids) < n for s, n in zip(states, num_outputs)]
        if not any(lacking):
            return None
        if any(s.needs_history and n - len(s.output_token_ids) > 1 for s, n in zip(states, num_outputs)):
            raise RuntimeError("a penalised request's history lacks more than the previous step's token")
        last = batch.last_sampled[step.sample_rows_tensor]
        return torch.where(to_device(np.array(lacking), self.device), last, vocab_size)

    def _prompts_seen(
        self, batch: InputBatch, states: list[RequestState], vocab_size: int, key: tuple
    ) -> torch.Tensor | None:
        """[B, V] bool: the prompt tokens of each of these requests with a repetition penalty (the others' rows
        none); None where none has one. Kept while `key` (the rows' requests and order) holds."""
        if all(s.params.repetition_penalty == 1.0 for s in states):
            return None
        if key == self._prompt_seen_key:
            return self._prompt_seen
        masks = self._prompt_masks
        new = [s for s in states if s.params.repetition_penalty != 1.0 and s.req_id not in masks]
        if new:
            built = prompt_token_mask([s.host_token_ids[: s.num_prompt_tokens] for s in new], vocab_size, self.device)
            masks.update((s.req_id, row) for s, row in zip(new, built))
        none = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        seen = torch.stack([masks[s.req_id] if s.params.repetition_penalty != 1.0 else none for s in states])
        self._prompt_seen_key, self._prompt_seen = key, seen
        return seen

    # ---- verification --------------------------------------------------------------------------
    def _verify(
        self,
        logits: torch.Tensor,
        sched: SchedulerOutput,
        step: StepBatch,
        batch: InputBatch,
        draft_probs: list[torch.Tensor | None] | None,
    ) -> Picked:
        """Request i's 1 + num_drafts[i] rows of logits verify its drafts: each row's distribution is the one
        sampling would draw from at that position (its SamplingBatch row sees the drafts before it)."""
        k, n = self.k, step.num_sampled
        num_drafts = step.num_drafts
        assert num_drafts is not None
        sample_rows = step.rows[step.sample_idx]
        states = [batch.states[r] for r in sample_rows.tolist()]
        draft_lists = [sched.scheduled_spec_decode_tokens.get(s.req_id, []) for s in states]
        if all(samples_plain_greedy(s.params) for s in states):
            rows = self._verify_plain_greedy(logits, draft_lists)
            return Picked(to_device(rows, logits.device), None, rows)  # pinned: a pageable upload would wait
        num_outputs = _outputs_before(batch, sample_rows, states, num_drafts)
        vocab_size = logits.shape[-1]
        prompts_seen = self._prompts_seen(batch, states, vocab_size, _rows_key(batch, sample_rows, vocab_size))
        sampling = self._expanded_batch(states, draft_lists, num_outputs, vocab_size, prompts_seen)
        counts = num_drafts + 1
        row_bad = ~torch.isfinite(logits.amax(dim=-1))
        logits = torch.where(row_bad[:, None], 0.0, logits)
        first = np.zeros(n, dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        bad = requests_with_a_bad_row(row_bad, counts)
        flat = np.fromiter((t for d in draft_lists for t in d), dtype=np.int64, count=int(num_drafts.sum()))
        verified = verify(logits, sampling, num_drafts, flat, k, draft_probs)
        packed = torch.zeros(n, self.width, dtype=torch.int64, device=logits.device)
        packed[:, : k + 1] = verified.token_ids
        packed[:, k + 1] = verified.num_tokens
        packed[:, k + 2] = bad
        if sampling.max_num_logprobs is None:
            return Picked(packed, None)
        return Picked(packed, _verified_logprobs(logits, sampling, verified, first, states))

    def _verify_plain_greedy(self, logits: torch.Tensor, draft_lists: list[list[int]]) -> np.ndarray:
        """Every request greedy on the raw logits (the common case): one argmax over all rows, the comparison with
        the drafts on the host (the step synchronises anyway). On CPU numpy's argmax: a few rows of a vocabulary
        take ~20 us there against ~50-350 us through torch's ops (a decode step's budget is ~2 ms)."""
        k = self.k
        if logits.device.type == "cpu":
            values = logits.numpy()
            best = values.argmax(axis=1)  # the first max, NaN counting as the max: torch.argmax's index
            ids, finite = best.tolist(), np.isfinite(values[np.arange(len(best)), best]).tolist()
        else:
            row_max, argmax = row_max_and_argmax(logits)
            ids, finite = torch.stack([argmax, torch.isfinite(row_max).to(torch.int64)]).tolist()
        packed = np.zeros((len(draft_lists), self.width), dtype=np.int64)
        at = 0
        for i, drafts in enumerate(draft_lists):
            m = len(drafts)
            a = 0
            while a < m and drafts[a] == ids[at + a]:
                a += 1
            packed[i, :a] = drafts[:a]
            packed[i, a] = ids[at + a]
            packed[i, k + 1] = a + 1
            packed[i, k + 2] = not all(finite[at : at + m + 1])
            at += m + 1
        return packed

    def _expanded_batch(
        self,
        states: list[RequestState],
        draft_lists: list[list[int]],
        num_outputs: list[int],
        vocab_size: int,
        prompts_seen: torch.Tensor | None,
    ) -> SamplingBatch:
        """One sampling row per verified position: request i's row j sees its outputs plus drafts[:j] (num_outputs[i]
        + j of them); prompts_seen (a row per request) repeated for its positions."""
        params, outputs, counts, generators, stops = [], [], [], [], []
        for state, drafts, num_out in zip(states, draft_lists, num_outputs):
            for j in range(len(drafts) + 1):
                params.append(state.params)
                outputs.append([*state.output_token_ids, *drafts[:j]] if state.needs_history else ())
                counts.append(num_out + j)
                generators.append(state.generator)
                stops.append(state.stop_ids)
        if prompts_seen is not None:
            positions = np.repeat(np.arange(len(states)), [len(d) + 1 for d in draft_lists])
            prompts_seen = prompts_seen[to_device(positions, self.device)]
        prompts = [()] * len(params)
        return SamplingBatch.build(
            params, prompts, outputs, generators, stops, vocab_size, self.device, counts, prompt_seen=prompts_seen
        )


def _rows_key(batch: InputBatch, sample_rows: np.ndarray, vocab_size: int) -> tuple:
    """What per-row tensors built for a step hold for as long as it is the same: the sampled rows' requests, in
    order (the batch's version moves whenever rows join, leave or move)."""
    return batch.version, sample_rows.tobytes(), vocab_size


def _outputs_before(
    batch: InputBatch, sample_rows: np.ndarray, states: list[RequestState], num_drafts: np.ndarray | int
) -> list[int]:
    """Each sampled request's outputs before its first position sampled this step (what min_tokens counts): the
    tokens computed once the step has run, less its drafts and its prompt. Placeholders of tokens still in flight
    count, so min_tokens waits for no step."""
    computed = (batch.num_computed[sample_rows] - num_drafts).tolist()
    return [c - s.num_prompt_tokens for c, s in zip(computed, states)]


def requests_with_a_bad_row(row_bad: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """Per request, whether any of its rows (counts[i] consecutive rows each) is non-finite. Counted in int32:
    a bool index_add_ on CUDA stores each row's flag in turn (its atomic "add" of bools is a plain store), so a
    request would be flagged by its last row alone."""
    n = len(counts)
    request_of_row = to_device(np.repeat(np.arange(n), counts), row_bad.device)
    bad_rows = torch.zeros(n, dtype=torch.int32, device=row_bad.device)
    return bad_rows.index_add_(0, request_of_row, row_bad.to(torch.int32)) > 0


def _per_request(out: SamplerOutput) -> list[RowLogprobs]:
    return [
        None if num is None else [TokenLogprobs(lp, top)]
        for lp, top, num in zip(out.logprobs or [], out.top_logprobs or [], out.num_logprobs or [])
    ]


def _verified_logprobs(
    logits: torch.Tensor, batch: SamplingBatch, verified: Verified, first: np.ndarray, states: list[RequestState]
) -> list[RowLogprobs]:
    """The target's raw logprob (and top alternatives) of each output token, at the position that produced it:
    gathered for all requests at once (a verification step is read on the host at once anyway)."""
    raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    counts_and_tokens = torch.cat((verified.num_tokens[:, None], verified.token_ids), dim=1).tolist()
    asking = [i for i, state in enumerate(states) if state.params.logprobs is not None]
    rows = [int(first[i]) + j for i in asking for j in range(counts_and_tokens[i][0])]
    tokens = [t for i in asking for t in counts_and_tokens[i][1 : 1 + counts_and_tokens[i][0]]]
    rows_t = to_device(np.array(rows, dtype=np.int64), logits.device)
    lps = raw[rows_t, to_device(np.array(tokens, dtype=np.int64), logits.device)].tolist()
    width = batch.max_num_logprobs or 0  # the batch's widest top-n (its rows are these requests', expanded)
    top_ids, top_values = [], []
    if width:
        values, ids = top_alternatives(raw[rows_t], width, batch.chosen_logprob_ids, rows_t)
        top_ids, top_values = ids.tolist(), values.tolist()
    out: list[RowLogprobs] = [None] * len(states)
    at = 0
    for i in asking:
        num, count = states[i].params.logprobs, counts_and_tokens[i][0]
        entries = []
        for r in range(at, at + count):
            top = list(zip(top_ids[r][:num], top_values[r][:num])) if num else []  # num > 0: width >= num
            entries.append(TokenLogprobs(lps[r], top))
        out[i] = entries
        at += count
    return out
