"""Triton, when installed: the import, its mode (compiled, or the CPU interpreter for tests) and `jit`.

Triton fixes interpreter vs compiled mode when it is first imported (torch >= 2.13 imports it with torch), so our
kernels follow that import-time mode (`INTERPRETED`) rather than reading TRITON_INTERPRET at decoration time.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - triton is optional (CPU-only installs)
    triton = None
    tl = None

# Mode triton was imported in (its own tl.zeros / tl.sum / ... are interpreted or compiled from then on).
INTERPRETED = triton is not None and not isinstance(tl.zeros, JITFunction)


def jit(fn=None, *, do_not_specialize: tuple[str, ...] | list[str] = ()):
    """`triton.jit` in the mode triton was imported in (identity without triton); `@jit(do_not_specialize=[...])`
    compiles one kernel for every value of those integer arguments (no special case for 1 or multiples of 16)."""
    if fn is None:
        return functools.partial(jit, do_not_specialize=do_not_specialize)
    if triton is None:
        return fn
    kw = {"do_not_specialize": list(do_not_specialize)} if do_not_specialize else {}
    if INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn, **kw)
    return JITFunction(fn, **kw)


def triton_available(device: torch.device | str) -> bool:
    """True when triton imports and the kernel can run on `device`: CUDA with compiled triton, or any device when
    triton was imported in interpreter mode and TRITON_INTERPRET=1 is still set (tests)."""
    if triton is None:
        return False
    if INTERPRETED:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return torch.device(device).type == "cuda"
