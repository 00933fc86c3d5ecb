"""What every benchmark shares: workloads, methods, patched copies, phases, records, tables.

Workloads (``workloads.py``, sized by ``sizes.py``) are patched by every method
(``methods.py``), each on its own copy (``measured.Measured``); the phases -- memory in a child
process (``memory.py``), gradient error (``gradients.py``), step time (``timing.py``), training
(``training.py``) and what differs when compiled (``compiled.py``) -- fill a ``records.Row`` per
method, and ``tables.py``, ``tables_compiled.py`` and ``plot.py`` turn the rows into
``results.md`` and ``pareto.png`` (``benchmarks/report.py`` writes them).
"""
