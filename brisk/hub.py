"""Where a model's files are: a local folder as-is, or a Hugging Face Hub id downloaded into (or found in) the
local Hugging Face cache. A leaf module: config.py resolves MODEL at start-up without importing the model side."""

from __future__ import annotations

import os

HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt")
# gpt-oss repos keep duplicate weights in original/ and metal/: only top-level files are needed.
HUB_IGNORE_PATTERNS = ("*/*",)


class ModelNotAvailableError(RuntimeError):
    """The model is neither a local directory nor downloadable right now."""


def resolve_model_path(
    model: str, revision: str | None = None, cache_dir: str | None = None, token: str | None = None
) -> str:
    """A local directory as-is; otherwise a Hub repo id, downloaded (or found in the HF cache, or `cache_dir`;
    `token`: the Hub's, else huggingface_hub's own: HF_TOKEN or the stored login)."""
    local = os.path.expanduser(model)
    if os.path.isdir(local):
        return local
    if model.startswith(("/", ".", "~")):
        raise ModelNotAvailableError(f"model path '{model}' is not a directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    # Read at call time: huggingface_hub reads HF_HUB_OFFLINE only once, when it is imported.
    offline = any(
        os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    try:
        return snapshot_download(
            repo_id=model,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            ignore_patterns=list(HUB_IGNORE_PATTERNS),
            local_files_only=offline,
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError, ValueError) as exc:
        why = "offline mode (HF_HUB_OFFLINE) and not in the local cache" if offline else f"{type(exc).__name__}: {exc}"
        raise ModelNotAvailableError(
            f"cannot get model '{model}' from the Hugging Face Hub ({why}); pass a local directory path instead"
        ) from exc
