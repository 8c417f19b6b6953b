"""benchmarks/bench_step.py's CPU counts of a whole Llama training step, pinned (issue 31.4). No timing.

The model is the benchmark's CPU shape (H 64, I 224, 2 heads, 1 KV head, vocab 512, 2 layers, fp32, SDPA,
use_cache=False, AdamW fused) at 8 tokens, where the Triton interpreter's time is short. The launches per layer
do not depend on the tokens; the step's count and the saved bytes do, through the loss: its "auto" strategy
(linear_cross_entropy.pick_strategy) takes "recompute" at 8 float32 tokens and "chunked" from 119 (at the
benchmark's 128 tokens apply()'s step is 126 launches, recompute's 130). A launch is an aten op that runs a
kernel or a Triton grid (gpu_audit.count(); see the benchmark's docstring); launches per layer are the 2-layer
model's count minus the 1-layer model's. The saved bytes per token (SavedBytesMeter over the forward) are pinned
too.

Where the counts per layer come from (each measured op by op on transformers 5.24 / torch 2.13):
  common to every column, 30: 21 GEMMs (q, k, v, o, gate, up, down forward; dX and dW of each backward),
      SDPA forward and backward (2), 7 adds (2 residual adds forward; backward, the gradient sums at the two
      residual adds, at the normed input of q, k, v (2) and of gate, up (1));
  Hugging Face's eager RoPE, 25 (the eager column): forward, for q and for k, x * cos, rotate_half (neg, cat),
      * sin, add = 10; backward, for each, two muls, neg, two slice_backward, two adds = 14; and the copy that
      turns q's gradient, [batch, heads, tokens, head_dim] after RoPE's backward, back into q_proj's [batch,
      tokens, hidden] (1; k's, one KV head here, is a view: at 8 KV heads it copies too);
  eager RMSNorm, 20 each: forward pow, mean, add eps, rsqrt, two muls (6); backward the autograd formulas:
      dW (mul, sum), d normed (mul), dx through rstd (mul), d rstd (mul, sum), rsqrt's (pow, two muls),
      mean's (div), pow's (pow, two muls), the sum of x's two gradients (add) (14);
  eager SwiGLU, 5: silu and mul forward; two muls and silu_backward backward.
  memkernels' RoPE, 2: _rope_kernel forward and backward, q and k in one launch each; its gradients come laid
      out as q_proj's output, so no copy;
  memkernels' RMSNorm, 3 each: _norm_fwd_kernel, _norm_bwd_kernel, _norm_reduce_partials_kernel (the dW sum);
  memkernels' gated MLP, 2: _product_kernel forward, _product_backward_kernel backward;
  mlp="recompute": gate and up recomputed in backward (2 more GEMMs); x's gradient from them summed by one
      add, as autograd sums it in the saving variant (the gradients bitwise equal): +2.
So eager 30 + 25 + 2 x 20 + 5 = 100; memkernels 30 + 2 + 2 x 3 + 2 = 40; recompute 42. Liger, 40: the
benchmark's LIGER_LAUNCHES_PER_LAYER_FROM_SOURCE (30 common + its RMSNorm 3 each + its RoPE 2 + its SwiGLU 2),
checked here against Liger's own kernels when liger_kernel is installed.

The step's launches beyond the layers (embedding, rotary tables, causal-mask setup, final norm, LM head and
loss, fused AdamW), per the 1-layer model: eager 150 - 100 = 50, memkernels 84 - 40 = 44, recompute 85 - 41 =
44.
"""
import pytest
from bench_loader import load_benchmark

pytest.importorskip("transformers")

bench_step = load_benchmark("bench_step")

pytestmark = pytest.mark.skipif(not bench_step.interpreting(), reason=(
    "counts Triton launches through the interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets on a "
    "machine without CUDA)"))

SHAPE = bench_step.default_shape("cpu", tokens=8)
# {column: (launches per step, launches per layer)}: derived in the module docstring
PINNED = {"eager": (250, 100), "memkernels": (124, 40), "recompute": (128, 42)}
# {column: saved bytes per token}: SavedBytesMeter's new bytes over the forward / 8 tokens (eager 119,148 bytes,
# apply() 63,912, recompute 35,240), as measured on transformers 5.24 / torch 2.13; deterministic (shapes and
# dtypes only). mlp="recompute" saves apply()'s bytes less each MLP's gate and up: 2 x 224 x 4 bytes a token in
# each of the 2 layers, 3,584 bytes a token.
PINNED_SAVED_PER_TOKEN = {"eager": 14893.5, "memkernels": 7989.0, "recompute": 4405.0}
_figures = {}


def figures(column):
    if column not in _figures:
        with bench_step._one_thread():
            _figures[column] = bench_step.count_column(column, SHAPE)
    return _figures[column]


def test_the_cpu_shape_is_the_benchmarks():
    assert (SHAPE.layers, SHAPE.hidden, SHAPE.intermediate, SHAPE.heads, SHAPE.kv_heads, SHAPE.vocab) == (
        2, 64, 224, 2, 1, 512)
    config = bench_step.llama_config(SHAPE)
    assert config._attn_implementation == "sdpa" and not config.tie_word_embeddings and not config.use_cache


@pytest.mark.parametrize("column", ["eager", "memkernels", "recompute"])
def test_launches_per_step_and_per_layer(column):
    counted = figures(column)
    assert (counted["launches"], counted["launches_per_layer"]) == PINNED[column], counted["by_kernel"]
    kernels = counted["by_kernel"]
    if column == "eager":
        assert not any(name.startswith("triton:") for name in kernels)
    else:  # memkernels' Triton path ran (the GPU's launches), not its PyTorch reference
        assert kernels["triton:_norm_fwd_kernel"] == kernels["triton:_norm_bwd_kernel"] == 5  # 2 per layer + final
        assert kernels["triton:_product_kernel"] == kernels["triton:_product_backward_kernel"] == 2
        assert kernels["triton:_rope_kernel"] == 4  # forward and backward, 2 layers
        # and saved fewer bytes per token for backward than eager
        assert PINNED_SAVED_PER_TOKEN[column] < PINNED_SAVED_PER_TOKEN["eager"]
    # the saved bytes per token, exactly (each interpreted column counted once, in its own test)
    assert counted["saved"] / SHAPE.tokens == PINNED_SAVED_PER_TOKEN[column], counted["saved"]


def test_recompute_saves_apply_s_bytes_less_the_mlp_s_gate_and_up():
    # on the pinned figures: 2 layers x (gate + up) x I x 4 bytes (float32)
    assert PINNED_SAVED_PER_TOKEN["memkernels"] - PINNED_SAVED_PER_TOKEN["recompute"] == (
        SHAPE.layers * 2 * SHAPE.intermediate * 4)


def test_memkernels_launches_per_layer_at_most_liger():
    # on the pinned figures, which test_launches_per_step_and_per_layer holds to the measured counts
    liger = bench_step.LIGER_LAUNCHES_PER_LAYER_FROM_SOURCE
    assert PINNED["memkernels"][1] <= liger
    assert bench_step.done({"memkernels": {"launches_per_layer": PINNED["memkernels"][1]}})
    # recompute: apply()'s launches and the two recomputed GEMMs (gate, up), by design; the two projections' dx
    # are summed by one add, as in the saving variant (where autograd's accumulation runs it)
    assert PINNED["recompute"][1] == PINNED["memkernels"][1] + 2


def test_liger_count_from_source_is_its_kernels_count():
    pytest.importorskip("liger_kernel.transformers")
    counted = figures("liger")
    assert counted["launches_per_layer"] == bench_step.LIGER_LAUNCHES_PER_LAYER_FROM_SOURCE == 40
    kernels = counted["by_kernel"]
    assert kernels["triton:_rms_norm_forward_kernel"] == kernels["triton:_rms_norm_backward_kernel"] == 5
    assert kernels["triton:_triton_rope"] == 4 and kernels["triton:_swiglu_forward_kernel"] == 2
    # its module-level patches were undone: the next model runs Hugging Face's own RoPE again
    from transformers.models.llama import modeling_llama
    assert modeling_llama.apply_rotary_pos_emb.__module__ == modeling_llama.__name__


def test_table_prints_the_rows_and_the_verdict():
    eager = dict(figures("eager"), host_s=None, step_s=None)
    # memkernels' column as pinned (its count is test_launches_per_step_and_per_layer's)
    launches, per_layer = PINNED["memkernels"]
    results = {"eager": eager, "memkernels": dict(eager, launches=launches, launches_per_layer=per_layer)}
    table = bench_step.format_table(SHAPE, results, {"compile": "not run on a CPU"})
    for row in ("peak MiB", "saved B/token", "launches/step", "launches/layer", "syncs/step", "host ms/step"):
        assert row in table
    assert "launches per layer <= Liger's (40, from its source" in table and table.endswith("apply() 40: met")
    # one launch a layer more than Liger's is not
    results["memkernels"]["launches_per_layer"] = 41
    assert bench_step.format_table(SHAPE, results, {}).endswith("apply() 41: NOT met")
