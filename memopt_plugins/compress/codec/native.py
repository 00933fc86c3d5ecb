"""The codec's fused CPU kernels (``kernels.c``): built on first use, called through ctypes.

``memopt_quantize`` makes one pass over a saved tensor (group minimum and maximum, parameters,
codes and bit packing while a group is in cache) where torch's elementwise ops make many;
``memopt_decode`` one back, both split between ``torch.get_num_threads()`` OpenMP threads. At
round-to-nearest they write the bytes of :mod:`.reference`; stochastic rounding hashes each
element's index with ``seed``. A view that is not one run is read, and decoded into, where its
strides place its elements (no contiguous copy); outputs are advised for transparent huge pages
(``madvise``), so a fresh one faults once per 2 MiB, not per 4 KiB page. ``memopt_mask_pack``
keeps a tensor of +0.0 and one other value (a dropout mask) as one bit an element, exactly.

The library is compiled once per source, compiler and CPU (``CC`` or ``cc``,
``-O3 -march=native -fopenmp``) into ``$XDG_CACHE_HOME/memopt_plugins``, with AVX-512 or AVX2
intrinsics where the CPU has them. Without a compiler, on another architecture or with
``MEMOPT_NATIVE=0`` the codec runs the reference on the CPU; a failed build is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("memopt")

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno")
_FLAGS += ("-shared", "-fPIC")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "memopt_quantize": (
        (_P, _INT, _I64, _I64, _I64, _INT, _F, _INT, ctypes.c_uint64, _F, _P, _P, _P, _P, _INT),
        ctypes.c_int64,
    ),
    "memopt_quantize_strided": (
        (
            _P,
            _INT,
            _INT,
            _P,
            _P,
            _I64,
            _I64,
            _I64,
            _INT,
            _F,
            _INT,
            ctypes.c_uint64,
            _F,
            _P,
            _P,
            _P,
            _P,
            _INT,
        ),
        ctypes.c_int64,
    ),  # fmt: skip
    "memopt_decode": ((_P, _INT, _F, _I64, _I64, _P, _P, _INT, _P, _INT), _INT),
    "memopt_decode_into": (
        (_P, _INT, _F, _I64, _I64, _P, _P, _INT, _I64, _INT, _P, _P, _P, _INT),
        _INT,
    ),
    "memopt_graph_encode": (
        (_P, _INT, _I64, _I64, _I64, _INT, _F, _INT, ctypes.c_uint64, _F, _P, _P, _P, _INT),
        _INT,
    ),
    "memopt_mask_pack": ((_P, _INT, _I64, _P, ctypes.POINTER(ctypes.c_uint32), _INT), _INT),
    "memopt_mask_unpack": ((_P, _INT, _I64, ctypes.c_uint32, _P, _INT), None),
}

# Group flags written by memopt_quantize.
_EXACT, _CONSTANT = 1, 2

_state: dict[str, object] = {}


def _compiler() -> list[str] | None:
    """The C compiler command: ``CC`` (a program and its arguments, as ``make`` takes it) or
    ``cc``; ``None`` when the program is not found."""
    cc = shlex.split(os.environ.get("CC", "cc"))
    path = shutil.which(cc[0]) if cc else None
    return [path, *cc[1:]] if path else None


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "memopt_plugins"


def _build(cc: list[str]) -> Path:
    """Compile ``kernels.c`` into the cache (once per source, compiler, flags and CPU)."""
    version = subprocess.run([cc[0], "--version"], capture_output=True, text=True).stdout
    identity = (_SOURCE.read_text(), " ".join(cc), version, " ".join(_FLAGS), _cpu_identity())
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes building at once never see a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [*cc, *_FLAGS, "-o", tmp, str(_SOURCE)], capture_output=True, text=True, timeout=120
        )
        if done.returncode:
            raise RuntimeError(done.stderr.strip() or f"{cc[0]} exited with {done.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded on first call; ``None`` where they cannot be used."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    lib = None
    cc = _compiler()
    if os.environ.get("MEMOPT_NATIVE", "1") == "0":
        log.debug("memopt: native codec kernels disabled by MEMOPT_NATIVE=0")
    elif platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64") or cc is None:
        log.debug("memopt: no C compiler or unsupported CPU; the codec uses torch ops")
    else:
        try:
            lib = ctypes.CDLL(str(_build(cc)))
            for name, (argtypes, restype) in _SIGNATURES.items():
                getattr(lib, name).argtypes = argtypes
                getattr(lib, name).restype = restype
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            log.warning("memopt: building the codec kernels failed, using torch ops: %s", exc)
            lib = None
    _state["lib"] = lib
    return lib


@dataclass(frozen=True, slots=True)
class KernelCodes:
    """What :func:`quantize` returns: packed codes and per-group parameters and flags."""

    codes: torch.Tensor  # uint8, packed
    scale: torch.Tensor  # bfloat16
    zero_point: torch.Tensor  # uint8
    exact: torch.Tensor | None  # bool per group (kept exactly), None when no group is flagged
    const: torch.Tensor | None  # bool per group (constant, value in the side table), or None


#: The most dims the kernels read or write strided (``MAX_DIMS`` in ``kernels.c``).
MAX_DIMS = 16


def _layout(t: torch.Tensor) -> tuple[int, object, object]:
    """``t``'s dims and its sizes and strides as C arrays for the kernels' strided entry points:
    no dims for a contiguous tensor (read or written as one run)."""
    if t.is_contiguous():
        return 0, None, None
    dims = t.dim()
    if dims > MAX_DIMS:
        raise ValueError(f"memopt: the codec kernels take at most {MAX_DIMS} strided dims")
    return dims, (ctypes.c_int64 * dims)(*t.shape), (ctypes.c_int64 * dims)(*t.stride())


def quantize(
    x: torch.Tensor, group_size: int, bits: int, first: float, seed: int | None
) -> KernelCodes:
    """The codes and group parameters of ``x`` (:func:`.reference.quantize`'s of its elements in
    index order), with the groups to keep exactly or as one value flagged. A ``x`` that is not
    contiguous (a transposed or permuted view, a slice with gaps) is read where it lies, in its
    index order: the same bytes as of ``x.reshape(-1)``, without that copy.

    ``first``: the first level in steps (:data:`.reference.FIRST_LEVEL`); ``seed``: stochastic
    rounding with noise from this seed, round-to-nearest when ``None``.
    """
    lib = library()
    per_byte = 8 // bits
    numel = x.numel()
    n_groups = -(-numel // group_size)
    packed = torch.empty(-(-n_groups * group_size // per_byte), dtype=torch.uint8)
    scale = torch.empty(n_groups, dtype=torch.bfloat16)
    zero_point = torch.empty(n_groups, dtype=torch.uint8)
    flags = torch.empty(n_groups, dtype=torch.uint8)
    if x.dim() > MAX_DIMS:
        x = x.contiguous()
    common = (
        numel, group_size, n_groups, bits, first, seed is not None, seed or 0,
        torch.finfo(x.dtype).max, packed.data_ptr(), scale.data_ptr(), zero_point.data_ptr(),
        flags.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    dims, sizes, strides = _layout(x)
    if dims:
        flagged = lib.memopt_quantize_strided(
            x.data_ptr(), _DTYPE_CODES[x.dtype], dims, sizes, strides, *common
        )
    else:
        flagged = lib.memopt_quantize(x.data_ptr(), _DTYPE_CODES[x.dtype], *common)
    if flagged < 0:
        raise MemoryError("memopt: no memory for the codec kernels' scratch buffers")
    any_flagged = flagged > 0
    return KernelCodes(
        codes=packed,
        scale=scale,
        zero_point=zero_point,
        exact=(flags & _EXACT).bool() if any_flagged else None,
        const=(flags & _CONSTANT).bool() if any_flagged else None,
    )


def decode(
    packed: torch.Tensor,
    bits: int,
    first: float,
    group_size: int,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The levels of every group's codes (:func:`.reference.decode`), as ``(groups, group_size)``
    of ``dtype``.

    ``first``: the first level in steps; ``scale``: bfloat16 per group; ``zero_point``: uint8 per
    group.
    """
    n_groups = scale.numel()
    out = torch.empty(n_groups, group_size, dtype=dtype)
    failed = library().memopt_decode(
        packed.data_ptr(), bits, first, group_size, n_groups, scale.contiguous().data_ptr(),
        zero_point.contiguous().data_ptr(), _DTYPE_CODES[dtype], out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("memopt: no memory for the codec kernels' scratch buffers")
    return out


def decode_into(
    packed: torch.Tensor,
    bits: int,
    first: float,
    group_size: int,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`decode`'s levels of the first ``out.numel()`` elements written into ``out``, in its
    index order and where its strides place them (a permuted layout, a tensor whose last group
    is partial: no copy into that layout after); returns ``out``."""
    lib = library()
    dims, sizes, strides = _layout(out)
    failed = lib.memopt_decode_into(
        packed.data_ptr(), bits, first, group_size, scale.numel(),
        scale.contiguous().data_ptr(), zero_point.contiguous().data_ptr(),
        _DTYPE_CODES[out.dtype], out.numel(), dims, sizes, strides, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("memopt: no memory for the codec kernels' scratch buffers")
    return out


def graph_encode(
    flat: torch.Tensor, group_size: int, bits: int, first: float, seed: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`.traced.encode` computes for contiguous 1-D ``flat`` in one pass: codes packed
    in planes, bfloat16 scale and uint8 zero point (:func:`.reference.graph_params`' for the
    groups' minima and maxima; scale 0 and the top code for a group decoded as NaN, whose codes
    are unspecified). ``seed``: stochastic rounding with :func:`quantize`'s noise, else
    round-to-nearest."""
    n_groups = -(-flat.numel() // group_size)
    packed = torch.empty(n_groups * group_size * bits // 8, dtype=torch.uint8)
    scale = torch.empty(n_groups, dtype=torch.bfloat16)
    zero_point = torch.empty(n_groups, dtype=torch.uint8)
    failed = library().memopt_graph_encode(
        flat.data_ptr(), _DTYPE_CODES[flat.dtype], flat.numel(), group_size, n_groups, bits, first,
        seed is not None, (seed or 0) & 0xFFFFFFFFFFFFFFFF, torch.finfo(flat.dtype).max,
        packed.data_ptr(), scale.data_ptr(), zero_point.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("memopt: no memory for the codec kernels' scratch buffers")
    return packed, scale, zero_point


def mask_pack(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """Contiguous ``x`` (elements of 2 or 4 bytes) as one bit an element, where it holds only
    +0.0 and one other value, compared bit for bit: the bits (low first) and that value's bit
    pattern (0 for an all-zero ``x``); ``None`` where it holds anything else."""
    numel = x.numel()
    bits = torch.empty(-(-numel // 8), dtype=torch.uint8)
    value = ctypes.c_uint32()
    mask = library().memopt_mask_pack(
        x.data_ptr(), x.element_size(), numel, bits.data_ptr(), ctypes.byref(value),
        torch.get_num_threads(),
    )  # fmt: skip
    return (bits, value.value) if mask else None


def mask_unpack(bits: torch.Tensor, value: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`mask_pack`'s inverse, written into contiguous ``out``: the value's bit pattern
    where a bit is set, +0.0 elsewhere; returns ``out``."""
    library().memopt_mask_unpack(
        bits.data_ptr(), out.element_size(), out.numel(), value, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out
