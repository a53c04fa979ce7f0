"""`stream_interval` on the engine side: a completion's outputs are held in the engine process until the API
server would send them anyway, so that with `stream_interval` N the engine -> API messages, their decoding and the
API's per-request wake-ups are one per N tokens instead of one per token.

The API's `StreamAccumulator` (brisk/server/streaming.py) releases a completion's tokens once it holds `interval`
of them or the completion finished. The batcher counts the same tokens the same way and sends a completion's held
outputs, merged into one, exactly when that accumulator would release them; so the chunks a client sees are the
ones it saw with per-step messages. Two outputs go out at once: a completion's first token (the server's
time-to-first-token clock stops on it; the accumulator still holds it) and anything carrying prompt logprobs.
"""

from __future__ import annotations

from brisk.engine.messages import EngineCoreOutput


def merge_outputs(first: EngineCoreOutput, second: EngineCoreOutput) -> EngineCoreOutput:
    """`first` extended by the later output `second` of the same completion (first is changed and returned)."""
    first.new_token_ids += second.new_token_ids
    if second.logprobs is not None:
        first.logprobs = (first.logprobs or []) + second.logprobs
    first.finish_reason, first.stop_reason = second.finish_reason, second.stop_reason
    first.num_cached_tokens = second.num_cached_tokens
    first.scheduled_time = first.scheduled_time or second.scheduled_time
    first.num_steps += second.num_steps
    return first


class StreamIntervalBatcher:
    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[tuple[str, int], EngineCoreOutput] = {}
        self._num_held: dict[tuple[str, int], int] = {}  # tokens since the accumulator's last release
        self._started: set[tuple[str, int]] = set()  # completions whose first token went out

    def add(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """One step's outputs in; the outputs to send now out (in order per completion)."""
        if self.interval <= 1:
            return outputs
        send: list[EngineCoreOutput] = []
        for out in outputs:
            key = (out.request_id, out.index)
            if out.prompt_logprobs is not None:  # a prompt chunk's logprobs: sent as it is, after what is held
                held = self._held.pop(key, None)
                if held is not None:
                    send.append(held)
                send.append(out)
                self._release(key, out)
                continue
            held = self._held.get(key)
            merged = out if held is None else merge_outputs(held, out)
            count = self._num_held.get(key, 0) + len(out.new_token_ids)
            if out.finish_reason is not None:
                self._held.pop(key, None)
                self._num_held.pop(key, None)
                self._started.discard(key)
                send.append(merged)
            elif count >= self.interval:
                self._held.pop(key, None)
                self._num_held[key] = 0
                self._started.add(key)
                send.append(merged)
            elif key not in self._started and out.new_token_ids:
                self._held.pop(key, None)
                self._num_held[key] = count
                self._started.add(key)
                send.append(merged)
            else:
                self._held[key] = merged
                self._num_held[key] = count
        return send

    def _release(self, key: tuple[str, int], out: EngineCoreOutput) -> None:
        """After sending `out` unmerged: its tokens count toward the accumulator's next release."""
        if out.finish_reason is not None:
            self._num_held.pop(key, None)
            self._started.discard(key)
            return
        count = self._num_held.get(key, 0) + len(out.new_token_ids)
        self._num_held[key] = 0 if count >= self.interval else count
        if out.new_token_ids:
            self._started.add(key)

    def forget(self, request_id: str) -> None:
        """Drop what is held for a request that failed (its outputs will not be wanted)."""
        for key in [k for k in self._num_held if k[0] == request_id]:
            self._held.pop(key, None)
            self._num_held.pop(key, None)
            self._started.discard(key)
