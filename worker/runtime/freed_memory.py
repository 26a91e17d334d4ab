"""Hand memory a load no longer needs back to the system.

`return_freed_memory`: glibc keeps freed memory for later allocations, and a load's temporaries (unpacked
blocks, packing's int32 intermediates, copies let go) fragment its heap: the dropped dense copies of the
Qwen3-0.6B shape left the worker's RSS at 2.5 GB, 1.2 GB after a trim; packing the Qwen3-30B-A3B shape's
experts grew it by twice what the packed weights hold before the trim at the end of the load.

`drop_mapped_pages`: a GGUF stays mapped, and every page the load read stays in the process's resident set
(the Qwen3-30B-A3B shape's whole 1.5 GB file) though the steps read copies. Dropping them from the mapping
leaves them in the page cache, read again on access; what a container's working set counts (and what
Kubernetes evicts by) shrinks by the file's size.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np


def return_freed_memory() -> None:
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; absent elsewhere
    if trim is not None:
        trim(0)


def drop_mapped_pages(mapped: np.ndarray) -> None:
    """Let the kernel drop `mapped`'s pages (an np.memmap of a whole file, read-only) from this process."""
    madvise = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if madvise is None or mapped.nbytes == 0:
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(mapped.ctypes.data, mapped.nbytes, mmap.MADV_DONTNEED)
