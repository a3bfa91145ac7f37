"""layernorm.cpu: large outputs reuse memory freed by earlier outputs, never memory still held;
the forward's checksum is an option."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

pytest.importorskip("torch")

import layernorm.cpu as lnc  # noqa: E402
from layernorm.cpu import memory  # noqa: E402


def test_fresh_outputs_never_share_memory_with_held_ones():
    """Protects the output pool: an output held by the caller is never handed out again (a
    second call gets other memory, and its values are its own), a freed output's block goes
    back to the pool and the next call of its size takes it, with the right result."""
    if memory.CAP_BYTES == 0:
        pytest.skip("the pool is off (LAYERNORM_POOL_MB=0)")
    x = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    y1, _ = lnc.rms_norm_forward(x)
    want = y1.copy()
    y2, _ = lnc.rms_norm_forward(x + 1)
    assert not np.shares_memory(y1, y2)
    assert np.array_equal(y1, want)  # the second call wrote elsewhere
    view = y1[::2]
    del y1
    gc.collect()
    y3, _ = lnc.rms_norm_forward(x)
    assert not np.shares_memory(y3, view)  # a view keeps its block out of the pool
    assert np.array_equal(view, want[::2])
    held = memory.held_bytes()
    del view, y2
    gc.collect()
    assert memory.held_bytes() >= held + 2 * (2 << 20)
    y4, _ = lnc.rms_norm_forward(x)
    assert memory.held_bytes() == held + (2 << 20)  # one block taken back
    assert np.array_equal(y4, want)


def test_small_outputs_are_plain_arrays():
    """Protects small calls from the pool's cost: under MIN_BYTES an output owns its memory."""
    y, _ = lnc.layer_norm_forward(np.ones((4, 8), np.float32))
    assert y.flags.owndata


def test_checksum_is_an_option():
    """Protects the checksum option: by default a changed x makes the backward raise; with
    checksum=False the cache holds no checksums, the results are the same bits, and the
    change goes unseen (as documented)."""
    x = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    dy = np.ones_like(x)
    y, cache = lnc.layer_norm_forward(x.copy())
    y_off, cache_off = lnc.layer_norm_forward(x.copy(), checksum=False)
    assert cache_off.check.size == 0 and cache.check.size == 64
    assert np.array_equal(y, y_off)
    for a, b in zip(lnc.layer_norm_backward(dy, cache), lnc.layer_norm_backward(dy, cache_off),
                    strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)
    cache.x[3, 5] += 1
    with pytest.raises(ValueError, match="changed between the forward and the backward"):
        lnc.layer_norm_backward(dy, cache)
    cache_off.x[3, 5] += 1
    lnc.layer_norm_backward(dy, cache_off)  # unseen: the documented cost of the option
    with pytest.raises(TypeError, match="checksum must be True or False"):
        lnc.rms_norm_forward(x, checksum=1)


def test_a_forked_child_writes_its_own_copy():
    """Protects the pool's blocks across fork: they are private memory, so a child that writes
    into an output it inherited, or takes a pooled block for its own output, leaves the
    parent's arrays as they were."""
    if not hasattr(os, "fork") or memory.CAP_BYTES == 0:
        pytest.skip("needs fork and the pool")
    x = np.random.default_rng(2).standard_normal((512, 1024)).astype(np.float32)
    y, _ = lnc.rms_norm_forward(x)
    want = y.copy()
    freed, _ = lnc.rms_norm_forward(x)
    del freed
    gc.collect()  # a block in the pool, which the child will take
    pid = os.fork()
    if pid == 0:  # the child: write into y, and take the pooled block for a new output
        y[:] = 7.0
        lnc.rms_norm_forward(x * 3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert np.array_equal(y, want)
    again, _ = lnc.rms_norm_forward(x)  # the parent's pooled block, untouched by the child
    assert np.array_equal(again, want)
