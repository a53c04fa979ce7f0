"""Where a model's files are: a local folder as-is, or a Hugging Face Hub id downloaded into (or found in) the
local Hugging Face cache (`resolve_model_path`); `resolve_model`, the same for MODEL as a user gives it, failing as
one-line ConfigErrors that say what to do. Imports nothing of brisk's but its errors: config.py resolves MODEL at
start-up without importing the model side."""

from __future__ import annotations

import os

from brisk.errors import ConfigError

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


def resolve_model(
    model: str, revision: str | None = None, download_dir: str | None = None, token: str | None = None
) -> str:
    """MODEL's folder: a local folder, or a Hub id from the Hub, or from the local Hugging Face cache when the Hub
    cannot be reached (huggingface_hub falls back to it; HF_HUB_OFFLINE skips the Hub). ConfigError in one line
    saying what to do when it is in neither."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        return resolve_model_path(model, revision, download_dir, token)
    except ModelNotAvailableError as exc:
        cause = exc.__cause__
        if cause is None:  # a path that is not a folder
            raise ConfigError(f"{exc}: pass a model folder or a Hugging Face model id as MODEL") from None
        if isinstance(cause, GatedRepoError):
            why = "is gated on the Hugging Face Hub: accept its terms there and set HF_TOKEN"
        elif isinstance(cause, RepositoryNotFoundError):
            why = "is not on the Hugging Face Hub (or is private: set HF_TOKEN): check the name"
        elif isinstance(cause, RevisionNotFoundError):
            why = f"has no revision {revision!r} on the Hugging Face Hub: check --revision"
        else:
            why = (
                f"is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub cannot be reached: "
                f"download it where the network is up (`hf download {model}`) into that cache (HF_HOME), "
                "or pass a local folder"
            )
        raise ConfigError(f"model '{model}' {why}") from None
