"""memkernels.OffloadActivations on the simulated device (CPU tensors stand for device tensors).

Every test compares against the same computation without offload: gradients
must be bitwise identical, since offload only moves bytes. Memory claims are
measured with memkernels.meters.
"""
import collections
import contextlib
import copy
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import SIM_SYNC_TIMEOUT_S
from torch.utils.checkpoint import checkpoint

import memkernels
import memkernels.runtime.offload as offload_runtime
from memkernels import _C
from memkernels import device
from memkernels.device import sim
from memkernels.meters import PeakBytesMeter, SavedBytesMeter
from memkernels.testing import ModelledKernel, settle_offload_copies

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def sim_device():
    device.use_sim()
    sim.configure(device_count=1, capacity=1 << 30, host_capacity=None, granularity=64 << 10,
                  memory="backed", address_space=1 << 36, sync_timeout_s=SIM_SYNC_TIMEOUT_S)
    yield
    sim.hold_events(False)


@pytest.fixture
def offload():
    """Factory of OffloadActivations, all closed (pinned memory freed) before the sim is reset."""
    made = []

    def make(**kwargs):
        made.append(memkernels.OffloadActivations(**kwargs))
        return made[-1]

    yield make
    sim.hold_events(False)
    for manager in made:
        manager.close()
    sim.reset()


# ------------------------------------------------------------------ a small GPT


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, -1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (dim // self.heads) ** 0.5
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        y = (scores.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, layers=2, seq=16, checkpoint_blocks=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint_blocks else block(x)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


def make_batch(vocab=64, batch=4, seq=16):
    return torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))


def train(model, batches, context=None, on_step=None):
    """Train a copy of `model` with SGD; returns every step's gradients."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step, (idx, targets) in enumerate(batches):
        if context is None:
            loss = model(idx, targets)
        else:
            with context:
                loss = model(idx, targets)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if on_step is not None:
            on_step(step)
    return grads


def offloaded_step(model, batch, manager):
    """One forward of a copy of `model` under `manager`, its copies settled, then backward: asserts the gradients
    are bitwise the plain step's; returns the manager's stats."""
    expected = train(model, [batch])
    model = copy.deepcopy(model)
    with manager:
        loss = model(*batch)
    settle_offload_copies(manager, timeout=SIM_SYNC_TIMEOUT_S)
    loss.backward()
    assert_bitwise_equal(expected, [[p.grad for p in model.parameters()]])
    return manager.stats()


def assert_bitwise_equal(expected, actual):
    assert len(expected) == len(actual)
    for step, (e_step, a_step) in enumerate(zip(expected, actual)):
        for i, (e, a) in enumerate(zip(e_step, a_step)):
            assert torch.equal(e, a), f"step {step}, gradient {i}: max diff {(e - a).abs().max().item()}"


# ------------------------------------------------------------------ the done-when tests


@pytest.mark.parametrize("offload_last_module", [True, False])
def test_gpt_three_steps_bitwise_identical_and_pool_reused(offload, offload_last_module):
    model, batches = GPT(), [make_batch() for _ in range(3)]
    expected = train(model, batches)
    manager = offload(min_offload_bytes=0, offload_last_module=offload_last_module)
    pinned_allocations = []
    actual = train(model, batches, manager, on_step=lambda step: pinned_allocations.append(
        manager.stats()["pinned_allocations"]))
    assert_bitwise_equal(expected, actual)
    stats = manager.stats()
    assert pinned_allocations[0] > 0
    assert pinned_allocations[1] == pinned_allocations[0] and pinned_allocations[2] == pinned_allocations[0], \
        f"steps 2 and 3 pinned new memory: cudaHostAlloc calls after each step {pinned_allocations}"
    assert stats["storages_offloaded"] > 0 and stats["pool_hits"] > 0
    assert stats["kept_by_reason"]["parameter"] > 0
    assert (stats["kept_by_reason"]["last_module"] > 0) == (not offload_last_module)
    manager.wait_for_offloads()  # copies still running when backward ended hold their handle until done
    assert manager.stats()["live_handles"] == 0, "the graphs are gone: every pinned block must be back"


def saved_activation_bytes(model, batch, manager=None):
    """(bytes saved for backward without offload, bytes allocated in forward still resident after it)."""
    with SavedBytesMeter() as saved:
        model(*batch)
    with PeakBytesMeter() as live:
        if manager is None:
            loss = model(*batch)
        else:
            with manager:
                loss = model(*batch)
            manager.wait_for_offloads()
        resident = live.current_bytes
    loss.backward()
    return saved.new_bytes, resident


def test_resident_saved_bytes_drop_by_at_least_90_percent(offload):
    model, batch = GPT(layers=3), make_batch()
    saved, resident_without = saved_activation_bytes(model, batch)
    assert resident_without >= saved, "without offload every saved activation stays resident"
    manager = offload(budget=None, min_offload_bytes=0, offload_last_module=True)
    _, resident_with = saved_activation_bytes(model, batch, manager)
    drop = 1 - resident_with / resident_without
    print(f"saved {saved} B; resident after forward: {resident_without} B without offload, "
          f"{resident_with} B with offload ({drop:.1%} less)")
    assert drop >= 0.9
    # The default keeps the last module's activations (backward needs them first).
    default = offload(min_offload_bytes=0)
    _, resident_default = saved_activation_bytes(model, batch, default)
    assert resident_with < resident_default < resident_without
    assert default.stats()["kept_by_reason"]["last_module"] > 0


@pytest.mark.parametrize("seed", range(12))
def test_random_copy_delays_keep_results_identical(offload, seed):
    model, batches = GPT(), [make_batch() for _ in range(2)]
    expected = train(model, batches)
    sim.set_random_delays(max_delay_us=300, seed=seed)
    manager = offload(min_offload_bytes=0, offload_last_module=seed % 2 == 0, prefetch_bytes=(seed % 3) * 64 << 10)
    assert_bitwise_equal(expected, train(model, batches, manager))


def test_device_copy_lives_until_its_offload_completed(offload):
    # Held events keep every D2H copy from completing: the device copies must
    # stay resident; once released and drained, they go.
    model, batch = GPT(), make_batch()
    expected = train(model, [batch])
    model = copy.deepcopy(model)
    manager = offload(min_offload_bytes=0, offload_last_module=True)
    _, resident_without = saved_activation_bytes(copy.deepcopy(model), batch)
    with PeakBytesMeter() as live:
        sim.hold_events(True)
        with manager:
            loss = model(*batch)
        held = live.current_bytes
        assert manager.stats()["engine"]["live_handles"] > 0
        sim.hold_events(False)
        manager.wait_for_offloads()
        drained = live.current_bytes
    assert held >= resident_without, "a device copy was freed before its D2H copy completed"
    assert drained < 0.1 * resident_without
    loss.backward()
    assert_bitwise_equal(expected, [[p.grad for p in model.parameters()]])


def test_backward_waits_for_held_prefetch_copies(offload):
    # Every copy back is stalled until a timer releases the events: backward
    # must wait for it (not read the uninitialized destination) and still match.
    model, batch = GPT(), make_batch()
    expected = train(model, [batch])
    model = copy.deepcopy(model)
    manager = offload(min_offload_bytes=0, offload_last_module=True)
    with manager:
        loss = model(*batch)
    manager.wait_for_offloads()
    hold_s = 0.3
    sim.hold_events(True)
    releaser = threading.Timer(hold_s, sim.hold_events, args=(False,))
    start = time.perf_counter()  # before the timer starts: a descheduled thread cannot shorten "waited"
    releaser.start()
    loss.backward()
    waited = time.perf_counter() - start
    releaser.join()
    # A lower bound only (load can only lengthen "waited"); backward's blocking wait is bounded by
    # SIM_SYNC_TIMEOUT_S, not by how soon a descheduled Timer thread gets to release the events.
    assert waited >= hold_s * 0.9, f"backward finished in {waited:.3f}s while its copies were held for {hold_s}s"
    assert_bitwise_equal(expected, [[p.grad for p in model.parameters()]])
    stats = manager.stats()
    assert stats["restores_from_device"] == 0 and stats["prefetch_hits"] > 0


# ------------------------------------------------------------------ what is saved, and how it comes back


class SaveViews(torch.autograd.Function):
    """Saves several views of its input's storage; backward reads all of them."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, x.t(), x[1:, 2:], x[0].expand(5, -1), x)
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        x, xt, corner, expanded, again = ctx.saved_tensors
        assert xt.stride() == (1, x.shape[1]) and expanded.stride() == (0, 1)
        assert corner.storage_offset() == x.shape[1] + 2
        g = x * 1 + xt.t() * 2 + again * 3
        g[1:, 2:] += corner
        g[0] += expanded.sum(0)
        return grad * g


def run_views(context):
    base = torch.randn(6, 7)
    x = (base * 2).requires_grad_(False)  # an activation, not a leaf that requires grad
    leaf = base.clone().requires_grad_(True)
    with context:
        y = SaveViews.apply(x + leaf)
    y.backward()
    return leaf.grad


def test_views_aliasing_and_double_saves(offload):
    torch.manual_seed(0)
    expected = run_views(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    torch.manual_seed(0)
    manager = offload(min_offload_bytes=0)
    actual = run_views(manager)
    assert torch.equal(expected, actual)
    assert manager.stats()["storages_offloaded"] == 1, "one storage saved five times is offloaded once"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["transposed", "strided_slice", "expanded", "offset_view", "channels_last"])
def test_non_contiguous_and_stride_zero_saves(offload, kind, dtype):
    def make(a):
        if kind == "transposed":
            return a.t()
        if kind == "strided_slice":
            return a[::2, 1::3]
        if kind == "expanded":
            return a[:1].expand(a.shape[0], -1)
        if kind == "offset_view":
            return a[3:, 5:]
        return a.reshape(2, 3, 8, 10).contiguous(memory_format=torch.channels_last)

    w = torch.randn(12, 40, dtype=dtype, requires_grad=True)

    def step(context):
        w.grad = None
        with context:
            view = make(w * 1.5)
            assert not view.is_contiguous()
            (view * view.exp()).sum().backward()
        return w.grad.clone()

    expected = step(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    manager = offload(min_offload_bytes=0)
    assert torch.equal(expected, step(manager))
    assert manager.stats()["storages_offloaded"] >= 1


@pytest.mark.parametrize("use_offload", [False, True])
def test_in_place_change_of_a_saved_tensor_raises_as_without_hooks(offload, use_offload):
    a = torch.randn(50, requires_grad=True)
    context = offload(min_offload_bytes=0) if use_offload else contextlib.nullcontext()
    with context:
        x = a * 2
        y = x.sin()  # saves x at version 0
    x.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_storage_saved_again_after_in_place_change_is_copied_again(offload):
    # The first save's graph is dropped before backward, so the change is legal;
    # the second save must not reuse the first copy.
    manager = offload(min_offload_bytes=0)
    a = torch.randn(50, requires_grad=True)
    with manager:
        x = a * 2
        dropped = x.sin()
        del dropped
        with torch.no_grad():
            x.mul_(3)
        z = x.cos()
    z.sum().backward()
    assert torch.equal(a.grad, -(x.detach()).sin() * 2)
    assert manager.stats()["storages_offloaded"] == 2


def test_retain_graph_and_double_backward(offload):
    model, (idx, targets) = GPT(), make_batch()

    def run(context):
        m = copy.deepcopy(model)
        with context:
            loss = m(idx, targets)
        loss.backward(retain_graph=True)
        loss.backward()  # unpacks everything a second time
        first = [p.grad.clone() for p in m.parameters()]
        x = torch.randn(30, requires_grad=True)
        with context:
            y = (x.tanh() ** 3).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.sum(), x)
        return first, [gx.detach(), ggx]

    torch.manual_seed(2)
    expected = run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    torch.manual_seed(2)
    manager = offload(min_offload_bytes=0)
    assert_bitwise_equal(expected, run(manager))
    assert manager.stats()["storages_offloaded"] > 0


class FlatLinear(nn.Module):
    """FSDP-style: weight and bias are views into one flat parameter."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.flat = nn.Parameter(torch.randn(n_out * n_in + n_out) * 0.1)

    def forward(self, x):
        weight = self.flat[: self.n_out * self.n_in].view(self.n_out, self.n_in)
        return F.linear(x, weight, self.flat[self.n_out * self.n_in:])


def test_parameters_and_flat_parameter_views_are_skipped(offload):
    layer = FlatLinear(64, 64)
    bn = nn.BatchNorm1d(64)
    manager = offload(min_offload_bytes=0)
    x = torch.randn(8, 64, requires_grad=True)  # so that linear saves its weight view for grad_input
    param_storage = layer.flat.untyped_storage()._cdata
    with manager:
        y = bn(layer(x * 1.0)).relu()
    offloaded_keys = [s.storage_ref()._cdata for s in manager._live if s.storage_ref() is not None]
    assert param_storage not in offloaded_keys
    kept = manager.stats()["kept_by_reason"]["parameter"]
    assert kept >= layer.flat.untyped_storage().nbytes()
    y.sum().backward()
    assert layer.flat.grad is not None and manager.stats()["storages_offloaded"] > 0


def test_small_other_device_and_no_offload_are_kept(offload):
    manager = offload(min_offload_bytes=4096)
    a = torch.randn(100, requires_grad=True)        # 400 B: small
    b = torch.randn(4096, requires_grad=True)       # 16 KiB: offloaded
    c = torch.randn(4096, requires_grad=True)       # under no_offload
    m = torch.randn(8, device="meta", requires_grad=True)
    with manager:
        ya = (a * 2).sin()
        yb = (b * 2).sin()
        with memkernels.no_offload():
            yc = (c * 2).sin()
        ym = (m * 2).sin()
    kept = manager.stats()["kept_by_reason"]
    assert kept["small"] == 400 and kept["no_offload"] == 16384 and kept["other_device"] == 32
    assert manager.stats()["bytes_offloaded"] == 16384
    (ya.sum() + yb.sum() + yc.sum()).backward()
    assert torch.equal(b.grad, 2 * (b * 2).cos())
    del ym


def test_pinned_cap_keeps_tensors_on_device_without_the_pageable_fallback(offload):
    model, batches = GPT(), [make_batch() for _ in range(2)]
    expected = train(model, batches)
    manager = offload(min_offload_bytes=0, max_pinned_bytes=256 << 10, offload_last_module=True,
                      pageable_fallback=False)
    assert_bitwise_equal(expected, train(model, batches, manager))
    stats = manager.stats()
    assert stats["kept_by_reason"]["cap"] > 0 and stats["storages_offloaded"] > 0
    assert stats["bytes_pageable"] == 0
    assert stats["engine"]["pool"]["peak_pinned_bytes"] <= 256 << 10


@pytest.mark.parametrize("cap", [1 << 20, 0], ids=["cap_1MiB", "host_pins_nothing"])
def test_pinned_refusals_fall_back_to_pageable_memory_and_match_bitwise(offload, cap):
    model, batches = GPT(layers=3, dim=64), [make_batch() for _ in range(3)]
    expected = train(model, batches)
    if cap == 0:
        sim.configure(host_capacity=0)  # the host refuses every pin (as under WSL's cap, at its limit)
    manager = offload(min_offload_bytes=0, offload_last_module=True, max_pinned_bytes=cap or None)
    with pytest.warns(RuntimeWarning, match="pinned host memory refused .* pageable"):
        actual = train(model, batches, manager)
    assert_bitwise_equal(expected, actual)
    stats = manager.stats()
    assert stats["bytes_pageable"] > 0 and stats["kept_by_reason"]["cap"] == 0
    if cap:
        assert 0 < stats["bytes_pageable"] < stats["bytes_offloaded"], "what fits goes pinned, the rest pageable"
        assert stats["engine"]["pool"]["peak_pinned_bytes"] <= cap
    else:
        assert stats["bytes_pageable"] == stats["bytes_offloaded"] and stats["pinned_bytes"] == 0
    # Resident after forward: the pageable copies left the device as the pinned ones do. On the simulator
    # "device" tensors and pageable host memory are both CPU memory, so the meter sees the pageable
    # copies too; they are the block's bytes_pageable, taken off.
    model, batch = GPT(layers=3, dim=64), make_batch()
    _, resident_without = saved_activation_bytes(model, batch)
    pageable_before = manager.stats()["bytes_pageable"]
    _, resident_with = saved_activation_bytes(model, batch, manager)
    pageable = manager.stats()["bytes_pageable"] - pageable_before
    assert pageable > 0 and resident_with - pageable < 0.1 * resident_without


def test_exception_mid_forward_leaves_nothing_behind(offload):
    model, batch = GPT(), make_batch()
    manager = offload(min_offload_bytes=0, offload_last_module=True)
    streams_before = None

    class Boom(Exception):
        pass

    captured = {}
    sim.set_random_delays(max_delay_us=500, seed=1)
    with pytest.raises(Boom):
        with manager:
            streams_before = sim.stats()["live_streams"]
            loss = model(*batch)
            captured["loss"] = loss  # the partial graph stays reachable
            raise Boom()
    stats = manager.stats()
    engine = stats["engine"]
    assert engine["offloads"] > 0
    assert engine["live_handles"] == 0 and engine["retiring_blocks"] == 0
    assert engine["pool"]["bytes_in_use"] == 0
    assert manager._engine.idle() and sim.stats()["live_streams"] == streams_before
    assert not manager._pending and not manager._deferred
    with pytest.raises(RuntimeError, match="discarded"):
        captured["loss"].backward()
    # The manager (and its pinned pool) still works afterwards.
    pinned = stats["pinned_allocations"]
    sim.set_random_delays(0, 0)
    expected = train(model, [batch])
    assert_bitwise_equal(expected, train(model, [batch], manager))
    assert manager.stats()["pinned_allocations"] == pinned


def test_two_forwards_before_backward_and_a_failing_third(offload):
    # Gradient accumulation: two blocks alive at once, backward in either order;
    # a third block that raises must not touch the first two.
    model, batches = GPT(), [make_batch() for _ in range(2)]
    reference = copy.deepcopy(model)
    for idx, targets in batches:
        reference(idx, targets).backward()
    expected = [[p.grad for p in reference.parameters()]]
    sim.set_random_delays(max_delay_us=200, seed=4)
    manager = offload(min_offload_bytes=0, offload_last_module=True)
    losses = []
    for batch in batches:
        with manager:
            losses.append(model(*batch))
    with pytest.raises(ZeroDivisionError):
        with manager:
            model(*batches[0])
            1 / 0
    losses[1].backward()
    losses[0].backward()
    assert_bitwise_equal(expected, [[p.grad for p in model.parameters()]])


@pytest.mark.parametrize("where", ["around", "inside"])
def test_checkpoint_interplay(offload, where):
    model, batches = GPT(checkpoint_blocks=where == "around"), [make_batch() for _ in range(2)]
    expected = train(model, batches)
    manager = offload(min_offload_bytes=0, offload_last_module=True)
    if where == "around":
        actual = train(model, batches, manager)
    else:
        # OffloadActivations opened inside the checkpointed function.
        class Inside(nn.Module):
            def __init__(self, block):
                super().__init__()
                self.block = block

            def forward(self, x):
                with manager:
                    return self.block(x)

        wrapped = copy.deepcopy(model)
        wrapped.blocks = nn.ModuleList(Inside(b) for b in wrapped.blocks)
        wrapped.checkpoint_blocks = True
        actual = train(wrapped, batches)
    assert_bitwise_equal(expected, actual)
    assert manager.stats()["storages_offloaded"] > 0


def test_prefetch_does_not_assume_reverse_order(offload):
    manager = offload(min_offload_bytes=0, prefetch_bytes=1 << 20)
    xa, xb = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)

    def forward():
        with manager:
            ya = (xa * 2).sin().exp().tanh().sum()
            yb = (xb * 3).cos().exp().tanh().sum()
        manager.wait_for_offloads()  # every unpack below restores from pinned memory
        return ya, yb

    # Branches packed a then b; backward runs a first (pack order, not reverse).
    ya, yb = forward()
    ya.backward()
    yb.backward()
    assert torch.equal(xa.grad, torch.autograd.grad((xa * 2).sin().exp().tanh().sum(), xa)[0])
    assert torch.equal(xb.grad, torch.autograd.grad((xb * 3).cos().exp().tanh().sum(), xb)[0])
    stats = manager.stats()
    assert stats["restores_from_device"] == 0
    # Each branch's first unpack restores on demand and prefetches the rest of that branch.
    assert stats["restores_on_demand"] == 2 and stats["prefetch_hits"] == 4
    # A wrong guess: b's backward prefetches a's tensors, then a's graph is dropped unused.
    ya, yb = forward()
    yb.backward()
    assert manager._prefetched_bytes > 0
    del ya
    assert manager._prefetched_bytes == 0, "prefetched copies of a dropped graph must be released"
    manager.wait_for_offloads()
    assert manager.stats()["live_handles"] == 0


class _RecordingEngine:
    """The engine, with its ordering calls recorded (which handle, which stream)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        attribute = getattr(self.engine, name)
        if name not in ("wait", "synchronize"):
            return attribute

        def recorded(*args):
            self.calls.append((name, *args))
            return attribute(*args)

        return recorded


def test_dropped_prefetch_is_freed_at_an_explicit_point_not_in_the_collector(offload):
    """A stash collected with a prefetch in flight makes no CUDA call from __del__ (any thread, any
    current stream): its storage waits for the copy on the stream recorded at prefetch time, at the
    next explicit point."""
    manager = offload(min_offload_bytes=0, offload_last_module=True)
    xa, xb = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    with manager:
        ya = (xa * 2).sin().exp().tanh().sum()
        yb = (xb * 3).cos().exp().tanh().sum()
    manager.wait_for_offloads()
    yb.backward()  # prefetches a's tensors too
    assert manager._prefetched_bytes > 0
    in_flight = {(stash.handle, stash.prefetched[1]) for stash in manager._live if stash.prefetched is not None}
    recorder = _RecordingEngine(manager._engine)
    manager._engine = recorder
    del ya  # the collector retires a's stashes
    assert manager._prefetched_bytes == 0 and recorder.calls == []
    assert {(handle, stream) for _, handle, stream in manager._orphans} == in_flight  # stream recorded at use
    manager.wait_for_offloads()  # an explicit point
    assert manager._orphans == [] and {call[1] for call in recorder.calls} >= {h for h, _ in in_flight}
    manager._engine = recorder.engine
    assert manager.stats()["live_handles"] == 0


def test_prefetch_budget_zero_restores_on_demand(offload):
    model, batches = GPT(), [make_batch()]
    expected = train(model, batches)
    manager = offload(min_offload_bytes=0, prefetch_bytes=0, offload_last_module=True)
    assert_bitwise_equal(expected, train(model, batches, manager))
    stats = manager.stats()
    # Unpacks whose D2H copy was still running use the device copy (timing-dependent).
    restores = stats["restores_on_demand"] + stats["restores_from_device"]
    assert stats["prefetch_hits"] == 0 and restores >= stats["storages_offloaded"]


# ------------------------------------------------------------------ parameter casts: cast again, not copied


def train_autocast(model, batches, context=None):
    """`train`, with forward under CPU autocast to bfloat16 (the weights' casts are saved for backward)."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    class Both:
        def __enter__(self):
            if context is not None:
                context.__enter__()
            autocast.__enter__()

        def __exit__(self, *exc):
            autocast.__exit__(*exc)
            return context.__exit__(*exc) if context is not None else False

    return train(model, batches, Both())


def test_autocast_weight_casts_are_cast_again_not_offloaded(offload):
    model, batches = GPT(layers=2), [make_batch() for _ in range(2)]
    expected = train_autocast(model, batches)
    manager = offload(min_offload_bytes=0, offload_last_module=True)
    assert_bitwise_equal(expected, train_autocast(model, batches, manager))
    stats = manager.stats()
    # Every Linear's weight cast is saved for its input's gradient: 4 a block and the head, each step.
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert stats["storages_recast"] == 2 * len(linears) == 2 * (4 * 2 + 1)
    assert stats["bytes_recast"] == 2 * sum(m.weight.numel() * 2 for m in linears)  # bfloat16 copies

    copier = offload(min_offload_bytes=0, offload_last_module=True, recast_parameters=False)
    assert_bitwise_equal(expected, train_autocast(model, batches, copier))
    copied = copier.stats()
    assert copied["storages_recast"] == 0
    assert copied["bytes_offloaded"] == stats["bytes_offloaded"] + stats["bytes_recast"], \
        "without recasting, exactly the weight casts are offloaded on top"


def test_resident_bytes_exclude_the_recast_weight_casts(offload):
    model, batch = GPT(layers=3, dim=64), make_batch()
    residents = {}
    for recast in (False, True):
        manager = offload(min_offload_bytes=0, offload_last_module=True, recast_parameters=recast)
        with PeakBytesMeter() as live:
            with manager, torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(*batch)
            manager.wait_for_offloads()
            residents[recast] = live.current_bytes
        loss.backward()
        model.zero_grad()
    # Autocast's cache of weight casts is dropped at the block's end either way; the casts neither
    # stay on the device nor occupy pinned memory when recast.
    assert residents[True] <= residents[False]


def test_a_parameter_changed_before_backward_is_refused_when_recast(offload):
    model, batch = GPT(), make_batch()
    manager = offload(min_offload_bytes=0)
    with manager, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*batch)
    with torch.no_grad():
        model.head.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place between the forward pass and its backward.*"
                                           "recast_parameters=False"):
        loss.backward()


def test_casts_of_frozen_or_modified_tensors_are_not_recast(offload):
    weight = nn.Parameter(torch.randn(64, 64))
    frozen = torch.randn(64, 64)
    x = torch.randn(8, 64, requires_grad=True) * 1  # not a leaf: its casts are activations
    manager = offload(min_offload_bytes=0, offload_last_module=True)
    with manager:
        cast = weight.to(torch.bfloat16)
        modified = weight.to(torch.bfloat16).mul_(1)  # not a plain cast any more
        y = x.bfloat16() @ cast.t() + x.bfloat16() @ modified.t() + x.bfloat16() @ frozen.bfloat16().t()
    y.float().sum().backward()
    stats = manager.stats()
    assert stats["storages_recast"] == 1
    assert stats["bytes_recast"] == 64 * 64 * 2


# ------------------------------------------------------------------ the budget: what the link hides


class TimedLayers(nn.Module):
    """`layers` of Linear + GELU, each a kernel of `seconds` forward (2x backward): each layer saves two
    [tokens, dim] float32 storages (the Linear's input, GELU's input)."""

    def __init__(self, layers=8, dim=64, seconds=1e-3):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.seconds = seconds

    def forward(self, x):
        for linear in self.linears:
            x = ModelledKernel.apply(F.gelu(linear(x)), self.seconds)
        return x.pow(2).mean()


def modelled_steps(model, x, manager, steps):
    """Per step: (modelled step time in seconds, bytes offloaded, the block's budget)."""
    rows = []
    for _ in range(steps):
        start = max(sim.clock(), sim.host_clock())
        before = manager.stats()["bytes_offloaded"] if manager is not None else 0
        if manager is None:
            loss = model(x)
        else:
            with manager:
                loss = model(x)
            settle_offload_copies(manager, timeout=SIM_SYNC_TIMEOUT_S)
        loss.backward()
        model.zero_grad()
        device.synchronize()  # the step ends when the device is done (copies included)
        after = manager.stats() if manager is not None else {"bytes_offloaded": 0, "budget_bytes": None}
        rows.append((max(sim.clock(), sim.host_clock()) - start, after["bytes_offloaded"] - before,
                     after["budget_bytes"]))
    return rows


LINK = 64 * MiB  # bytes per second: slow enough that offloading everything (1 MiB a step) cannot hide


def test_budget_auto_offloads_what_the_link_hides_behind_the_forward(offload):
    sim.set_link_bandwidth(LINK)
    model, x = TimedLayers(), torch.randn(256, 64, requires_grad=True)
    forward, step = 8 * 1e-3, 8 * 3e-3
    baseline = modelled_steps(model, x, None, 2)
    assert baseline[-1][0] == pytest.approx(step, rel=1e-9), "the model: forward 8 ms, backward 16 ms"

    auto = offload(min_offload_bytes=0)
    rows = modelled_steps(model, x, auto, 4)
    everything = offload(budget=None, min_offload_bytes=0)
    unlimited = modelled_steps(model, x, everything, 4)
    print(f"modelled step (ms): none {baseline[-1][0] * 1e3:.2f}; auto " +
          ", ".join(f"{t * 1e3:.2f} ({b} B of budget {budget})" for t, b, budget in rows) +
          "; everything " + ", ".join(f"{t * 1e3:.2f} ({b} B)" for t, b, _ in unlimited))

    assert rows[0][2] is None, "the first block knows no forward time: it offloads everything"
    stats = auto.stats()
    assert stats["forward_seconds"] == pytest.approx(forward, rel=1e-9)
    assert stats["link_bandwidth"] == pytest.approx(LINK, rel=1e-9)
    for step_time, offloaded, budget in rows[1:]:
        assert budget == int(LINK * forward)
        assert 0 < offloaded <= budget
        assert step_time <= 1.05 * baseline[-1][0]
    assert stats["kept_by_reason"]["budget"] > 0
    # The same link without the budget: the copies do not hide, and the step pays for them.
    assert unlimited[-1][1] > rows[-1][1]
    assert unlimited[-1][0] > 1.05 * baseline[-1][0]


def test_budget_fills_earliest_saves_first_and_matches_bitwise(offload):
    model, batches = GPT(layers=3), [make_batch() for _ in range(2)]
    expected = train(model, batches)
    everything = offload(budget=None, min_offload_bytes=0, offload_last_module=True)
    train(model, batches[:1], everything)
    total = everything.stats()["bytes_offloaded"]
    budget = total // 3
    manager = offload(budget=budget, min_offload_bytes=0, offload_last_module=True)
    states = []

    def record_states(step):
        states.append([ref().state for ref in manager._order if ref() is not None])

    # The block's stashes in save order, read before backward frees them: offloaded ones first, then
    # every later one kept for the budget.
    real_exit = manager.__exit__

    def exit_and_record(*exc):
        result = real_exit(*exc)
        record_states(None)
        return result

    manager.__exit__ = exit_and_record
    assert_bitwise_equal(expected, train(model, batches, manager))
    for step in states:
        kept = [state == "kept" for state in step]
        assert any(kept) and not all(kept)
        assert kept == sorted(kept), f"a save was offloaded after one the budget kept: {step}"
    stats = manager.stats()
    assert stats["budget_bytes"] == budget
    assert 0 < stats["bytes_offloaded"] <= 2 * budget
    assert stats["bytes_offloaded"] + stats["kept_by_reason"]["budget"] == 2 * total


# ------------------------------------------------------------------ offloaded checkpoints


class CheckpointedGPT(GPT):
    """GPT whose blocks are checkpointed, reentrant or not."""

    def __init__(self, reentrant, **kwargs):
        super().__init__(**kwargs)
        self.reentrant = reentrant

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_offloaded_checkpoints_move_only_the_region_inputs_and_match_bitwise(offload, reentrant):
    layers = 4
    model, batches = CheckpointedGPT(reentrant, layers=layers), [make_batch() for _ in range(3)]
    expected = train(model, batches)
    manager = offload(only_checkpoint_inputs=True, min_offload_bytes=0)
    assert_bitwise_equal(expected, train(model, batches, manager))
    stats = manager.stats()
    region_input = 4 * 16 * 32 * 4  # [batch, seq, dim] float32
    # Every block's input but the last (backward recomputes that one first), every step.
    assert stats["storages_offloaded"] == 3 * (layers - 1)
    assert stats["bytes_offloaded"] == 3 * (layers - 1) * region_input
    assert stats["kept_by_reason"]["last_module"] == 3 * region_input
    assert stats["kept_by_reason"]["not_checkpoint_input"] > 0  # the embedding's, the head's, the loss's saves


@pytest.mark.parametrize("prefetch_bytes", [1, "auto"])
def test_offloaded_checkpoints_prefetch_one_region_ahead(offload, monkeypatch, prefetch_bytes):
    monkeypatch.setattr(offload_runtime, "_AUTO_PREFETCH_FLOOR", 1 << 10)  # under one region's input
    layers, region_input = 5, 4 * 16 * 32 * 4
    # A window smaller than one region's input still restores the next one ahead of its recompute; "auto"'s is
    # one region's input, not every region's (the block is the whole forward).
    manager = offload(only_checkpoint_inputs=True, min_offload_bytes=0, prefetch_bytes=prefetch_bytes)
    stats = offloaded_step(CheckpointedGPT(False, layers=layers), make_batch(), manager)
    assert stats["storages_offloaded"] == layers - 1
    assert stats["prefetch_hits"] == layers - 1 and stats["restores_on_demand"] == 0
    assert stats["prefetch_window_bytes"] == (1 if prefetch_bytes == 1 else region_input)


def test_offloaded_checkpoints_under_hugging_face_gradient_checkpointing(offload):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    model.activation_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 16))

    def grads(context):
        trained = copy.deepcopy(model)
        with context:
            loss = trained(input_ids=ids, labels=ids).loss
        loss.backward()
        return [[p.grad for p in trained.parameters()]]

    expected = grads(contextlib.nullcontext())
    manager = offload(only_checkpoint_inputs=True, min_offload_bytes=0)
    assert_bitwise_equal(expected, grads(manager))
    stats = manager.stats()
    # Each decoder layer's hidden states [2, 16, 32] float32 (its other inputs, RoPE's tables, are not
    # tensors of the checkpoint call here or are small); all but the last layer's.
    assert stats["storages_offloaded"] >= config.num_hidden_layers - 1
    assert stats["bytes_offloaded"] >= (config.num_hidden_layers - 1) * 2 * 16 * 32 * 4


def _tiny_hf_llama(layers=3):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    model.activation_checkpointing_enable()
    return model


def test_offload_checkpoints_attaches_to_a_model_without_touching_the_loop():
    model = _tiny_hf_llama()
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def train(net):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        grads = []
        for ids in batches:
            net(input_ids=ids, labels=ids).loss.backward()  # the loop a Trainer runs: no context manager
            grads.append([p.grad.clone() for p in net.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        return grads

    expected = train(copy.deepcopy(model))
    handle = memkernels.offload_checkpoints(model, min_offload_bytes=0)
    try:
        assert_bitwise_equal(expected, train(model))
        stats = handle.stats()
        assert stats["storages_offloaded"] >= 2 * (3 - 1), stats  # every layer's input but the last, each step
        with torch.no_grad():  # evaluation: nothing saved, no block entered
            model(input_ids=batches[0])
        assert handle.stats()["storages_offloaded"] == stats["storages_offloaded"]
    finally:
        handle.remove()
    assert not model._forward_hooks and not model._forward_pre_hooks
    with pytest.raises(RuntimeError, match="closed"):
        handle.offload.__enter__()


def test_offload_checkpoints_inside_a_hugging_face_trainer(tmp_path):
    """TrainingArguments(activation_checkpointing=True) checkpoints the layers; offload_checkpoints moves
    their inputs, the Trainer's loop untouched."""
    transformers = pytest.importorskip("transformers")

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def trained(offloaded):
        model = _tiny_hf_llama(layers=2)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(offloaded)), max_steps=2,
                                              per_device_train_batch_size=2, report_to="none", use_cpu=True,
                                              save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                              activation_checkpointing=True)
        handle = memkernels.offload_checkpoints(model, min_offload_bytes=0) if offloaded else None
        try:
            transformers.Trainer(model=model, args=args, train_dataset=Tokens()).train()
            offloaded_storages = handle.stats()["storages_offloaded"] if handle else 0
        finally:
            if handle:
                handle.remove()
        return [p.detach().clone() for p in model.parameters()], offloaded_storages

    expected, _ = trained(False)
    actual, storages = trained(True)
    assert_bitwise_equal([expected], [actual])
    assert storages >= 2, "each step's first layer input went to the host"


def test_offload_checkpoints_discards_a_forward_that_raised():
    model = _tiny_hf_llama(layers=2)
    handle = memkernels.offload_checkpoints(model, min_offload_bytes=0)
    try:
        ids = torch.randint(0, 128, (2, 16))
        with pytest.raises(IndexError):
            model(input_ids=ids, labels=ids + 1000)  # targets past the vocabulary: the loss raises
        assert not handle.offload._active
        handle.offload.wait_for_offloads()
        assert handle.stats()["live_handles"] == 0, "the failed block's copies are released"
        model(input_ids=ids, labels=ids).loss.backward()  # the next step runs as usual
        assert handle.stats()["storages_offloaded"] > 0
    finally:
        handle.remove()


def test_offload_checkpoints_refuses_what_it_cannot_do():
    with pytest.raises(TypeError, match="nn.Module"):
        memkernels.offload_checkpoints(lambda x: x)
    with pytest.raises(ValueError, match="only_checkpoint_inputs"):
        memkernels.offload_checkpoints(nn.Linear(2, 2), only_checkpoint_inputs=False)


def test_a_block_without_checkpoints_says_that_nothing_was_offloaded(offload):
    model, batch = GPT(), make_batch()
    manager = offload(only_checkpoint_inputs=True, min_offload_bytes=0)
    with pytest.warns(RuntimeWarning, match="none as a torch.utils.checkpoint input"):
        with manager:
            loss = model(*batch)
    loss.backward()
    assert manager.stats()["bytes_offloaded"] == 0


def test_prefetch_continues_into_the_blocks_entered_before(offload):
    """A plan's offloaded layers are a block each: backward's restores run one block ahead all the same."""
    layers = 5
    model = nn.ModuleList(nn.Linear(64, 64) for _ in range(layers))
    x = torch.randn(128, 64, requires_grad=True)
    manager = offload(min_offload_bytes=0, offload_last_module=True, budget=None, prefetch_bytes=1)

    def forward(context):
        h = x
        for linear in model:
            with context:
                h = F.gelu(linear(h))
        return h.pow(2).mean()

    forward(contextlib.nullcontext()).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss = forward(manager)
    settle_offload_copies(manager, timeout=SIM_SYNC_TIMEOUT_S)
    loss.backward()
    assert_bitwise_equal([expected], [[p.grad for p in model.parameters()]])
    stats = manager.stats()
    assert stats["storages_offloaded"] == 2 * layers - 1  # each block's input and GELU's input; x is a leaf
    assert stats["restores_on_demand"] == 1, "only the first restore of backward waits for its copy"
    assert stats["prefetch_hits"] == stats["storages_offloaded"] - 1


class SavesBoth(torch.autograd.Function):
    """x * y, saving both; backward unpacks them in pack order (x first), as autograd's own nodes do."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y, grad * x


class TwoSavesLayer(nn.Module):
    """Saves its input (the Linear), two activations read by one node in pack order, and the input of its last
    op (sin), each storage once: a prefetch window of one tensor restores the first of the two on demand."""

    def __init__(self, dim):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, h):
        a = self.linear(h)
        return SavesBoth.apply(a * 2, a + 1).sin()  # the scalar ops save nothing


class LayerStack(nn.Module):
    def __init__(self, layers=4, dim=64):
        super().__init__()
        self.layers = nn.ModuleList(TwoSavesLayer(dim) for _ in range(layers))

    def forward(self, x, per_layer_context=None):
        for layer in self.layers:
            with per_layer_context if per_layer_context is not None else contextlib.nullcontext():
                x = layer(x)
        return x.pow(2).mean()


def test_auto_prefetch_window_restores_the_previous_block_whole(offload, monkeypatch):
    """Blocks (one per layer) whose offloaded bytes exceed a fixed window: "auto" makes the window the largest
    block's, so each block's restores are all prefetch hits; the fixed window restores one tensor of each block
    on demand. The floor is lowered to a KiB so that 128 KiB blocks stand for the 128 MiB-plus of a real layer."""
    monkeypatch.setattr(offload_runtime, "_AUTO_PREFETCH_FLOOR", 1 << 10)
    layers, tensor = 4, 128 * 64 * 4
    model, x = LayerStack(layers), torch.randn(128, 64, requires_grad=True)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]

    def run(prefetch_bytes):
        model.zero_grad()
        manager = offload(min_offload_bytes=0, offload_last_module=True, budget=None, prefetch_bytes=prefetch_bytes)
        assert manager.stats()["prefetch_window_bytes"] == (1 << 10 if prefetch_bytes == "auto" else prefetch_bytes)
        offloaded_per_block = []

        class Block:
            def __enter__(self):
                self.before = manager.stats()["bytes_offloaded"]
                manager.__enter__()

            def __exit__(self, *exc):
                manager.__exit__(*exc)
                offloaded_per_block.append(manager.stats()["bytes_offloaded"] - self.before)

        loss = model(x, Block())
        settle_offload_copies(manager, timeout=SIM_SYNC_TIMEOUT_S)
        window = manager.stats()["prefetch_window_bytes"]  # before backward: this step's forward counts
        loss.backward()
        assert_bitwise_equal([expected], [[p.grad for p in model.parameters()]])
        return manager.stats(), window, offloaded_per_block

    stats, window, offloaded_per_block = run("auto")
    # Layer 0's input is the leaf x (kept); every other block offloads its input, the two, and sin's input.
    assert offloaded_per_block == [3 * tensor] + [4 * tensor] * (layers - 1)
    assert window == max(offloaded_per_block) == stats["prefetch_window_bytes"]
    assert stats["restores_on_demand"] == 1, "only backward's first restore waits for its copy"
    assert stats["prefetch_hits"] == stats["storages_offloaded"] - 1 and stats["restores_from_device"] == 0

    stats, window, _ = run(tensor)  # a fixed window of one tensor
    assert window == tensor
    assert stats["restores_on_demand"] == 1 + layers, "each block's first-packed of the two comes on demand"


def test_auto_prefetch_window_in_a_whole_forward_block_is_one_layer(offload, monkeypatch):
    """One block around the whole model (the usual `with offload: loss = model(x)`): the window is the largest
    layer of its nn.ModuleList, not the block, so backward does not bring the whole step back at once."""
    monkeypatch.setattr(offload_runtime, "_AUTO_PREFETCH_FLOOR", 1 << 10)
    layers, tensor = 4, 128 * 64 * 4
    model, x = LayerStack(layers), torch.randn(128, 64, requires_grad=True)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    manager = offload(min_offload_bytes=0, offload_last_module=True, budget=None)
    with manager:
        loss = model(x)
    settle_offload_copies(manager, timeout=SIM_SYNC_TIMEOUT_S)
    # A layer offloads its input, the two and sin's input (layer 0: not its input, the leaf x); the last one
    # runs to the block's end, the loss's input (pow) too.
    assert manager.stats()["bytes_offloaded"] == 4 * layers * tensor
    assert manager.stats()["prefetch_window_bytes"] == 5 * tensor
    loss.backward()
    assert_bitwise_equal([expected], [[p.grad for p in model.parameters()]])
    stats = manager.stats()
    assert stats["restores_on_demand"] == 1 and stats["prefetch_hits"] == stats["storages_offloaded"] - 1


def test_auto_prefetch_window_counts_pinned_bytes_only(offload, monkeypatch):
    """A pageable copy is restored on demand, never prefetched: it takes no room in the window."""
    monkeypatch.setattr(offload_runtime, "_AUTO_PREFETCH_FLOOR", 1 << 10)
    x = torch.randn(128 << 10, requires_grad=True)  # 512 KiB storages: a pinned slab each, two under the cap
    manager = offload(min_offload_bytes=0, offload_last_module=True, budget=None, max_pinned_bytes=1 << 20)
    with pytest.warns(RuntimeWarning, match="pageable"):
        with manager:
            loss = (x * 1).sin().sin().sin().sum()
    stats = manager.stats()
    assert stats["bytes_offloaded"] == 3 * (512 << 10) and stats["bytes_pageable"] == 512 << 10
    assert stats["prefetch_window_bytes"] == 1 << 20
    loss.backward()
    assert torch.equal(x.grad, torch.autograd.grad((x * 1).sin().sin().sin().sum(), x)[0])


def test_prefetch_bytes_takes_auto_or_a_nonnegative_int(offload):
    for value in ("auto", 0, 1 << 20):
        assert offload(prefetch_bytes=value).prefetch_bytes == value
    assert offload().prefetch_bytes == "auto"
    for value in ("fast", -1, None, 2.5, True):
        with pytest.raises(ValueError, match=r"prefetch_bytes must be 'auto' or a non-negative int \(bytes\)"):
            memkernels.OffloadActivations(prefetch_bytes=value)


def test_unpack_of_a_tensor_still_copying_starts_the_restores_before_it(offload):
    """A tensor whose device-to-host copy is still running is read on the device, without waiting for the
    copy; that unpack also starts restoring the offloaded tensors before it, which come back as prefetch hits
    rather than on demand."""
    x = torch.randn(256, 256, requires_grad=True)
    manager = offload(min_offload_bytes=0, offload_last_module=True, budget=None)
    with manager:
        h1 = x * 2
        h2 = h1.sin()  # saves h1
        settle_offload_copies(manager, timeout=SIM_SYNC_TIMEOUT_S)  # h1 is on the host
        sim.hold_events(True)  # h2's copy stays in flight
        loss = h2.cos().sum()  # saves h2
    # Between cos's backward (it reads h2) and sin's (it reads h1): let the copies run.
    h2.register_hook(lambda grad: sim.hold_events(False))
    loss.backward()
    assert torch.equal(x.grad, torch.autograd.grad((x * 2).sin().cos().sum(), x)[0])
    stats = manager.stats()
    assert stats["restores_from_device"] == 1
    assert stats["prefetch_hits"] == 1 and stats["restores_on_demand"] == 0


def test_unpack_reads_the_device_copy_still_held_after_its_copy_completed(offload):
    """A device copy whose D2H copy completed since the manager last looked is still alive at the unpack:
    it is read there, not dropped and copied back (a restore and a wait backward does not need)."""
    x = torch.randn(256, 256, requires_grad=True)
    manager = offload(min_offload_bytes=0, offload_last_module=True, budget=None)
    sim.hold_events(True)  # no copy completes inside the block
    with manager:
        loss = (x * 2).sin().cos().sum()  # saves sin's input and cos's
    sim.hold_events(False)
    device.synchronize()  # the copies completed; the manager has not looked since
    assert manager._pending, "the device copies are still held"
    loss.backward()
    assert torch.equal(x.grad, torch.autograd.grad((x * 2).sin().cos().sum(), x)[0])
    stats = manager.stats()
    assert stats["restores_from_device"] == 1, "cos's input, read where it was"
    assert stats["prefetch_hits"] == 1 and stats["restores_on_demand"] == 0


@pytest.mark.parametrize("first_read", ["from_host", "on_device"])
def test_a_storage_saved_by_two_ops_is_restored_once_for_both(offload, first_read):
    """tanh saves its output and sin, the next op, saves the same tensor as its input: one storage, two
    readers. Backward's first reader (sin) restores it from the host, or reads the device copy still held
    after its D2H copy completed; the second (tanh) must find that copy still on the device, not copy the
    storage back again (an H2D copy, and on a GPU a wait no prefetch hid). Once both read it, nothing holds
    it: after each pass only x's gradient is left, and a second pass (retain_graph) restores it once more."""
    x = torch.randn(256, 256, requires_grad=True)
    expected = torch.autograd.grad((x * 2).tanh().sin().sum(), x)[0]
    manager = offload(min_offload_bytes=0, offload_last_module=True, budget=None)
    sim.hold_events(first_read == "on_device")
    with manager:
        loss = (x * 2).tanh().sin().sum()  # one stash, packed twice
    sim.hold_events(False)
    if first_read == "from_host":
        settle_offload_copies(manager, timeout=SIM_SYNC_TIMEOUT_S)
    else:
        device.synchronize()  # the copy completed; the manager has not looked since (stats() would)
        assert manager._pending, "the device copy is still held"

    restores = []
    for retain_graph in (True, False):
        with PeakBytesMeter() as live:
            loss.backward(retain_graph=retain_graph)
        assert live.current_bytes <= x.nbytes, "a restored copy outlived the pass that read it"
        stats = manager.stats()
        restores.append((stats["engine"]["bytes_prefetched"], stats["restores_on_demand"]))
    assert torch.equal(x.grad, 2 * expected)
    assert manager.stats()["storages_offloaded"] == 1
    # The first pass copies back once from the host, or not at all; the second, once.
    first_pass = (x.nbytes, 1) if first_read == "from_host" else (0, 0)
    assert restores == [first_pass, (first_pass[0] + x.nbytes, first_pass[1] + 1)]
    assert manager.stats()["restores_from_device"] == (first_read == "on_device")


def test_each_offloaded_storage_comes_back_once_per_backward(offload):
    """In the GPT, softmax saves its output and the matmul with v saves it as its input: after the forward's
    copies completed, backward copies each offloaded storage back once, however many ops read it."""
    stats = offloaded_step(GPT(), make_batch(), offload(min_offload_bytes=0, offload_last_module=True, budget=None))
    assert stats["engine"]["prefetches"] == stats["storages_offloaded"]
    assert stats["engine"]["bytes_prefetched"] == stats["bytes_offloaded"]


class CheckpointedTimedLayers(TimedLayers):
    """TimedLayers with every layer checkpointed: backward recomputes each layer's forward kernel (the
    kernel comes first in the region: checkpoint stops recomputing once it has every saved tensor)."""

    def forward(self, x):
        for linear in self.linears:
            x = checkpoint(lambda h, linear=linear: F.gelu(linear(ModelledKernel.apply(h, self.seconds))), x,
                           use_reentrant=False)
        return x.pow(2).mean()


def test_offloaded_checkpoints_cost_at_most_2_percent_over_recompute(offload):
    sim.set_link_bandwidth(LINK)
    model, x = CheckpointedTimedLayers(), torch.randn(256, 64, requires_grad=True)
    recompute = modelled_steps(model, x, None, 2)
    assert recompute[-1][0] == pytest.approx(8 * 4e-3, rel=1e-9), "forward 1 ms, recompute 1 ms, backward 2 ms"
    manager = offload(only_checkpoint_inputs=True, min_offload_bytes=0)
    rows = modelled_steps(model, x, manager, 3)
    print(f"modelled step (ms): recompute {recompute[-1][0] * 1e3:.2f}; offloaded checkpoints " +
          ", ".join(f"{t * 1e3:.2f} ({b} B)" for t, b, _ in rows))
    region_input = 256 * 64 * 4
    for step_time, offloaded, _ in rows:
        # Every layer's input but the first (x, a leaf the caller holds anyway) and the last.
        assert offloaded == 6 * region_input
        assert step_time <= 1.02 * recompute[-1][0]

    with PeakBytesMeter() as live:
        with manager:
            loss = model(x)
        manager.wait_for_offloads()
        offloaded_resident = live.current_bytes
    loss.backward()
    with PeakBytesMeter() as live:
        loss = model(x)
        recompute_resident = live.current_bytes
    loss.backward()
    assert recompute_resident - offloaded_resident >= 6 * region_input, "the checkpoints' device bytes are gone"


# ------------------------------------------------------------------ API


@pytest.mark.parametrize("kwargs,name", [
    ({"budget": "fast"}, "budget"),
    ({"budget": -1}, "budget"),
    ({"link_bandwidth": 0}, "link_bandwidth"),
    ({"forward_seconds": float("inf")}, "forward_seconds"),
    ({"recast_parameters": 1}, "recast_parameters"),
    ({"only_checkpoint_inputs": "yes"}, "only_checkpoint_inputs"),
    ({"min_offload_bytes": -1}, "min_offload_bytes"),
    ({"max_pinned_bytes": 1.5}, "max_pinned_bytes"),
    ({"prefetch_bytes": "1M"}, "prefetch_bytes"),
    ({"prefetch_bytes": -1}, "prefetch_bytes"),
    ({"prefetch_bytes": None}, "prefetch_bytes"),
    ({"offload_last_module": 1}, "offload_last_module"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        memkernels.OffloadActivations(**kwargs)


def test_not_reentrant_and_unusable_after_close(offload):
    manager = offload()
    with manager:
        with pytest.raises(RuntimeError, match="already active"):
            manager.__enter__()
    manager.close()
    with pytest.raises(RuntimeError, match="closed"):
        with manager:
            pass


def test_saved_tensor_after_close_raises_clearly(offload):
    manager = offload(min_offload_bytes=0)
    x = torch.randn(100, requires_grad=True)
    with manager:
        y = (x * 2).sin().sum()
    manager.close()
    with pytest.raises(RuntimeError, match="discarded"):
        y.backward()


def test_plain_cpu_is_a_no_op_that_warns_once_naming_why():
    # A fresh interpreter without the simulator and without CUDA, every warning shown: a CPU-only torch
    # installed by mistake used to turn offload off without a word.
    code = (
        "import warnings, torch, memkernels\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    m = memkernels.OffloadActivations(min_offload_bytes=0)\n"
        "    memkernels.OffloadActivations()\n"
        "x = torch.randn(10, requires_grad=True)\n"
        "with m:\n"
        "    x2 = x * 2\n"
        "    y = x2.sin()\n"
        "assert y.grad_fn._saved_self is x2, 'a pack hook replaced the saved tensor'\n"
        "y.sum().backward()\n"
        "s = m.stats()\n"
        "assert not m.enabled and s['enabled'] is False and s['bytes_offloaded'] == 0 and s['mode'] is None, s\n"
        "assert memkernels.device.is_locked() is False\n"
        "assert len(caught) == 1, [str(w.message) for w in caught]\n"
        "assert caught[0].category is RuntimeWarning and caught[0].filename == '<string>'\n"
        "print(caught[0].message)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MEMKERNELS_DEVICE"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    message = result.stdout
    assert message.startswith("memkernels.OffloadActivations is disabled (a no-op): ")
    if torch.version.cuda is None and torch.version.hip is None:
        assert f"this torch ({torch.__version__}) is a CPU-only build" in message
    else:
        assert "torch.cuda.is_available() is False" in message


def test_exports():
    from memkernels.offload import OffloadActivations, no_offload

    assert memkernels.OffloadActivations is OffloadActivations and memkernels.no_offload is no_offload
    assert "OffloadActivations" in dir(memkernels)


class _OnCuda0(torch.Tensor):
    """A CPU tensor that reports cuda:0, as a tensor on the first GPU would."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_cuda_forward_time_is_read_at_the_next_block_without_a_sync(offload, monkeypatch):
    """The CUDA timer of budget="auto" on stand-ins (CUDA mode over the simulated engine, events on a
    fake clock): a block's forward time is read when the next block starts, if its end event completed
    (query(), never a host synchronization); the budget is the link's bandwidth times the median."""
    monkeypatch.setattr(memkernels.OffloadActivations, "_resolve_mode", staticmethod(lambda: "cuda"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    clock = {"ms": 0.0, "done": True}

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock["ms"]

        def query(self):
            return clock["done"]

        def elapsed_time(self, end):
            return end.at - self.at

        def synchronize(self):
            raise AssertionError("the forward timer must not synchronize the host")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    manager = offload(link_bandwidth=1e9)
    with manager:
        clock["ms"] += 4.0
    assert manager.stats()["budget_bytes"] is None, "the first block knows no forward time"
    with manager:  # block 1's 4 ms: 1e9 B/s x 4 ms
        clock["ms"] += 6.0
    assert manager.stats()["budget_bytes"] == 4_000_000
    with manager:  # the median of 4 and 6 ms
        clock["ms"] += 100.0
    assert manager.stats()["budget_bytes"] == 5_000_000
    clock["done"] = False  # block 3's end event has not completed when block 4 starts: not read, not waited for
    with manager:
        pass
    stats = manager.stats()
    assert stats["budget_bytes"] == 5_000_000 and stats["forward_seconds"] == pytest.approx(0.005)


def test_cuda_device_is_taken_at_enter_not_at_construction(offload, monkeypatch):
    """Built before torch.cuda.set_device(rank), the manager must serve the rank's GPU, not cuda:0.
    CUDA mode on the simulated engine, with the current device a stand-in."""
    monkeypatch.setattr(memkernels.OffloadActivations, "_resolve_mode", staticmethod(lambda: "cuda"))
    current = {"index": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    manager = offload(budget=None, min_offload_bytes=0)  # cuda:0 current here; no budget: no CUDA events
    current["index"] = 1  # torch.cuda.set_device(1)
    with manager:
        assert manager._device == torch.device("cuda", 1)
        with pytest.warns(RuntimeWarning, match="handles cuda:1 .* tensors saved on cuda:0 stay there"):
            reason, _ = manager._skip_reason(torch.zeros(4).as_subclass(_OnCuda0))
        assert reason == "other_device"
        assert manager._skip_reason(torch.zeros(4))[0] == "other_device"  # a CPU tensor: kept, no warning
    current["index"] = 0
    with pytest.raises(RuntimeError, match="one OffloadActivations per device"):
        manager.__enter__()
    assert not manager._active


def test_pinned_cap_trims_at_the_next_block_not_inside_the_step(offload):
    manager = offload(min_offload_bytes=0, max_pinned_bytes=1 << 20, offload_last_module=True,
                      pageable_fallback=False)
    x = torch.randn(512, 256, requires_grad=True)  # 512 KiB saved: a slab of its own
    with manager:
        y = (x * 2).sin().sum()
    y.backward()
    manager.wait_for_offloads()
    del y
    big = torch.randn(900, 256, requires_grad=True)  # 900 KiB: needs the first slab's room
    with manager:
        z = (big * 2).sin().sum()
    frees_in_step = manager.stats()["engine"]["pool"]["slab_frees"]
    assert frees_in_step == 0 and manager.stats()["kept_by_reason"]["cap"] > 0  # refused, not trimmed mid-step
    z.backward()
    with manager:  # the next block starts outside the step: the unused slab goes back now
        w = (big * 2).sin().sum()
    pool = manager.stats()["engine"]["pool"]
    assert pool["slab_frees"] >= 1 and manager.stats()["storages_offloaded"] > 1
    w.backward()
    del z, w
    manager.wait_for_offloads()
    manager.empty_cache()  # outside the step: nothing in use, everything goes back
    stats = manager.stats()
    assert stats["live_handles"] == 0 and stats["pinned_bytes"] == 0


class _CountingEngine:
    """The C++ engine with its waiting calls counted (trim() waits on every copy in flight)."""

    def __init__(self, engine):
        self._engine, self.calls = engine, collections.Counter()

    def __getattr__(self, name):
        attr = getattr(self._engine, name)
        if name in ("trim", "synchronize_all"):
            def counted(*args, **kwargs):
                self.calls[name] += 1
                return attr(*args, **kwargs)
            return counted
        return attr


@pytest.mark.parametrize("pageable_fallback", [False, True], ids=["kept", "pageable"])
def test_pinned_cap_refusal_never_trims_between_the_blocks_of_one_forward(offload, pageable_fallback):
    """A block per layer (what apply_plan's per-layer offload does) under a cap that refuses: entering a later
    block of the same forward must not trim, since trim() waits for every copy in flight and the host would
    stop there behind the earlier layers' copies (modelled: its clock would jump). The refusal is answered
    between steps, at the next step's first block: the unused pinned slab goes back then. Gradients bitwise
    equal to no offload."""
    sim.set_link_bandwidth(LINK)  # each 32 KiB copy takes 0.5 modelled ms, the layers' compute none
    layers, tensor, steps = 4, 128 * 64 * 4, 3
    model, x = LayerStack(layers), torch.randn(128, 64, requires_grad=True)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    cap = tensor + tensor // 2  # one 32 KiB block pins, the next one is refused
    manager = offload(min_offload_bytes=0, offload_last_module=True, budget=None, max_pinned_bytes=cap,
                      pageable_fallback=pageable_fallback)
    engine = manager._engine = _CountingEngine(_C.offload.Engine(max_pinned_bytes=cap))
    entries = []  # per block entry: (step, block, waits during __enter__, host clock moved, slab frees)

    class PerLayerBlock:
        def __init__(self, step):
            self.step, self.block = step, 0

        def __enter__(self):
            calls, clock = sum(engine.calls.values()), sim.host_clock()
            frees = engine.stats()["pool"]["slab_frees"]
            manager.__enter__()
            entries.append((self.step, self.block, sum(engine.calls.values()) - calls, sim.host_clock() - clock,
                            engine.stats()["pool"]["slab_frees"] - frees))
            self.block += 1

        def __exit__(self, *exc):
            manager.__exit__(*exc)

    warns = pytest.warns(RuntimeWarning, match="pageable") if pageable_fallback else contextlib.nullcontext()
    refusals = []
    with warns:
        for step in range(steps):
            model.zero_grad()
            loss = model(x, PerLayerBlock(step))
            refusals.append(engine.stats()["pool"]["refusals"])
            loss.backward()
            assert_bitwise_equal([expected], [[p.grad for p in model.parameters()]])
            del loss
    assert refusals[0] > 0 and refusals == sorted(set(refusals)), "every step's forward was refused pinned memory"
    stats = manager.stats()
    assert (stats["bytes_pageable"] > 0) == pageable_fallback and (stats["kept_by_reason"]["cap"] > 0) != (
        pageable_fallback)
    mid_forward = [e for e in entries if e[1] > 0]
    assert len(mid_forward) == steps * (layers - 1)
    assert all(waits == 0 and moved == 0 for _, _, waits, moved, _ in mid_forward), \
        f"a later block of a forward trimmed or waited on the copies: {mid_forward}"
    # Between steps the trim still runs (once per step after a refusal) and gives the unused slab back.
    first_blocks = [e for e in entries if e[1] == 0]
    assert engine.calls["trim"] == steps - 1
    assert first_blocks[0][2] == 0 and all(waits >= 1 and frees >= 1 for _, _, waits, _, frees in first_blocks[1:]), \
        f"the next step's first block must trim and give the unused slab back: {first_blocks}"
    assert stats["engine"]["pool"]["peak_pinned_bytes"] <= cap
    manager.wait_for_offloads()
    manager.empty_cache()
    assert manager.stats()["live_handles"] == 0 and manager.stats()["pinned_bytes"] == 0
