"""Logprob entries in OpenAI's shape (chat `logprobs.content`, Responses `output_text.logprobs`)."""

from __future__ import annotations

from brisk.server.schemas import TokenLogprob, TopLogprob


def token_text(tokenizer, token_id: int, as_token_id: bool) -> str:
    """How logprobs name a token: its text, or vLLM's `token_id:N` (return_tokens_as_token_ids: a token that is part
    of a UTF-8 character has no text of its own)."""
    return f"token_id:{token_id}" if as_token_id else tokenizer.decode([token_id])


def logprob_entries(
    tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int | None, as_token_ids: bool = False
) -> list[TokenLogprob]:
    """Each token's entry and its top_n likeliest alternatives; top_n None: all of its logprobs, in their order."""

    def item(tok: int, lp: float) -> TopLogprob:
        text = token_text(tokenizer, tok, as_token_ids)
        return TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))

    entries = []
    for token_id, lps in zip(token_ids, logprobs):
        top = list(lps.items()) if top_n is None else sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        entries.append(TokenLogprob(**dict(item(token_id, lps[token_id])), top_logprobs=[item(t, lp) for t, lp in top]))
    return entries
