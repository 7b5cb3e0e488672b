"""Process-level helpers (jaxppo.process)."""

import ctypes
import platform

import pytest

from jaxppo.process import release_free_memory


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_release_free_memory_hands_freed_heap_pages_back_to_the_os():
    """Blocks freed in the middle of glibc's heap (below a block still in use) stay resident,
    which is what XLA's compiles and updates leave behind; releasing gives them back."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 1600  # 100 MB in blocks below the mmap threshold
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    kept = libc.malloc(size)  # above them: glibc does not shrink the heap past it on free
    for b in blocks:
        libc.free(b)
    before = _rss_mb()
    assert not release_free_memory(after_seconds=0.01)  # after short work: left alone
    assert _rss_mb() > before - 25
    assert release_free_memory(after_seconds=0.6)
    released = before - _rss_mb()
    libc.free(kept)
    assert released > 75, f"{released:.0f} MB released of 100 MB freed"
