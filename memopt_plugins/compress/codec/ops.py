"""The codec as PyTorch operators: ``memopt::quantize``, ``memopt::dequantize``, and for compiled
graphs (:mod:`.traced`) ``memopt::graph_encode`` and ``memopt::graph_seed``.

Operators (``torch.library.custom_op``) with fake implementations are what ``torch.compile`` can
trace. The real implementation is chosen per call by the tensor's device and ``MEMOPT_CODEC``
(:func:`codec_for`; read at import, :data:`REQUESTED`): ``auto`` (the C kernels on the CPU,
Triton on CUDA, else the reference), ``torch``, ``native`` or ``triton``; anything outside
:data:`CODECS` is an error, and float64 always takes the reference. Eager code calls
:func:`quantize` / :func:`dequantize` here, which pick the same implementations without the
operator dispatch (paid for every saved tensor). Every implementation writes the same bytes at
round-to-nearest; stochastic rounding takes its noise from an explicit ``seed``. On CUDA the side
tables have sizes fixed by the tensor's size (:func:`.reference.bounded_tables`), so the host
never waits for the GPU while packing.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import os
import weakref
from collections.abc import Callable
from types import ModuleType

import torch

from . import native, reference
from .reference import FIRST_LEVEL, Quantized

log = logging.getLogger("memopt")

#: The values ``MEMOPT_CODEC`` takes (see the module docstring).
CODECS = ("auto", "torch", "native", "triton")
#: What the kernels take; other floating types (float64) take the reference.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: ``MEMOPT_CODEC`` as the process started (read once: never per saved tensor); a test or a
#: benchmark sets it here to switch codecs within a process.
REQUESTED = os.environ.get("MEMOPT_CODEC", "auto")

_triton: dict[str, object] = {}


def triton_kernels() -> ModuleType | None:
    """The Triton kernels (:mod:`.triton_kernels`), imported on first call (the first codec call
    on a CUDA tensor, or under ``MEMOPT_CODEC=triton``); ``None`` where ``triton`` cannot be
    imported (or its interpreter setting changed after it was): a warning says so once, and the
    reason is kept for the error that
    ``MEMOPT_CODEC=triton`` raises."""
    if "module" not in _triton:
        try:
            from . import triton_kernels as kernels
        except Exception as exc:  # not installed, or an install that fails to import
            _triton.update(module=None, error=exc)
            log.warning(
                "memopt: its Triton kernels cannot be imported (%r): on CUDA the codec runs as "
                "torch ops, not fused kernels (pip install triton)",
                exc,
            )
        else:
            _triton["module"] = kernels
    return _triton["module"]  # type: ignore[return-value]


def codec_for(device: torch.device) -> str:
    """The codec that serves tensors on ``device`` under ``MEMOPT_CODEC`` (:data:`REQUESTED`):
    ``"native"``, ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: ``MEMOPT_CODEC`` is not one of :data:`CODECS`.
        RuntimeError: the codec it names cannot serve ``device`` here.
    """
    requested = REQUESTED
    if requested == "auto":
        if device.type == "cpu":
            return "native" if native.library() is not None else "torch"
        return "triton" if device.type == "cuda" and triton_kernels() is not None else "torch"
    if requested == "torch":
        return "torch"
    if requested == "native":
        if device.type != "cpu":
            raise RuntimeError(
                f"MEMOPT_CODEC=native: the C kernels take CPU tensors only, got one on {device}; "
                "use MEMOPT_CODEC=auto (Triton on CUDA), triton or torch"
            )
        if native.library() is None:
            raise RuntimeError(
                "MEMOPT_CODEC=native, but the C kernels are not available here (MEMOPT_NATIVE=0, "
                "no C compiler, an unsupported CPU, or a failed build, logged as a warning)"
            )
        return "native"
    if requested == "triton":
        kernels = triton_kernels()
        if kernels is None:
            error = _triton["error"]
            raise RuntimeError(
                f"MEMOPT_CODEC=triton, but memopt's Triton kernels cannot be imported ({error!r}); "
                "install triton (pip install triton) or set MEMOPT_CODEC=auto"
            ) from error  # type: ignore[misc]
        if device.type == "cuda" or (device.type == "cpu" and kernels.INTERPRETED):
            return "triton"
        raise RuntimeError(
            f"MEMOPT_CODEC=triton: the Triton kernels take CUDA tensors, got one on {device} "
            "(CPU tensors run through Triton's interpreter: TRITON_INTERPRET=1 in the environment "
            "before the process imports triton)"
        )
    raise ValueError(f"MEMOPT_CODEC must be one of {', '.join(CODECS)}; got {requested!r}")


def _codec(device: torch.device, dtype: torch.dtype) -> str:
    codec = codec_for(device)
    return codec if dtype in KERNEL_DTYPES else "torch"


def _quantize_native(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    """The C kernel's codes with side tables as large as the groups it flagged (on the CPU,
    reading their sizes waits for nothing)."""
    codes, scale, zero_point, *tables = _native_untabled(x, bits, group_size, seed)
    empty = reference.side_tables(None, None, None, like=x, group_size=group_size)
    return (
        codes,
        scale,
        zero_point,
        *(e if t is None else t for t, e in zip(tables, empty, strict=True)),
    )


def _native_untabled(
    x: torch.Tensor, bits: int, group_size: int, seed: int | None
) -> tuple[torch.Tensor | None, ...]:
    """:func:`_quantize_native`'s, with ``None`` for all four side tables where the kernel
    flagged no group (no empty tables made: the common case, on the path of every saved tensor).
    ``x`` of any layout: the kernel reads it in index order where it lies."""
    q = native.quantize(x, group_size, bits, FIRST_LEVEL[bits], seed)
    if q.exact is None:
        return (q.codes, q.scale, q.zero_point, None, None, None, None)
    exact, const = (f if f.any() else None for f in (q.exact, q.const))
    groups = reference.Groups.of(x, group_size) if exact is not None or const is not None else None
    tables = reference.side_tables(groups, exact, const, like=x, group_size=group_size)
    return (q.codes, q.scale, q.zero_point, *(t if t.numel() else None for t in tables))


def _untabled(kernel: Callable[..., Quantized]) -> Callable[..., tuple[torch.Tensor | None, ...]]:
    """``kernel`` of ``x`` flattened (a copy where it is not contiguous), with ``None`` for each
    empty side table."""

    def untabled(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> tuple:
        flat = x.reshape(-1).contiguous()
        codes, scale, zero_point, *tables = kernel(flat, bits, group_size, seed)
        return (codes, scale, zero_point, *(t if t.numel() else None for t in tables))

    return untabled


def _quantize_triton(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    """The Triton kernel's codes with side tables of sizes known without reading the device
    (:func:`.reference.bounded_tables`): on a GPU the host never waits for the kernel here. The
    groups lost for want of room are marked for decoding as NaN (scale 0, the top code)."""
    codes, scale, zero_point, exact, const = triton_kernels().quantize(x, bits, group_size, seed)
    groups = reference.Groups.of(x, group_size)
    tables, lost = reference.bounded_tables(groups, exact, const, scale, like=x)
    zero_point = torch.where(lost, 2**bits - 1, zero_point)  # scale is 0 already
    return (codes, scale, zero_point, *tables)


def _decode_native(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    return native.decode(codes, bits, FIRST_LEVEL[bits], group_size, scale, zero_point, dtype)


def _decode_triton(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    return triton_kernels().decode(codes, scale, zero_point, bits, group_size, dtype)


#: Quantize implementations by codec (:func:`codec_for`).
_QUANTIZE_KERNELS: dict[str, Callable[[torch.Tensor, int, int, int | None], Quantized]] = {
    "native": _quantize_native,
    "triton": _quantize_triton,
    "torch": reference.quantize,
}
#: Decode implementations by codec: the levels of every group, ``(groups, group_size)``.
_DECODE_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "native": _decode_native,
    "triton": _decode_triton,
    "torch": reference.decode,
}


def quantize(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    """Codes, scale, zero point and side tables of flat contiguous ``x`` (see the package,
    :mod:`memopt_plugins.compress.codec`)."""
    return _QUANTIZE_KERNELS[_codec(x.device, x.dtype)](x, bits, group_size, seed)


#: :data:`_QUANTIZE_KERNELS` with ``None`` for each empty side table: what eager calls take.
_EAGER_KERNELS = {
    "native": _native_untabled,
    "triton": _untabled(_quantize_triton),
    "torch": _untabled(reference.quantize),
}


def quantizer(
    device: torch.device, dtype: torch.dtype
) -> Callable[[torch.Tensor, int, int, int | None], tuple[torch.Tensor | None, ...]]:
    """The implementation :func:`quantize` calls for a tensor on ``device`` of ``dtype``, taking
    a tensor of any layout (its elements in index order) and giving ``None`` for each empty side
    table: for an eager caller that calls it itself, one frame nearer the kernel (the eager pack
    path)."""
    return _EAGER_KERNELS[_codec(device, dtype)]


def quantize_bounded(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    """:func:`quantize` with side tables of the Triton kernels' fixed room
    (:func:`.reference.bounded_tables`): sizes known from ``x``'s size alone, what a compiled
    graph needs (data-dependent sizes broke the graph). Groups past the room are lost as on CUDA:
    decoded as NaN (scale 0, the top code)."""
    quantized = quantize(x, bits, group_size, seed)
    if _codec(x.device, x.dtype) == "triton":
        return quantized  # its tables have that room already
    codes, scale, zero_point, exact_index, _, const_index, _ = quantized
    groups = reference.Groups.of(x, group_size)
    exact, const = (_flags(index, len(groups)) for index in (exact_index, const_index))
    tables, lost = reference.bounded_tables(groups, exact, const, scale, like=x)
    scale = scale.masked_fill(lost, 0)
    zero_point = zero_point.masked_fill(lost, 2**bits - 1)
    return (codes, scale, zero_point, *tables)


def _flags(index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The groups at ``index`` as a bool per group."""
    flags = torch.zeros(n_groups, dtype=torch.bool, device=index.device)
    return flags.index_fill_(0, index, True)


#: The operator compiled graphs call: :func:`quantize_bounded`.
quantize_op = torch.library.custom_op("memopt::quantize", quantize_bounded, mutates_args=())


@quantize_op.register_fake
def _quantize_fake(x: torch.Tensor, bits: int, group_size: int, seed: int | None) -> Quantized:
    groups = -(-x.numel() // group_size)
    n_exact, n_const = reference.exact_slots(groups), reference.const_slots(groups)
    index = {"dtype": torch.int64}
    return (
        x.new_empty(-(-groups * group_size * bits // 8), dtype=torch.uint8),
        x.new_empty(groups, dtype=torch.bfloat16),
        x.new_empty(groups, dtype=torch.uint8),
        x.new_empty(n_exact, **index),
        x.new_empty(n_exact, group_size),
        x.new_empty(n_const, **index),
        x.new_empty(n_const),
    )


def native_in_graphs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether compiled graphs encode ``dtype`` tensors on ``device`` by the C kernel
    (:data:`graph_encode_op`); elsewhere they inline the traced encoder (:mod:`.traced`)."""
    return device.type == "cpu" and _codec(device, dtype) == "native"


def graph_encode(
    x: torch.Tensor, bits: int, group_size: int, seed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.traced.encode`'s codes, scale and zero point of ``x`` by the C kernel in one pass
    (:func:`.native.graph_encode`; ``seed`` an int64 scalar, read on the host)."""
    flat = x.contiguous().view(-1)
    seed_value = None if seed is None else int(seed)
    return native.graph_encode(flat, group_size, bits, FIRST_LEVEL[bits], seed_value)


#: The operator compiled graphs call where the C kernels serve (:func:`native_in_graphs`): opaque
#: to inductor, which otherwise generated and compiled the encoder's kernels for every tensor a
#: graph saves (compiled whole, most of the compile time memopt added).
graph_encode_op = torch.library.custom_op("memopt::graph_encode", graph_encode, mutates_args=())


@graph_encode_op.register_fake
def _graph_encode_fake(
    x: torch.Tensor, bits: int, group_size: int, seed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = -(-x.numel() // group_size)
    return (
        x.new_empty(groups * group_size * bits // 8, dtype=torch.uint8),
        x.new_empty(groups, dtype=torch.bfloat16),
        x.new_empty(groups, dtype=torch.uint8),
    )


#: Where compiled graphs draw their rounding seeds (:func:`graph_seed`), by key: held weakly
#: (a registry must not keep a dropped model's hooks alive), keys never reused (a graph compiled
#: for one model must not draw from another's).
_SEED_SOURCES: dict[int, Callable[[], Callable[[], int] | None]] = {}
_SOURCE_KEYS = itertools.count(1)


def add_seed_source(draw: Callable[[], int]) -> int:
    """Register ``draw`` (a host-side draw of one seed, held weakly: keep it alive) for
    :func:`graph_seed`; its key."""
    key = next(_SOURCE_KEYS)
    _SEED_SOURCES[key] = weakref.WeakMethod(draw) if inspect.ismethod(draw) else weakref.ref(draw)
    return key


def remove_seed_source(key: int) -> None:
    _SEED_SOURCES.pop(key, None)


def graph_seed(anchor: torch.Tensor, source: int) -> torch.Tensor:
    """A fresh seed for the rounding noise of one tensor a compiled graph saves, at every run
    of the graph: one draw of seed source ``source`` (the hooks' generator, on the host: never
    the global RNG, and no wait on the device), as an int64 scalar on ``anchor``'s device.
    ``anchor`` (a small tensor of the graph) places the call after it; its values are unread.
    A graph whose source was removed (memopt taken off) rounds with seed 0."""
    return torch.tensor(_drawn(source), dtype=torch.int64, device=anchor.device)


def _drawn(source: int) -> int:
    """One draw of seed source ``source``; 0 once it was removed."""
    ref = _SEED_SOURCES.get(source)
    draw = ref() if ref is not None else None
    return 0 if draw is None else draw()


def quantize_drawn(x: torch.Tensor, bits: int, group_size: int, source: int) -> Quantized:
    """:func:`quantize_bounded` with stochastic rounding at a seed drawn from seed source
    ``source`` when it runs: what a graph traced through
    :func:`~memopt_plugins.compress.codec.quantize` calls, so that the draw is neither a graph
    break nor a constant of the trace."""
    return quantize_bounded(x, bits, group_size, _drawn(source))


#: The operator compiled graphs call: opaque, and tagged as seeded noise, so that no pass of the
#: compiler folds it into a constant or merges two calls.
graph_seed_op = torch.library.custom_op(
    "memopt::graph_seed",
    graph_seed,
    mutates_args=(),
    tags=(torch.Tag.nondeterministic_seeded,),
)


@graph_seed_op.register_fake
def _graph_seed_fake(anchor: torch.Tensor, source: int) -> torch.Tensor:
    return anchor.new_empty((), dtype=torch.int64)


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    exact_index: torch.Tensor | None,
    exact_values: torch.Tensor | None,
    const_index: torch.Tensor | None,
    const_values: torch.Tensor | None,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``numel`` values (flat, contiguous, ``dtype``) that :func:`quantize` encoded."""
    decode = _DECODE_KERNELS[_codec(codes.device, dtype)]
    out = decode(codes, scale, zero_point, bits, group_size, dtype)
    reference.apply_tables(out, exact_index, exact_values, const_index, const_values)
    out = out.view(-1)
    return out if out.numel() == numel else out[:numel].clone()


def dequantize_into(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    exact_index: torch.Tensor | None,
    exact_values: torch.Tensor | None,
    const_index: torch.Tensor | None,
    const_values: torch.Tensor | None,
    bits: int,
    group_size: int,
    shape: torch.Size,
    stride: tuple[int, ...] | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """What :func:`quantize` encoded as a tensor of ``shape`` at ``stride`` (``None``:
    contiguous), eager: the C kernel decodes into that layout directly where it serves and no
    group is in a side table; elsewhere :func:`dequantize`'s values, copied into it where it is
    another."""
    untabled = exact_index is None and const_index is None
    if untabled and len(shape) <= native.MAX_DIMS and _codec(codes.device, dtype) == "native":
        out = (
            torch.empty(shape, dtype=dtype)
            if stride is None
            else torch.empty_strided(shape, stride, dtype=dtype)
        )
        first = FIRST_LEVEL[bits]
        return native.decode_into(codes, bits, first, group_size, scale, zero_point, out)
    tables = (exact_index, exact_values, const_index, const_values)
    flat = dequantize(codes, scale, zero_point, *tables, bits, group_size, math.prod(shape), dtype)
    return laid_out(flat.view(shape), stride)


def laid_out(out: torch.Tensor, stride: tuple[int, ...] | None) -> torch.Tensor:
    """``out`` itself where it has ``stride`` (``None``: any), else a copy with it."""
    if stride is None or out.stride() == stride:
        return out
    return torch.empty_strided(out.shape, stride, dtype=out.dtype, device=out.device).copy_(out)


#: The operator compiled graphs call; the same function as :func:`dequantize`.
dequantize_op = torch.library.custom_op("memopt::dequantize", dequantize, mutates_args=())


@dequantize_op.register_fake
def _dequantize_fake(codes: torch.Tensor, *tables_and_settings: object) -> torch.Tensor:
    *_, numel, dtype = tables_and_settings  # the last two arguments
    return codes.new_empty(numel, dtype=dtype)


#: The operator traced calls of the codec's ``quantize`` run: seeded noise, never folded.
quantize_drawn_op = torch.library.custom_op(
    "memopt::quantize_drawn",
    quantize_drawn,
    mutates_args=(),
    tags=(torch.Tag.nondeterministic_seeded,),
)


@quantize_drawn_op.register_fake
def _quantize_drawn_fake(x: torch.Tensor, bits: int, group_size: int, source: int) -> Quantized:
    return _quantize_fake(x, bits, group_size, None)
