"""memopt's benchmarks: one harness and the studies built on it, run from the repository root.

    python -m benchmarks.run [--quick] [--out DIR]     memopt next to PyTorch's memory tools
    python -m benchmarks.fits                          the batch that fits (fits.md/json)
    python -m benchmarks.depth                         the batch that fits at 4, 12, 24 layers
    python -m benchmarks.bits_both_ways                bits raised and lowered (bits.md/json)
    python -m benchmarks.compiled_gap                  what compiled compression keeps
    python -m benchmarks.compile_time                  compile time against the baseline's
    python -m benchmarks.step_time                     int8 and int4's step time, paired in one run
    python -m benchmarks.recompute_bench               the planner against checkpointing
    python -m benchmarks.batchnorm_digits              running-statistics BatchNorm on digits
    python -m benchmarks.drift_metrics                 which drift metric
    python -m benchmarks.drift_check_time              a drift check's time in training steps
    python -m benchmarks.gradient_bias                 bias of the compressed gradient
    python -m benchmarks.loss_head                     memopt's chunked loss against PyTorch's
    python -m benchmarks.codec_kernels --against REV   the C codec kernels against REV's
    python -m benchmarks.nanogpt_fits                  karpathy/nanoGPT by configuration alone
    python -m benchmarks.cuda                          codec throughput, memory, time on a GPU
    python -m benchmarks.report [results.json]         redraw pareto.png / merge compiled rows

``harness/`` is what they share: the workloads and their sizes, the methods, a patched copy per
method (``measured.py``), the phases (memory, gradients, timing, training, compiled), the rows
they fill (``records.py``) and the tables and plot (``tables*.py``, ``plot.py``, ``notes.md``).
Results are committed beside this file (:data:`RESULTS`).
"""

import argparse
from collections.abc import Collection
from pathlib import Path

#: The folder the results are committed in (``results.md``, ``fits.md``, ...).
RESULTS = Path(__file__).resolve().parent
#: The repository root: the working directory of the child processes (``python -m``).
ROOT = RESULTS.parent


def chosen(
    parser: argparse.ArgumentParser, only: str, names: Collection[str], flag: str = "--only"
) -> list[str]:
    """The comma-separated names of ``flag``, each one of ``names`` (else a usage error)."""
    keys = [k for k in only.split(",") if k]
    unknown = [k for k in keys if k not in names]
    if unknown:
        parser.error(f"{flag}: unknown name(s) {unknown}; choose from {sorted(names)}")
    return keys
