"""Every Triton kernel specialization memopt launches builds for A100 and H100 GPUs, no GPU needed.

Triton's interpreter (``tests/test_triton.py``) runs the kernels on the CPU and accepts code a
GPU build rejects; this compiles each launch :func:`.triton_launch.specializations` enumerates
for the default group size through Triton, LLVM and ``ptxas`` to cubins for sm_80 and sm_90
(:mod:`memopt_plugins.compress.codec.cuda_build`), and fails on a build error, a register spill,
an approximate division or a fused multiply-add (the reference's bytes need IEEE division and no
FMA). ``tests/test_triton.py`` checks that training launches nothing outside the enumeration.
Compiles are cached by Triton (``TRITON_CACHE_DIR``): a cold run is the long one.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU: run without TRITON_INTERPRET=1", allow_module_level=True)

from memopt_plugins.compress.codec import cuda_build, triton_launch  # noqa: E402


def test_every_specialization_builds_for_sm80_and_sm90_without_spills() -> None:
    launches = triton_launch.specializations(cuda_build.GROUP_SIZES)
    start = time.perf_counter()
    builds = cuda_build.build_all(launches, cuda_build.ARCHS)
    report = cuda_build.summary(builds, time.perf_counter() - start)
    bad = "\n".join(str(b) for b in cuda_build.problems(builds))
    assert not bad, f"{report}\n{bad}"
    assert len(builds) == 2 * len(launches) and {b.arch for b in builds} == {80, 90}
    quantize = [b for b in builds if b.launch.kernel == "_quantize_kernel"]
    # 8/4/2 bits x three element types x two roundings, each dividing with IEEE division.
    assert len(quantize) == 2 * 18 and all(b.ieee_divisions > 0 for b in quantize), report
    assert all(0 < b.registers <= 255 for b in builds), report


def test_the_enumeration_covers_every_bit_width_type_rounding_and_mask() -> None:
    launches = triton_launch.specializations([256, 7, 4096])
    assert len(launches) == len(set(launches))
    for group_size in (256, 7, 4096):
        constants = [launch.constants for launch in triton_launch.specializations([group_size])]
        quantize = {
            (c["BITS"], c["DTYPE"], c["STOCHASTIC"]) for c in constants if "STOCHASTIC" in c
        }
        quantize_or_decode = [c for c in constants if "FIRST" in c]
        assert len(quantize) == 3 * 3 * 2 and len(quantize_or_decode) == 3 * 3 * 3, group_size
    masks = [launch for launch in launches if "mask" in launch.kernel]
    assert len(masks) == 3 + 4  # packing floats of 2, 4 and 8 bytes; unpacking four types
    # One tile per group size, whatever the tensor: 2048 elements, or one group beyond that.
    for bits in (8, 4, 2):
        tile = triton_launch.quantize_launch(bits, 256, triton_launch.F32, True)
        assert tile.constants["GROUPS"] == 8 and tile.num_warps == 4
        assert triton_launch.quantize_launch(bits, 4096, triton_launch.F32, True).num_warps == 8
        # Groups of 7 straddle bytes below 8 bits: one code per byte, torch packs them.
        assert triton_launch.per_byte(bits, 7) == 1
        assert triton_launch.per_byte(bits, 256) == 8 // bits
