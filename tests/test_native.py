"""The codec's fused CPU kernels: the same bytes as the torch path, thread-count independence,
the build cache, and the fallback to torch ops when they cannot be built."""

import os

import pytest
import torch

from memopt_plugins.compress.codec import (
    decode_mask,
    dequantize,
    encode_mask,
    native,
    ops,
    quantize,
)
from memopt_plugins.compress.codec.reference import FIRST_LEVEL, graph_params

BITS = (2, 4, 8)

pytestmark = pytest.mark.skipif(
    native.library() is None, reason="the codec kernels cannot be built here (no C compiler?)"
)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _adversarial(n: int, group_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with zeros, and groups that take every special path of the codec."""
    g = _generator(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(
        -3, 3, (1,), generator=g
    )
    x[torch.randint(n, (n // 50 + 1,), generator=g)] = 0.0
    specials = [
        lambda v: v.fill_(0.5),  # constant, exact by its codes
        lambda v: v.fill_(-3.0),
        lambda v: v.fill_(1e-30),  # constant the codes cannot express: side table
        lambda v: v.__setitem__(0, float("nan")),  # kept exactly
        lambda v: v.__setitem__(-1, float("inf")),
        lambda v: v.abs_(),  # one-signed groups
        lambda v: v.neg_().abs_().neg_(),
        lambda v: v.sign_().mul_(6.0e4),  # near float16's limit
        lambda v: v.fill_(1e-41),  # subnormal in float32
        lambda v: v.fill_(float("-inf")),
    ]
    for i, special in enumerate(specials):
        if (i + 1) * group_size <= n:
            special(x[i * group_size : (i + 1) * group_size])
    return x.to(dtype)


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same dtype, shape and bit pattern (NaN and signed zeros included)."""
    if a is None or b is None:
        return a is None and b is None
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    ("numel", "group_size"), [(40_000, 256), (12_345, 100), (3_001, 7), (9, 1), (5, 64)]
)
def test_kernels_write_the_same_bytes_as_the_torch_path(
    dtype: torch.dtype, bits: int, numel: int, group_size: int, monkeypatch
) -> None:
    x = _adversarial(numel, group_size, dtype, seed=numel + bits)
    fused = quantize(x, bits, group_size, stochastic=False)
    fused_decoded = dequantize(fused)
    monkeypatch.setitem(native._state, "lib", None)
    reference = quantize(x, bits, group_size, stochastic=False)
    for field in (
        "codes",
        "scale",
        "zero_point",
        "exact_index",
        "exact_values",
        "const_index",
        "const_values",
    ):
        assert _same_bits(getattr(fused, field), getattr(reference, field)), field
    assert _same_bits(fused_decoded, dequantize(fused))  # the torch decoder reads kernel output
    assert _same_bits(fused_decoded, dequantize(reference))


# Group extremes at the edges the parameters test: zeros of both signs, float32's and float16's
# subnormals, float16's rounding boundary to 0 (2^-25), float16's and float32's limits, Inf and
# NaN. (bfloat16's boundary, 2^-134, lies below every invertible step: no group reaches it.)
_EDGES = [
    0.0, -0.0, 1e-45, 1e-41, 2.0**-25, 2.0**-25 * (1 + 2**-23), 2.0**-24, 1e-30,
    0.5, 1.0, 3.0, 6.0e4, 65504.0, 7.0e4, 3.0e38, float("inf"), float("nan"),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", BITS)
def test_the_graph_encoder_writes_the_reference_parameters(dtype, bits) -> None:
    """``memopt_graph_encode``'s scale and zero point are the traced codec's (reference) bits
    for groups whose extremes are every pair of edges."""
    edges = torch.tensor(_EDGES)
    edges = torch.cat((edges, -edges))
    lo, hi = edges.repeat_interleave(len(edges)), edges.repeat(len(edges))
    g = _generator(bits)
    spread = 10.0 ** torch.randint(-40, 38, (5000,), generator=g).float()
    mn = torch.randn(5000, generator=g) * spread
    mx = mn + torch.rand(5000, generator=g) * spread
    mn = torch.cat((torch.minimum(lo, hi), mn, mx[:100]))  # every pair of edges; constants
    mx = torch.cat((torch.maximum(lo, hi), mx, mx[:100]))
    groups = torch.stack((mn, mx, mn, mx), 1).to(dtype)  # each pair a group of four
    kernel = native.graph_encode(groups.view(-1), 4, bits, FIRST_LEVEL[bits], None)[1:]
    expected = graph_params(groups[:, 0].float(), groups[:, 1].float(), bits, dtype)
    assert _same_bits(kernel[0], expected[0]) and _same_bits(kernel[1], expected[1])
    assert ((expected[0] == 0) & (expected[1] == 2**bits - 1)).any()  # lost groups are met


@pytest.mark.parametrize("stochastic", [False, True])
def test_kernels_give_the_same_result_on_any_number_of_threads(stochastic: bool) -> None:
    x = torch.randn(1001, 257, generator=_generator(30))  # 1005 groups, split between threads
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            p = quantize(x, 4, stochastic=stochastic, generator=_generator(31))
            results.append((p.codes, dequantize(p)))
    finally:
        torch.set_num_threads(threads)
    for codes, decoded in results[1:]:
        assert torch.equal(codes, results[0][0])
        assert torch.equal(decoded, results[0][1])


def _views(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Views that are not one contiguous run, as models save them."""
    g = _generator(50)
    qkv = _adversarial(2 * 33 * 3 * 4 * 24, 256, dtype, seed=51).view(2, 33, 3 * 4 * 24)
    heads = qkv.split(4 * 24, dim=-1)[1].view(2, 33, 4, 24).transpose(1, 2)  # SDPA's key
    return {
        "transposed": _adversarial(300 * 70, 256, dtype, seed=52).view(300, 70).t(),
        "permuted": torch.randn(3, 40, 5, 64, generator=g).to(dtype).permute(0, 2, 1, 3),
        "slice with gaps": heads,
        "size-1 dims": torch.randn(7, 1, 90, generator=g).to(dtype).transpose(0, 2),
        "expanded": torch.randn(1, 333, generator=g).to(dtype).expand(5, 333),
        "a column": torch.randn(999, 3, generator=g).to(dtype)[:, 1],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", [256, 100, 7])
@pytest.mark.parametrize("stochastic", [False, True])
def test_a_view_is_coded_where_it_lies_as_its_contiguous_copy_is(
    dtype: torch.dtype, bits: int, group_size: int, stochastic: bool
) -> None:
    # A view that is not one run (attention's heads, a transpose, a slice with gaps) is read in
    # its index order where it lies, and decoded into its own layout: the same bytes and values
    # as quantizing and decoding its contiguous copy, written where its strides place them.
    seed = 7 if stochastic else None
    for name, view in _views(dtype).items():
        assert not view.is_contiguous(), name
        flat = view.reshape(-1).contiguous()
        strided = native.quantize(view, group_size, bits, FIRST_LEVEL[bits], seed)
        copied = native.quantize(flat, group_size, bits, FIRST_LEVEL[bits], seed)
        for field in ("codes", "scale", "zero_point", "exact", "const"):
            assert _same_bits(getattr(strided, field), getattr(copied, field)), (name, field)
        args = (bits, FIRST_LEVEL[bits], group_size, copied.scale, copied.zero_point)
        levels = native.decode(copied.codes, *args, dtype).view(-1)[: view.numel()]
        out = torch.empty_strided(view.shape, view.stride(), dtype=dtype)
        if name in ("expanded", "a column", "slice with gaps"):  # gaps or overlaps: dense
            out = torch.empty(view.shape, dtype=dtype).transpose(0, -1).contiguous()
            out = out.transpose(0, -1)
        assert native.decode_into(copied.codes, *args, out) is out
        assert _same_bits(out.reshape(-1), levels), name


def test_a_view_of_more_dims_than_the_kernels_walk_is_coded_through_its_copy() -> None:
    shape = (2,) * (native.MAX_DIMS + 1)
    view = torch.randn(shape, generator=_generator(54)).transpose(0, -1)
    p = quantize(view, 8, stochastic=False)
    copied = quantize(view.contiguous(), 8, stochastic=False)
    assert torch.equal(p.codes, copied.codes)
    decoded = dequantize(p, view.stride())
    assert decoded.stride() == view.stride() and torch.equal(decoded, dequantize(copied))


def test_views_are_coded_without_a_copy_of_their_own() -> None:
    # The eager codec makes no full-size copy of a view it codes or of what it decodes into a
    # view's layout: no clone, contiguous or copy_ of the tensor's size on the way.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_):
                self.seen.append(str(func))
            return out

    view = torch.randn(4, 256, 6, 64, generator=_generator(53)).transpose(1, 2)  # (B, H, T, D)
    with Copies() as mode:
        for stochastic in (False, True):
            p = quantize(view, 4, stochastic=stochastic)
            decoded = dequantize(p, view.stride())
    assert mode.seen == []
    assert decoded.stride() == view.stride()
    assert torch.equal(decoded, dequantize(p).view(view.shape))


#: The kernels' intrinsics paths: the CPU flags each needs, and the compiler flag that builds the
#: path below it instead.
SIMD_PATHS = {
    "avx512": ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, "-mno-avx512f"),
    "avx2": ({"avx2", "fma"}, "-mno-avx2"),
}


def _kernel_bytes(x: torch.Tensor, group_size: int) -> list[torch.Tensor | None]:
    """Everything quantize and dequantize write for x, at every width, nearest and stochastic."""
    out = []
    for bits in BITS:
        for stochastic in (False, True):
            p = quantize(x, bits, group_size, stochastic=stochastic, generator=_generator(34))
            out += [p.codes, p.scale, p.zero_point, p.exact_index, p.const_index, dequantize(p)]
            if not x.is_contiguous():  # decoded into the view's own layout too
                out.append(dequantize(p, x.stride()))
    return out


@pytest.mark.parametrize("path", SIMD_PATHS)
def test_the_portable_kernels_write_the_same_bytes(path, tmp_path, monkeypatch) -> None:
    # Where the CPU has AVX-512 or AVX2, the kernels run intrinsics (group extremes, rounding,
    # noise, packing, decoding); built without them, the next path down does (down to the plain
    # C loops). Every path must write the same bytes (codes, parameters, decoded values), nearest
    # and stochastic, for float32 and bfloat16 groups read in place and float16 ones converted,
    # also on groups that are not a whole number of vectors (the intrinsics' tails) or that
    # start inside a byte or on an odd element (group size 7).
    needs, without = SIMD_PATHS[path]
    if not needs <= set(native._cpu_identity().split()):
        pytest.skip(f"no {path} here: both builds would run the same loops")
    x = _adversarial(40_000, 256, torch.float32, seed=33)
    odd = _adversarial(4_000, 100, torch.float32, seed=35)
    inputs = [
        (x, 256),
        (odd, 100),
        (x.bfloat16(), 256),
        (odd.bfloat16(), 100),
        (odd.half(), 100),
        (_adversarial(3_001, 7, torch.bfloat16, seed=36), 7),
        (x.view(200, 200).t(), 256),  # read where it lies, a run of one element at a time
        (x.bfloat16().view(10, 20, 200).transpose(0, 1), 100),  # runs of a whole last dim
    ]
    masks = [m for kind, m in _masks(torch.float32) + _masks(torch.bfloat16) if kind == "mask"]
    compiler = os.environ.get("CC", "cc")
    built = {}
    for flags in ("", without):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / (flags or "native")))
        monkeypatch.setenv("CC", f"{compiler} {flags}")
        monkeypatch.setattr(native, "_state", {})
        assert native.library() is not None
        built[flags] = [field for t, size in inputs for field in _kernel_bytes(t, size)]
        built[flags] += [
            f for m in masks for f in (encode_mask(m).bits, decode_mask(encode_mask(m)))
        ]
    for simd, portable in zip(built[""], built[without], strict=True):
        assert _same_bits(simd, portable)


def _masks(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Tensors of +0.0 and one other value ("mask") and near misses ("other"), at sizes around
    the kernels' vector tails and beyond one thread's range."""
    out = []
    for n in (1, 9, 33, 513, 100_003, 600_000):
        g = _generator(n)
        keep = torch.rand(n, generator=g) > 0.1
        mask = keep.to(dtype) / 0.9  # dropout's on the CPU
        out += [
            ("mask", mask),
            ("mask", torch.where(keep, float("-inf"), 0.0).to(dtype)),
            ("mask", torch.where(keep, -3.0, 0.0).to(dtype)),
            ("mask", torch.zeros(n, dtype=dtype)),
            ("mask", torch.full((n,), 0.25, dtype=dtype)),
        ]
        if n > 1:
            signed = mask.clone()
            signed[n // 2] = -0.0  # a zero of the other sign: another bit pattern
            second = mask.clone()
            second[-1] = 2.0
            out += [("other", signed), ("other", second), ("other", torch.randn(n, generator=g))]
    return [(kind, t.to(dtype)) for kind, t in out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_masks_are_kept_bit_for_bit_by_both_implementations(dtype, monkeypatch) -> None:
    # A tensor of +0.0 and one other value (dropout's mask on the CPU) is kept as a bit an
    # element that decodes to it bit for bit; the C kernel (on one thread and on several) and
    # the torch ops write the same bits, and each decodes the other's. Anything else -- -0.0
    # among the zeros, a second value, an activation -- is no mask.
    threads = torch.get_num_threads()
    for kind, x in _masks(dtype):
        made = {}
        for codec, split in (("auto", 1), ("auto", 2), ("torch", 1)):
            monkeypatch.setattr(ops, "REQUESTED", codec)
            torch.set_num_threads(split)
            try:
                made[codec, split] = encode_mask(x)
            finally:
                torch.set_num_threads(threads)
        if kind == "other":
            assert all(m is None for m in made.values()), (kind, x.numel())
            continue
        first = made["auto", 1]
        assert first.nbytes <= -(-x.numel() // 8) + x.element_size()
        for m in made.values():
            assert torch.equal(m.bits, first.bits) and _same_bits(m.value, first.value)
            for codec in ("auto", "torch"):
                monkeypatch.setattr(ops, "REQUESTED", codec)
                out = decode_mask(m)
                assert out.shape == x.shape and _same_bits(out.view(-1), x.view(-1))


def test_kernels_are_built_once_into_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is not None
    built = list((tmp_path / "memopt_plugins").glob("kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is not None  # loaded from the cache, not rebuilt
    assert built[0].stat().st_mtime_ns == stamp
    assert list((tmp_path / "memopt_plugins").iterdir()) == built  # no temporary file left


def test_without_kernels_the_codec_falls_back_to_torch(tmp_path, monkeypatch, caplog) -> None:
    x = torch.randn(5000, generator=_generator(32))
    expected = quantize(x, 8, stochastic=False).codes
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    monkeypatch.setattr(native, "_state", {})
    with caplog.at_level("WARNING", logger="memopt"):
        assert torch.equal(quantize(x, 8, stochastic=False).codes, expected)
    assert native.library() is None
    assert "building the codec kernels failed" in caplog.text
    monkeypatch.delenv("CC")
    monkeypatch.setenv("MEMOPT_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is None
    assert torch.equal(quantize(x, 8, stochastic=False).codes, expected)


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping holding ``address`` in ``/proc/self/smaps``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: its address range
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


HUGE_PAGE = 1 << 21


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="no transparent huge pages (not Linux, or a kernel built without them)",
)
def test_large_outputs_ask_for_huge_pages() -> None:
    # A fresh output costs a page fault per 4 KiB on first touch, more than writing the page:
    # the kernels advise the 2 MiB-aligned interior of what they write (codes, decoded values)
    # for transparent huge pages (madvise's "hg" flag).
    x = torch.randn(8 << 20, generator=_generator(40))  # 32 MiB; its int8 codes 8 MiB
    p = quantize(x, 8, stochastic=False)
    decoded = dequantize(p)
    for out in (p.codes, decoded):
        interior = (out.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        assert "hg" in _vm_flags(interior)
    assert torch.equal(decoded, dequantize(p))  # where the pages come from, nothing else
