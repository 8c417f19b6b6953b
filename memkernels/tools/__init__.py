"""Tools that measure first and then decide.

- ``profile``: where memory goes in a step (activation ledger, evaluate, memory_summary);
- ``estimate``: per-GPU memory of a training run, on the meta device;
- ``plan``, ``placement``, ``plan_apply``: what to turn on so that a run fits, and applying it;
- ``monitor``, ``explain``: live runs and post-mortems of out-of-memory errors;
- ``gpu_audit``: what each op would cost a GPU, counted on a CPU;
- ``sizes``: parsing and printing byte sizes.
"""
