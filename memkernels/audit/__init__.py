"""What each fused op would cost a GPU, counted on a CPU: ``gpu_audit`` (bytes, FLOPs, operand dtypes, syncs,
launches and a labelled time model per op; ``python -m memkernels.audit.gpu_audit``)."""
