"""The Triton kernels, run on the CPU by Triton's interpreter: the torch reference's bytes at
round-to-nearest, unbiased stochastic rounding from the seed, dropout masks bit for bit; and a
compile of the kernels for a CUDA GPU (no GPU needed) that checks what byte equality rests on.

Triton reads ``TRITON_INTERPRET`` when it is imported (its own library functions are
``triton.jit`` functions too), and importing memopt already imports it (``torch._dynamo`` does),
so the interpreter cannot be switched on inside a test process that has not started with it.
Collected in the suite, this module runs its kernel tests in a child pytest started with
``TRITON_INTERPRET=1`` (one test here; the child's report is its failure message). Run directly
as ``TRITON_INTERPRET=1 pytest tests/test_triton.py``, it runs them in process, each with
``MEMOPT_CODEC=triton``. The interpreter is slow: the tensors are small.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from test_native import _adversarial, _same_bits  # noqa: E402

from memopt_plugins import dropout  # noqa: E402
from memopt_plugins.compress import codec  # noqa: E402
from memopt_plugins.compress.codec import ops, reference  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# numpy, under the interpreter, warns about the NaN/Inf of groups kept exactly (as torch would not).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("codes", "scale", "zero_point", "exact_index", "exact_values", "const_index")
FIELDS += ("const_values",)


def _python(*args: str, **env: str) -> subprocess.CompletedProcess:
    """A child Python in the repository root: this environment without ``TRITON_INTERPRET``,
    plus ``env``."""
    child = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=child, capture_output=True, text=True, timeout=600
    )


_COMPILE_FOR_A_GPU = textwrap.dedent(
    r"""
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from memopt_plugins.compress.codec import triton_kernels as tc

    def ptx(fn, constexprs, **pointers):
        signature = {
            n: "constexpr" if n in constexprs else pointers.get(n, "i64") for n in fn.arg_names
        }
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        target = GPUTarget("cuda", 90, 32)
        options = {"enable_fp_fusion": False}
        return triton.compile(source, target=target, options=options).asm["ptx"]

    codes = {"codes_ptr": "*u8", "scale_ptr": "*i16", "zero_point_ptr": "*u8"}
    quantize = {"flags_ptr": "*u8", "dtype_max": "fp32", "half_least": "fp32", **codes}
    tile = {"GROUPS": 8, "BYTE_COLS": 128, "PER_BYTE": 2}
    straddling = {"GROUPS": 16, "BYTE_COLS": 128, "PER_BYTE": 1}  # group_size 100 at 2 bits
    code = "".join([
        ptx(tc._quantize_kernel, dict(BITS=4, FIRST=0.0625, DTYPE=1, STOCHASTIC=True, **tile),
            x_ptr="*i16", **quantize),
        ptx(tc._quantize_kernel, dict(BITS=2, FIRST=1.0, DTYPE=2, STOCHASTIC=False, **straddling),
            x_ptr="*fp16", **quantize),
        ptx(tc._decode_kernel, dict(FIRST=0.0625, DTYPE=1, LANE_BITS=4, **tile),
            out_ptr="*i16", **codes),
        ptx(tc._decode_kernel, dict(FIRST=1.0, DTYPE=2, LANE_BITS=8, **straddling),
            out_ptr="*fp16", **codes),
        ptx(tc._pack_mask_kernel, dict(MAGNITUDE=2**31 - 1, BYTES=512), noise_ptr="*i32",
            packed_ptr="*u8"),
        ptx(tc._unpack_mask_kernel, dict(ONE=0x3F80, BLOCK=4096), packed_ptr="*u8",
            out_ptr="*i16"),
    ])
    print(len(re.findall(r"div\.rn\.f32", code)), len(re.findall(r"div\.(full|approx)", code)),
          len(re.findall(r"\bfma\.", code)))
    """
)


if not INTERPRETED:  # the suite's process

    def test_the_kernel_tests_pass_under_the_interpreter() -> None:
        done = _python(
            "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, TRITON_INTERPRET="1"
        )
        report = done.stdout[-8000:] + done.stderr[-2000:]
        assert done.returncode == 0, report
        assert " passed" in done.stdout and "skipped" not in done.stdout, report

    def test_cpu_tensors_are_an_error_without_the_interpreter(monkeypatch) -> None:
        monkeypatch.setenv("MEMOPT_CODEC", "triton")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            ops.quantize(torch.randn(300), 8, 256, None)

    def test_the_interpreter_switched_on_too_late_is_a_clear_error(monkeypatch) -> None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton is imported already, compiled
        monkeypatch.setenv("MEMOPT_CODEC", "triton")
        monkeypatch.setattr(ops, "_triton", {})
        monkeypatch.delitem(
            sys.modules, "memopt_plugins.compress.codec.triton_kernels", raising=False
        )
        monkeypatch.delattr(codec, "triton_kernels", raising=False)
        with pytest.raises(RuntimeError, match="before the process imports triton"):
            ops.quantize(torch.randn(300), 8, 256, None)

    def test_the_kernels_compile_for_a_cuda_gpu_with_ieee_division_and_no_fma() -> None:
        # Byte equality with the reference rests on divisions rounded to nearest and on no
        # multiply-add contracted into an FMA: look for both in the PTX for an H100 (sm_90).
        done = _python("-c", _COMPILE_FOR_A_GPU)
        assert done.returncode == 0, done.stderr[-4000:]
        rounded, approximate, fused = map(int, done.stdout.split())
        assert rounded > 0 and approximate == 0 and fused == 0


else:  # the child run (or TRITON_INTERPRET=1 pytest tests/test_triton.py)

    @pytest.fixture
    def kernels(monkeypatch):
        """The Triton kernels module, serving every codec call (``MEMOPT_CODEC=triton``)."""
        monkeypatch.setenv("MEMOPT_CODEC", "triton")
        assert ops.codec_for(torch.device("cpu")) == "triton"
        return ops.triton_kernels()

    def _quantized(x: torch.Tensor, bits: int, group_size: int, seed: int | None = None) -> dict:
        """The operator's outputs by field; empty side tables as ``None``, as ``PackedTensor`` has
        them."""
        out = ops.quantize(x, bits, group_size, seed)
        return {
            f: t if t.numel() or f in FIELDS[:3] else None for f, t in zip(FIELDS, out, strict=True)
        }

    def _decoded(
        q: dict, bits: int, group_size: int, numel: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return ops.dequantize(*q.values(), bits, group_size, numel, dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("bits", [2, 4, 8])
    @pytest.mark.parametrize(
        ("numel", "group_size"),
        [(2_600, 256), (1_001, 100), (3_001, 7), (9, 1)],  # ragged; odd sizes: bytes across groups
    )
    def test_kernels_write_the_reference_bytes_at_nearest_rounding(
        kernels, dtype: torch.dtype, bits: int, numel: int, group_size: int, monkeypatch
    ) -> None:
        # Zeros, constants (exact by their codes, or in the side table), NaN/Inf, one-signed groups,
        # float16's limit, float32 subnormals: every path of the codec.
        x = _adversarial(numel, group_size, dtype, seed=numel + bits)
        kernel = _quantized(x, bits, group_size)
        kernel_decoded = _decoded(kernel, bits, group_size, numel, dtype)
        monkeypatch.setenv("MEMOPT_CODEC", "torch")
        expected = _quantized(x, bits, group_size)
        for field in FIELDS:
            assert _same_bits(kernel[field], expected[field]), field
        assert (
            kernel["exact_index"] is not None or numel < 4 * group_size
        )  # the specials were there
        assert _same_bits(kernel_decoded, _decoded(kernel, bits, group_size, numel, dtype))

    def test_stochastic_4bit_decodes_average_to_the_input(kernels) -> None:
        g = torch.Generator().manual_seed(11)
        # |x| in [0.05, 3): above the first level (1/16 of a ~0.42 step), which values below it
        # round up to; both groups span [-3, 3], so they share one step.
        x = torch.rand(512, generator=g) * 2.95 + 0.05
        x[torch.rand(512, generator=g) < 0.5] *= -1
        x[0], x[1], x[256], x[257] = 3.0, -3.0, 3.0, -3.0
        decodes = []
        for seed in range(48):
            q = _quantized(x, 4, 256, seed)
            decodes.append(_decoded(q, 4, 256, x.numel(), x.dtype).double())
        step = q["scale"].double().repeat_interleave(256)
        errors = (torch.stack(decodes) - x.double()) / step
        assert errors.abs().max() < 1  # each decode: one of the two levels around the value
        bias = errors.mean(0)
        # One decode's error has std <= 1/2 step, so the mean of 48 has <= 0.072: the largest of
        # 512 stays under 0.3, and their average under 0.015 (5 sigma).
        assert bias.abs().max() < 0.3
        assert bias.mean().abs() < 0.015
        # It converges: the 48-decode mean is several times closer than one decode (1/sqrt(48)).
        assert bias.abs().mean() < 0.35 * errors[0].abs().mean()
        nearest = _decoded(_quantized(x, 4, 256), 4, 256, x.numel(), x.dtype).double()
        assert ((nearest - x.double()) / step).abs().mean() > 0.15  # nearest is biased per value

    def test_the_seed_alone_decides_the_noise(kernels) -> None:
        x = torch.randn(2_000, generator=torch.Generator().manual_seed(3))
        a, b, c = (ops.quantize(x, 4, 256, seed) for seed in (5, 5, 6))
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
        assert (a[0] != c[0]).float().mean() > 0.3

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
    @pytest.mark.parametrize("numel", [1, 7, 8, 1_001, 5_000])
    def test_dropout_masks_are_the_torch_paths_bits(
        kernels, dtype: torch.dtype, numel: int, monkeypatch
    ) -> None:
        g = torch.Generator().manual_seed(numel)
        noise = torch.empty(numel, dtype=dtype).bernoulli_(0.3, generator=g).view(-1, 1)
        packed = dropout.pack_mask(noise)
        unpacked = dropout.unpack_mask(packed, noise.shape, dtype)
        monkeypatch.setenv("MEMOPT_CODEC", "torch")
        expected = dropout.pack_mask(noise)
        assert torch.equal(packed, expected) and packed.numel() == math.ceil(numel / 8)
        assert _same_bits(unpacked, dropout.unpack_mask(expected, noise.shape, dtype))
        assert unpacked.shape == noise.shape and torch.equal(unpacked, noise)

    def test_bitmask_dropout_runs_the_mask_kernels_and_matches_torch(kernels, monkeypatch) -> None:
        calls = []
        for name in ("pack_mask", "unpack_mask"):
            kernel = getattr(kernels, name)
            monkeypatch.setattr(
                kernels, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a)
            )
        layer = dropout.MemoryDropout(0.3)
        layer.mode = "bitmask"
        x = torch.randn(37, 29)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            torch.manual_seed(1)
            leaf = x.clone().requires_grad_()
            out = layer(leaf)
            out.backward(torch.arange(out.numel(), dtype=out.dtype).view(out.shape))
            return out.detach(), leaf.grad

        out, grad = step()
        assert calls == ["pack_mask", "unpack_mask"]
        monkeypatch.setenv("MEMOPT_CODEC", "torch")
        expected_out, expected_grad = step()
        assert torch.equal(out, expected_out) and torch.equal(grad, expected_grad)
        assert 0.2 < (out == 0).float().mean() < 0.4

    def test_float64_takes_the_reference(kernels, monkeypatch) -> None:
        x = torch.randn(700, dtype=torch.float64)
        monkeypatch.setattr(kernels, "quantize", None)  # a call would fail
        assert torch.equal(ops.quantize(x, 4, 256, None)[0], reference.quantize(x, 4, 256, None)[0])
