"""nbflash._device.ptxas_info / parse_ptxas_log: ptxas' registers, spills and stack, read without a GPU.

The offline compile tests (test_backward, test_backward_tc, test_forward_tc,
test_hopper, test_intrinsics) and benchmarks/fp32_candidates.py all assemble
their PTX with this helper; here its parser is checked on logs as nvJitLink
writes them, and the helper itself on a hand-written kernel.
"""

from __future__ import annotations

import pytest

from nbflash._device import PtxasError, parse_ptxas_log, ptxas_info

# nvJitLink 13's -verbose info log: ptxas' report, then the linker's summary (whose smem on sm_90 includes the
# 1 KB the system reserves, and whose "used N registers" is lower case).
LOG_SM90 = (
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function 'add_one' for 'sm_90'\n"
    "ptxas info    : Function properties for add_one\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 8 registers, used 1 barriers, 256 bytes smem\n"
    "ptxas info    : Compile time = 15.283 ms\n"
    "info    : 0 bytes gmem\n"
    "info    : Function properties for 'add_one':\n"
    "info    : used 8 registers, used 1 barriers, 0 stack, 1280 bytes smem, 536 bytes cmem[0], 0 bytes lmem\n"
)

# A kernel that spills: stack frame, spill stores and loads all non-zero (the sm_80 form of the registers line).
LOG_SPILLS = (
    "ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function '_ZN6cudapy7nbflash8backwardE' for 'sm_80'\n"
    "ptxas info    : Function properties for _ZN6cudapy7nbflash8backwardE\n"
    "ptxas         .     152 bytes stack frame, 148 bytes spill stores, 212 bytes spill loads\n"
    "ptxas info    : Used 255 registers, used 1 barriers, 152 bytes cumulative stack size, 400 bytes cmem[0]\n"
)

# No shared memory and no barrier: ptxas leaves both out of its line; the linker's smem line is not ptxas'.
LOG_NO_SMEM = (
    "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
    "ptxas info    : Function properties for k\n"
    "ptxas         .     64 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 12 registers\n"
    "info    : used 12 registers, used 5 barriers, 64 stack, 1024 bytes smem, 540 bytes cmem[0], 0 bytes lmem\n"
)


LOG_CACHED_LINK = """info    : 8 bytes gmem
info    : Function properties for 'tma_tiles':
info    : used 32 registers, used 1 barriers, 0 stack, 17416 bytes smem, 728 bytes cmem[0], 0 bytes lmem
"""


def test_parse_ptxas_log():
    info = parse_ptxas_log(LOG_SM90)
    assert {k: v for k, v in info.items() if k != "log"} == {
        "registers": 8,
        "spill_stores": 0,
        "spill_loads": 0,
        "spill_bytes": 0,
        "stack_bytes": 0,
        "shared_bytes": 256,  # ptxas' static shared memory, not the linker's 1280
        "barriers": 1,
        "function": "add_one",
    }
    assert info["log"] == LOG_SM90

    info = parse_ptxas_log(LOG_SPILLS)
    assert (info["registers"], info["spill_stores"], info["spill_loads"], info["spill_bytes"]) == (255, 148, 212, 360)
    assert (info["stack_bytes"], info["shared_bytes"], info["barriers"]) == (152, 0, 1)
    assert info["function"] == "_ZN6cudapy7nbflash8backwardE"

    info = parse_ptxas_log(LOG_NO_SMEM)
    assert (info["registers"], info["stack_bytes"], info["shared_bytes"], info["barriers"]) == (12, 64, 0, 0)

    # A link nvJitLink took from its cache: only the linker's summary (seen on the H200, 2026-11-30).
    cached = parse_ptxas_log(LOG_CACHED_LINK)
    fields = ("registers", "stack_bytes", "spill_bytes", "shared_bytes")
    assert tuple(cached[f] for f in fields) == (32, 0, 0, 17416)
    assert cached["spill_stores"] is None and cached["barriers"] == 1
    assert parse_ptxas_log(LOG_CACHED_LINK.replace("0 bytes lmem", "24 bytes lmem"))["spill_bytes"] == 24

    # Nothing to read: every field is None (ptxas_info raises instead when a successful link logs no such lines).
    empty = parse_ptxas_log("")
    assert all(v is None for k, v in empty.items() if k != "log"), empty


# A tiny kernel: 256 bytes of shared memory behind a barrier, and a 1 KB local array indexed at run time (the
# stack frame).
TINY_PTX = r"""
.version 7.0
.target sm_80
.address_size 64

.visible .entry tiny(.param .u64 p, .param .u32 i)
{
    .shared .align 4 .b8 buf[256];
    .local .align 4 .b8 arr[1024];
    .reg .b64 %rd<6>;
    .reg .b32 %r<2>;
    .reg .f32 %f<4>;
    ld.param.u64 %rd1, [p];
    ld.param.u32 %r1, [i];
    cvta.to.global.u64 %rd2, %rd1;
    ld.global.f32 %f1, [%rd2];
    st.shared.f32 [buf], %f1;
    bar.sync 0;
    ld.shared.f32 %f2, [buf+4];
    st.local.f32 [arr], %f2;
    st.local.f32 [arr+1020], %f1;
    mov.u64 %rd3, arr;
    mul.wide.u32 %rd4, %r1, 4;
    add.u64 %rd5, %rd3, %rd4;
    ld.local.f32 %f3, [%rd5];
    st.global.f32 [%rd2], %f3;
    ret;
}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ptxas_info_compiles_for(arch):
    """The real helper: nvJitLink runs ptxas on a hand-written kernel (no GPU needed)."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    info = ptxas_info(TINY_PTX, arch)
    assert info["ok"] and info["error_log"] == "" and info["arch"] == arch
    assert info["function"] == "tiny" and f"for '{arch}'" in info["log"]
    assert 0 < info["registers"] <= 255, info["log"]
    assert (info["spill_stores"], info["spill_loads"], info["spill_bytes"]) == (0, 0, 0), info["log"]
    assert info["stack_bytes"] == 1024, info["log"]
    assert info["shared_bytes"] == 256 and info["barriers"] == 1, info["log"]
    assert info["cubin"][:4] == b"\x7fELF"


def test_ptxas_info_refusal_compiles_for_sm90():
    """PTX that ptxas refuses: PtxasError with its error log, or ok=False with check=False."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    bad = TINY_PTX.replace("mul.wide.u32", "bogus.wide.u32")
    with pytest.raises(PtxasError, match="bogus") as err:
        ptxas_info(bad, "sm_90")
    assert "bogus" in err.value.log
    info = ptxas_info(bad, "sm_90", check=False)
    assert not info["ok"] and info["cubin"] is None
    assert "bogus" in info["error_log"] and info["error_log"] in info["log"]
    assert info["registers"] is None
