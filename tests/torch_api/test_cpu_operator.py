"""The CPU operator of layernorm.torch and the threads of both APIs: the C++ operator against
its Python twin, the fallback where it cannot be built, thread counts, fork and concurrent
callers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import layernorm.cpu as lnc  # noqa: E402
import layernorm.torch as lt  # noqa: E402
from layernorm.cpu.statistics import NSTATS  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.tolerances import assert_close  # noqa: E402
from layernorm.torch import _ops  # noqa: E402

needs_native = pytest.mark.skipif(not _ops.NATIVE, reason="the C++ engine is not loaded here")

# Every norm forward and backward in float32 and bfloat16 (with a float32 residual stream):
# the script saves the results (and whether each is a parameter's gradient) to the file named
# by its argument, so that two processes can be compared.
_RESULTS = textwrap.dedent("""
    import sys, torch, layernorm.torch as lt
    from layernorm.torch import _ops
    out = []
    for dt in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(70, 3, 96, generator=g).to(dt).requires_grad_()
        r = torch.randn(70, 3, 96, generator=g).to(dt).requires_grad_()
        w = torch.randn(96, generator=g).requires_grad_()
        b = torch.randn(96, generator=g).requires_grad_()
        outs = [lt.layer_norm(x, 96, w, b), lt.rms_norm(x, 96, w),
                *lt.add_layer_norm(x, r, 96, w, b, residual_dtype=torch.float32),
                *lt.add_rms_norm(x, r, 96, w)]
        loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
        grads = torch.autograd.grad(loss, (x, r, w, b))
        with torch.inference_mode():
            outs += [lt.layer_norm(x, 96, w, b), lt.add_rms_norm(x, r, 96, w)[0]]
        out += [(t.detach(), False) for t in (*outs, *grads[:2])]
        out += [(t.detach(), True) for t in grads[2:]]
    g = torch.Generator().manual_seed(4)
    x, r = (torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    w = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    ok = (torch.autograd.gradgradcheck(lambda x, w: lt.layer_norm(x, 6, w), (x, w))
          and torch.autograd.gradgradcheck(lambda x, r, w: lt.add_rms_norm(x, r, 6, w),
                                           (x, r, w)))
    x3 = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(_ops.fwd, (x3, None, w, None, 1e-5, True, False, None))
    torch.save(out, sys.argv[1])
    print(_ops.NATIVE, ok)
""")


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)


@needs_native
def test_the_fallback_agrees_with_the_engine(tmp_path):
    """Protects the fallback's equivalence: with the C++ engine turned off
    (LAYERNORM_NO_CPP=1) the ops' CPU kernels are the NumPy fallback's and autograd is
    registered from Python, and
    every result of the family, forward, backward and inference, agrees with the engine's
    within the tolerance table (the two sum a row in different orders); double backward passes
    gradgradcheck through both autograd implementations, and opcheck passes on a 3-D input
    through both."""
    paths = tmp_path / "native.pt", tmp_path / "python.pt"
    native = _run(_RESULTS, str(paths[0]))
    python = _run(_RESULTS, str(paths[1]), LAYERNORM_NO_CPP="1")
    assert native.returncode == 0 and python.returncode == 0, native.stderr + python.stderr
    assert (native.stdout.split(), python.stdout.split()) == (["True", "True"], ["False", "True"])
    got, want = torch.load(paths[0]), torch.load(paths[1])
    assert len(got) == len(want) == 2 * 12
    for k, ((g, param), (w, _)) in enumerate(zip(got, want, strict=True)):
        w64 = w.double().numpy()
        assert_close(g.double().numpy(), w64, str(w.dtype).removeprefix("torch."),
                     "param" if param else "out", scale=max(1.0, float(abs(w64).max())),
                     name=f"result {k}")


def test_inference_keeps_no_statistics():
    """Protects the inference path: under inference_mode, no_grad, or with no input needing
    a gradient, the functions run the op that computes and returns no statistics, and give
    the training forward's y and h bits."""
    x, r = torch.randn(6, 64), torch.randn(6, 64)
    w = torch.randn(64, requires_grad=True)
    y_train, h_train = lt.add_layer_norm(x, r, 64, w)
    for ctx in (torch.inference_mode(), torch.no_grad()):
        with ctx, torch.profiler.profile() as prof:
            y, h = lt.add_layer_norm(x, r, 64, w)
        names = [e.name for e in prof.events()]
        assert "layernorm::norm" in names and "layernorm::fwd" not in names
        assert torch.equal(y, y_train.detach()) and torch.equal(h, h_train.detach())
    with torch.profiler.profile() as prof:
        lt.layer_norm(x, 64, w.detach())  # nothing requires grad
    names = [e.name for e in prof.events()]
    assert "layernorm::norm" in names and "layernorm::fwd" not in names
    assert len(torch.ops.layernorm.norm.default._schema.returns) == 2  # y and h only


def test_a_changed_input_is_refused_by_the_version_counter():
    """Protects the backward against a changed x: the torch path keeps no checksum, and
    autograd's version counter refuses the backward of an input changed in place."""
    x = torch.randn(4, 16, requires_grad=True)
    xx = x * 1
    y = lt.rms_norm(xx, 16)
    with torch.no_grad():
        xx.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# --- threads ---------------------------------------------------------------------------------

_OS_THREADS = textwrap.dedent("""
    import os, sys, threading, numpy as np, torch
    n = int(sys.argv[1])
    torch.set_num_threads(n)
    import layernorm.torch as lt, layernorm.cpu as lnc
    before = len(os.listdir("/proc/self/task"))
    x = torch.randn(4096, 1024, requires_grad=True)
    y, c = lnc.layer_norm_forward(x.detach().numpy())
    lnc.layer_norm_backward(y, c)
    after_numpy = len(os.listdir("/proc/self/task"))
    lt.layer_norm(x, 1024).sum().backward()
    pool = [t.name for t in threading.enumerate() if t.name.startswith("layernorm")]
    print(after_numpy - before, len(os.listdir("/proc/self/task")) - before, len(pool))
""")


def test_one_thread_means_one_thread():
    """Protects the thread counts: with torch.set_num_threads(1) a large forward and backward
    through the NumPy API, then through layernorm.torch, start no thread at all (torch's pool
    stays unwoken); with 2 the NumPy API's call already wakes a second thread of torch's,
    where the machine has one. Both run on the engine over torch's threads: no thread of
    the package's own is ever started."""
    one = subprocess.run([sys.executable, "-c", _OS_THREADS, "1"], capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    assert one.stdout.split() == ["0", "0", "0"]
    if (os.cpu_count() or 1) >= 2:
        two = subprocess.run([sys.executable, "-c", _OS_THREADS, "2"], capture_output=True,
                             text=True, timeout=600)
        assert two.returncode == 0, two.stderr
        numpy_new, new, pool = map(int, two.stdout.split())
        assert numpy_new >= 1 and new >= numpy_new and pool == 0


_FORK = textwrap.dedent("""
    import numpy as np, torch, layernorm.torch as lt, layernorm.cpu as lnc
    torch.set_num_threads(2)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), lt.RMSNorm(512))

    def evaluate():                            # both APIs' pools run in the parent
        x = torch.randn(2048, 512, requires_grad=True)
        y, h = lt.add_layer_norm(x, torch.randn(2048, 512), 512)
        (y.sum() + h.sum() + model(x).sum()).backward()
        y, c = lnc.layer_norm_forward(x.detach().numpy())
        lnc.layer_norm_backward(y, c)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            t = torch.randn(64, 512, generator=torch.Generator().manual_seed(i))
            y, _ = lnc.layer_norm_forward(t.numpy())
            return lt.layer_norm(t, 512) - torch.from_numpy(y)

    loader = torch.utils.data.DataLoader(Rows(), batch_size=2, num_workers=2)
    worst = 0.0
    for epoch in range(2):                     # each epoch forks new workers after evaluate()
        evaluate()
        worst = max([worst, *(float(b.abs().max()) for b in loader)])
    print(worst)
""")


def test_dataloader_workers_forked_after_a_kernel_ran():
    """Protects fork safety: in a training loop that evaluates (forward and backward through
    both APIs, two threads) and then starts an epoch's DataLoader workers (fork, Linux's
    default), twice, the workers run both APIs' kernels and return the right rows, instead of
    dying on a threading layer that cannot be forked."""
    if sys.platform != "linux":
        pytest.skip("fork is the start method on Linux")
    done = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1e-5
    assert "fork() called" not in done.stderr


@pytest.mark.parametrize("api", ["numpy", "torch"])
def test_two_python_threads_call_at_once(api):
    """Protects concurrent callers: two Python threads calling the kernels at once, each on
    its own data, get the results one thread alone gets, bit for bit."""
    g = np.random.default_rng(4)
    xs = [g.standard_normal((512, 768)).astype(np.float32) for _ in range(2)]

    def call(x):
        if api == "numpy":
            y, c = lnc.rms_norm_forward(x)
            return [y, lnc.rms_norm_backward(y, c)[0]]
        t = torch.from_numpy(x).requires_grad_()
        y = lt.rms_norm(t, 768)
        (dx,) = torch.autograd.grad(y, t, y)
        return [y.detach().numpy(), dx.numpy()]

    want = [call(x) for x in xs]
    got: list = [None, None]
    errors: list = []

    def worker(i):
        try:
            for _ in range(20):
                got[i] = call(xs[i])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    for i in range(2):
        for a, b in zip(got[i], want[i], strict=True):
            assert np.array_equal(a, b)


def test_every_norm_dtype_pair_is_served():
    """Protects the kernel names: each forward and backward the C++ operator asks for with
    half dtypes and mixed residual dtypes is one the NumPy API compiles too (one key rule)."""
    x = torch.randn(5, 32, dtype=torch.float16, requires_grad=True)
    r = torch.randn(5, 32, dtype=torch.bfloat16, requires_grad=True)
    for name, n in NORMS.items():
        fn = getattr(lt, name)
        out = fn(x, r, 32, residual_dtype=torch.float32) if n.residual else fn(x, 32)
        outs = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(sum(o.float().sum() for o in outs),
                                    (x, r) if n.residual else (x,))
        assert all(torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("call, message", [
    (lambda x, w: _ops.fwd(x, None, w[:2], None, 1e-5, True, False, None), "weight must have"),
    (lambda x, w: _ops.norm(x, x[:1], w, None, 1e-5, True, False, None), "residual must have"),
    (lambda x, w: _ops.bwd(x, None, x, w, None, torch.zeros(1, NSTATS,
                                                            dtype=torch.float64),
                           torch.zeros(4, 0, dtype=torch.int64), True, False, None, None),
     "stats0 must be"),
    (lambda x, w: _ops.bwd(x[:2], None, x, w, None, torch.zeros(4, NSTATS,
                                                               dtype=torch.float64),
                           torch.zeros(4, 0, dtype=torch.int64), True, False, None, None),
     "dy must have"),
])
def test_a_direct_op_call_with_wrong_shapes_is_refused(call, message):
    """Protects memory safety below the public functions: an op called directly with a
    parameter, residual, gradient or statistics of the wrong shape raises ValueError instead
    of reading or writing out of bounds."""
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match=message):
        call(x, w)


def _nh_hash(row: np.ndarray, block_bytes: int) -> int:
    """The engine's row checksum as element.h states it, in Python integers: the row's bits as
    32-bit words (word w keyed by K0 + w K, mod 2**32), each block of ``block_bytes`` padded
    with zero bits to whole pairs, the pairs (a, b) multiplied to 64 bits and summed mod 2**64."""
    k0, k = 0x7F4A7C15, 0x9E3779B9
    raw = row.tobytes()
    total = 0
    for start in range(0, len(raw), block_bytes):
        blk = raw[start:start + block_bytes]
        blk += bytes(-len(blk) % 8)
        words = np.frombuffer(blk, np.uint32).astype(np.uint64)
        w = np.arange(len(words), dtype=np.uint64) + start // 4
        keyed = (words + ((k0 + w * k) & 0xFFFFFFFF)) & 0xFFFFFFFF
        total += int((keyed[0::2] * keyed[1::2]).sum(dtype=np.uint64))  # wraps mod 2**64
    return total % 2**64


@needs_native
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_the_checksum_is_the_stated_hash(name, dtype):
    """Protects the engine's row checksum (element.h, BlockHash): the forward's value of
    each row (of x, or of h for an add-norm) is the NH hash element.h states, computed here
    from the row's bytes, for both statistics sweeps that take it (LayerNorm's and RMSNorm's
    steps differ) at row lengths that end inside a vector, inside a pair of words, and on a
    block's edge (512 elements), so a vector loop that keyed a lane wrongly, or dropped a tail,
    fails even where the forward and the backward (which must agree with it) would agree with
    each other."""
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    from layernorm.dtypes import resolve

    dt = resolve(dtype)
    rng = np.random.default_rng(21)
    for d in (1, 3, 17, 40, 511, 512, 513, 1100):
        x = rng.standard_normal((3, d)).astype(dt)
        if name == "add_rms_norm":
            _, rows, cache = lnc.add_rms_norm_forward(x, rng.standard_normal((3, d)).astype(dt))
        else:
            rows, cache = x, getattr(lnc, f"{name}_forward")(x)[1]
        want = [_nh_hash(row, 512 * rows.itemsize) for row in rows]
        assert cache.check.tolist() == want, (name, dtype, d)
