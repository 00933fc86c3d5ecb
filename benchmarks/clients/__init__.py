"""Third-party model code, vendored unmodified, so that benchmarks train what users run.

``nanogpt_model.py``: ``model.py`` of karpathy/nanoGPT at commit 3adf61e1
(MIT licence: ``NANOGPT_LICENSE``).
"""
