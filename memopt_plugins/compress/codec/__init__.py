"""Activation codec: group-wise integer quantization of floating tensors.

:func:`quantize` turns a floating tensor into a :class:`PackedTensor`: codes of 8, 4 or 2 bits
packed into ``uint8``, a bfloat16 scale and a ``uint8`` zero point per group of ``group_size``
elements (:func:`packed_nbytes` states the cost); :func:`dequantize` restores shape and dtype. An
exact zero decodes to zero and a nonzero value keeps its sign (backward reads sign patterns, e.g.
ReLU's); stochastic rounding is unbiased except within :data:`FIRST_LEVEL` of a step of zero, and
draws from private generators, never the global RNG; constant groups decode exactly and NaN/Inf
groups are kept exactly. Integer tensors are narrowed losslessly (:mod:`memopt_plugins.packing`),
a tensor of +0.0 and one other value (a dropout mask) kept as bits (:func:`encode_mask`).

The layers, each importing only those below: this façade (plus dropout's 1-bit masks),
:mod:`.ops` (the PyTorch operators and the choice of implementation, ``MEMOPT_CODEC``),
:mod:`.reference` (the specification), :mod:`.native` (C, CPU), :mod:`.triton_kernels` (CUDA) and
:mod:`.traced` (inside compiled graphs). docs/cuda-codec.md describes them.
"""

from __future__ import annotations

import base64
import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ...packing import pack_bits, unpack_bits
from . import native, ops
from .reference import FLOAT_DTYPES, SUPPORTED_BITS

_GENERATOR_SEED = 0x6D656D6F  # of codec_generator: fixed; "memo" in ASCII
_GENERATORS: dict[torch.device, torch.Generator] = {}


def tensor_nbytes(x: torch.Tensor) -> int:
    """Bytes of the elements of ``x`` (numel × element size)."""
    return x.numel() * x.element_size()


def _optional_nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(tensor_nbytes(t) for t in tensors if t is not None)


@dataclass(frozen=True, slots=True)
class PackedTensor:
    """A quantized tensor: compact tensors only, nothing full-size in full precision.

    Attributes:
        codes: ``uint8``, bit-packed codes of all groups (padding included), ``8 // bits`` per byte.
        scale: ``bfloat16`` step size per group (0 for an all-zero group).
        zero_point: ``uint8`` code that decodes to exactly 0, per group.
        exact_index: ``int64`` indices of the groups kept exactly (NaN/Inf or unrepresentable
            range), or ``None``; from the Triton kernels and in compiled graphs a number of
            entries fixed by the size (:func:`.reference.exact_slots`), the unused ones past the
            last group (the same for ``const_index``).
        exact_values: those groups' values in the original dtype, ``(k, group_size)``, or ``None``.
        const_index: ``int64`` indices of constant groups whose value the codes cannot express
            exactly (e.g. ``1e-30``, ``inf``), or ``None``.
        const_values: one value per such group in the original dtype, or ``None``.
        shape, dtype: of the original tensor.
        bits, group_size: codec settings.
        numel: number of elements of the original tensor (the codes carry padding after it).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    exact_index: torch.Tensor | None
    exact_values: torch.Tensor | None
    const_index: torch.Tensor | None
    const_values: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors inside."""
        return _optional_nbytes(
            self.codes,
            self.scale,
            self.zero_point,
            self.exact_index,
            self.exact_values,
            self.const_index,
            self.const_values,
        )


def packed_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes that :func:`quantize` stores for ``numel`` elements at ``bits`` per element.

    The codes of whole groups (a partial last group is padded to ``group_size``), ``8 // bits`` per
    byte, plus 3 bytes per group: the bfloat16 scale and the ``uint8`` zero point. This is
    ``quantize(x, bits, group_size).nbytes`` for any ``x`` of ``numel`` elements without groups
    kept exactly (NaN/Inf or an unrepresentable range) or constant groups kept as one value (on
    CUDA and in compiled graphs the side tables' fixed room comes on top,
    :func:`.reference.exact_slots`); the single source of truth for estimates of the codec's cost.
    """
    _check_settings(bits, group_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel!r}")
    groups = -(-numel // group_size)
    return -(-groups * group_size * bits // 8) + 3 * groups


def codec_generator(device: torch.device | str) -> torch.Generator:
    """The private generator that stochastic rounding uses on ``device`` when :func:`quantize` is
    given none (a direct call; the engine's hooks pass their :class:`NoiseGenerators`).

    Created on first use and seeded with a fixed constant; the global RNG is never touched. It
    lives on the host whatever ``device`` is (:func:`draw_seed` then never waits for a GPU).
    Callers that must replay a computation exactly can save and restore its state
    (``get_state`` / ``set_state``).
    """
    device = _indexed(device)
    generator = _GENERATORS.get(device)
    if generator is None:
        generator = torch.Generator()
        generator.manual_seed(_GENERATOR_SEED)
        _GENERATORS[device] = generator
    return generator


class NoiseGenerators:
    """Per-device generators of stochastic-rounding noise, all seeded with ``seed``.

    Each is created, seeded, on the first tensor packed on its device, so the same seed gives the
    same noise whatever else ran in the process; the global RNG is never drawn from. They are
    host generators for every device: a tensor's noise is decided by one seed (:func:`draw_seed`),
    and drawing it from a CUDA generator would make the host wait for the device at every saved
    tensor.
    """

    def __init__(self, seed: int | Callable[[], int]):
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def seed(self) -> int:
        """The seed; given as a function, it is called once, at the first draw (a seed mixed
        with the rank is read when training runs, after the process group was created)."""
        if callable(self._seed):
            self._seed = int(self._seed())
        return self._seed

    def __call__(self, device: torch.device | str) -> torch.Generator:
        """The generator of ``device`` (a device without an index: the current one)."""
        device = _indexed(device)
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator

    def state_dict(self) -> dict[str, object]:
        """The seed and each generator's state, in plain Python types (JSON-safe: a checkpoint
        resumed from it rounds with the noise the run would have drawn next)."""
        return {
            "seed": self.seed,
            "generators": {
                str(d): base64.b64encode(g.get_state().numpy().tobytes()).decode("ascii")
                for d, g in self._generators.items()
            },
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._seed = int(state["seed"])
        self._generators = {}
        for device, encoded in dict(state.get("generators", {})).items():
            generator = torch.Generator()
            raw = bytearray(base64.b64decode(encoded))
            generator.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
            self._generators[torch.device(device)] = generator


def _indexed(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    return device


def _check_settings(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")


def _check_args(x: torch.Tensor, bits: int, group_size: int) -> None:
    _check_settings(bits, group_size)
    if x.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"quantize takes a floating tensor ({allowed}), got {x.dtype}")


def draw_seed(generator: torch.Generator) -> int:
    """One draw from ``generator``: the seed of one tensor's rounding noise (no device sync with
    the host generators of :class:`NoiseGenerators` and :func:`codec_generator`)."""
    return int(torch.randint(2**62, (), generator=generator, device=generator.device))


#: The seed source (:func:`.ops.add_seed_source`) of each generator traced calls draw from,
#: and of each device's :func:`codec_generator`; a source holds its generator weakly.
_SOURCES: weakref.WeakKeyDictionary[torch.Generator, tuple[int, Callable[[], int]]] = (
    weakref.WeakKeyDictionary()
)
_DEVICE_SOURCES: dict[torch.device, tuple[int, Callable[[], int]]] = {}


@torch._dynamo.assume_constant_result
def _seed_source(generator: torch.Generator | None, device: torch.device) -> int:
    """The key of the seed source drawing from ``generator`` (``None``: ``device``'s
    :func:`codec_generator`), run at trace time: a constant of the graph, whose runs each draw
    afresh. The generator is never made or read while tracing."""
    if generator is None:
        found = _DEVICE_SOURCES.get(device)
        if found is None:

            def draw() -> int:
                return draw_seed(codec_generator(device))

            found = _DEVICE_SOURCES[device] = (ops.add_seed_source(draw), draw)
        return found[0]
    found = _SOURCES.get(generator)
    if found is None:
        ref = weakref.ref(generator)

        def draw() -> int:
            alive = ref()
            return 0 if alive is None else draw_seed(alive)

        found = _SOURCES[generator] = (ops.add_seed_source(draw), draw)
    return found[0]


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int = 256,
    stochastic: bool = True,
    generator: torch.Generator | None = None,
) -> PackedTensor:
    """Quantize ``x`` to ``bits`` (2, 4 or 8) per element in groups of ``group_size`` elements.

    Args:
        x: a float32, bfloat16, float16 or float64 tensor of any shape and layout.
        bits: code width; 8 → one code per byte, 4 → two, 2 → four.
        group_size: consecutive elements (in row-major order) sharing a scale and zero point.
        stochastic: unbiased stochastic rounding if true, round to nearest otherwise.
        generator: source of the rounding noise (one seed is drawn from it per call); by default
            a private per-device generator (see :func:`codec_generator`), so the global RNG
            stream is left untouched.

    Returns:
        A :class:`PackedTensor` that references neither ``x`` nor any full-precision copy of it.
    """
    _check_args(x, bits, group_size)
    if not torch.compiler.is_compiling():
        seed = None
        if stochastic:
            seed = draw_seed(generator if generator is not None else codec_generator(x.device))
        kernel = ops.quantizer(x.device, x.dtype)  # no dispatching frame; None: no table
        # any layout: the C kernel reads a view where it lies, in index order (no copy first)
        codes, scale, zero_point, *tables = kernel(x.detach(), bits, group_size, seed)
    else:
        flat = x.detach().reshape(-1).contiguous()
        if stochastic:  # traced: the seed is drawn when the graph runs, inside the operator
            source = _seed_source(generator, _indexed(x.device))
            quantized = ops.quantize_drawn_op(flat, bits, group_size, source)
        else:
            quantized = ops.quantize_op(flat, bits, group_size, None)
        codes, scale, zero_point, *tables = quantized
    exact_index, exact_values, const_index, const_values = tables
    return PackedTensor(
        codes=codes,
        scale=scale,
        zero_point=zero_point,
        exact_index=exact_index,
        exact_values=exact_values,
        const_index=const_index,
        const_values=const_values if const_index is not None else None,
        shape=x.shape,
        dtype=x.dtype,
        bits=bits,
        group_size=group_size,
        numel=x.numel(),
    )


def dequantize(p: PackedTensor, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """Decode ``p`` to a tensor of its original shape and dtype: contiguous, or at ``stride``
    (its elements in index order where the strides place them; decoded in place there by the C
    kernels, copied into it elsewhere).

    Nothing in ``p`` requires gradients, so neither does the result (no ``no_grad`` needed).
    """
    tables = (p.exact_index, p.exact_values, p.const_index, p.const_values)
    if not torch.compiler.is_compiling():
        settings = (p.bits, p.group_size, p.shape, stride, p.dtype)
        return ops.dequantize_into(p.codes, p.scale, p.zero_point, *tables, *settings)
    out = ops.dequantize_op(
        p.codes, p.scale, p.zero_point, *tables, p.bits, p.group_size, p.numel, p.dtype
    )
    return ops.laid_out(out.view(p.shape), stride)


#: The integer type of each mask dtype's width: its elements compared bit for bit.
_PATTERNS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass(frozen=True, slots=True)
class MaskTensor:
    """A tensor of +0.0 and one other value, exactly: a bit an element (low bits first), set
    where the element is ``value`` (a 0-dim tensor of ``dtype``)."""

    bits: torch.Tensor
    value: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return mask_nbytes(math.prod(self.shape), self.value.element_size())


def mask_nbytes(numel: int, element_size: int) -> int:
    """Bytes of a :class:`MaskTensor` of ``numel`` elements of ``element_size`` bytes."""
    return -(-numel // 8) + element_size


def encode_mask(x: torch.Tensor) -> MaskTensor | None:
    """``x`` as a :class:`MaskTensor` where it is one: a contiguous CPU tensor (float32,
    bfloat16 or float16) whose elements are all +0.0 or one other value, compared bit for bit
    (-0.0 is another value), so that :func:`decode_mask` gives ``x`` back to the bit. A dropout
    mask on the CPU is one (0 and ``1 / (1 - p)``): exact in a bit where :func:`quantize` would
    round ``1 / (1 - p)`` to neighbouring levels. ``None`` for anything else, found at its
    first element that is neither (at once for an activation)."""
    pattern = _PATTERNS.get(x.dtype)
    if pattern is None or x.device.type != "cpu" or not x.is_contiguous() or not x.numel():
        return None
    if ops.codec_for(x.device) == "native":
        packed = native.mask_pack(x)
        if packed is None:
            return None
        bits, value = packed
        value = torch.tensor(value, dtype=torch.int64).to(pattern).view(x.dtype)
    else:  # the same bits in torch ops
        ints = x.detach().reshape(-1).view(pattern)
        low, high = (int(v) for v in torch.aminmax(ints))
        if low and high and low != high:  # two values, neither +0.0
            return None
        value = torch.tensor(low or high, dtype=pattern)
        if not bool(((ints == 0) | (ints == value)).all()):
            return None
        bits, value = pack_bits(ints == value, 1), value.view(x.dtype)
    return MaskTensor(bits, value, x.shape, x.dtype)


def decode_mask(m: MaskTensor) -> torch.Tensor:
    """The contiguous tensor :func:`encode_mask` was given."""
    if ops.codec_for(m.bits.device) == "native":
        pattern = int(m.value.view(_PATTERNS[m.dtype])) & ((1 << 8 * m.value.element_size()) - 1)
        return native.mask_unpack(m.bits, pattern, torch.empty(m.shape, dtype=m.dtype))
    set_ = unpack_bits(m.bits, 1, math.prod(m.shape)).view(m.shape).bool()
    return torch.where(set_, m.value, torch.zeros((), dtype=m.dtype))


def _triton_masks(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels pack and unpack masks of ``dtype`` on ``device``: where they
    serve the codec (``MEMOPT_CODEC``, :func:`.ops.codec_for`), for floating masks; the torch ops
    of :mod:`memopt_plugins.packing` elsewhere, with the same bits."""
    return dtype.is_floating_point and ops.codec_for(device) == "triton"


def pack_mask(noise: torch.Tensor) -> torch.Tensor:
    """A 0/1 tensor of any dtype (a dropout mask) as ``uint8`` bits, 8 elements per byte, in
    row-major order."""
    if _triton_masks(noise.device, noise.dtype):
        return ops.triton_kernels().pack_mask(noise)
    return pack_bits(noise.to(torch.uint8).reshape(-1), 1)


def unpack_mask(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: a contiguous 0/1 tensor of ``shape`` and ``dtype``."""
    if _triton_masks(packed.device, dtype):
        return ops.triton_kernels().unpack_mask(packed, math.prod(shape), dtype).view(shape)
    return unpack_bits(packed, 1, math.prod(shape)).view(shape).to(dtype)
