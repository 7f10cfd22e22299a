"""Keep freed memory in the process instead of handing it back to the kernel after every step (glibc only).

A CPU training step allocates and frees the same few-megabyte tensors again and again. glibc's malloc serves
blocks that large with ``mmap`` and returns them with ``munmap``, or gives the top of its heap back with
``brk`` once more than its trim threshold lies free there. Either way the next step's tensors land on fresh
pages, and the kernel zeroes each one on first touch. How often depends on the process's heap layout: on the
2parity CPU model (2 threads) from about 450 to 14,000 minor page faults per fp32 step, at about 0.7 us each,
and rarely any per bf16 step (measured with benchmarks/step_speed.py). With both thresholds raised to 1 GiB,
freed blocks stay in the heap and the next step reuses them: fp32 steps of processes that faulted heavily went
from 114-122 ms to 93-101 ms.

PyTorch's CPU tuning guide reaches the same end by swapping in tcmalloc or jemalloc with ``LD_PRELOAD``,
which needs a system package and an environment variable set before Python starts. ``mallopt`` is glibc's
own switch for this, callable at any time. ``maskprior`` calls :func:`keep_freed_memory` when it starts,
through :func:`keep_freed_memory_if_enabled` (``MASKPRIOR_KEEP_FREED_MEMORY=0`` turns that off); in a
notebook, call it yourself.

The cost: memory a run has freed stays in the process (up to 1 GiB of it beyond what is in use), instead of
going back to the system between steps; the peak is unchanged.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

# mallopt(3) parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 30  # 1 GiB
OLD_GLIBC_MMAP_MAX = 32 << 20  # older glibc releases refuse an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB)
ENV = "MASKPRIOR_KEEP_FREED_MEMORY"


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None  # musl, macOS, Windows: their allocators have no such thresholds
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Raise glibc malloc's mmap and trim thresholds to ``threshold`` bytes; whether it took effect.

    False (and nothing changed) where the C library is not glibc. Setting the thresholds also switches off
    glibc's own adaptive mmap threshold, so the setting holds for the rest of the process.
    """
    if threshold <= 0:
        raise ValueError(f"threshold must be a positive number of bytes, got {threshold}")
    libc = _glibc()
    if libc is None:
        return False
    # mallopt returns 1 on success and 0 when it refuses the value.
    mmap_set = libc.mallopt(M_MMAP_THRESHOLD, threshold) or libc.mallopt(M_MMAP_THRESHOLD,
                                                                         min(threshold, OLD_GLIBC_MMAP_MAX))
    return bool(mmap_set) and bool(libc.mallopt(M_TRIM_THRESHOLD, threshold))


def enabled_by_environment() -> bool:
    """False when ``MASKPRIOR_KEEP_FREED_MEMORY`` is ``0``, ``false``, ``no`` or ``off``; True otherwise."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on", ""):
        return True
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 1 or 0 (also true/false, yes/no, on/off)")


def keep_freed_memory_if_enabled() -> bool:
    """:func:`keep_freed_memory` unless the environment switches it off; whether freed memory is now kept.

    A bad ``MASKPRIOR_KEEP_FREED_MEMORY`` raises ValueError naming it (:func:`enabled_by_environment`).
    """
    return enabled_by_environment() and keep_freed_memory()
