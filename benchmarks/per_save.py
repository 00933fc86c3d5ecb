"""What one saved tensor costs the Python side of compression (writes nothing; prints JSON).

Deterministic proxies, then a short paired timing (noisy on a shared machine):

* ``frames``: Python frames between the pack hook's entry and the C kernel's call, for one
  saved tensor of a small CNN at int8 (read from the stack inside a stand-in for the kernel's
  entry point, which then calls the kernel);
* ``calls``: Python call events (``sys.setprofile``) in one forward of that CNN;
* ``objects``: gc-tracked objects alive after that forward (its loss held) beyond those before,
  with and without memopt;
* ``seconds``: median forward+backward time of the CNN and of a tiny GPT-2 step, with and
  without memopt int8, interleaved.

    python -m benchmarks.per_save [--no-timing]
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from memopt_plugins import MemoryOptimizer
from memopt_plugins.compress.codec import native

CONFIG = {"quantize": {"bits": 8, "rounding": "nearest"}, "drift": {"enabled": False}}


def small_cnn() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = 3
    for out in (16, 32, 32):
        layers += [nn.Conv2d(width, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
        width = out
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
    return model, torch.randn(8, 3, 32, 32)


def tiny_gpt2() -> tuple[nn.Module, torch.Tensor]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from zoo import hf_gpt2

    model, batch, _ = hf_gpt2(batch_size=4, seq=64, dim=64, layers=2)
    return model, batch


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x, labels=x).loss if x.dtype == torch.long else model(x).sum()
    return out


def _op_site(frame) -> bool:
    """Whether ``frame`` is the torch code that called the op whose save ran the hook (a
    module's forward or a functional), not the module-call machinery of a hook's GraphModule."""
    name, where = frame.f_code.co_name, frame.f_code.co_filename
    if where.endswith("torch/nn/functional.py"):
        return True
    return "torch/nn/modules" in where and name not in ("_call_impl", "_wrapped_call_impl")


def frames_per_save() -> int:
    """Frames from the pack hook to the kernel call, for the first tensor the kernel codes."""
    model, x = small_cnn()
    opt = MemoryOptimizer(CONFIG)
    opt.apply(model)
    lib = native.library()
    if lib is None:
        return -1
    depths: list[int] = []
    real = lib.memopt_quantize

    class Counting:
        def __getattr__(self, name):
            return getattr(lib, name)

        def memopt_quantize(self, *args):
            frame, n = sys._getframe(1), 0
            while frame is not None and not _op_site(frame):
                n, frame = n + 1, frame.f_back
            depths.append(n)
            return real(*args)

    before = native._state["lib"]
    native._state["lib"] = Counting()
    try:
        _loss(model, x).backward()
    finally:
        native._state["lib"] = before
        opt.remove()
    return depths[0] if depths else -1


def calls_per_forward(apply: bool) -> int:
    model, x = small_cnn()
    opt = MemoryOptimizer(CONFIG)
    if apply:
        opt.apply(model)
    _loss(model, x).backward()  # warm: first-call work is not the steady state
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        loss = _loss(model, x)
    finally:
        sys.setprofile(None)
    loss.backward()
    return count[0]


def objects_per_forward(apply: bool) -> int:
    model, x = small_cnn()
    opt = MemoryOptimizer(CONFIG)
    if apply:
        opt.apply(model)
    _loss(model, x).backward()
    gc.collect()
    before = len(gc.get_objects())
    loss = _loss(model, x)
    after = len(gc.get_objects())
    loss.backward()
    return after - before


def paired_seconds(build, steps: int = 15) -> dict[str, float]:
    """Median step time without and with memopt int8, the two interleaved step by step."""
    plain, x = build()
    compressed, _ = build()
    opt = MemoryOptimizer(CONFIG)
    opt.apply(compressed)
    times: dict[str, list[float]] = {"baseline": [], "int8": []}
    for i in range(steps + 3):
        for name, model in (("baseline", plain), ("int8", compressed)):
            start = time.perf_counter()
            _loss(model, x).backward()
            if i >= 3:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    out: dict[str, object] = {
        "frames": frames_per_save(),
        "calls": {"baseline": calls_per_forward(False), "int8": calls_per_forward(True)},
        "objects": {"baseline": objects_per_forward(False), "int8": objects_per_forward(True)},
    }
    if "--no-timing" not in sys.argv:
        out["seconds"] = {"cnn": paired_seconds(small_cnn), "gpt2": paired_seconds(tiny_gpt2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
