"""The profiler: memory of one training step per module, its report and chart, and ``memopt plan``.

* :mod:`.meter` -- bytes retained for backward and the peak of a step (RSS on CPU, the allocator
  on CUDA);
* :mod:`.run` -- :func:`profile_model`, the step measured per module and on the allocator's
  timeline (peak, where it is, what is alive there, per sample), as is and under a config;
* :mod:`.report` -- its table, Markdown and JSON; :mod:`.plot` draws the PNGs (bars, timeline)
  from the plain rows the report hands it; :mod:`.units` -- bytes for people;
* :mod:`.plan` -- :func:`suggest_config`, a config for a memory budget; :mod:`.fit` -- ``memopt
  plan``'s peak budget or memory cap and the largest batch; :mod:`.training` -- a whole
  training's memory, read in a fresh process.
"""

from .plan import suggest_config
from .report import ProfileReport
from .run import profile_model

__all__ = ["ProfileReport", "profile_model", "suggest_config"]
