"""glibc's malloc tuning: when it applies, and that a tuned client process serves tensor-sized
buffers from the heap instead of a fresh mapping each (the server's re-exec is tested in
test_server.py)."""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

from tensorkv.wire import allocator

PROBE = """
import ctypes, sys
import numpy as np
from tensorkv.wire import allocator

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
if sys.argv[1] == "tune":
    allocator.tune_this_process()
before = mallinfo2().hblks
buffers = [np.empty(4 << 20, np.uint8) for _ in range(3)]  # 4 MiB each, as stream buffers are
print(mallinfo2().hblks - before)  # how many of them are mappings of their own
"""


def _mapped_blocks(*args, **env):
    base = {k: v for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", "TENSORKV_NO_MALLOC_TUNING") and not k.startswith("MALLOC_")}
    result = subprocess.run([sys.executable, "-c", PROBE, *args], env={**base, **env}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc 2.33 or newer")
def test_a_tuned_process_takes_big_buffers_from_the_heap():
    assert _mapped_blocks("plain") == 3
    assert _mapped_blocks("tune") == 0
    assert _mapped_blocks("tune", TENSORKV_NO_MALLOC_TUNING="1") == 3
    assert _mapped_blocks("tune", GLIBC_TUNABLES="glibc.malloc.arena_max=4") == 3


def test_when_tuning_applies(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("TENSORKV_NO_MALLOC_TUNING", raising=False)
    try:
        on_glibc = sys.platform == "linux" and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):
        on_glibc = False
    assert allocator.wanted() == on_glibc
    monkeypatch.setenv("TENSORKV_NO_MALLOC_TUNING", "1")
    assert not allocator.wanted()
    monkeypatch.setenv("TENSORKV_NO_MALLOC_TUNING", "0")
    assert allocator.wanted() == on_glibc
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    assert not allocator.wanted()


def test_receive_buffers_are_used_again_only_once_nothing_refers_to_them():
    size = allocator.REUSE_MIN_BYTES
    buffers = allocator.Buffers(max_bytes=3 * size + 10)
    first = buffers.empty(size)
    view = first[5:].view(np.int8)
    del first
    second = buffers.empty(size)
    assert second is not view.base  # a view keeps its buffer
    memory = memoryview(second)
    del second
    third = buffers.empty(size)
    assert third is not memory.obj and third is not view.base  # a memoryview too
    del view, memory, third
    assert buffers.empty(size) is buffers._kept[0] and len(buffers._kept) == 3
    assert buffers.empty(100).nbytes == 100 and len(buffers._kept) == 3  # small ones are not kept


def test_receive_buffers_kept_take_max_bytes_at_most():
    size = allocator.REUSE_MIN_BYTES
    buffers = allocator.Buffers(max_bytes=3 * size + 10)
    burst = [buffers.empty(size + extra) for extra in range(5)]  # in use: the last two not kept
    assert [buffer.nbytes - size for buffer in buffers._kept] == [0, 1, 2]
    del burst
    buffers.empty(size + 10)  # idle ones, the first made first, make room
    assert [buffer.nbytes - size for buffer in buffers._kept] == [2, 10]
    assert sum(buffer.nbytes for buffer in buffers._kept) <= buffers.max_bytes
