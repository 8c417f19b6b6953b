"""After and during a run: ``monitor`` (MemoryMonitor: per-step rows, fragmentation warning, out-of-memory
capture), ``replay`` (recorded snapshots through the pool and through a model of PyTorch's policy,
``_torch_policy``), ``explain`` (the post-mortem of a snapshot)."""
