"""Offline API: `LLM(model, **options).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec
from tqdm import tqdm
from transformers import AutoTokenizer

from brisk.config import EngineConfig, check_fits_machine, generation_defaults, load_chat_template
from brisk.distributed.launch import launcher_env
from brisk.engine.core import EngineCore
from brisk.engine.messages import EngineCoreRequest
from brisk.engine.output_processor import OutputProcessor
from brisk.harmony.chat import is_harmony_model, render_chat
from brisk.model_config import ModelConfig
from brisk.outputs import RequestOutput
from brisk.sampling_params import SamplingParams

# A prompt is text, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """The offline engine of one model. It holds the engine and, with tp_size > 1, the worker processes and the
    process group: released by `close()`, at the end of a `with` block, when the object is garbage-collected, or at
    interpreter exit, whichever comes first (once)."""

    def __init__(
        self, model: str, *, tokenizer: str | None = None, extra_llm_api_options: str | None = None, **options
    ):
        """`options`: engine options in any spelling of the option table (docs/options.md): trtllm's
        (max_batch_size, kv_cache_config={...}) or vLLM's (max_num_seqs, gpu_memory_utilization...)."""
        if tokenizer is not None:
            options["tokenizer"] = tokenizer
        self.config = EngineConfig.build(model, extra_llm_api_options, find_model=True, **options)
        path = self.config.model
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or path)
        chat_template = load_chat_template(self.config)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        model_config = ModelConfig.from_pretrained(path)
        check_fits_machine(self.config, model_config, launched_externally=launcher_env() is not None)
        self.generation_defaults = generation_defaults(self.config, model_config)
        self._engine = EngineCore(self.config)
        self._engine.structured.tokenizer = self.tokenizer  # loaded once, for the grammars too
        # Holds the engine, not self: the finalizer runs when this object goes (or at exit, or on close()).
        self._release = weakref.finalize(self, self._engine.shutdown)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @property
    def engine(self) -> EngineCore:
        if not self._release.alive:
            raise RuntimeError("this LLM was closed: create a new one")
        return self._engine

    def close(self) -> None:
        """Stop the worker ranks (tp_size > 1) and leave the process group; the LLM cannot generate afterwards.
        Calling it again does nothing."""
        self._release()

    def shutdown(self) -> None:
        """The same as `close()`."""
        self.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults, as vLLM applies them."""
        return SamplingParams(**self.generation_defaults)

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(params_list)} sampling params")
        # Every request is checked (the same checks as the server's) before any is queued.
        tokenized = [self._tokenize(prompt) for prompt in prompt_list]
        salts = [_cache_salt(prompt) for prompt in prompt_list]
        vocab_size, max_seq_len = self.engine.model_config.vocab_size, self.engine.max_seq_len
        for i, ((_, token_ids), params) in enumerate(zip(tokenized, params_list)):
            params.validate()
            params.check_max_logprobs(self.config.max_logprobs)
            params.check_for_model(token_ids, vocab_size, max_seq_len)
            params_list[i] = params = self._resolve_structured_outputs(params)
            self._check_structured_outputs(params)
        order: list[str] = []
        try:
            for salt, (text, token_ids), params in zip(salts, tokenized, params_list):
                rid = str(next(self._ids))
                self.engine.add_request(EngineCoreRequest(rid, token_ids, params, salt))
                self.output_processor.add_request(rid, text, token_ids, params)
                order.append(rid)
        except Exception:
            for rid in order:  # all or nothing: drop what was already queued
                self.engine.abort_request(rid)
                self.output_processor.abort(rid)
            raise
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`. continue_final_message: the last message is continued (a prefill), not answered."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self.render_chat(
                    conv, add_generation_prompt, tools, chat_template_kwargs, continue_final_message
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _resolve_structured_outputs(self, params: SamplingParams) -> SamplingParams:
        """The params with their JSON whitespace left to the engine (None) set from structured_outputs_config."""
        spec = params.structured_outputs
        if spec is None or spec.disable_any_whitespace is not None:
            return params
        whitespace = self.config.structured_outputs_config.disable_any_whitespace
        return replace(params, structured_outputs=msgspec.structs.replace(spec, disable_any_whitespace=whitespace))

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the grammar now with the engine's compiler (cached, so the engine's own compile is a hit):
        InvalidRequest naming the problem, or a compile over the time limit."""
        spec = params.structured_outputs
        if spec is not None:
            self.engine.structured.compiler().compile(spec)

    def render_chat(
        self, messages, add_generation_prompt=True, tools=None, chat_template_kwargs=None, continue_final_message=False
    ) -> list[int]:
        """The prompt ids of a conversation, rendered as the server renders it (harmony for gpt-oss).
        Raises ValueError for what cannot be rendered (an unknown role, non-text content)."""
        is_harmony = is_harmony_model(self.engine.model_config.hf_config.model_type, self.tokenizer)
        return render_chat(
            self.tokenizer,
            messages,
            harmony=is_harmony,
            tools=tools,
            template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, list(prompt)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished_requests() or self.output_processor.has_unfinished():
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("the engine finished requests it never reported")  # a bug, never a hang
            step = self.engine.step()
            processed = self.output_processor.process(step.outputs)
            if step.refused:  # after admission (a grammar that did not compile): the whole call fails, nothing leaks
                for rid in order:
                    self.engine.abort_request(rid)
                    self.output_processor.abort(rid)
                raise step.refused[0][1]
            for rid, index in processed.aborts:
                self.engine.abort_request(rid, index)
            for out in processed.finished:
                finished[out.request_id] = out
                bar.update(1)
        bar.close()
        return [finished[rid] for rid in order]


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt dict's `cache_salt` (vLLM's): its prefix-cache blocks are shared only with prompts of that salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string")
    return salt


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)  # any iterable, read once
    token_ids = [p for p in items if isinstance(p, int)]
    if not token_ids:
        return [p for p in items if not isinstance(p, int)]  # every item
    if len(token_ids) == len(items):
        return [token_ids]  # one token-id prompt
    raise TypeError("prompts mixes token ids with other prompts: pass one list[int] or a list of prompts")
