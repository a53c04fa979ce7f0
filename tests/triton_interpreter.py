"""Triton's interpreter, made to patch triton.language once a launch rather than at every helper call.

The interpreter runs a kernel by patching triton.language's builtins with host versions for the launch, and then
patches them again at every call of a @triton.jit helper from inside the kernel (an `inspect.getmembers` over the
language's modules each time; the helper call's patches are never restored). Inside a launch the language is patched
already, so those calls change nothing but cost a third of the MXFP4 MoE kernels' interpreted time (their helpers
run every K step). `skip_nested_language_patches` leaves the launch's own patching as it is and makes a nested one a
no-op where the launch has patched the modules it names; what a kernel computes is unchanged, as every kernel test checks against its torch reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _LaunchPatches:
    """The language modules patched in the running launch (a set from its start until its scope is restored)."""

    patch_lang: Callable[[Any], Any]
    scope_type: type
    language: tuple[Any, ...]  # triton.language and triton.language.core: the modules the interpreter patches
    patched: set[int] | None = None  # ids of the modules patched in the running launch; None: no launch runs
    modules_of: dict[Any, frozenset[int]] = field(default_factory=dict)

    def __call__(self, fn: Any) -> Any:
        modules = self.modules_of.get(fn)
        if modules is None:  # as the interpreter picks them: the language modules fn's globals name
            names = fn.__globals__.values()
            modules = self.modules_of[fn] = frozenset(id(m) for m in self.language if any(v is m for v in names))
        if self.patched is not None and modules <= self.patched:  # a helper whose language the launch patched
            return self.scope_type()
        scope = self.patch_lang(fn)
        if self.patched is not None:  # a helper naming a module the launch had not patched (tl.zeros: core)
            self.patched |= modules
            return scope
        self.patched = set(modules)
        restore = scope.restore

        def restored() -> None:
            self.patched = None
            restore()

        scope.restore = restored
        return scope


def skip_nested_language_patches() -> None:
    """Installs the once-a-launch patching in Triton's interpreter; where this Triton has no such hook its
    interpreter runs as it is."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or isinstance(patch_lang, _LaunchPatches):
        return
    import triton.language as tl

    interpreter._patch_lang = _LaunchPatches(patch_lang, scope_type, (tl, tl.core))
