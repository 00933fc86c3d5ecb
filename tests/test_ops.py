"""The codec's PyTorch operators: schema, fake (meta) implementations, traceable by compile; and
the choice of implementation (``MEMOPT_CODEC``)."""

from __future__ import annotations

import sys

import pytest
import torch

from memopt_plugins.compress import codec
from memopt_plugins.compress.codec import dequantize, native, ops, quantize, reference
from memopt_plugins.compress.codec.ops import dequantize_op, quantize_op

NUMEL = 1000  # three whole groups of 256 and a partial one


def _input(dtype: torch.dtype, special: bool) -> torch.Tensor:
    x = torch.randn(NUMEL).to(dtype)
    if special:  # a group kept exactly (Inf; NaN would not compare equal) and a constant one the
        x[10] = float("inf")  # codes cannot express
        x[256:512] = 1e-30 if dtype != torch.bfloat16 else 1e-38
    return x


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_and_dequantize_pass_opcheck(bits, dtype, special):
    x = _input(dtype, special)
    for seed in (None, 7):
        torch.library.opcheck(quantize_op, (x, bits, 256, seed))
    packed = quantize_op(x, bits, 256, None)
    torch.library.opcheck(dequantize_op, (*packed, bits, 256, NUMEL, dtype))


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_encode_passes_opcheck(dtype, bits):
    x = _input(dtype, special=True)
    for seed in (None, torch.tensor(7)):
        torch.library.opcheck(ops.graph_encode_op, (x, bits, 256, seed))


def test_the_seed_is_the_only_source_of_rounding_noise():
    x = torch.randn(NUMEL)
    a, b = quantize_op(x, 4, 256, 11), quantize_op(x, 4, 256, 11)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    other = quantize_op(x, 4, 256, 12)
    assert not torch.equal(a[0], other[0])


@pytest.mark.parametrize("special", [False, True])
def test_a_compiled_round_trip_equals_the_eager_one(special):
    x = _input(torch.float32, special)

    def round_trip(t: torch.Tensor) -> torch.Tensor:
        return dequantize_op(*quantize_op(t, 8, 256, None), 8, 256, t.numel(), t.dtype)

    compiled = torch.compile(round_trip, fullgraph=True, backend="inductor")
    eager = dequantize(quantize(x, 8, group_size=256, stochastic=False))
    assert torch.equal(compiled(x), eager)


# --------------------------------------------------------------------------- MEMOPT_CODEC

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_a_bad_codec_name_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "cuda")
    with pytest.raises(ValueError, match=r"auto, torch, native, triton; got 'cuda'"):
        quantize(torch.randn(NUMEL), 8)


def test_auto_takes_the_c_kernels_on_cpu_and_triton_on_cuda_where_available(monkeypatch):
    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "auto")
    monkeypatch.setitem(native._state, "lib", object())  # the C kernels, built
    monkeypatch.setattr(ops, "_triton", {"module": object()})  # triton, imported
    assert (ops.codec_for(CPU), ops.codec_for(CUDA)) == ("native", "triton")
    assert ops.codec_for(torch.device("meta")) == "torch"
    monkeypatch.setitem(native._state, "lib", None)  # MEMOPT_NATIVE=0, or no compiler
    monkeypatch.setattr(ops, "_triton", {"module": None, "error": ImportError("no triton")})
    assert (ops.codec_for(CPU), ops.codec_for(CUDA)) == ("torch", "torch")


def test_torch_runs_the_reference_even_where_the_kernels_are_built(monkeypatch):
    def fail(*args):
        raise AssertionError("a C kernel ran")

    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "torch")
    monkeypatch.setattr(native, "quantize", fail)
    monkeypatch.setattr(native, "decode", fail)
    x = _input(torch.float32, special=True)
    packed = quantize(x, 4, group_size=256, stochastic=False)
    expected = reference.quantize(x, 4, 256, None)
    assert torch.equal(packed.codes, expected[0]) and torch.equal(packed.scale, expected[1])
    assert torch.equal(dequantize(packed).isinf(), x.isinf())


def test_native_is_an_error_off_the_cpu_or_without_the_kernels(monkeypatch):
    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "native")
    with pytest.raises(RuntimeError, match="CPU tensors only, got one on cuda"):
        ops.codec_for(CUDA)
    monkeypatch.setitem(native._state, "lib", None)
    with pytest.raises(RuntimeError, match="C kernels are not available"):
        quantize(torch.randn(NUMEL), 8)


def test_triton_is_an_error_when_triton_cannot_be_imported(monkeypatch, caplog):
    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "triton")
    monkeypatch.setattr(ops, "_triton", {})
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    monkeypatch.delitem(sys.modules, "memopt_plugins.compress.codec.triton_kernels", raising=False)
    monkeypatch.delattr(codec, "triton_kernels", raising=False)
    with pytest.raises(
        RuntimeError, match=r"Triton kernels cannot be imported .*pip install triton"
    ):
        with caplog.at_level("WARNING", logger="memopt"):
            quantize(torch.randn(NUMEL), 8)
    assert caplog.text.count("on CUDA the codec runs as torch ops") == 1
    monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "auto")
    assert ops.codec_for(CUDA) == "torch"  # auto: the reference, no error
    assert caplog.text.count("on CUDA the codec runs as torch ops") == 1  # said once
