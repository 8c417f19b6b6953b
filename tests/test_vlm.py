"""memkernels.apply() on vision-language models (issue 37 point 2): tiny Qwen2.5-VL and Gemma 3 built from their
transformers configs (random weights, random pixel values, fp32 on the CPU).

apply() fuses the language model's norms, gated MLPs, RoPE and the LM head's loss (in the
``...ForConditionalGeneration`` wrapper), and the vision tower's norms and MLPs where their formulas match; the
images pass through the vision tower as before. Parity is test_patch.py's rule (against the unpatched model in
float64, the patched model's loss and every gradient, vision tower's included, err at most 2x what the unpatched
model errs in fp32, plus a floor of a few fp32 roundings). In bfloat16 the same rule holds fusion by fusion on the
inputs each sees in the model, and the whole model's gradient error matches the unpatched model's (see below).
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memkernels.fusions.apply import apply  # noqa: E402
from memkernels.testing import check_against_reference  # noqa: E402
from test_patch import _assert_parity, _loss_and_grads, _with_random_norm_weights  # noqa: E402

VOCAB = 160
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128)


def _require(name):
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return getattr(transformers, name)


def _qwen2_5_vl():
    """Qwen2.5-VL: a 2-block vision tower (RMSNorms, gated SiLU MLPs with biases, windowed attention) whose merger
    turns 4 x 4 patches of 14 px into 4 image tokens; a 2-layer Qwen2 language model with multimodal RoPE."""
    model_class, config_class = _require("Qwen2_5_VLForConditionalGeneration"), _require("Qwen2_5_VLConfig")
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    text = dict(TEXT, num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
                bos_token_id=0, eos_token_id=0)
    config = config_class(text_config=text, vision_config=vision, image_token_id=150, video_token_id=151,
                          vision_start_token_id=152, vision_end_token_id=153, attn_implementation="sdpa")
    model = model_class(config)
    ids = torch.randint(0, 140, (1, 24))
    ids[0, 3], ids[0, 4:8], ids[0, 8] = 152, 150, 153  # <vision_start> 4 x <image> <vision_end>
    labels = ids.clone()
    labels[0, :9] = -100  # the prompt and the image are not scored
    vc = config.vision_config
    images = dict(pixel_values=torch.randn(16, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2),
                  image_grid_thw=torch.tensor([[1, 4, 4]]))
    return model, ids, labels, images


def _gemma3():
    """Gemma 3: a 2-layer SigLIP vision tower (LayerNorms, GELU-tanh fc1/fc2 MLPs) on 28 x 28 px images in 7 px
    patches, pooled to 4 tokens an image and normalized by the projector's Gemma RMSNorm; a 2-layer Gemma 3
    language model. Its text config's softcap is set: the wrapper does not apply it (Gemma3ForCausalLM does)."""
    model_class, config_class = _require("Gemma3ForConditionalGeneration"), _require("Gemma3Config")
    text = dict(TEXT, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7)
    config = config_class(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=150,
                          boi_token_index=151, eoi_token_index=152, attn_implementation="sdpa")
    model = _with_random_norm_weights(model_class(config))
    with torch.no_grad():  # initialized to zeros: the images would reach the language model as zeros, no gradient back
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    ids = torch.randint(1, 140, (2, 20))
    ids[:, 3:7] = 150  # 4 image tokens in each row
    labels = ids.clone()
    labels[:, :7] = -100
    images = dict(pixel_values=torch.randn(2, 3, 28, 28), token_type_ids=(ids == 150).long())
    return model, ids, labels, images


MODELS = {"qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3}
# The CAUSAL_LM_HEADS entries these models test (test_apply_training.py tests the text-only ones).
HEADS = {"Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Gemma3ForConditionalGeneration": "gemma3"}
# What apply() must fuse in each tower (the report's ``tower`` labels, by their first word) and leave alone.
FUSED = {
    "qwen2_5_vl": {"vision": {"Qwen2_5_VLRMSNorm": 5, "Qwen2_5_VLMLP": 2},
                   "language": {"Qwen2_5_VLRMSNorm": 5, "Qwen2MLP": 2, "Qwen2_5_VLAttention": 2},
                   "LM": {"Qwen2_5_VLForConditionalGeneration": 1}},
    "gemma3": {"vision": {"LayerNorm": 6, "SiglipMLP": 3},
               "projector": {"Gemma3RMSNorm": 1},
               "language": {"Gemma3RMSNorm": 13, "Gemma3MLP": 2, "Gemma3Attention": 2},
               "LM": {"Gemma3ForConditionalGeneration": 1}},
}
LEFT_ALONE = {"qwen2_5_vl": {"vision": {"Qwen2_5_VLVisionAttention": 2}}, "gemma3": {}}


def assert_patched_parity(model, patched, ids, labels, **kwargs):
    """test_patch.assert_patched_parity with the image inputs: loss and every gradient of ``patched`` against
    ``model``, both judged against float64; returns the patched model's gradients."""
    reference = copy.deepcopy(model).double()
    doubled = {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items() if torch.is_tensor(v)}
    loss64, grads64 = _loss_and_grads(reference, ids, labels, **{**kwargs, **doubled})
    loss32, grads32 = _loss_and_grads(model, ids, labels, **kwargs)
    loss_p, grads_p = _loss_and_grads(patched, ids, labels, **kwargs)
    _assert_parity(loss64.reshape(1), loss32.reshape(1), loss_p.reshape(1), "loss")
    assert set(grads_p) == set(grads32)
    global_scale = max(g.abs().max().item() for g in grads64.values())
    for name, g64 in grads64.items():
        _assert_parity(g64, grads32[name], grads_p[name], name, scale=max(g64.abs().max().item(), global_scale * 1e-3))
    return grads_p


def _by_tower(rows, key):
    towers = {}
    for row in rows:
        kinds = towers.setdefault(row["tower"].split()[0], {})
        kinds[row[key]] = kinds.get(row[key], 0) + 1
    return towers


def _build(name):
    torch.manual_seed(0)
    model, ids, labels, images = MODELS[name]()
    return model.train(), ids, labels, images


@pytest.mark.parametrize("name", sorted(MODELS))
def test_report_lists_each_tower(name):
    model, *_ = _build(name)
    report = apply(model)
    assert _by_tower(report.replaced, "before") == FUSED[name]
    assert _by_tower(report.skipped, "type") == LEFT_ALONE[name]
    assert all(row["reason"] for row in report.skipped)
    summary = report.summary()
    assert "by tower:" in summary and "LM head and loss: fused 1 x" in summary
    assert report.bytes_per_token["after"] < report.bytes_per_token["before"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_loss_and_gradients_match_with_images(name):
    model, ids, labels, images = _build(name)
    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    kwargs = dict(images, use_cache=False)

    # The fused loss is what runs: no logits are materialized, the output keeps the wrapper's fields.
    out = patched(input_ids=ids, labels=labels, **kwargs)
    expected = model(input_ids=ids, labels=labels, **kwargs)
    assert out.logits is None and type(out) is type(expected)
    assert out.image_outputs is not None
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)

    grads = assert_patched_parity(model, patched, ids, labels, **images)  # test_patch's _loss: use_cache=False
    vision = [n for n in grads if ".visual." in n or ".vision_tower." in n]
    assert vision and all(grads[n].abs().sum() > 0 for n in vision if "norm" in n or "mlp" in n)  # images reach the loss

    # eval mode: the model's own forward, logits as before
    patched.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids, **kwargs).logits, model(input_ids=ids, **kwargs).logits,
                                   rtol=1e-5, atol=1e-5)


def test_every_vision_language_head_is_tested_here():
    assert set(HEADS.values()) == set(MODELS)
    for name in MODELS:
        assert set(FUSED[name]["LM"]) <= set(HEADS)


@pytest.mark.parametrize("name", ["qwen2_5_vl"])
def test_bfloat16_loss_and_gradients_match_with_images(name):
    """The same parity in bfloat16 (the model and the pixel values; the float64 reference from the same weights):
    every gradient, the vision tower's included, errs at most 2x what the unpatched bf16 model errs plus one bf16
    rounding of its scale (test_patch._assert_parity: a bf16 gradient is stored no nearer). Measured over seeds 0-2
    and ATEN_CPU_CAPABILITY default / avx2 / this machine's: 0.54-0.84 of that bound (seed 0, the test's: at most
    0.68); without the bf16 floor 1.04x at avx2. Gemma 3 is not held to this whole-model per-tensor rule: see the
    three bfloat16 tests below, which hold both models to it fusion by fusion."""
    model, ids, labels, images = _build(name)
    model = model.to(torch.bfloat16)
    images = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in images.items()}
    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    assert_patched_parity(model, patched, ids, labels, **images)


# bfloat16, fusion by fusion. Through a whole model, each gradient's error is the sum of every op's rounding on
# the way back, and the patched model's roundings differ from the unpatched one's wherever one fused op sits: the
# per-tensor rule then compares two draws of the same noise. Gemma 3 (seeds 0-5, ATEN_CPU_CAPABILITY default, avx2
# and AVX512): the patched model's error over all gradients is 0.90-1.16x the unpatched one's and its median
# tensor's 0.84-1.18x, while the largest per-tensor ratio is 1.47-2.48x (16-element q/k norm weights, and the
# embeddings and projections at the far end of the chain). The RoPE op alone (random q, k) errs 0.61-1.00x what
# Hugging Face's errs. So each fusion is held to test_patch's rule (check_against_reference's) on the inputs it sees
# in the model (seeds 0-5 at AVX512, 0-3 at default, 0-2 at avx2, both models: modules at most 0.71 of the bound,
# RoPE 0.31, the loss head 0.61), and the whole model to its error over all gradients. A norm whose output is 2^-7
# too large, or RoPE's sin table 2^-6 too large, fails.

def _bf16(name):
    model, ids, labels, images = _build(name)
    images = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in images.items()}
    return model.to(torch.bfloat16), ids, labels, images


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bfloat16_each_fused_module_matches_on_its_inputs_in_the_model(name):
    """Every module apply() replaced (norms and MLPs of both towers, the projector's norm) run in bf16 on the
    inputs it gets in the unpatched bf16 model, forward and backward: each output and gradient (inputs' and
    weights') within check_against_reference's rule (test_patch's) of the unpatched module's, against the module
    in float64 on the same inputs. Attention modules are checked at their RoPE call (next test), the wrapper at its
    loss head (the one after)."""
    model, ids, labels, images = _bf16(name)
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    names = [row["name"] for row in report.replaced
             if row["name"] and not row["after"].startswith("MemkernelsRope")]
    calls = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda module, args, kwargs, n=n: calls.setdefault(n, (args, kwargs)) and None, with_kwargs=True)
        for n in names]
    model(input_ids=ids, labels=labels, use_cache=False, **images)
    for hook in hooks:
        hook.remove()
    assert set(calls) == set(names) and len(names) >= 10
    for n in names:
        args, kwargs = calls[n]
        assert not any(torch.is_tensor(value) for value in kwargs.values()), (n, kwargs)  # passed as they are
        eager, fused = model.get_submodule(n), patched.get_submodule(n)
        weights = dict(eager.named_parameters())
        assert list(dict(fused.named_parameters())) == list(weights), n  # apply() keeps the module's parameters

        def call(module):  # the module on (its inputs, then its parameters), each an input to check
            return lambda *tensors: torch.func.functional_call(
                module, dict(zip(weights, tensors[len(args):])), tensors[:len(args)], kwargs)

        inputs = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args]
        check_against_reference(call(fused), call(eager), [*inputs, *(w.detach().requires_grad_() for w in
                                                                      weights.values())], name=n)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bfloat16_rope_matches_on_the_queries_and_keys_in_the_model(name, monkeypatch):
    """The fused RoPE on each (q, k, cos, sin) the patched bf16 model's attention passes it: outputs and q's and k's
    gradients within check_against_reference's rule of Hugging Face's formula in bf16 (rope's eager twin)."""
    from memkernels.fusions.rope import op as rope_op
    from memkernels.fusions.rope import reference as rope_reference
    model, ids, labels, images = _bf16(name)
    apply(model, measure=False)
    calls, fused = [], rope_op.rope_checked
    monkeypatch.setattr(rope_op, "rope_checked", lambda *args: calls.append(args) or fused(*args))
    model(input_ids=ids, labels=labels, use_cache=False, **images).loss.backward()
    assert len(calls) == model.config.text_config.num_hidden_layers
    for index, (q, k, cos, sin, *backend) in enumerate(calls):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()  # queries and keys are what is rotated
        check_against_reference(lambda *a: fused(*a, *backend), rope_reference.eager, [q, k, cos, sin],
                                name=f"RoPE call {index}")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bfloat16_loss_head_and_the_whole_model_match(name):
    """The fused loss head in the bf16 model (nothing else fused): the loss and every gradient within test_patch's
    rule. Then everything fused: the error of all gradients together (root mean square, against the float64 model)
    at most 1.5x the unpatched bf16 model's; measured 0.90-1.16x for Gemma 3 and 1.01-1.04x for Qwen2.5-VL (see
    above). A wrong formula or wiring in any fusion errs by far more than rounding does."""
    model, ids, labels, images = _bf16(name)
    head_only = copy.deepcopy(model)
    apply(head_only, norms=False, mlp=False, rope=False, measure=False)
    assert_patched_parity(model, head_only, ids, labels, **images)

    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    reference = copy.deepcopy(model).double()
    doubled = {k: v.double() if v.is_floating_point() else v for k, v in images.items()}
    _, grads64 = _loss_and_grads(reference, ids, labels, **doubled)
    _, grads_eager = _loss_and_grads(model, ids, labels, **images)
    _, grads_patched = _loss_and_grads(patched, ids, labels, **images)
    assert set(grads_patched) == set(grads_eager) == set(grads64)

    def error(grads):
        return sum((grads[n].double() - g).pow(2).sum().item() for n, g in grads64.items()) ** 0.5

    assert error(grads_patched) <= 1.5 * error(grads_eager), (error(grads_patched), error(grads_eager))
