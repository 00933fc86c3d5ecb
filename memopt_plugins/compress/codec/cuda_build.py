"""Compile every Triton kernel specialization for CUDA GPUs ahead of time, without a GPU.

Triton's interpreter, which runs the kernels' tests on the CPU, accepts code a GPU build
rejects. This compiles each launch :func:`.triton_launch.specializations` enumerates through the
whole GPU pipeline (Triton IR, LLVM, PTX, and ``ptxas`` from the triton wheel to a cubin) for each
target architecture, and reads each cubin's registers and local memory (``cuobjdump``, also in
the wheel): local memory there is spilled registers, each access a trip to memory.

    python -m memopt_plugins.compress.codec.cuda_build [--arch 80 90] [--group-size 256 ...]

Prints one line per build and exits with status 1 when a build fails or spills. Needs
``triton`` (imported without ``TRITON_INTERPRET``); no CUDA device or toolkit.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from .triton_launch import Launch, specializations

#: Architectures built by default: A100 (sm_80) and H100 (sm_90).
ARCHS = (80, 90)
#: Group sizes built by default: the configuration's default.
GROUP_SIZES = (256,)
_DIVISIONS = (r"div\.rn\.f32", r"div\.(?:full|approx)")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass(frozen=True)
class Build:
    """One specialization built for one architecture: registers per thread, bytes of stack
    and local memory per thread (spills), seconds; in its PTX, the IEEE divisions
    (``div.rn.f32``), approximate divisions and fused multiply-adds (the reference's bytes need
    none of the last two); ``error`` where the build failed."""

    launch: Launch
    arch: int
    registers: int = 0
    spilled: int = 0
    seconds: float = 0.0
    ieee_divisions: int = 0
    approximate_divisions: int = 0
    fused_multiply_adds: int = 0
    error: str = ""

    def __str__(self) -> str:
        if self.error:
            return f"sm_{self.arch} {self.launch}: FAILED {self.error}"
        spills = f", {self.spilled} bytes spilled" if self.spilled else ""
        inexact = self.approximate_divisions + self.fused_multiply_adds
        inexact_text = f", {inexact} approximate divisions or FMAs" if inexact else ""
        return f"sm_{self.arch} {self.launch}: {self.registers} registers{spills}{inexact_text}"


def _signature(fn, launch: Launch) -> tuple[dict, dict]:
    """Triton's signature of ``fn`` at ``launch``, and its attributes: pointers 16-byte aligned
    (torch's allocations are), integers typed as in :attr:`Launch.types`."""
    types, constants = dict(launch.types), launch.constants
    signature = {n: "constexpr" if n in constants else types[n] for n in fn.arg_names}
    aligned = [["tt.divisibility", 16]]
    attrs = {(i,): aligned for i, n in enumerate(fn.arg_names) if signature[n].startswith("*")}
    return signature, attrs


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack + local bytes) per thread of the one kernel in ``cubin``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
    found = _USAGE.search(usage.stdout)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage: no usage in {usage.stdout + usage.stderr!r}")
    registers, stack, _, local = map(int, found.groups())
    return registers, stack + local


def build(launch: Launch, arch: int) -> Build:
    """Compile ``launch`` for ``sm_{arch}`` with the options the kernels launch with."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import triton_kernels

    if triton_kernels.INTERPRETED:
        raise RuntimeError("cuda_build compiles for a GPU: unset TRITON_INTERPRET")
    fn = getattr(triton_kernels, launch.kernel)
    signature, attrs = _signature(fn, launch)
    source = ASTSource(fn, signature, constexprs=launch.constants, attrs=attrs)
    options = {"num_warps": launch.num_warps, "enable_fp_fusion": False}
    start = time.perf_counter()
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        registers, spilled = _resources(kernel.asm["cubin"])
    except Exception as exc:  # the report names every failed build, not only the first
        message = " ".join(str(exc).split())[:400]
        return Build(launch, arch, error=f"{type(exc).__name__}: {message}")
    seconds = time.perf_counter() - start
    ptx = kernel.asm["ptx"]
    divisions = [len(re.findall(pattern, ptx)) for pattern in _DIVISIONS]
    fused = len(re.findall(r"\bfma\.", ptx))
    return Build(launch, arch, registers, spilled, seconds, *divisions, fused)


def _build_pair(pair: tuple[Launch, int]) -> Build:
    return build(*pair)


def build_all(launches: Iterable[Launch], archs: Iterable[int], jobs: int = 1) -> list[Build]:
    """:func:`build` of every launch for every architecture, on ``jobs`` processes."""
    pairs = [(launch, arch) for arch in archs for launch in launches]
    if jobs <= 1:
        return [_build_pair(pair) for pair in pairs]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_build_pair, pairs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    parser.add_argument("--group-size", type=int, nargs="+", default=list(GROUP_SIZES))
    parser.add_argument("--jobs", type=int, default=1, help="compiling processes (default 1)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    builds = build_all(specializations(args.group_size), args.arch, args.jobs)
    for b in builds:
        print(b)
    print(summary(builds, time.perf_counter() - start))
    return 1 if problems(builds) else 0


def problems(builds: list[Build]) -> list[Build]:
    """The builds that failed, spill registers, or divide or multiply-add inexactly."""
    return [
        b for b in builds
        if b.error or b.spilled or b.approximate_divisions or b.fused_multiply_adds
    ]  # fmt: skip


def summary(builds: list[Build], seconds: float) -> str:
    """One line: how many builds, how long, how many failed or spilled, the most registers."""
    archs = len({b.arch for b in builds}) or 1
    return (
        f"{len(builds)} builds ({len(builds) // archs} specializations x {archs} "
        f"architectures) in {seconds:.1f} s: {sum(bool(b.error) for b in builds)} failed, "
        f"{sum(bool(b.spilled) for b in builds)} spill registers, {len(problems(builds))} "
        f"with problems; most registers {max((b.registers for b in builds), default=0)}"
    )


if __name__ == "__main__":
    sys.exit(main())
