"""The fast launch path (nbflash._launch): its parameter ABI, its packing, and launches on the GPU.

Without a GPU: the parameters the launcher packs are checked against the
``.param`` list NVVM gives the real kernels' PTX entries (count, order, size),
the descriptors of strided and ``bshd`` views are checked field by field, and
the simulator is shown to launch exactly as before.  On a GPU (``gpu``): the
fast launch writes the same bits as Numba's dispatcher, on the stream it is
given, and launches captured into CUDA graphs (PyTorch's and CuPy's) replay
correctly.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import nbflash
from nbflash import _device, _launch
from nbflash._device import cuda
from nbflash._launch import ArrayArg

#: PTX parameter type -> the struct codes that pack into it (size must match too).
PTX_CODES = {
    ".u64": "Qq",
    ".s64": "Qq",
    ".b64": "Qq",
    ".f64": "d",
    ".f32": "f",
    ".u32": "Ii",
    ".s32": "Ii",
    ".b32": "Iif",
    ".u16": "Hhe",  # float16 travels as its bits
    ".s16": "Hh",
    ".b16": "Hhe",
    ".u8": "Bb?",
    ".s8": "Bb?",
    ".b8": "Bb?",
}
PTX_SIZES = {"64": 8, "32": 4, "16": 2, "8": 1}

# Runs with the simulator off (NVVM only, no driver): for each kernel, the codes the
# launcher derives and the .param types of the compiled PTX entry.
ABI_SCRIPT = r"""
import json, re, sys
import numpy as np
from nbflash._device import SIMULATOR, compile_ptx_offline, numba
assert not SIMULATOR
from nbflash import _launch, backward, forward
from nbflash._launch import ArrayArg

def entry_params(ptx):
    body = re.search(r"\.entry\s+\S+\s*\((.*?)\)", ptx, re.S).group(1)
    return re.findall(r"\.param\s+(\.\w+)", body)

rows = []
def check(name, pyfunc, sig, fastmath=False):
    ptx = compile_ptx_offline(pyfunc, sig, cc=(9, 0), fastmath=fastmath)
    rows.append(dict(kernel=name, codes=_launch.param_codes(sig), ptx=entry_params(ptx)))

# The forward kernel, typed from descriptors of bshd views as the fast path types them.
cfg = forward.choose_config(64, "float16", simulator=False)
def view(shape, dtype):
    x = np.zeros(shape, dtype)
    return ArrayArg(x.ctypes.data, x.shape, x.strides, x.dtype).permute((0, 2, 1, 3))
q, k, v, o = (view((2, 7, 3, 64), np.float16) for _ in range(4))
lse = np.zeros((2, 3, 7), np.float32)
lse = ArrayArg(lse.ctypes.data, lse.shape, lse.strides, lse.dtype)
trace = ArrayArg(0, (1, 1, 1, 1, 2), (8, 8, 8, 8, 4), np.dtype(np.float32))
key, values = _launch._flatten((q, k, v, o, lse, 0.5, True, trace))
sig = _launch._signature(key)
ref = forward.kernel_signature(cfg)  # all layout 'A'; lse and trace are contiguous here: 'C'
assert sig[:4] == ref[:4] and sig[5:7] == ref[5:7], (sig, ref)
assert [(a.dtype, a.ndim, a.layout) for a in (sig[4], sig[7])] == [(r.dtype, r.ndim, "C") for r in (ref[4], ref[7])]
check("flash_forward", forward.forward_kernel(cfg).py_func, sig, True)
rows[-1]["values"] = len(values)

# Every backward kernel of one configuration.
bcfg = backward.choose_config(64, "float32", simulator=False)
for name, tile, kern, bsig, fastmath in backward.compile_targets([bcfg]):
    check(name, kern.py_func, bsig, fastmath)

# Scalars of every kind the ABI names, between arrays (alignment after a 1-byte bool).
def scalars(flag, a, x32, i32, h, c, u8, t, b):
    if flag:
        a[0] = x32 + i32 + h + c.real + u8 + t[0] + t[1]
        b[0, 0] = a[0]
t = numba.types
check("scalars", scalars, (t.boolean, t.Array(t.float32, 1, "C"), t.float32, t.int32, t.float16, t.complex64,
                           t.uint8, t.UniTuple(t.float64, 2), t.Array(t.float64, 2, "F")))
print(json.dumps(rows))
"""


def _compile_rows():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", ABI_SCRIPT], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_parameter_abi_matches_the_ptx_entry():
    """The launcher's parameter list is the kernel's: same count, each of the PTX type's size and kind."""
    pytest.importorskip("numba.cuda")
    rows = _compile_rows()
    assert {r["kernel"] for r in rows} >= {"flash_forward", "scalars", "flash_backward_dkdv"}
    for r in rows:
        codes, ptx = r["codes"], r["ptx"]
        assert len(codes) == len(ptx), (r["kernel"], codes, ptx)
        for i, (code, ptype) in enumerate(zip(codes, ptx, strict=True)):
            assert code in PTX_CODES[ptype], (r["kernel"], i, code, ptype)
            assert struct.calcsize(code) == PTX_SIZES[ptype.lstrip(".usbf")], (r["kernel"], i, code, ptype)
    fwd = next(r for r in rows if r["kernel"] == "flash_forward")
    # four 4-D arrays (13 each), lse 3-D (11), scale f64, causal u8, trace 5-D (15)
    assert len(fwd["codes"]) == fwd["values"] == 4 * 13 + 11 + 1 + 1 + 15


def test_packed_buffer_alignment():
    """Each parameter at its natural alignment, as the driver reads the ``extra`` buffer."""
    codes = ["Q", "?", "Q", "d", "?", "f", "e", "?", "d"]
    assert _launch.param_offsets(codes) == [0, 8, 16, 24, 32, 36, 40, 42, 48]
    packed = struct.pack("@" + "".join(codes), 1, True, 2, 0.5, False, 1.5, 2.0, True, -1.0)
    assert len(packed) == 56
    assert struct.unpack_from("@d", packed, 24) == (0.5,) and packed[8] == 1 and packed[42] == 1


def _arg(x):
    return ArrayArg(x.__array_interface__["data"][0], x.shape, x.strides, x.dtype)


def test_descriptor_of_strided_and_bshd_views():
    base = np.zeros((2, 9, 3, 3, 16), np.float16)  # a packed (B, N, 3, H, D) qkv buffer
    q = base[:, :, 1]  # bshd slice: (2, 9, 3, 16)
    canon = _arg(q).permute((0, 2, 1, 3))  # what the kernel sees: (B, H, N, D)
    assert canon.shape == (2, 3, 9, 16)
    assert canon.strides == (9 * 3 * 3 * 16 * 2, 16 * 2, 3 * 3 * 16 * 2, 2)
    assert canon.ptr == base.__array_interface__["data"][0] + 3 * 16 * 2
    assert canon.strides == q.transpose(0, 2, 1, 3).strides
    key, values = _launch._flatten((canon, 0.25, False))
    assert key == (("<f2", 4, "A"), "d", "?")
    assert values == [0, 0, 2 * 3 * 9 * 16, 2, canon.ptr, *canon.shape, *canon.strides, 0.25, False]


@pytest.mark.parametrize(
    "shape, make, layout",
    [
        ((2, 3, 4, 5), lambda x: x, "C"),
        ((2, 3, 4, 5), lambda x: np.asfortranarray(x), "F"),
        ((2, 3, 4, 5), lambda x: x.transpose(0, 2, 1, 3), "A"),
        ((1, 1, 4, 5), lambda x: x.transpose(0, 2, 1, 3)[:, :, :1], "C"),  # length-1 axes: any stride
        ((3, 4), lambda x: x[:, ::2], "A"),
        ((3, 4), lambda x: np.broadcast_to(x[:1], (3, 4)), "A"),  # zero stride on a length-3 axis
        ((3, 4), lambda x: x[:, ::-1], "A"),
    ],
)
def test_layout_letter(shape, make, layout):
    a = make(np.zeros(shape, np.float32))
    assert _launch.array_layout(a.shape, a.strides, a.itemsize) == layout
    if layout == "C":
        assert a.flags.c_contiguous


def test_unsupported_arguments_fall_back():
    """Anything the fast path cannot describe (a NumPy array to copy, an object) goes to Numba's dispatcher."""
    assert _launch._flatten((np.zeros(3), 1.0)) == (None, None)
    assert _launch._flatten((object(),)) == (None, None)


@pytest.mark.skipif(not nbflash.SIMULATOR, reason="the simulator's launch")
def test_simulator_launch_is_unchanged(monkeypatch):
    """In the simulator launch() is Numba's own (strided views in place); the fast path is never loaded."""

    def no_fast_path():
        raise AssertionError("the simulator must not use the fast launch path")

    monkeypatch.setattr(_device, "_load_fast_path", no_fast_path)
    monkeypatch.setattr(_device, "_fast_path", None)

    @_device.kernel
    def scale_rows(x, y, s):
        i = cuda.grid(1)
        if i < x.shape[0]:
            for j in range(x.shape[1]):
                y[i, j] = x[i, j] * s

    x = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # strided view
    y = np.zeros((8, 3), np.float32)[::2]  # strided output view, written in place
    _device.launch(scale_rows, 1, 4, 0, 0, x, y, np.float32(2.0))
    np.testing.assert_array_equal(y, 2 * x)


# ----------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------


def _forward_case(cp, dtype, b=2, h=3, n=200, d=64, layout="bhsd"):
    from nbflash import forward

    rng = cp.random.default_rng(0)
    shape = (b, h, n, d) if layout == "bhsd" else (b, n, h, d)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(3))
    cfg = forward.choose_config(d, np.dtype(dtype).name)
    return forward, cfg, q, k, v


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gpu_fast_launch_equals_dispatcher(dtype, layout):
    cp = pytest.importorskip("cupy")
    forward, cfg, q, k, v = _forward_case(cp, dtype, layout=layout)
    canon = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(0, 2, 1, 3))
    b, h, n, _ = canon(q).shape
    outs = []
    for route in (_device.dispatcher_launch, None):
        o = cp.full(q.shape, np.nan, dtype=dtype)
        lse = cp.full((b, h, n), np.nan, dtype=np.float32)
        trace = cp.zeros((1, 1, 1, 1, 2), np.float32)
        kern = forward.forward_kernel(cfg)
        grid, block = (-(-n // cfg.block_m), h, b), (cfg.threads_x, cfg.threads_y, 1)
        args = (canon(q), canon(k), canon(v), canon(o), lse, 0.18, True, trace)
        if route is None:
            assert _launch.launch(kern, grid, block, 0, forward.shared_bytes(cfg), args)
        else:
            route(kern, grid, block, 0, forward.shared_bytes(cfg), *args)
        cp.cuda.runtime.deviceSynchronize()
        outs.append((o, lse))
    for a, b_ in zip(outs[0], outs[1], strict=True):
        assert cp.array_equal(a.view(np.uint8), b_.view(np.uint8)), "fast launch differs from the dispatcher's"


@pytest.mark.gpu
def test_gpu_launch_on_a_side_stream():
    """A launch given a busy side stream waits for the work queued before it there."""
    torch = pytest.importorskip("torch")
    import nbflash.torch as nbt

    q0, k0, v0 = (torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    want = nbt.attention(q0, k0, v0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        q, k, v = (x.clone() for x in (q0, k0, v0))  # ready only after the sleep
        got = nbt.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, want)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_torch_cuda_graph_replays(dtype):
    torch = pytest.importorskip("torch")
    import nbflash.torch as nbt

    dt = getattr(torch, dtype)
    shape = (2, 4, 130, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dt) for _ in range(3))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles) outside the capture
        nbt.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = nbt.attention(q, k, v, causal=True)
    for seed in (1, 2):
        torch.manual_seed(seed)
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        want = nbt.attention(q.clone(), k.clone(), v.clone(), causal=True)
        torch.cuda.synchronize()
        assert torch.equal(o, want), f"replay {seed} differs from a fresh call"


@pytest.mark.gpu
def test_gpu_cupy_stream_capture_replays():
    cp = pytest.importorskip("cupy")
    rng = cp.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 100, 64), dtype=np.float32) for _ in range(3))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        nbflash.attention(q, k, v)  # warm-up: compile and fill CuPy's memory pool
        stream.synchronize()
        stream.begin_capture()
        o = nbflash.attention(q, k, v)
        graph = stream.end_capture()
        for _ in range(2):
            for x in (q, k, v):
                x[...] = rng.standard_normal(x.shape, dtype=np.float32)
            graph.launch(stream)
            want = nbflash.attention(q, k, v)
            stream.synchronize()
            assert cp.array_equal(o, want)


# ----------------------------------------------------------------------------
# Recipes: launches recorded once per call signature, replayed with new pointers
# ----------------------------------------------------------------------------

# Runs with the simulator off and no GPU: recording launches nothing, so only the device
# properties the kernel choice reads are answered here.
RECIPE_SCRIPT = r"""
import json
import numpy as np
from nbflash import _device, _launch, api, backward, backward_tc, forward, forward_tc
from nbflash._launch import ArrayArg
assert not _device.SIMULATOR
_device._current_index = lambda: 0
_device._device_properties = lambda index: ((9, 0), 232448, 132)

def canon(a):
    return a.permute((0, 2, 1, 3))

def desc(ptr, shape, dtype):  # a C-contiguous bshd array at ptr, seen as (B, H, N, D)
    dt = np.dtype(dtype)
    strides, step = [], dt.itemsize
    for n in reversed(shape):
        strides.append(step); step *= n
    return ArrayArg(ptr, tuple(shape), tuple(reversed(strides)), dt)

class RealArena:  # the scratch a replay would get: the same offsets from a real base address
    def __init__(self, base):
        self.base, self.arena = base, _launch.Arena(0)
    def __call__(self, shape, dtype):
        a = self.arena(shape, dtype)
        return a._replace(ptr=self.base + (a.ptr - self.arena.base))

cases = []
B, Nq, Nk, H = 2, 37, 50, 3
for kind, dt, d in (("float16", np.float16, 64), ("bfloat16", np.uint16, 128), ("float32", np.float32, 40)):
    base = 0x7F0000000000
    ptrs = [base + i * 0x10000000 + 256 for i in range(10)]
    q, o, do, dq = (canon(desc(p, (B, Nq, H, d), dt)) for p in (ptrs[0], ptrs[3], ptrs[5], ptrs[6]))
    k, v, dk, dv = (canon(desc(p, (B, Nk, H, d), dt)) for p in (ptrs[1], ptrs[2], ptrs[7], ptrs[8]))
    lse = desc(ptrs[4], (B, H, Nq), np.float32)
    for backend in ("simt", "tensor_core") if kind != "float32" else ("simt",):
        plan = api.plan_forward(d, kind, 0.125, q, k, v, backend)
        launch_fwd = (lambda *a, **kw: forward_tc.launch_forward_tc(plan.config, *a, check=False, **kw)) \
            if plan.backend == "tensor_core" else (lambda *a, **kw: forward.launch_forward(plan.config, *a, **kw))
        arrays = (q, k, v, o, lse)
        with _launch.record() as fake:
            launch_fwd(*_launch.placeholder_args(arrays), 0.125, True, stream=0)
        with _launch.record() as real:
            launch_fwd(*arrays, 0.125, True, stream=0)
        recipe = _launch.Recipe(fake)
        want = [list(_launch._flatten(args)[1]) for *_, args in real]
        cases.append(dict(case=f"forward {kind} {backend}", got=recipe.values([a.ptr for a in arrays]),
                          want=want, n=len(fake), scratch=recipe.scratch_bytes))
        for det in (True, False):
            bplan = api.plan_backward(d, kind, 0.125, do, q, k, v, o, backend)
            arrays = (do, q, k, v, o, lse, dq, dk, dv)
            arena = _launch.Arena(len(arrays))
            with _launch.record() as fake:
                api.run_backward(bplan, *_launch.placeholder_args(arrays), 0.125, True, deterministic=det,
                                 stream=0, empty=arena)
            with _launch.record() as real:
                api.run_backward(bplan, *arrays, 0.125, True, deterministic=det, stream=0,
                                 empty=RealArena(ptrs[9]))
            recipe = _launch.Recipe(fake, arena.nbytes)
            want = [list(_launch._flatten(args)[1]) for *_, args in real]
            cases.append(dict(case=f"backward {kind} {bplan.backend} det={det}",
                              got=recipe.values([a.ptr for a in arrays] + [ptrs[9]]), want=want, n=len(fake),
                              scratch=recipe.scratch_bytes))

# The TMA forward (Hopper): its tensor maps are a Derived argument, made at each replay from that replay's
# pointers.  The maps are faked here (no GPU): a "device array" whose address encodes what it was made from.
from types import SimpleNamespace
from nbflash import forward_wgmma, tma
made = []
def fake_maps(specs, box_cols=64, stream=0, device=None):
    made.append([(x.ptr, x.shape, x.strides, rows, *box) for x, rows, *box in specs] + [stream, device])
    return SimpleNamespace(data=SimpleNamespace(ptr=0x10000 + 0x100 * len(made)))
tma.stacked_maps = fake_maps
# Its work counter (forward_wgmma.work_counter) is a Derived argument too, found per (device, stream): faked alike.
counters = {}
def fake_counter(sources, stream, device):
    ptr = counters.setdefault((device, stream), 0x20000 + 0x100 * len(counters))
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr))
forward_wgmma._stream_counter = fake_counter

def direct(launches):  # directly made launches' parameter values (Derived maps made as a replay on stream 0x77
    # makes them), and the maps made
    made.clear()
    values = []
    for *_, args in launches:
        args = [a.like._replace(ptr=a.make(a.sources, 0x77, 0).data.ptr) if type(a) is _launch.Derived else a
                for a in args]
        values.append(list(_launch._flatten(args)[1]))
    return values, list(made)
for layout in ("bhsd", "bshd"):
    d, dt = 128, np.float16
    base = 0x7E0000000000
    ptrs = [base + i * 0x10000000 + 256 for i in range(5)]
    shape_q, shape_k = (B, Nq, H, d), (B, Nk, H, d)
    if layout == "bhsd":
        q, o = (desc(p, (B, H, Nq, d), dt) for p in (ptrs[0], ptrs[3]))
        k, v = (desc(p, (B, H, Nk, d), dt) for p in (ptrs[1], ptrs[2]))
    else:
        q, o = (canon(desc(p, shape_q, dt)) for p in (ptrs[0], ptrs[3]))
        k, v = (canon(desc(p, shape_k, dt)) for p in (ptrs[1], ptrs[2]))
    lse = desc(ptrs[4], (B, H, Nq), np.float32)
    plan = api.plan_forward(d, "float16", 0.125, q, k, v, "auto")
    assert plan.backend == "wgmma" and plan.config.copies == "tma", plan
    arrays = (q, k, v, o, lse)
    with _launch.record() as fake:
        forward_wgmma.launch_forward_wgmma(plan.config, *_launch.placeholder_args(arrays), 0.125, True, stream=0,
                                           check=False)
    recipe = _launch.Recipe(fake)
    made.clear()
    got = recipe.values([a.ptr for a in arrays], stream=0x77, device=0)
    got_made = list(made)
    with _launch.record() as real:
        forward_wgmma.launch_forward_wgmma(plan.config, *arrays, 0.125, True, stream=0, check=False)
    want, want_made = direct(real)
    cases.append(dict(case=f"forward tma {layout}", got=got, want=want, n=len(fake), scratch=0,
                      made=[got_made, want_made]))
    # Each replay's stream finds its own counter.
    counters.clear()
    for stream in (0x77, 0x78, 0x77):
        recipe.values([a.ptr for a in arrays], stream=stream, device=0)
    cases.append(dict(case=f"forward tma {layout} counters", got=[sorted(counters.items())],
                      want=[[((0, 0x77), 0x20000), ((0, 0x78), 0x20100)]], n=1, scratch=0))
    # Fresh pointers give fresh maps, made from them.
    made.clear()
    recipe.values([p + 0x1000 for p in ptrs], stream=0x77, device=0)
    cases.append(dict(case=f"forward tma {layout} new pointers", got=[[made[0][i][0] - made_i[0]
                      for i, made_i in enumerate(want_made[0][:3])]], want=[[0x1000] * 3], n=1, scratch=0))
# Strides the TMA cannot step (k, v broadcast over heads: stride 0) keep the wgmma kernel, copying with cp.async.
shared_kv = desc(ptrs[1], (B, 1, Nk, 128), np.float16)
shared_kv = shared_kv._replace(shape=(B, H, Nk, 128), strides=(shared_kv.strides[0], 0, *shared_kv.strides[2:]))
plan = api.plan_forward(128, "float16", 0.125, desc(ptrs[0], (B, H, Nq, 128), np.float16), shared_kv, shared_kv)
cases.append(dict(case="forward tma fallback", got=[[plan.backend, plan.config.copies]], want=[["wgmma", "cp.async"]],
                  n=1, scratch=0))
# At D = 64 TMA at every length: 128 x 128 ws-overlap tiles, and from WSO_MIN_KEYS_D64 keys 128 x 192 ones (causal,
# persistent blocks) or 192 x 128 ones with three consumers (non-causal, persistent blocks with the dynamic scheduler
# at every length).
plans = [api.plan_forward(64, "bfloat16", 0.125, desc(ptrs[0], (1, 2, 64, 64), np.uint16),
                          *(desc(ptrs[1], (1, 2, n, 64), np.uint16),) * 2, "auto", causal)
         for n, causal in ((1024, False), (2048, False), (2048, True), (16384, False), (16384, True))]
cases.append(dict(case="forward tma at D = 64",
                  got=[[p.config.pipeline, p.config.copies, p.config.block_m, p.config.block_n, p.config.persistent]
                       for p in plans],
                  want=[["ws-overlap", "tma", 128, 128, True], ["ws-overlap", "tma", 192, 128, True],
                        ["ws-overlap", "tma", 128, 192, True], ["ws-overlap", "tma", 192, 128, True],
                        ["ws-overlap", "tma", 128, 192, True]], n=1, scratch=0))
# The Hopper backward's warp-specialised dK/dV kernel: its maps (q, do, k, v and the 16-bit view of the scratch
# holding lse2 and D) made per replay from the replay's pointers, the scratch's from the arena's real base.
from nbflash import backward_wgmma
d, dt = 128, np.float16
base = 0x7D0000000000
ptrs = [base + i * 0x10000000 + 256 for i in range(10)]
q, o, do, dq = (canon(desc(p, (B, Nq, H, d), dt)) for p in (ptrs[0], ptrs[3], ptrs[5], ptrs[6]))
k, v, dk, dv = (canon(desc(p, (B, Nk, H, d), dt)) for p in (ptrs[1], ptrs[2], ptrs[7], ptrs[8]))
lse = desc(ptrs[4], (B, H, Nq), np.float32)
bplan = api.plan_backward(d, "float16", 0.125, do, q, k, v, o, "auto", True)
assert bplan.backend == "wgmma" and bplan.config.dkdv_ws, bplan
arrays = (do, q, k, v, o, lse, dq, dk, dv)
arena = _launch.Arena(len(arrays))
with _launch.record() as fake:
    api.run_backward(bplan, *_launch.placeholder_args(arrays), 0.125, True, deterministic=None, stream=0,
                     empty=arena)
recipe = _launch.Recipe(fake, arena.nbytes)
made.clear()
got = recipe.values([a.ptr for a in arrays] + [ptrs[9]], stream=0x77, device=0)
got_made = list(made)
with _launch.record() as real:
    api.run_backward(bplan, *arrays, 0.125, True, deterministic=None, stream=0, empty=RealArena(ptrs[9]))
want, want_made = direct(real)
cases.append(dict(case="backward wgmma ws", got=got, want=want, n=len(fake), scratch=recipe.scratch_bytes,
                  made=[got_made, want_made]))
# ... and its configuration without TMA where k, v are broadcast over heads, or for short causal calls at D = 64.
shared_kv = desc(ptrs[1], (B, 1, Nk, d), dt)
shared_kv = shared_kv._replace(shape=(B, H, Nk, d), strides=(shared_kv.strides[0], 0, *shared_kv.strides[2:]))
x64 = desc(ptrs[0], (1, 2, 64, 64), np.float16)
picks = [api.plan_backward(d, "float16", 0.125, do, q, shared_kv, shared_kv, o, "auto", True).config.dkdv_ws]
picks += [api.plan_backward(64, "float16", 0.125, x64, x64, desc(ptrs[1], (1, 2, n, 64), np.float16),
                            desc(ptrs[2], (1, 2, n, 64), np.float16), x64, "auto", causal).config.dkdv_ws
          for n, causal in ((512, True), (1024, True), (512, False))]
cases.append(dict(case="backward wgmma ws fallback", got=[picks], want=[[False, False, True, True]], n=1, scratch=0))
print(json.dumps(cases))
"""


def test_recipe_replays_exactly_what_a_direct_launch_would_pass():
    """A recipe recorded on placeholder pointers, given the real ones, yields the parameter values of the
    launches made on the real descriptors: forward and backward (both dQ routes, scratch from the arena),
    SIMT and tensor cores, bshd views, ragged lengths; the TMA forward's tensor maps made per replay from the
    replay's own pointers, and its cp.async twin where the TMA cannot step along k and v."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", RECIPE_SCRIPT], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = json.loads(out.stdout.strip().splitlines()[-1])
    # (forward + 2 backward) per backend: fp16, bf16 x 2 backends; fp32 SIMT; the TMA forward (2 layouts x 3: the
    # replay, its work counters per stream, fresh pointers; and its fallbacks); the ws backward and its fallbacks
    assert len(cases) == 2 * 2 * 3 + 3 + 8 + 2
    for c in cases:
        assert c["n"] >= 1 and c["got"] == c["want"], c["case"]
        if "made" in c:  # the replay made its tensor maps from exactly the direct launch's arrays (q, k, v; the
            # backward's q, do, k, v and its lse2 / D scratch), once
            got_made, want_made = c["made"]
            maps = 5 if c["case"].startswith("forward") else 7
            assert got_made == want_made and len(got_made) == 1 and len(got_made[0]) == maps, c["case"]
        if c["case"].startswith("backward") and "fallback" not in c["case"]:
            assert c["n"] == 3 and c["scratch"] > 0, c
    # The placeholders really were replaced: no value left in the placeholder range.
    for c in cases:
        for vals in c["got"]:
            assert not any(type(x) is int and x >= 1 << _launch.PLACEHOLDER_SHIFT for x in vals), c["case"]


def test_arena_carves_aligned_contiguous_pieces():
    arena = _launch.Arena(3)
    a = arena((2, 3, 5), np.float32)
    b = arena((7,), np.float64)
    assert a.ptr == _launch.placeholder(3) and a.strides == (60, 20, 4) and a.shape == (2, 3, 5)
    assert b.ptr == _launch.placeholder(3) + 256 and b.strides == (8,)
    assert arena.nbytes == 512


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gpu_cached_signature_runs_fresh_inputs(dtype, layout):
    """Calls of one signature replay one recipe: each call must still read its own inputs and write new
    outputs (a stale pointer would return the first call's result)."""
    cp = pytest.importorskip("cupy")
    from nbflash import api
    from nbflash.reference import attention_ref

    rng = cp.random.default_rng(11)
    shape = (2, 3, 77, 64) if layout == "bhsd" else (2, 77, 3, 64)
    tol = 2e-2 if dtype == np.float16 else 1e-4
    for trial in range(3):
        q, k, v, do = (rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(4))
        o, lse = nbflash.attention(q, k, v, causal=True, layout=layout, return_lse=True)
        dq, dk, dv = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, layout=layout)
        canon = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(0, 2, 1, 3))
        want, _ = attention_ref(*(canon(cp.asnumpy(x)).astype(np.float64) for x in (q, k, v)), causal=True)
        assert np.abs(canon(cp.asnumpy(o)).astype(np.float64) - want).max() < tol, trial
        # the gradients against the uncached route: forced SIMT and tensor-core runs are cached separately
        again = nbflash.attention_backward(do.copy(), q.copy(), k.copy(), v.copy(), o.copy(), lse.copy(),
                                           causal=True, layout=layout)
        for a, b in zip((dq, dk, dv), again, strict=True):
            assert cp.array_equal(a, b), trial
    assert api._FORWARD_RECIPES and api._BACKWARD_RECIPES


@pytest.mark.gpu
def test_gpu_cached_signature_still_checks_alignment_and_inputs():
    """A signature differs by alignment: a misaligned view of a cached shape takes SIMT (or is refused when
    tensor cores are forced); bad inputs after a cached call are refused as before."""
    cp = pytest.importorskip("cupy")
    rng = cp.random.default_rng(5)
    shape = (1, 2, 64, 64)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in range(3))
    o_tc = nbflash.attention(q, k, v, backend="tensor_core")
    buf = cp.empty(q.size + 1, np.float16)
    q_mis = buf[1:].reshape(shape)
    q_mis[...] = q
    assert q_mis.data.ptr % 16
    assert nbflash.which_backend(q_mis, k, v).backend == "simt"
    o_mis = nbflash.attention(q_mis, k, v)
    assert float(cp.abs(o_mis.astype(cp.float32) - o_tc.astype(cp.float32)).max()) < 2e-2
    with pytest.raises(ValueError, match="aligned"):
        nbflash.attention(q_mis, k, v, backend="tensor_core")
    with pytest.raises(TypeError, match="dtype"):
        nbflash.attention(q, k.astype(np.float32), v)
    with pytest.raises(TypeError):
        nbflash.attention(q, k, v, causal=1)
    with pytest.raises(ValueError):
        nbflash.attention(q, k, v, scale=float("nan"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_torch_cached_signature_runs_fresh_inputs(dtype):
    torch = pytest.importorskip("torch")
    import nbflash.torch as nbt

    dt = getattr(torch, dtype)
    tol = 1e-4 if dtype == "float32" else 3e-2
    for trial in range(3):
        q, k, v = (torch.randn(2, 3, 70, 64, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        o = nbt.attention(q, k, v, causal=True)
        o.sum().backward()  # an all-zero-stride incoming gradient: copied, and the copy's signature cached
        q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
        ref.sum().backward()
        assert (o.double() - ref).abs().max().item() < tol, trial
        for a, b in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
            assert (a.double() - b).abs().max().item() < 10 * tol, trial


def test_signature_key_and_cache():
    """One key per call signature (alignment included); an unhashable flag has none; the cache is bounded."""
    meta = [((2, 3), (24, 8), "e"), ((2, 3), (24, 8), "e")]
    key = _launch.signature_key(0, meta, [True, True], ("bhsd", float, 0.5))
    assert key == _launch.signature_key(0, list(meta), (True, True), ("bhsd", float, 0.5))
    # Each array's alignment is its own part of the key: a kernel choice may depend on any one of them.
    first, second = (_launch.signature_key(0, meta, a, ("bhsd", float, 0.5)) for a in ([False, True], [True, False]))
    assert len({key, first, second}) == 3
    assert _launch.signature_key(0, meta, [True, True], ([0.5],)) is None
    cache = _launch.SignatureCache(limit=2)
    for i in range(3):
        cache.put(i, i)
    assert len(cache) <= 2 and cache[2] == 2
