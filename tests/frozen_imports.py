"""The fork server's last import (:data:`fresh.PRELOAD`): what it imported becomes permanent to the
garbage collector (``gc.freeze``), so that a forked child's full collections scan only what the
child made. A memory reading collects garbage before each figure: over the imported torch,
transformers and Lightning, each collection cost about a fifth of a second."""

import gc

gc.freeze()
