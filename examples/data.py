"""Small real data sets that need no download, for the examples and the demo.

- :func:`stdlib_text`: the Python standard library's own source, as one ASCII string — a
  character-level language-modelling corpus that ships with every Python.
- :class:`CharWindows`: random ``block_size`` windows of such a text as ``(inputs, targets)``.
- :func:`digits`: scikit-learn's bundled 8x8 handwritten digits (1,797 images).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

VOCAB = 128  # ASCII: every other byte becomes "?"


def stdlib_text(max_chars: int = 2_000_000) -> str:
    """The top-level ``.py`` files of the standard library, concatenated in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if not parts:
        raise FileNotFoundError(f"no standard-library sources under {root}")
    return "".join(parts)[:max_chars]


def encode(text: str) -> torch.Tensor:
    """Token ids (int64) of ``text``: ASCII codes, anything else as ``?``."""
    data = bytearray(text.encode("ascii", errors="replace"))
    return torch.frombuffer(data, dtype=torch.uint8).long()


def decode(ids: torch.Tensor) -> str:
    """The text of token ids."""
    return bytes(ids.clamp(0, VOCAB - 1).to(torch.uint8).tolist()).decode("ascii")


class CharWindows(Dataset):
    """``length`` windows of ``tokens`` at random offsets (fixed by ``seed``) as ``(x, y)``.

    ``y`` is ``x`` shifted by one token: the next character at every position.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, length: int, seed: int = 0):
        if tokens.numel() <= block_size + 1:
            raise ValueError(f"{tokens.numel()} tokens are too few for windows of {block_size}")
        self.tokens = tokens
        self.block_size = block_size
        generator = torch.Generator().manual_seed(seed)
        last = tokens.numel() - block_size - 1
        self.offsets = torch.randint(0, last, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[i])
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def char_splits(
    block_size: int, train_windows: int, val_windows: int, max_chars: int = 2_000_000
) -> tuple[CharWindows, CharWindows]:
    """Train and validation windows from the first 90% and the last 10% of :func:`stdlib_text`."""
    tokens = encode(stdlib_text(max_chars))
    cut = int(0.9 * tokens.numel())
    return (
        CharWindows(tokens[:cut], block_size, train_windows, seed=0),
        CharWindows(tokens[cut:], block_size, val_windows, seed=1),
    )


def digits(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as ``(N, 1, 8, 8)`` float images in [0, 1] with labels; train, val."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(val_fraction * len(labels))
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])
