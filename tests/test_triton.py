"""The Triton kernels, run on the CPU by Triton's interpreter: the torch reference's bytes at
round-to-nearest, unbiased stochastic rounding from the seed, dropout masks bit for bit, and
only the launches ``tests/test_cuda_build.py`` compiles for CUDA GPUs (no GPU needed).

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
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from test_cuda_codec import bounded_mismatches, codec_outputs  # noqa: E402
from test_native import _adversarial, _same_bits  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from memopt_plugins import MemoryOptimizer, dropout  # noqa: E402
from memopt_plugins.compress import codec  # noqa: E402
from memopt_plugins.compress.codec import ops, reference, triton_launch  # noqa: E402
from memopt_plugins.compress.hooks import CompressionHooks  # noqa: E402

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


if not INTERPRETED:  # the suite's process

    def test_the_kernel_tests_pass_under_the_interpreter() -> None:
        done = _python(
            "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, TRITON_INTERPRET="1"
        )
        report = done.stdout[-8000:] + done.stderr[-2000:]
        assert done.returncode == 0, report
        assert " passed" in done.stdout and "skipped" not in done.stdout, report

    def test_cpu_tensors_are_an_error_without_the_interpreter(monkeypatch) -> None:
        monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "triton")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            ops.quantize(torch.randn(300), 8, 256, None)

    def test_the_interpreter_switched_on_too_late_is_a_clear_error(monkeypatch) -> None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton is imported already, compiled
        monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "triton")
        monkeypatch.setattr(ops, "_triton", {})
        monkeypatch.delitem(
            sys.modules, "memopt_plugins.compress.codec.triton_kernels", raising=False
        )
        monkeypatch.delattr(codec, "triton_kernels", raising=False)
        with pytest.raises(RuntimeError, match="before the process imports triton"):
            ops.quantize(torch.randn(300), 8, 256, None)


else:  # the child run (or TRITON_INTERPRET=1 pytest tests/test_triton.py)

    @pytest.fixture
    def kernels(monkeypatch):
        """The Triton kernels module, serving every codec call (``MEMOPT_CODEC=triton``)."""
        monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "triton")
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
        kernel = codec_outputs(x, bits, group_size)
        monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "torch")
        expected = codec_outputs(x, bits, group_size)
        assert bounded_mismatches(kernel, expected, bits, group_size) == []
        lost = kernel["zero_point"] != expected["zero_point"]
        assert expected["exact_index"].numel() or numel < 4 * group_size  # specials were there
        # and more than the room (of one element, every group is a constant: room for all 9)
        assert lost.any() or numel < 4 * group_size or group_size == 1
        # The reference decodes the kernel's bytes to the same bits, and lost groups to NaN too
        # (its sign is the arithmetic's).
        packed = [kernel[name] for name in FIELDS]
        by_reference = ops.dequantize(*packed, bits, group_size, numel, dtype)
        lost_elements = lost.repeat_interleave(group_size)[:numel]
        assert by_reference[lost_elements].isnan().all()
        assert _same_bits(by_reference[~lost_elements], kernel["decoded"][~lost_elements])

    def test_groups_past_the_tables_room_decode_as_nan_and_constants_from_their_codes(
        kernels,
    ) -> None:
        n_groups, size = 64, 32
        x = torch.randn(n_groups, size, generator=torch.Generator().manual_seed(2))
        x[1:11, 3] = float("nan")  # 10 groups kept exactly: room for 1 + 64 // 1024 = 1
        x[20:50] = 0.1  # 30 constants the codes cannot hold exactly: room for 16 + 64 // 64 = 17
        x[60:64] = float("inf")  # and 4 constants that are not finite, past the room too
        q = _quantized(x.view(-1), 4, size)
        out = _decoded(q, 4, size, x.numel(), x.dtype).view(n_groups, size)
        assert reference.exact_slots(n_groups) == 1 and reference.const_slots(n_groups) == 17
        assert _same_bits(out[1], x[1])  # in the table: exactly, NaN where x is
        assert out[2:11].isnan().all()  # lost
        assert torch.equal(out[20:37], x[20:37])  # in the table: exactly
        rounded = out[37:50]  # 0.1 rounded up to one first level of a bfloat16 step
        assert (rounded == rounded[0, 0]).all() and 0.1 < rounded[0, 0] < 0.1 * (1 + 2**-7)
        assert out[60:].isnan().all()
        others = torch.cat((out[:1], out[11:20], out[50:60]))
        assert others.isfinite().all()
        assert (others - torch.cat((x[:1], x[11:20], x[50:60]))).abs().max() < 0.5

    class _NoDeviceReads(TorchDispatchMode):
        """Fails on every operator that makes the host wait for a GPU: reading a value
        (``_local_scalar_dense``: ``item``, ``bool``, ``int``; and ``tolist``, which reads a CPU
        tensor's memory without an operator) or sizing an output by the data (``nonzero``,
        indexing by a bool mask, ``masked_select``, ``unique``, ...). Copies from a GPU to the
        host sync too; on CPU tensors they are not copies, so this cannot see them."""

        SYNCING = {
            "_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "_unique2",
            "unique_dim", "unique_consecutive", "repeat_interleave", "masked_scatter",
        }  # fmt: skip
        INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}

        #: Inside :func:`codec.draw_seed`: a read of a host generator's draw, which never waits
        #: for a GPU (the generators are on the host for every device), so it is let through.
        drawing_seed = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "_local_scalar_dense" and _NoDeviceReads.drawing_seed:
                return func(*args, **(kwargs or {}))
            masked = name in self.INDEXING and any(
                i is not None and i.dtype == torch.bool for i in args[1]
            )
            if name in self.SYNCING or masked:
                raise AssertionError(f"{func} makes the host wait for the device")
            return func(*args, **(kwargs or {}))

        def __enter__(self):
            def tolist(t: torch.Tensor) -> list:
                raise AssertionError("Tensor.tolist makes the host wait for the device")

            self._tolist, torch.Tensor.tolist = torch.Tensor.tolist, tolist
            return super().__enter__()

        def __exit__(self, *exc):
            torch.Tensor.tolist = self._tolist
            return super().__exit__(*exc)

    def test_the_no_device_reads_mode_catches_what_it_names() -> None:
        t = torch.tensor([0.0, 1.0])
        reads = (t[1].item, lambda: t.tolist(), t.nonzero, lambda: t[t > 0], lambda: bool(t[1]))
        for read in reads:
            with pytest.raises(AssertionError, match="wait for the device"), _NoDeviceReads():
                read()

    @pytest.fixture
    def host_seeds(monkeypatch):
        """:func:`codec.draw_seed` checked to draw from a host generator, and let through."""
        draw = codec.draw_seed

        def on_the_host(generator: torch.Generator) -> int:
            assert generator.device.type == "cpu"
            _NoDeviceReads.drawing_seed = True
            try:
                return draw(generator)
            finally:
                _NoDeviceReads.drawing_seed = False

        monkeypatch.setattr(codec, "draw_seed", on_the_host)

    @pytest.mark.parametrize("bits", [2, 4, 8])
    def test_the_codec_never_waits_for_the_device(kernels, host_seeds, bits: int) -> None:
        # The CUDA code path (Triton), run on CPU tensors: with groups kept exactly and constants,
        # past the tables' room too, and stochastic rounding drawing its seed from a generator.
        x = _adversarial(40_192, 256, torch.float32, seed=bits)
        generator = codec.NoiseGenerators(7)(x.device)
        with _NoDeviceReads():
            packed = codec.quantize(x, bits, 256, generator=generator)
            out = codec.dequantize(packed)
        assert packed.exact_index is not None and packed.const_index is not None
        # It did the work: within a step of the nearest levels, in the groups of finite values.
        expected = codec.dequantize(codec.quantize(x, bits, 256, stochastic=False))
        finite = x.view(-1, 256).isfinite().all(1)
        error = (out - expected).view(-1, 256)[finite].abs()
        assert finite.sum() > 150 and (error <= packed.scale[finite].float()[:, None]).all()

    def test_pack_and_unpack_never_wait_for_the_device_in_training(
        kernels, host_seeds, monkeypatch
    ) -> None:
        calls = []
        for name in ("pack", "unpack"):
            hook = getattr(CompressionHooks, name)

            def watched(*args, _hook=hook, _name=name):
                calls.append(_name)
                with _NoDeviceReads():
                    return _hook(*args)

            monkeypatch.setattr(CompressionHooks, name, staticmethod(watched) if name == "unpack"
                                else watched)  # fmt: skip
        launches = []
        quantize = kernels.quantize
        monkeypatch.setattr(kernels, "quantize", lambda *a: launches.append(a[1]) or quantize(*a))
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.Tanh())
        opt = MemoryOptimizer({"quantize": {"bits": 4}})
        opt.apply(model)
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
        model(x).square().mean().backward()
        opt.remove()
        assert launches and set(launches) == {4}  # tensors went through the Triton kernels
        assert "pack" in calls and "unpack" in calls
        assert x.grad is not None and x.grad.isfinite().all()

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
        monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "torch")
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
        monkeypatch.setattr("memopt_plugins.compress.codec.ops.REQUESTED", "torch")
        expected_out, expected_grad = step()
        assert torch.equal(out, expected_out) and torch.equal(grad, expected_grad)
        assert 0.2 < (out == 0).float().mean() < 0.4

    @pytest.mark.parametrize("bits", [8, 4, 2])
    def test_training_launches_only_the_enumerated_specializations(
        kernels, bits: int, monkeypatch
    ) -> None:
        # tests/test_cuda_build.py compiles triton_launch.specializations for GPUs: every launch
        # a training step makes (float32 and bfloat16, compression, bitmask dropout) is in it.
        launched = []
        run = kernels._run
        monkeypatch.setattr(kernels, "_run", lambda launch, *a: launched.append(launch) or run(
            launch, *a))  # fmt: skip
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 64))
        config = {"quantize": {"bits": bits, "min_numel": 0}, "dropout": {"mode": "bitmask"}}
        opt = MemoryOptimizer(config)
        opt.apply(model)
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype)
            x = torch.randn(48, 64, dtype=dtype, requires_grad=True)
            model(x).float().square().mean().backward()
        opt.remove()
        enumerated = set(triton_launch.specializations([opt.config.quantize.group_size]))
        assert launched and not set(launched) - enumerated, set(launched) - enumerated
        kernels_run = {launch.kernel for launch in launched}
        assert kernels_run == {
            "_quantize_kernel", "_decode_kernel", "_pack_mask_kernel", "_unpack_mask_kernel"
        }  # fmt: skip
        dtypes = {launch.constants.get("DTYPE") for launch in launched} - {None}
        assert dtypes == {triton_launch.F32, triton_launch.BF16}

    def test_the_mask_constants_are_the_bits_of_one(kernels) -> None:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            one = torch.ones((), dtype=dtype).view(kernels._BITS_OF[dtype.itemsize])
            launch = triton_launch.unpack_mask_launch(str(dtype).removeprefix("torch."))
            assert launch.constants["ONE"] == int(one)

    def test_float64_takes_the_reference(kernels, monkeypatch) -> None:
        x = torch.randn(700, dtype=torch.float64)
        monkeypatch.setattr(kernels, "quantize", None)  # a call would fail
        assert torch.equal(ops.quantize(x, 4, 256, None)[0], reference.quantize(x, 4, 256, None)[0])
