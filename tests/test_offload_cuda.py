"""OffloadActivations on the real CUDA runtime: what tests/test_offload.py shows on the simulated device,
on a GPU (benchmarks/gpu_check.sh runs this file). Without a CUDA GPU every test here is skipped, saying
so: the same code paths run on the simulator in tests/test_offload.py, tests/test_offload_distributed.py
and tests/test_bench_offload.py.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memkernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the simulated device's tests are tests/test_offload.py)")


class Blocks(nn.Module):
    """Pre-norm MLP blocks with residuals; optionally each block checkpointed (non-reentrant)."""

    def __init__(self, layers=4, dim=256, checkpointed=False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                  nn.Linear(4 * dim, dim)) for _ in range(layers))
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x))
        return x.float().pow(2).mean()


def train(model, x, manager, steps=3):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(steps):
        with manager if manager is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return grads


@pytest.mark.parametrize("mode", ["everything", "auto", "checkpoints"])
def test_gradients_bitwise_identical_on_cuda(mode):
    torch.manual_seed(0)
    model = Blocks(checkpointed=mode == "checkpoints").cuda()
    x = torch.randn(8, 512, 256, device="cuda")
    expected = train(model, x, None)
    options = {"everything": {"budget": None}, "auto": {}, "checkpoints": {"only_checkpoint_inputs": True}}[mode]
    manager = memkernels.OffloadActivations(min_offload_bytes=0, **options)
    try:
        actual = train(model, x, manager)
        stats = manager.stats()
    finally:
        manager.close()
    for step, (e_step, a_step) in enumerate(zip(expected, actual)):
        for i, (e, a) in enumerate(zip(e_step, a_step)):
            assert torch.equal(e, a), f"{mode}, step {step}, gradient {i}: max diff {(e - a).abs().max().item()}"
    assert stats["mode"] == "cuda" and stats["storages_offloaded"] > 0
    assert stats["storages_recast"] > 0 or mode == "checkpoints", "autocast's weight casts are cast again"
    if mode == "auto":
        assert stats["link_bandwidth"] > 1e9 and stats["forward_seconds"] > 0  # measured: GB/s, seconds


def test_offloaded_checkpoints_take_their_inputs_off_the_device():
    torch.manual_seed(0)
    model = Blocks(layers=6, checkpointed=True).cuda()
    x = torch.randn(8, 1024, 256, device="cuda")
    manager = memkernels.OffloadActivations(only_checkpoint_inputs=True, min_offload_bytes=0)
    try:
        allocated = {}
        for name, context in (("recompute", None), ("offloaded", manager)):
            torch.cuda.synchronize()
            with context if context is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                              lambda t: t):
                loss = model(x)
            if context is not None:
                context.wait_for_offloads()
            allocated[name] = torch.cuda.memory_allocated()
            loss.backward()
            model.zero_grad(set_to_none=True)
        block_input = x.numel() * x.element_size()
        # Blocks 2-5's inputs left the device (block 1's is x, which the caller holds; block 6's stays for
        # backward, which recomputes it first).
        assert allocated["recompute"] - allocated["offloaded"] >= 4 * block_input
    finally:
        manager.close()
