"""What runs inside a training process: the pool allocator (``allocator``), activation offload (``offload``),
the real or simulated device (``device``), the meters of saved and peak bytes (``meters``), the activation
ledger (``ledger``) and sizes as people write and read them (``sizes``).

Nothing here imports ``memkernels.planning``, ``memkernels.forensics`` or ``memkernels.audit``
(tests/test_imports.py): a training run loads the runtime alone.
"""
