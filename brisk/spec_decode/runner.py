"""The model runner's speculative step: verify the drafts, take the tokens to the host, roll back, draft again.

With speculation configured every step that samples ends here (ModelRunner.execute_model):
1. logits at every verified position (the request's last token and each draft: StepBatch.logits_indices);
2. the ranks that sample verify (rejection.py; a step without drafts samples as usual), then the tokens are
   shared (TP: rank 0 broadcasts them; attention DP: the ranks gather them) in one packed [n, k + 3] tensor;
3. the host copy (a speculative step is synchronous): each request's accepted tokens go into the batch's token
   buffer, its last one into `last_sampled` (the next step's input), and its computed tokens drop by the
   rejected drafts (blocks past them too, as the scheduler does: `Scheduler._roll_back`);
4. the proposer drafts for the requests that may speculate; the drafts go back in ModelRunnerOutput.

Structured-output requests speculate with the drafts their grammar allows (the scheduler checks them); their
logits are masked at every verified position before verification.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from brisk.distributed.comm import all_gather_rows
from brisk.kv_cache.manager import cdiv
from brisk.model_runner.sampler import MIN_SAMPLING_TEMPERATURE, SamplingBatch, row_max_and_argmax
from brisk.scheduler.output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from brisk.spec_decode.config import SpeculativeConfig
from brisk.spec_decode.proposer import ProposeInputs, Proposer
from brisk.spec_decode.rejection import verify

if TYPE_CHECKING:
    from brisk.model_runner.input_batch import RequestState
    from brisk.model_runner.runner import ModelRunner, StepBatch

RowLogprobs = list[TokenLogprobs] | None


class SpecDecodeRunner:
    def __init__(self, runner: ModelRunner, proposer: Proposer, config: SpeculativeConfig) -> None:
        self.runner = runner
        self.proposer = proposer
        self.k = config.max_draft_len
        self.disable_by_batch_size = config.disable_by_batch_size
        runner.batch.enable_token_buffer(runner.max_seq_len)
        # Drafters that sample: each request's q for its pending drafts, until the step that verifies them.
        self._draft_probs: dict[str, torch.Tensor] = {}
        # Adaptive draft length (config.draft_len_after_rejection): requests whose last verified drafts were not all
        # accepted, drafting this many tokens until a step accepts all of them.
        self.draft_len_after_rejection = config.draft_len_after_rejection
        self._short_drafts: set[str] = set()

    @torch.inference_mode()
    def sample_and_propose(
        self, scheds: list[SchedulerOutput], step: StepBatch, hidden: torch.Tensor
    ) -> list[ModelRunnerOutput] | None:
        """This rank's part of the step after the forward; the ModelRunnerOutput of every DP rank on rank 0."""
        runner = self.runner
        p = runner.parallel
        num_sampled_all = [s.num_sampled_requests for s in scheds]
        if self._draft_probs or self._short_drafts:
            for rid in (*scheds[p.dp_rank].finished_req_ids, *scheds[p.dp_rank].preempted_req_ids):
                self._draft_probs.pop(rid, None)
                self._short_drafts.discard(rid)
        samples_here = p.dp_size > 1 or p.rank == 0
        packed: torch.Tensor | None = None
        logprobs: list[RowLogprobs] | None = None
        if step.num_sampled:
            logits = runner.model.compute_logits(hidden[step.logits_indices])  # every TP rank takes part
            if samples_here:
                logits, sched = logits.float(), scheds[p.dp_rank]
                if sched.grammar_req_ids:  # structured outputs: masked at every verified position, before verifying
                    first_rows = None
                    if step.num_drafts is not None:
                        first_rows = np.concatenate(([0], np.cumsum(step.num_drafts + 1)[:-1])).tolist()
                    runner.grammar_masker(logits, sched, first_rows)
                packed, logprobs = self._sample(logits, step, sched)
        if p.world_size > 1:
            packed = self._share(packed, step, num_sampled_all)
        host: list[list[int]] = packed.tolist() if packed is not None else []  # the step's host synchronisation
        if p.dp_size > 1 and host:
            offset = sum(num_sampled_all[: p.dp_rank])
            host = host[offset : offset + step.num_sampled]
        req_ids = scheds[p.dp_rank].sampled_req_ids
        # A drafter with its own KV (EAGLE3: needs_every_step) sees every step, also one that sampled nothing.
        every_step = getattr(self.proposer, "needs_every_step", False)
        drafts = self._record_and_propose(step, hidden, req_ids, host) if host or every_step else []
        if p.dp_size > 1:  # rank 0 reports every DP rank's rows
            gathered: list | None = [None] * p.dp_size if p.rank == 0 else None
            dist.gather_object((host, logprobs, drafts), gathered, dst=0, group=runner.cpu_group)
            per_rank = gathered
        else:
            per_rank = [(host, logprobs, drafts)]
        if p.rank != 0 or per_rank is None:
            return None
        return [_output(s.sampled_req_ids, *part) for s, part in zip(scheds, per_rank)]

    def _sample(
        self, logits: torch.Tensor, step: StepBatch, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, list[RowLogprobs] | None]:
        """Packed [n, k + 3]: the output tokens (k + 1 columns), their count, the non-finite flag; and the logprobs
        per request when some asked for them."""
        runner, k = self.runner, self.k
        n = step.num_sampled
        if step.num_drafts is None:  # no drafts: sample as without speculation
            packed = torch.zeros(n, k + 3, dtype=torch.int64, device=logits.device)
            token_ids, bad, sampler_out = runner._sample(logits, step)
            packed[:, 0] = token_ids
            packed[:, k + 1] = 1
            packed[:, k + 2] = bad
            if sampler_out is None:
                return packed, None
            return packed, [
                None if num is None else [TokenLogprobs(lp, top)]
                for lp, top, num in zip(
                    sampler_out.logprobs or [], sampler_out.top_logprobs or [], sampler_out.num_logprobs or []
                )
            ]
        num_drafts = step.num_drafts
        rows = step.rows[step.sample_idx]
        states = [runner.batch.states[r] for r in rows.tolist()]
        draft_lists = [sched.scheduled_spec_decode_tokens.get(s.req_id, []) for s in states]
        if all(_plain_greedy(s) for s in states):
            return self._verify_plain_greedy(logits, num_drafts, draft_lists), None
        batch = self._expanded_batch(states, draft_lists, logits.shape[-1])
        counts = num_drafts + 1
        row_bad = ~torch.isfinite(logits.amax(dim=-1))
        logits = torch.where(row_bad[:, None], 0.0, logits)
        first = np.zeros(n, dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        bad = torch.zeros(n, dtype=torch.bool, device=logits.device)
        bad.index_add_(0, torch.from_numpy(np.repeat(np.arange(n), counts)).to(logits.device), row_bad.to(torch.bool))
        flat = np.fromiter((t for d in draft_lists for t in d), dtype=np.int64, count=int(num_drafts.sum()))
        draft_probs = [self._draft_probs.pop(s.req_id, None) for s in states] if self._draft_probs else None
        verified = verify(logits, batch, num_drafts, flat, k, draft_probs)
        packed = torch.zeros(n, k + 3, dtype=torch.int64, device=logits.device)
        packed[:, : k + 1] = verified.token_ids
        packed[:, k + 1] = verified.num_tokens
        packed[:, k + 2] = bad
        if batch.max_num_logprobs is None:
            return packed, None
        return packed, _logprobs(logits, batch, verified, first, states)

    def _verify_plain_greedy(self, logits: torch.Tensor, num_drafts: np.ndarray, draft_lists: list[list[int]]):
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
        packed = np.zeros((len(draft_lists), k + 3), dtype=np.int64)
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
        return torch.from_numpy(packed).to(logits.device)

    def _expanded_batch(self, states, draft_lists: list[list[int]], vocab_size: int) -> SamplingBatch:
        """One sampling row per verified position: request i's row j sees its outputs plus drafts[:j]."""
        params, prompts, outputs, generators, stops = [], [], [], [], []
        for state, drafts in zip(states, draft_lists):
            for j in range(len(drafts) + 1):
                params.append(state.params)
                prompts.append(state.host_token_ids[: state.num_prompt_tokens] if state.needs_history else ())
                outputs.append([*state.output_token_ids, *drafts[:j]] if state.needs_history else ())
                generators.append(state.generator)
                stops.append(state.stop_ids)
        return SamplingBatch.build(params, prompts, outputs, generators, stops, vocab_size, self.runner.device)

    def _share(self, packed: torch.Tensor | None, step: StepBatch, num_sampled_all: list[int]) -> torch.Tensor | None:
        runner, p = self.runner, self.runner.parallel
        if p.dp_size > 1:
            if not any(num_sampled_all):
                return None
            mine = packed if packed is not None else torch.zeros(0, self.k + 3, dtype=torch.int64, device=runner.device)
            return all_gather_rows(mine, num_sampled_all)
        n = num_sampled_all[0]
        if not n:
            return packed
        buf = (
            packed
            if p.rank == 0 and packed is not None
            else torch.empty(n, self.k + 3, dtype=torch.int64, device=runner.device)
        )
        dist.broadcast(buf, src=0)
        return buf

    def _record_and_propose(
        self, step: StepBatch, hidden: torch.Tensor, req_ids: list[str], host: list[list[int]]
    ) -> list[list[int]]:
        runner, k = self.runner, self.k
        batch = runner.batch
        token_buf = batch.token_ids
        assert token_buf is not None  # enable_token_buffer in __init__
        rows = step.rows[step.sample_idx]
        num_drafts = step.num_drafts
        lookahead = self.proposer.lookahead_slots()
        bs = runner.block_size
        eligible: list[int] = []  # indices into the sampled requests
        last_rows, last_tokens = [], []
        for i, (row, packed_row) in enumerate(zip(rows.tolist(), host)):
            count, bad = packed_row[k + 1], packed_row[k + 2]
            if bad:
                continue
            tokens = packed_row[:count]
            state = batch.states[row]
            nt = int(batch.num_tokens[row])
            token_buf[row, nt : nt + count] = tokens
            batch.num_tokens[row] = nt + count
            if state.needs_history:
                state.output_token_ids.extend(tokens)
            last_rows.append(row)
            last_tokens.append(tokens[-1])
            rejected = (int(num_drafts[i]) if num_drafts is not None else 0) - (count - 1)
            if self.draft_len_after_rejection is not None and num_drafts is not None and num_drafts[i]:
                if rejected:
                    self._short_drafts.add(req_ids[i])
                else:
                    self._short_drafts.discard(req_ids[i])
            if rejected:
                batch.num_computed[row] -= rejected
                batch.num_blocks[row] = min(batch.num_blocks[row], cdiv(int(batch.num_computed[row]) + lookahead, bs))
            eligible.append(i)
        if last_rows:
            batch.last_sampled[torch.tensor(last_rows, device=runner.device)] = torch.tensor(
                last_tokens, dtype=torch.int64, device=runner.device
            )
        drafts: list[list[int]] = [[] for _ in host]
        if self.disable_by_batch_size is not None and batch.num_rows >= self.disable_by_batch_size:
            eligible = []
        p = runner.parallel
        every_step = getattr(self.proposer, "needs_every_step", False)  # it still runs, for its KV, with no requests
        if not (eligible or every_step) or not (self.proposer.on_every_rank or p.dp_size > 1 or p.rank == 0):
            return drafts
        idx = np.asarray(eligible, dtype=np.int64)
        sel_rows = rows[idx]
        counts = np.asarray([host[i][k + 1] for i in eligible], dtype=np.int64)
        inputs = ProposeInputs(
            req_ids=[req_ids[i] for i in eligible],
            rows=sel_rows,
            token_ids=token_buf,
            num_tokens=batch.num_tokens[sel_rows].copy(),
            num_accepted=counts,
            max_draft_len=k,
            step=step,
            hidden_states=hidden,
            sample_pos=step.sample_idx[idx],
            block_table=batch.block_tables[0],
        )
        proposal = self.proposer.propose(inputs)
        short = self.draft_len_after_rejection
        for j, (i, d) in enumerate(zip(eligible, proposal.token_ids)):
            drafts[i] = list(d) if short is None or req_ids[i] not in self._short_drafts else list(d[:short])
            q = proposal.probs[j] if proposal.probs is not None else None
            if q is not None and drafts[i]:
                self._draft_probs[req_ids[i]] = q[: len(drafts[i])]
            else:
                self._draft_probs.pop(req_ids[i], None)
        return drafts


def _plain_greedy(state: RequestState) -> bool:
    """Greedy on the raw logits: no logit_bias, no min_tokens or penalties (what needs the history), no logprobs."""
    params = state.params
    return (
        (params.greedy or params.temperature < MIN_SAMPLING_TEMPERATURE)
        and not params.logit_bias
        and not state.needs_history
        and params.logprobs is None
    )


def _logprobs(logits: torch.Tensor, batch: SamplingBatch, verified, first: np.ndarray, states) -> list[RowLogprobs]:
    """The target's raw logprob (and top alternatives) of each output token, at the position that produced it."""
    raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    counts = verified.num_tokens.tolist()
    tokens = verified.token_ids.tolist()
    out: list[RowLogprobs] = []
    width = batch.max_num_logprobs or 0
    for i, state in enumerate(states):
        num = state.params.logprobs
        if num is None:
            out.append(None)
            continue
        rows = torch.arange(int(first[i]), int(first[i]) + counts[i], device=logits.device)
        toks = torch.tensor(tokens[i][: counts[i]], device=logits.device)
        lps = raw[rows, toks].tolist()
        if width and num:
            values, ids = raw[rows].topk(num, dim=-1)
            tops = [list(zip(a, b)) for a, b in zip(ids.tolist(), values.tolist())]
        else:
            tops = [[] for _ in lps]
        out.append([TokenLogprobs(lp, top) for lp, top in zip(lps, tops)])
    return out


def _output(
    req_ids: list[str], host: list[list[int]], logprobs: list[RowLogprobs] | None, drafts: list[list[int]]
) -> ModelRunnerOutput:
    out = ModelRunnerOutput([], [], [] if logprobs is not None else None, [], spec_token_ids=[])
    k2 = len(host[0]) - 1 if host else 0  # the packed row: k + 1 tokens, count, flag
    for j, rid in enumerate(req_ids):
        packed_row = host[j]
        if packed_row[k2]:
            out.failed_req_ids.append(rid)
            continue
        out.req_ids.append(rid)
        out.sampled_token_ids.append(packed_row[: packed_row[k2 - 1]])
        if out.logprobs is not None and logprobs is not None:
            out.logprobs.append(logprobs[j])
        assert out.spec_token_ids is not None
        out.spec_token_ids.append(drafts[j] if drafts else [])
    return out
