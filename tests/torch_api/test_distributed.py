"""layernorm.torch under torch.distributed, on 2 CPU processes (gloo): DDP and FSDP2 train a
pre-norm block of our modules to the single-process parameters, and DTensor runs the fused ops
on each rank's rows (sequence parallelism) without gathering x, reducing dweight and dbias.

The tests share 2 worker processes (spawned once for the module, a FileStore in a temporary
directory); each test hands them a task, rank 0 saves what it measured, and the test compares
it here with the same computation run in this process on the whole batch.
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import subprocess
import sys
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with the gloo backend",
                allow_module_level=True)

import torch.distributed as dist  # noqa: E402 - after the skips
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import layernorm.torch as lt  # noqa: E402
from layernorm.family import NORMS  # noqa: E402
from layernorm.tolerances import assert_close  # noqa: E402

WORLD = 2
D = 32
BATCH, SEQ = 4, 8  # the whole batch: (BATCH, SEQ, D) tokens, SEQ a multiple of WORLD
STEPS = 3
LR = 0.5

# Tolerances: everything runs in float32. y, h, dx and dresidual are per-row results ("out");
# dweight, dbias and the parameters after SGD steps are sums over rows ("param"); each result
# is compared with scale = the larger of 1 and its largest value. The distributed runs differ
# from the single process only in the order of those sums (per-rank partial sums, then a
# reduction), and y, h, dx and dresidual not at all.
DTYPE = "float32"


def _close(got: torch.Tensor, want: torch.Tensor, quantity: str, name: str) -> None:
    got, want = (np.asarray(t.detach().double()) for t in (got, want))
    assert_close(got, want, DTYPE, quantity, scale=max(float(np.max(np.abs(want))), 1.0),
                 name=name)


def _need(module: str, name: str) -> None:
    """Skip the test, with the error this torch gives, where it has no ``module.name``."""
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"this torch lacks {module}.{name}: {type(exc).__name__}: {exc}")


# --- running on WORLD processes ----------------------------------------------------------------

TASK_TIMEOUT = 120  # seconds for one test's work on the processes (a few, normally)


class WorkerError(RuntimeError):
    """A task raised in a worker process; the message holds the workers' tracebacks."""


class World:
    """WORLD processes in one gloo process group, kept for the module's tests (starting one
    costs seconds: torch, DTensor and the kernels' cache load in each). :meth:`run` runs a
    task on all of them and returns rank 0's result; after a failed task the processes are
    replaced, since a failed collective can leave the group unusable."""

    def __init__(self, tmp) -> None:
        self.tmp, self.starts, self.procs, self.inboxes = tmp, 0, [], []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.SimpleQueue() for _ in range(WORLD)]
        self.replies = ctx.Queue()
        store = self.tmp / f"store{self.starts}"  # a FileStore is for one group
        self.starts += 1
        self.procs = [ctx.Process(target=_serve, args=(rank, str(store), inbox, self.replies),
                                  daemon=True) for rank, inbox in enumerate(self.inboxes)]
        for proc in self.procs:
            proc.start()

    def run(self, fn, *args):
        """``fn(rank, *args)`` on every process; rank 0's return value. Raises WorkerError
        with the tracebacks if any process raised, TimeoutError if one took too long."""
        if not self.procs:
            self._start()
        out = self.tmp / "rank0.pt"
        for inbox in self.inboxes:
            inbox.put((fn, args, str(out)))
        try:
            errors = [self.replies.get(timeout=TASK_TIMEOUT) for _ in range(WORLD)]
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"{fn.__name__} did not finish in {TASK_TIMEOUT} s") from None
        if any(errors):
            self.stop()
            raise WorkerError("\n".join(e for e in errors if e))
        return torch.load(out, weights_only=False)

    def stop(self) -> None:
        for inbox, proc in zip(self.inboxes, self.procs, strict=True):
            if proc.is_alive():
                inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():  # stuck in a collective whose peer has gone
                proc.kill()
                proc.join()
        self.procs, self.inboxes = [], []


def _serve(rank: int, store: str, inbox, replies) -> None:
    """A worker: join the group, then run each task from ``inbox`` until None; reply None
    or the task's traceback. Rank 0 saves the task's result where the task says."""
    torch.set_num_threads(1)  # WORLD processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        while (task := inbox.get()) is not None:
            fn, args, out = task
            try:
                result = fn(rank, *args)
                if rank == 0:
                    torch.save(result, out)
                replies.put(None)
            except Exception:  # reported to the test, which raises it
                replies.put(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The module's WORLD worker processes (:class:`World`)."""
    w = World(tmp_path_factory.mktemp("world"))
    yield w
    w.stop()


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _counts(comm) -> dict[str, int]:
    """Counts of collectives (a CommDebugMode's, or one pass's of them) by name, zeros
    dropped."""
    return {str(op): n for op, n in comm.items() if n}


# --- the block ----------------------------------------------------------------------------


class AddNorm(torch.nn.Module):
    """The residual add and norm that close a pre-norm block: y, h = add_norm(f, residual)."""

    def __init__(self, centred: bool) -> None:
        super().__init__()
        self.centred = centred
        self.weight = torch.nn.Parameter(torch.ones(D))
        self.bias = torch.nn.Parameter(torch.zeros(D)) if centred else None

    def forward(self, f, residual):
        if self.centred:
            return lt.add_layer_norm(f, residual, (D,), self.weight, self.bias)
        return lt.add_rms_norm(f, residual, (D,), self.weight)


class Block(torch.nn.Module):
    """x -> norm -> Linear -> GELU -> Linear = f; y, h = add_norm(f, x): a pre-norm MLP block
    of our modules (LayerNorm and add_layer_norm, or RMSNorm and add_rms_norm)."""

    def __init__(self, centred: bool) -> None:
        super().__init__()
        self.norm = lt.LayerNorm(D) if centred else lt.RMSNorm(D)
        self.fc1 = torch.nn.Linear(D, 2 * D)
        self.fc2 = torch.nn.Linear(2 * D, D)
        self.out_norm = AddNorm(centred)

    def forward(self, x):
        return self.out_norm(self.fc2(F.gelu(self.fc1(self.norm(x)))), x)


def _block(centred: bool) -> Block:
    """The block as every process builds it: the same seed, and norm parameters moved away from
    ones and zeros so their gradients depend on them."""
    torch.manual_seed(0)
    block = Block(centred)
    with torch.no_grad():
        for p in (*block.norm.parameters(), *block.out_norm.parameters()):
            p.add_(0.3 * torch.randn_like(p))
    return block


def _batches() -> list[tuple[torch.Tensor, ...]]:
    """STEPS batches of (x, target, probe), each (BATCH, SEQ, D) float32."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, SEQ, D, generator=g) * 2 + 0.5,
             torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, D, generator=g))
            for _ in range(STEPS)]


def _train(model, batches) -> None:
    """STEPS of SGD on the mean squared error of y plus a linear probe of h (so both outputs,
    and dh, carry gradients). Means over the batch: a rank's mean over its share, averaged
    over the ranks by DDP and FSDP2, is the whole batch's."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, target, probe in batches:
        y, h = model(x)
        loss = ((y - target) ** 2).mean() + (h * probe).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _trained(centred: bool, batches) -> dict[str, torch.Tensor]:
    """The single-process run: parameters of the block trained on the whole batches."""
    model = _block(centred)
    _train(model, batches)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_parameters(got: dict, want: dict, centred: bool, what: str) -> None:
    """``got`` (a distributed run's parameters) equal ``want`` (:func:`_trained`), and the
    single-process run moved every parameter from where it started."""
    assert got.keys() == want.keys()
    start = dict(_block(centred).named_parameters())
    for name, w in want.items():  # the steps moved every parameter: the check has teeth
        assert float((w - start[name].detach()).abs().max()) > 1e-3, f"{what}: {name} did not train"
        _close(got[name], w, "param", f"{what} {name}")


# --- DTensor: the ops on each rank's rows -----------------------------------------------------

# (function, shape of x, the dim it is split along, keyword arguments): a row split of the
# flattened (M, D) (M odd: the ranks hold 6 and 5 rows), of (S, B, D) along S, and of (B, S, D)
# along S (flattening gives a strided split of the rows); with and without a weight, h in
# float64 from float32 x and residual, and zero-centred gamma.
OP_CASES = {
    "layer_norm rows": ("layer_norm", (11, D), 0, {}),
    "rms_norm (B, S, D) along S, no weight": ("rms_norm", (2, 6, D), 1, {"weight": None}),
    "add_layer_norm (S, B, D) along S, float64 h": (
        "add_layer_norm", (6, 2, D), 0, {"residual_dtype": torch.float64}),
    "add_rms_norm (B, S, D) along S, zero-centred": (
        "add_rms_norm", (2, 6, D), 1, {"zero_centered_gamma": True}),
}


def _op_inputs(name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor | None]:
    """x, residual, weight, bias and the cotangents dy, dh of ``name`` (float32; None where
    the function has no such argument)."""
    g = torch.Generator().manual_seed(2)
    norm = NORMS[name]
    return {"x": torch.randn(shape, generator=g) * 2 + 0.5,
            "residual": torch.randn(shape, generator=g) if norm.residual else None,
            "weight": torch.randn(D, generator=g),
            "bias": torch.randn(D, generator=g) if norm.centred else None,
            "dy": torch.randn(shape, generator=g),
            "dh": torch.randn(shape, generator=g) if norm.residual else None}


def _op_call(name: str, t: dict, kw: dict) -> tuple:
    """(outputs, gradients) of ``name`` on the tensors ``t``: outputs y [, h]; gradients of
    x [, residual] and of the parameters given, by the cotangents dy [, dh]."""
    kw = dict(kw)
    weight = kw.pop("weight", t["weight"])
    inputs = [t["x"]] + ([t["residual"]] if t["residual"] is not None else [])
    params = [p for p in (weight, t["bias"]) if p is not None]
    for leaf in (*inputs, *params):
        leaf.requires_grad_()
    args = (*inputs, (D,), weight) + ((t["bias"],) if NORMS[name].centred else ())
    out = getattr(lt, name)(*args, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    if "residual_dtype" in kw:  # h, and so dh, in the residual's dtype
        t = {**t, "dh": t["dh"].to(kw["residual_dtype"])}
    cots = [c for c in (t["dy"], t["dh"]) if c is not None][:len(outs)]
    grads = torch.autograd.grad(outs, [*inputs, *params], cots)
    return outs, grads


def _ops_worker(rank: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = _mesh()
    out = {}
    for case, (name, shape, dim, kw) in OP_CASES.items():
        t = _op_inputs(name, shape)
        dt = {k: None if v is None else distribute_tensor(
            v, mesh, [Shard(dim) if v.dim() > 1 else Replicate()]) for k, v in t.items()}
        with CommDebugMode() as comm:
            outs, grads = _op_call(name, dt, kw)
        local_rows = outs[0].to_local().shape[dim]
        out[case] = {
            "comm": _counts(comm.get_comm_counts()),
            "local_rows": local_rows,
            "outs": [(o.placements, o.full_tensor()) for o in outs],
            "grads": [(g.placements, g.full_tensor()) for g in grads],
        }
    return out


def test_dtensor_runs_the_ops_on_each_ranks_rows(world):
    """Protects the ops' sharding strategies: x (and residual, dy, dh) split by rows over the 2
    ranks, weight and bias replicated; the forward and backward run on the local rows with no
    collective at all (no gather of x), y, h, dx and dresidual come out split as x was,
    dweight and dbias come out Partial (each rank's sum over its rows) and, reduced, equal the
    single-process gradients; y, h, dx and dresidual equal the single-process ones."""
    from torch.distributed.tensor import Partial, Shard

    _need("torch.distributed.tensor.experimental", "register_sharding")
    want = {case: _op_call(name, _op_inputs(name, shape), kw)
            for case, (name, shape, _dim, kw) in OP_CASES.items()}
    got = world.run(_ops_worker)
    for case, (_name, shape, dim, _kw) in OP_CASES.items():
        g, (w_outs, w_grads) = got[case], want[case]
        assert g["comm"] == {}, f"{case}: collectives {g['comm']}"
        assert g["local_rows"] == -(-shape[dim] // WORLD), case  # rank 0's share of the rows
        n_data = len(w_outs)  # x [, residual]: the gradients split as x
        for (placements, value), w, label in zip(
                g["outs"] + g["grads"], [*w_outs, *w_grads],
                ["y", "h"][:n_data] + ["dx", "dresidual"][:n_data] + ["dweight", "dbias"],
                strict=False):
            split = label in ("y", "h", "dx", "dresidual")
            assert placements == ((Shard(dim),) if split else (Partial(),)), \
                f"{case} {label}: {placements}"
            _close(value, w, "out" if split else "param", f"{case} {label}")


# --- DTensor: sequence parallelism through the modules ----------------------------------------

# (centred, the dim of the block's input split over the ranks): RMSNorm on (S, B, D) along S
# (Megatron's layout), LayerNorm on (B, S, D) along S.
SP_CASES = [(False, 0), (True, 1)]
# The block's collectives in each pass, all the linears': forward, fc1 gathers the norm's y and
# fc2 reduce-scatters its partial sums; backward, the same two the other way round.
LINEARS = {"c10d_functional.all_gather_into_tensor": 1, "c10d_functional.reduce_scatter_tensor": 1}


def _sp_layout(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """A (BATCH, SEQ, D) tensor in the case's layout: (S, B, D) for seq_dim 0."""
    return t.transpose(0, 1).contiguous() if seq_dim == 0 else t


def _sp_worker(rank: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = _mesh()
    out = {}
    for centred, seq in SP_CASES:
        model = _block(centred)
        parallelize_module(model, mesh, {
            "norm": SequenceParallel(sequence_dim=seq),  # our module, parameters replicated
            "fc1": ColwiseParallel(input_layouts=Shard(seq)),  # gathers the norm's y
            "fc2": RowwiseParallel(output_layouts=Shard(seq), use_local_output=False),
        })
        distribute_module(model.out_norm, mesh)  # replicated parameters; inputs split by seq
        batches = [tuple(distribute_tensor(_sp_layout(t, seq), mesh, [Shard(seq)]) for t in b)
                   for b in _batches()]
        with CommDebugMode() as comm:  # the first step's forward and backward
            x, target, probe = batches[0]
            y, h = model(x)
            (((y - target) ** 2).mean() + (h * probe).mean()).backward()
        model.zero_grad()
        _train(model, batches)
        out[(centred, seq)] = {
            "comm": {p: _counts(comm.comm_module_counts["Global"][p])
                     for p in ("forward", "backward")},
            "placements": (y.placements, h.placements),
            "grad_placements": {n: p.grad.placements for n, p in model.named_parameters()
                                if "norm" in n},
            "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        }
    return out


def test_sequence_parallel_block_trains_as_one_process(world):
    """Protects our modules under tensor + sequence parallelism (parallelize_module:
    SequenceParallel for our norm, column- and row-wise linears, the closing add-norm on
    replicated parameters): the norms see x split along the sequence and run with no
    collective (the block's only collectives in the forward and the backward are the
    linears'), y and h come out split as x, the norms' weight gradients come out Partial, and
    after STEPS of SGD (which reduces them) every parameter equals the single-process run."""
    from torch.distributed.tensor import Partial, Shard

    _need("torch.distributed.tensor.experimental", "register_sharding")
    _need("torch.distributed.tensor.parallel", "SequenceParallel")
    want = {(centred, seq): _trained(centred, [tuple(_sp_layout(t, seq) for t in b)
                                               for b in _batches()])
            for centred, seq in SP_CASES}
    got = world.run(_sp_worker)
    for centred, seq in SP_CASES:
        g, what = got[(centred, seq)], f"sequence parallel centred={centred} seq dim {seq}"
        assert g["comm"] == {"forward": LINEARS, "backward": LINEARS}, f"{what}: {g['comm']}"
        assert g["placements"] == ((Shard(seq),), (Shard(seq),)), what
        assert set(g["grad_placements"].values()) == {(Partial(),)}, what
        _same_parameters(g["params"], want[(centred, seq)], centred, what)


# --- DDP and FSDP2 --------------------------------------------------------------------------


def _rank_share(rank: int) -> list[tuple[torch.Tensor, ...]]:
    n = BATCH // WORLD
    return [tuple(t[rank * n:(rank + 1) * n] for t in b) for b in _batches()]


def _ddp_worker(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for centred in (False, True):
        model = DistributedDataParallel(_block(centred))
        _train(model, _rank_share(rank))
        out[centred] = {n: p.detach() for n, p in model.module.named_parameters()}
    return out


def test_ddp_trains_as_one_process(world):
    """Protects our modules under DistributedDataParallel: each rank trains on half the batch,
    and after STEPS of SGD every parameter (the norms' included) equals the single-process run
    on the whole batch, for the RMSNorm block and the LayerNorm block."""
    want = {centred: _trained(centred, _batches()) for centred in (False, True)}
    got = world.run(_ddp_worker)
    for centred in (False, True):
        _same_parameters(got[centred], want[centred], centred, f"DDP centred={centred}")


def _fsdp_worker(rank: int, centred: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    model = _block(centred)
    for sub in (model.norm, model.fc1, model.fc2, model.out_norm):
        fully_shard(sub, mesh=mesh)  # each module gathers its parameters and frees them after
    fully_shard(model, mesh=mesh)
    _train(model, _rank_share(rank))
    return {n: p.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("centred", [False, True], ids=["rms", "layer"])
def test_fsdp2_trains_as_one_process(world, centred):
    """Protects our modules under FSDP2 (fully_shard per module, then the root): parameters
    gathered for each module's forward and backward and freed after, gradients reduce-scattered;
    after STEPS of SGD the gathered parameters equal the single-process run on the whole batch."""
    _need("torch.distributed.fsdp", "fully_shard")
    want = _trained(centred, _batches())
    got = world.run(_fsdp_worker, centred)
    _same_parameters(got, want, centred, f"FSDP2 centred={centred}")


# --- registration ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtensor_first", [False, True])
def test_dtensor_strategies_register_when_dtensor_is_imported(tmp_path, dtensor_first):
    """Protects the registration, in either import order: importing layernorm.torch does not
    import DTensor (it costs seconds), and importing DTensor afterwards registers the ops'
    strategies; with DTensor imported first (as Liger-Kernel, QuACK and Hugging Face do), they
    register at once, after the ops they describe exist. Either way without a warning, and a
    DTensor input runs (here on a 1-process mesh) instead of raising DTensor's error."""
    _need("torch.distributed.tensor.experimental", "register_sharding")
    first = "import torch.distributed.tensor" if dtensor_first else ""
    lazy = "" if dtensor_first else (
        'assert "torch.distributed.tensor" not in sys.modules, "layernorm.torch imported DTensor"')
    code = f"""
import sys
import warnings
warnings.simplefilter("error")
import torch
import torch.distributed as dist
{first}
import layernorm.torch as lt
{lazy}
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
x = distribute_tensor(torch.randn(4, 8), init_device_mesh("cpu", (1,)), [Shard(0)])
assert lt.rms_norm(x, 8).placements == (Shard(0),)
dist.destroy_process_group()
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=False)
    assert res.returncode == 0, res.stderr


def test_memory_efficient_refuses_dtensor_inputs(tmp_path):
    """Protects the memory-efficient mode's refusal of DTensor inputs (its op has no sharding
    strategy: the kept channels and rows are data-dependent sizes): where a gradient is needed
    it raises a ValueError naming the argument and the default mode before any work, instead
    of DTensor's propagation error; under torch.no_grad, where the mode changes nothing, it
    runs; and the default mode runs on the same DTensor (here on a 1-process mesh)."""
    _need("torch.distributed.tensor.experimental", "register_sharding")
    code = f"""
import torch
import torch.distributed as dist
import torch.distributed.tensor
import layernorm.torch as lt
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
x = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)]).requires_grad_()
w = distribute_tensor(torch.randn(8), mesh, [Replicate()]).requires_grad_()
try:
    lt.rms_norm(x, 8, w, memory_efficient=True)
except ValueError as exc:
    assert "memory_efficient=True does not support DTensor inputs (input is a DTensor)" in str(exc)
    assert "memory_efficient=False" in str(exc)
else:
    raise AssertionError("no ValueError")
with torch.no_grad():
    assert lt.rms_norm(x, 8, w, memory_efficient=True).placements == (Shard(0),)
lt.rms_norm(x, 8, w).sum().backward()
assert x.grad is not None and w.grad is not None
dist.destroy_process_group()
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=False)
    assert res.returncode == 0, res.stderr
