"""The codec's C kernels (``kernels.c``) of this tree against another revision's, same bytes.

Both sources are compiled with :mod:`memopt_plugins.compress.codec.native`'s flags and loaded
side by side. Inputs: the float32 tensors memopt int8 quantizes in one training step of
``fits.MODELS["resnet"]`` (batch 64), and one 16x256x1024 tensor, each also in bfloat16. For
every input set, width (8, 4, 2 bits), rounding (stochastic, nearest) and decode, both builds
must write the same bytes; then each is timed, alternating, as the minimum of ``--rounds``
rounds over the set (thread CPU time at one thread, wall time with more), beside a clone of
the set: through ``native.quantize`` / ``native.decode``, and the C entry points alone writing
into buffers allocated once. Prints a table (ms) and, with ``--json``, writes the numbers.

    python -m benchmarks.codec_kernels [--against main] [--threads 1] [--rounds 5] [--json F]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from memopt_plugins.compress.codec import native
from memopt_plugins.compress.codec.reference import FIRST_LEVEL

GROUP_SIZE = 256
SEED = 12345
#: What native.quantize writes: compared byte for byte between the builds.
KERNEL_FIELDS = ("codes", "scale", "zero_point", "exact", "const")


def build(source: Path, target: Path) -> ctypes.CDLL:
    """``source`` compiled as native.py compiles kernels.c, loaded with its signatures."""
    cc = native._compiler()
    subprocess.run([*cc, *native._FLAGS, "-o", str(target), str(source)], check=True)
    lib = ctypes.CDLL(str(target))
    for name, (argtypes, restype) in native._SIGNATURES.items():
        if hasattr(lib, name):  # an older source lacks the later entry points (strided ones)
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = restype
    return lib


def resnet_saves() -> list[torch.Tensor]:
    """Copies of the tensors memopt int8 quantizes in one ResNet training step (after one)."""
    from benchmarks.fits import MODELS
    from benchmarks.harness.paired import TrainStep
    from memopt_plugins import MemoryOptimizer

    model, batch, loss_fn = MODELS["resnet"].build(False)
    opt = MemoryOptimizer({"quantize": {"bits": 8}, "drift": {"enabled": False}})
    opt.apply(model)
    step = TrainStep(model, batch, loss_fn, opt=opt)
    step()
    seen, quantize = [], native.quantize

    def recording(flat: torch.Tensor, *args):
        seen.append(flat.clone())
        return quantize(flat, *args)

    native.quantize = recording
    try:
        step()
    finally:
        native.quantize = quantize
    return seen


def best_ms(fn: Callable[[], object], rounds: int, clock: Callable[[], float]) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best * 1e3


def _bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous().view(-1).view(torch.uint8)


def _same(a: list, b: list) -> bool:
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def encode(lib, tensors: list[torch.Tensor], bits: int, seed: int | None) -> list:
    native._state["lib"] = lib
    return [native.quantize(t, GROUP_SIZE, bits, FIRST_LEVEL[bits], seed) for t in tensors]


def decode(lib, codes: list, bits: int, dtype: torch.dtype) -> list[torch.Tensor]:
    native._state["lib"] = lib
    first = FIRST_LEVEL[bits]
    return [
        native.decode(c.codes, bits, first, GROUP_SIZE, c.scale, c.zero_point, dtype) for c in codes
    ]


def encode_into(lib, tensors: list[torch.Tensor], outs: list, bits: int, seed: int | None):
    """The kernel alone: ``memopt_quantize`` into the buffers of earlier results ``outs`` (no
    Python wrapper, no allocation)."""
    first, threads = FIRST_LEVEL[bits], torch.get_num_threads()
    for t, o in zip(tensors, outs, strict=True):
        flags = torch.empty_like(o.zero_point) if o.exact is None else o.exact.to(torch.uint8)
        lib.memopt_quantize(
            t.data_ptr(), native._DTYPE_CODES[t.dtype], t.numel(), GROUP_SIZE, o.scale.numel(),
            bits, first, seed is not None, seed or 0, torch.finfo(t.dtype).max,
            o.codes.data_ptr(), o.scale.data_ptr(), o.zero_point.data_ptr(), flags.data_ptr(),
            threads,
        )  # fmt: skip


def decode_into(lib, codes: list, outs: list[torch.Tensor], bits: int) -> None:
    """The kernel alone: ``memopt_decode`` into ``outs``."""
    first, threads = FIRST_LEVEL[bits], torch.get_num_threads()
    for c, out in zip(codes, outs, strict=True):
        lib.memopt_decode(
            c.codes.data_ptr(), bits, first, GROUP_SIZE, c.scale.numel(), c.scale.data_ptr(),
            c.zero_point.data_ptr(), native._DTYPE_CODES[out.dtype], out.data_ptr(), threads,
        )  # fmt: skip


def alternate(libs: dict, run: Callable, rounds: int, clock) -> dict[str, float]:
    """Each build's best time of ``run(lib)``, the builds alternated twice (the machine's load
    shifts under both)."""
    timings: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(2):
        for name, lib in libs.items():
            timings[name].append(best_ms(partial(run, lib), rounds, clock))
    return {name: min(times) for name, times in timings.items()}


def compare(libs: dict, tensors: list[torch.Tensor], rounds: int, clock) -> list[dict]:
    """Rows of (op, width, each build's ms) for quantize and decode of ``tensors``, after
    checking that the builds write the same bytes."""
    rows = []
    for bits in (8, 4, 2):
        for seed in (SEED, None):
            out = [encode(lib, tensors, bits, seed) for lib in libs.values()]
            fields = [[_bytes(getattr(c, f)) for c in cs for f in KERNEL_FIELDS] for cs in out]
            assert _same(*fields), f"the builds' codes differ at {bits} bits, seed {seed}"
            times = alternate(libs, partial(_encode_as, tensors, bits, seed), rounds, clock)
            alone = alternate(
                libs, partial(_encode_into_as, tensors, out[0], bits, seed), rounds, clock
            )
            op = "quantize " + ("stochastic" if seed is not None else "nearest")
            rows.append({"op": op, "bits": bits, **times, "kernel alone": alone})
        codes, dtype = out[0], tensors[0].dtype
        decoded = [[_bytes(d) for d in decode(lib, codes, bits, dtype)] for lib in libs.values()]
        assert _same(*decoded), f"the builds decode differently at {bits} bits"
        times = alternate(libs, partial(_decode_as, codes, bits, dtype), rounds, clock)
        outs = decode(next(iter(libs.values())), codes, bits, dtype)
        alone = alternate(libs, partial(_decode_into_as, codes, outs, bits), rounds, clock)
        rows.append({"op": "decode", "bits": bits, **times, "kernel alone": alone})
    return rows


def _encode_as(tensors, bits, seed, lib):
    return encode(lib, tensors, bits, seed)


def _decode_as(codes, bits, dtype, lib):
    return decode(lib, codes, bits, dtype)


def _encode_into_as(tensors, outs, bits, seed, lib):
    return encode_into(lib, tensors, outs, bits, seed)


def _decode_into_as(codes, outs, bits, lib):
    return decode_into(lib, codes, outs, bits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", help="git revision of the other kernels.c")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other.c"
        path = "memopt_plugins/compress/codec/kernels.c"
        other.write_text(
            subprocess.run(
                ["git", "show", f"{args.against}:{path}"], capture_output=True, text=True,
                check=True, cwd=native._SOURCE.parents[3],
            ).stdout
        )  # fmt: skip
        libs = {
            args.against: build(other, Path(tmp) / "other.so"),
            "this tree": build(native._SOURCE, Path(tmp) / "this.so"),
        }
        resnet = resnet_saves()
        big = [torch.randn(16, 256, 1024, generator=torch.Generator().manual_seed(0)).view(-1)]
        sets = {"resnet": resnet, "resnet bf16": [t.bfloat16() for t in resnet]}
        sets |= {"16x256x1024": big, "16x256x1024 bf16": [big[0].bfloat16()]}
        report = {}
        print(f"threads {args.threads}; ms, min of {args.rounds} rounds; builds: {list(libs)}")
        for name, tensors in sets.items():
            mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
            clone = best_ms(lambda ts=tensors: [t.clone() for t in ts], args.rounds, clock)
            rows = compare(libs, tensors, args.rounds, clock)
            report[name] = {"MiB": mib, "tensors": len(tensors), "clone": clone, "rows": rows}
            print(f"\n{name}: {len(tensors)} tensors, {mib:.1f} MiB, clone {clone:.2f}")
            for row in rows:
                cells = "  ".join(f"{k} {row[k]:7.2f}" for k in libs)
                alone = "  ".join(f"{k} {row['kernel alone'][k]:7.2f}" for k in libs)
                print(f"  {row['op']:20s} {row['bits']} bits  {cells}  | kernel alone: {alone}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
