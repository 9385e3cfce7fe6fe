"""The KV cache tensors: zero, of the asked shape and dtype, aligned, one per layer; a CPU
cache's pages resident only once written, or all of them once committed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem.worker.kv_cache import allocate_kv_caches

SHAPE = (2, 5, 16, 3, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_caches_are_zero_aligned_and_separate(dtype):
    caches = allocate_kv_caches(3, SHAPE, dtype, torch.device("cpu"))
    assert len(caches) == 3
    for c in caches:
        assert c.shape == SHAPE and c.dtype == dtype and c.is_contiguous() and c.device.type == "cpu"
        assert c.data_ptr() % 64 == 0
        assert not c.view(torch.uint8).any()
    caches[0][1, 2] = 1
    assert caches[0].float().sum() == 16 * 3 * 24 and not caches[1].view(torch.uint8).any()


def test_large_cpu_cache_is_zero():
    """Large enough for calloc to hand out fresh pages (glibc's mmap threshold is 32 MiB at
    most; this is 40 MiB): still zero, and writable."""
    (cache,) = allocate_kv_caches(1, (2, 640, 16, 8, 128), torch.bfloat16, torch.device("cpu"))
    assert not cache.view(torch.uint8).any()
    cache.fill_(1)
    assert cache.float().mean() == 1


# Run in a fresh process: in a long one (the test suite), a large calloc may be served from
# freed heap memory that is resident already, and then nothing is on demand.
_COMMIT = """
import os, torch
from tandem.worker.kv_cache import allocate_kv_caches, commit_kv_caches
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = rss()
caches = allocate_kv_caches(2, (2, 640, 16, 8, 128), torch.bfloat16, torch.device("cpu"))
allocated = rss()
commit_kv_caches(caches)
committed = rss()
print(allocated - before, committed - allocated, int(any(c.view(torch.uint8).any() for c in caches)))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the RSS from /proc")
def test_commit_makes_a_cpu_cache_resident():
    """In a fresh process, allocating 2 x 40 MiB takes no memory yet; committing makes all
    of it resident (what an engine-core process does at start) and leaves it zero."""
    out = subprocess.run([sys.executable, "-c", _COMMIT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown_alloc, grown_commit, nonzero = (float(x) for x in out.stdout.split()[-3:])
    assert grown_alloc < 16 and grown_commit > 72 and nonzero == 0, out.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_caches_are_zero():
    caches = allocate_kv_caches(2, SHAPE, torch.bfloat16, torch.device("cuda"))
    assert all(c.device.type == "cuda" and c.shape == SHAPE and not c.view(torch.uint8).any() for c in caches)
