"""OffloadActivations under FSDP2 (fully_shard): two CPU processes, gloo backend, the simulated device.

Each rank trains its half of a batch with every block and the whole model sharded; its gradients (the
reduce-scattered shards) with offload must be bitwise identical to the same rank's without it, in each
mode: everything (budget=None), the default budget ("auto": the first step offloads everything, the
second runs under the budget), and offloaded checkpoints (the blocks checkpointed, only their inputs
offloaded), each over two steps. FSDP2 swaps unsharded parameters in and out around each block's
forward; the offload must neither copy them nor hold them.
"""
import torch

from gloo_ranks import WORLD, spawn
from memkernels.models import ModelConfig, TransformerLM

CONFIG = ModelConfig(name="dist-tiny", vocab_size=101, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=4,
                     intermediate_size=64, max_seq_len=32, norm="layernorm", mlp="gelu", position="learned",
                     tie_embeddings=False, bias=True)
MODES = {  # name: (OffloadActivations keywords, checkpoint the blocks)
    "everything": ({"budget": None}, False),
    "auto": ({}, False),
    "checkpoints": ({"only_checkpoint_inputs": True}, True),
}
STEPS = 2


def _sharded(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train(model, batches, manager):
    """Every step's gradient shards (local tensors), SGD between steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for ids in batches:
        if manager is None:
            loss = model(ids, ids)
        else:
            with manager:
                loss = model(ids, ids)
        loss.backward()
        steps.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return steps


def _offloaded_training(rank):
    import memkernels
    from memkernels import device
    from torch.distributed.device_mesh import init_device_mesh

    device.use_sim()
    lines = []
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(1234)  # same weights and batches on every rank
    base = TransformerLM(CONFIG)
    batches = [torch.randint(0, CONFIG.vocab_size, (4, 24)).chunk(WORLD)[rank] for _ in range(STEPS)]
    for name, (options, checkpointed) in MODES.items():
        expected_model, model = TransformerLM(CONFIG), TransformerLM(CONFIG)
        for copy in (expected_model, model):
            copy.load_state_dict(base.state_dict())
            copy.checkpointing = checkpointed
        expected = _train(_sharded(expected_model, mesh), batches, None)
        manager = memkernels.OffloadActivations(min_offload_bytes=0, **options)
        try:
            actual = _train(_sharded(model, mesh), batches, manager)
            stats = manager.stats()
        finally:
            manager.close()
        different = [f"step {step} {n}" for step, (e, a) in enumerate(zip(expected, actual))
                     for n in e if not torch.equal(e[n], a[n])]
        lines.append(f"{name} offloaded {stats['storages_offloaded']} parameters_kept "
                     f"{stats['kept_by_reason']['parameter']} different {different}")
    return lines


def test_fsdp2_gradients_bitwise_identical_with_offload_in_every_mode(tmp_path):
    for rank, rows in enumerate(spawn(tmp_path, _offloaded_training)):
        assert [row.split()[0] for row in rows] == list(MODES), rows
        for row in rows:
            words = row.split()
            assert int(words[2]) > 0, f"rank {rank}: nothing offloaded: {row}"
            assert row.endswith("different []"), f"rank {rank}: {row}"
