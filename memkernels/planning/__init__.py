"""Decide before a run: ``estimate`` (per-GPU memory of a run, on the meta device), ``plan`` (the decision flow:
baseline, checkpointing, offload, micro-batch, accumulation), ``placement`` (keep / recompute / offload per layer
under a budget), ``apply_plan`` (``memkernels.apply(model, plan)``), ``evaluate`` (two steps side by side)."""
