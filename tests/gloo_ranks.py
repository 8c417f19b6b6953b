"""Tests on WORLD gloo ranks (CPU processes): :func:`spawn` runs a test's body on each and hands back what each
rank reported."""
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def run_rank(rank, world, store_path, result_path, body, *args):
    """One rank of a gloo group of ``world``: ``body(rank, *args)`` returns the lines this rank reports (empty
    where all is well), written to ``result_path.<rank>`` for the test to read back."""
    torch.set_num_threads(1)  # two ranks on a 2-core machine: more threads only contend
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        lines = body(rank, *args)
        with open(f"{result_path}.{rank}", "w") as handle:
            handle.write("\n".join(lines))
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalization. Gloo's worker thread drops its last reference to a finished
    # all-reduce (an AsyncWork whose ThreadLocalState holds a Python object) a moment after the
    # main thread sees it complete; if that happens while Python finalizes, the decref's GIL
    # acquire calls pthread_exit inside a noexcept destructor and the rank dies of SIGABRT
    # ("terminate called without an active exception"; about 1 run in 100 on a loaded 2-core
    # machine, core dump: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> ~ThreadLocalState).
    # A PyTorch teardown race (pytorch/pytorch#179291), not a verdict on the gradients, which
    # are written above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(tmp_path, body, *args, world=WORLD):
    """Run ``body`` on ``world`` gloo ranks; returns each rank's lines."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with gloo is required for this test")
    result_path = str(tmp_path / "result")
    mp.spawn(run_rank, args=(world, str(tmp_path / "store"), result_path, body, *args), nprocs=world, join=True)
    lines = []
    for rank in range(world):
        with open(f"{result_path}.{rank}") as handle:
            lines.append(handle.read().splitlines())
    return lines
