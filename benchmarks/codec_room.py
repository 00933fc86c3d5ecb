"""Bytes the codec holds per tensor eagerly and traced in a compiled graph (writes codec_room.md).

Traced by ``torch.compile``, ``quantize`` gives side tables of a room fixed by the tensor's size
(``reference.exact_slots`` / ``const_slots``, as the CUDA kernels do), so that no size depends on
the data and the graph does not break; eagerly on the CPU the tables are as large as what they
hold (nothing, for ordinary activations). The table states what the room costs at each width.

    python -m benchmarks.codec_room --out benchmarks
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from memopt_plugins.compress.codec import packed_nbytes, quantize

SHAPES = [((4096,), torch.float32), ((8, 128, 768), torch.bfloat16), ((1024, 1024), torch.float32)]


def held_bytes(x: torch.Tensor, bits: int, compiled: bool) -> int:
    """``quantize(x).nbytes`` at round-to-nearest, eagerly or in a compiled graph."""

    def nbytes(t: torch.Tensor) -> int:
        return quantize(t, bits, 256, stochastic=False).nbytes

    if compiled:
        torch._dynamo.reset()
        nbytes = torch.compile(nbytes, backend="eager", fullgraph=True)
    return nbytes(x)


def table() -> str:
    rows = [
        "| tensor | bits | original B | eager B | compiled B | room vs eager |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for shape, dtype in SHAPES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        for bits in (8, 4, 2):
            eager, compiled = held_bytes(x, bits, False), held_bytes(x, bits, True)
            assert eager == packed_nbytes(x.numel(), bits, 256)  # no group flagged
            name = f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
            original = x.numel() * x.element_size()
            growth = 100 * (compiled - eager) / eager
            rows.append(f"| {name} | {bits} | {original} | {eager} | {compiled} | +{growth:.2f}% |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks"))
    args = parser.parse_args()
    text = (
        "# The codec's bytes per tensor, eager and traced in a compiled graph\n\n"
        f"`python -m benchmarks.codec_room` (torch {torch.__version__}), group size 256, random "
        "normal values (no group kept exactly or constant). *compiled*: `quantize` traced by "
        "`torch.compile` (fullgraph), whose side tables have room fixed by the tensor's size.\n\n"
        f"{table()}\n"
    )
    (args.out / "codec_room.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
