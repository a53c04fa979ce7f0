"""brisk: a small, fast LLM inference server."""

from brisk.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy, so `import brisk.scheduler` does not pull in torch models and transformers.
    if name == "LLM":
        from brisk.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from brisk import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'brisk' has no attribute {name!r}")
