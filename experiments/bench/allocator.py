"""CPU allocator setting for timing runs: keep large freed blocks in the process (glibc only).

glibc's ``malloc`` serves blocks above its mmap threshold (at most 32 MiB by default) with a fresh
``mmap`` and returns them on ``free``. A ``[2, 4096, 1152]`` fp32 activation is 36 MiB, so on CPU every
such tensor of a forward is page-faulted in anew: about 9,200 minor faults, often more time than the
arithmetic of the op that fills it (measured in docs/benchmarks.md). The cost is per full-length tensor, so
it is the same for the unmerged and the merged model, but it is a larger share of the merged one and hides
what merging saves.

``keep_freed_memory()`` raises the mmap and trim thresholds with ``mallopt`` so freed blocks are reused;
the same effect as starting the process with ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, or
using jemalloc/tcmalloc, as CPU inference guides advise. ``tomerge bench`` calls it on CPU for every
method alike, baseline included (``--no-keep-freed-memory`` turns it off).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
M_MMAP_THRESHOLD = -3


def keep_freed_memory(limit_bytes: int = 1 << 30) -> bool:
    """Let glibc keep freed blocks of up to ``limit_bytes`` for reuse instead of unmapping them.

    Returns:
        True when applied; False where the C library is not glibc (nothing is changed there).
    """
    if not 0 < limit_bytes < 1 << 31:  # mallopt takes a C int
        raise ValueError(f"limit_bytes must be in (0, 2**31), got {limit_bytes}")
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    ok = libc.mallopt(M_MMAP_THRESHOLD, limit_bytes) == 1 and libc.mallopt(M_TRIM_THRESHOLD, limit_bytes) == 1
    if not ok:
        raise RuntimeError("mallopt rejected the thresholds")
    return True
