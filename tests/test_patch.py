"""memkernels.apply on tiny Hugging Face models built from configs (no downloads) and on TransformerLM.

Parity is judged the project's way: the unpatched model run in float64 is the
reference; the patched fp32 model's loss and every parameter gradient must be
within 2x the error the unpatched fp32 model itself makes against it (plus a
floor of a few fp32 roundings of the largest value, for gradients that are zero
by symmetry and hold only rounding noise).
"""
import copy
import inspect
import sys

import pytest
import torch

from memkernels.fusions.apply import apply
from memkernels.models import ModelConfig, TransformerLM
from memkernels.runtime.ledger import activation_ledger

transformers = pytest.importorskip("transformers")

VOCAB = 131
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, attn_implementation="sdpa")


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **COMMON))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **COMMON))


def _qwen3():  # also RMSNorms over each head's queries and keys (q_norm, k_norm)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_key_value_heads=2, head_dim=16, **COMMON))


def _with_random_norm_weights(model):
    """Gemma initializes its norm weights to 0 (scale 1 + w), the others to 1: make the weights matter."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
                module.weight.normal_(0, 0.1)
    return model


def _gemma():
    return _with_random_norm_weights(
        transformers.GemmaForCausalLM(transformers.GemmaConfig(num_key_value_heads=1, head_dim=16, **COMMON)))


def _gemma3():
    # a softcap small enough to bend these logits
    config = transformers.Gemma3TextConfig(num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5, **COMMON)
    return _with_random_norm_weights(transformers.Gemma3ForCausalLM(config))


def _qwen3_5():  # its RMSNorm is Gemma's (1 + w), which a name would not tell
    # full attention only: its linear-attention layers' CPU fallback makes a Trainer run take a minute, and
    # apply() leaves attention alone
    config = transformers.Qwen3_5TextConfig(num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=0,
                                            eos_token_id=0, layer_types=["full_attention"] * 2, **COMMON)
    return _with_random_norm_weights(transformers.Qwen3_5ForCausalLM(config))


def _gemma4():  # its norms scale by the weight in float32 (not 1 + w); its v_norm has no weight
    # Its per-layer input embeddings and its full-attention layers' head size shrunk with the rest: at their
    # defaults (262144 x 256 per-layer embeddings, head_dim 512) the tiny model had 134.7 M parameters and its
    # tests took minutes; apply() touches neither.
    config = transformers.Gemma4TextConfig(num_key_value_heads=1, head_dim=16, global_head_dim=16,
                                           final_logit_softcapping=0.5, vocab_size_per_layer_input=VOCAB,
                                           hidden_size_per_layer_input=16, pad_token_id=0, bos_token_id=0,
                                           eos_token_id=0, **COMMON)
    return _with_random_norm_weights(transformers.Gemma4ForCausalLM(config))


def _olmo2():  # its RMSNorm scales in float32, then casts
    return _with_random_norm_weights(transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
        num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0, **COMMON)))


def _phi3():  # packed gate_up_proj
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0, **COMMON))


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(config)


def _tiny_lm():
    config = ModelConfig(name="tiny", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                         intermediate_size=96, max_seq_len=64, norm="layernorm", mlp="gelu", position="learned",
                         tie_embeddings=True, bias=True)
    return TransformerLM(config)


HF_MODELS = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_5": _qwen3_5, "gemma": _gemma,
             "gemma3": _gemma3, "gemma4": _gemma4, "olmo2": _olmo2, "phi3": _phi3, "gpt2": _gpt2}
ALL_MODELS = dict(HF_MODELS, memkernels_tiny_lm=_tiny_lm)


def _batch(batch=2, seq=24):
    ids = torch.randint(0, VOCAB, (batch, seq))
    labels = ids.clone()
    labels[0, :3] = -100  # ignored positions, as padding would be
    return ids, labels


def _loss(model, ids, labels, **kwargs):
    if isinstance(model, TransformerLM):
        return model(ids, labels)
    return model(input_ids=ids, labels=labels, use_cache=False, **kwargs).loss


def _loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = _loss(model, ids, labels, **kwargs)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_parity(reference, eager, patched, name, scale=None):
    """patched within 2x eager's error against the float64 reference, plus a floor of
    4 fp32 roundings of ``scale`` (default: the reference's largest magnitude), or, for a result
    stored in a half dtype, one rounding to that dtype: its elements are stored no nearer."""
    scale = reference.abs().max().item() if scale is None else scale
    eager_error = (eager.double() - reference).abs().max().item()
    patched_error = (patched.double() - reference).abs().max().item()
    floor = max(4 * torch.finfo(torch.float32).eps, torch.finfo(patched.dtype).eps / 2) * scale
    assert patched_error <= 2 * eager_error + floor, (
        f"{name}: patched error {patched_error:.3e} > 2 x eager error {eager_error:.3e} + floor {floor:.1e}")


@pytest.fixture
def triton_backend():
    from memkernels import set_backend
    set_backend("triton")
    yield
    set_backend("auto")


@pytest.mark.parametrize("family", sorted(ALL_MODELS))
def test_loss_and_every_gradient_match_unpatched(family):
    _check_gradient_parity(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["memkernels_tiny_lm", "gpt2", "llama"])
def test_triton_kernels_match_unpatched(family, triton_backend):
    """The same parity with the Triton kernels (run by the interpreter on the CPU)."""
    _check_gradient_parity(family)


def _check_gradient_parity(family):
    model = ALL_MODELS[family]().train()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    assert report.replaced, report.summary()
    assert_patched_parity(model, patched, *_batch())


def assert_patched_parity(model, patched, ids, labels):
    """Loss and every gradient of ``patched`` against ``model``, both judged against float64; returns
    the patched model's gradients."""
    reference = copy.deepcopy(model).double()
    loss64, grads64 = _loss_and_grads(reference, ids, labels)
    loss32, grads32 = _loss_and_grads(model, ids, labels)
    loss_p, grads_p = _loss_and_grads(patched, ids, labels)
    _assert_parity(loss64.reshape(1), loss32.reshape(1), loss_p.reshape(1), "loss")
    assert set(grads_p) == set(grads32)
    # The floor is relative to the model's largest gradient: some gradients are zero
    # by symmetry (a key bias under softmax) and hold rounding noise only.
    global_scale = max(g.abs().max().item() for g in grads64.values())
    for name, g64 in grads64.items():
        _assert_parity(g64, grads32[name], grads_p[name], name, scale=max(g64.abs().max().item(), global_scale * 1e-3))
    return grads_p


@pytest.mark.parametrize("family", sorted(ALL_MODELS))
def test_ledger_shows_fewer_saved_bytes_per_token(family):
    model = ALL_MODELS[family]().train()
    patched = copy.deepcopy(model)
    report = apply(patched)
    ids, labels = _batch()
    tokens = ids.numel()

    def saved(m):
        if isinstance(m, TransformerLM):
            return activation_ledger(m, ids, labels)
        return activation_ledger(m, input_ids=ids, labels=labels, use_cache=False)

    before, after = saved(model), saved(patched)
    assert after.per_token(tokens) < before.per_token(tokens)
    assert after.by_category()["logits/loss"] < before.by_category()["logits/loss"]
    # apply()'s own figure, measured on a meta copy, says the same
    assert report.bytes_per_token["after"] < report.bytes_per_token["before"]


@pytest.mark.parametrize("family", sorted(ALL_MODELS))
def test_state_dict_loads_both_ways(family):
    model = ALL_MODELS[family]()
    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    original_state, patched_state = model.state_dict(), patched.state_dict()
    assert list(patched_state) == list(original_state)
    for key, value in original_state.items():
        assert patched_state[key].shape == value.shape and torch.equal(patched_state[key], value), key
    fresh = ALL_MODELS[family]()
    fresh_patched = copy.deepcopy(fresh)
    apply(fresh_patched, measure=False)
    fresh_patched.load_state_dict(original_state, strict=True)   # unpatched checkpoint -> patched model
    fresh.load_state_dict(patched_state, strict=True)            # patched checkpoint -> unpatched model
    ids, labels = _batch()
    with torch.no_grad():
        assert torch.allclose(_loss(fresh, ids, labels), _loss(model, ids, labels))
        assert torch.allclose(_loss(fresh_patched, ids, labels), _loss(model, ids, labels), rtol=1e-5)


@pytest.mark.parametrize("family", sorted(HF_MODELS))
def test_without_labels_the_logits_are_unchanged(family):
    model = HF_MODELS[family]().eval()
    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    ids, _ = _batch()
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        got = patched(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # eval mode with labels: the logits, as an eval loop scoring predictions needs
        evaluated = patched(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(evaluated.logits, expected, rtol=1e-5, atol=1e-5)
    patched.train()
    with torch.no_grad():
        assert patched(input_ids=ids, labels=ids, use_cache=False).logits is None  # training: logits never built
        asked = patched(input_ids=ids, labels=ids, use_cache=False, skip_logits=False)
    torch.testing.assert_close(asked.logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(asked.loss, evaluated.loss)


def test_num_items_in_batch_sums_then_divides_like_hugging_face():
    model = _llama()
    patched = copy.deepcopy(model)
    apply(patched, measure=False)
    ids, labels = _batch()
    items = torch.tensor(17)
    expected = model(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False).loss
    got = patched(input_ids=ids, labels=labels, num_items_in_batch=items, use_cache=False).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_report_lists_replacements_and_skips():
    report = apply(_llama())
    replaced = {(r["before"], r["after"]) for r in report.replaced}
    assert ("LlamaRMSNorm", "FusedRMSNorm") in replaced
    assert ("LlamaForCausalLM", "MemkernelsLlamaForCausalLM") in replaced
    assert sum(r["before"] == "LlamaRMSNorm" for r in report.replaced) == 2 * 2 + 1
    assert ("LlamaMLP", "MemkernelsLlamaMLP (saves gate, up)") in replaced and report.skipped == []
    g = _gemma()
    gemma_norms = [m for m in g.modules() if type(m).__name__ == "GemmaRMSNorm"]
    apply(g, measure=False)
    fused = [m for m in g.modules() if type(m).__name__ == "FusedRMSNorm"]
    assert len(fused) == len(gemma_norms) and all(m.offset == 1.0 for m in fused)
    text = report.summary()
    assert "FusedRMSNorm" in text and "per token" in text


@pytest.mark.parametrize("family", sorted(ALL_MODELS))
def test_apply_twice_changes_nothing_more(family):
    model = ALL_MODELS[family]()
    first = apply(model, measure=False)
    keys = list(model.state_dict())
    second = apply(model, measure=False)
    assert first.replaced and second.replaced == []
    assert list(model.state_dict()) == keys


def test_switches_are_honoured():
    model = _gpt2()
    report = apply(model, norms=False, loss=False, measure=False)
    assert {r["before"] for r in report.replaced} == {"GPT2MLP"}
    assert any(type(m).__name__ == "LayerNorm" for m in model.modules())


def test_bad_arguments_and_missing_ops_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="nn.Module"):
        apply("llama")
    with pytest.raises(ValueError, match="norms"):
        apply(_tiny_lm(), norms="yes")
    monkeypatch.setitem(sys.modules, "memkernels.fusions.loss.linear_cross_entropy", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"apply\(loss=True\).*loss=False"):
        apply(_tiny_lm(), measure=False)


def test_bert_feed_forward_is_fused_with_parity():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(config)
    reference = copy.deepcopy(model).double()
    patched = copy.deepcopy(model)
    report = apply(patched, measure=False)
    assert sum(r["before"] == "BertLayer" for r in report.replaced) == 2
    ids, _ = _batch()
    outs = [m(input_ids=ids).last_hidden_state.double() for m in (reference, model, patched)]
    _assert_parity(*[o.detach() for o in outs], "bert hidden states")
    before = activation_ledger(model, input_ids=ids).by_category()["mlp"]
    after = activation_ledger(patched, input_ids=ids).by_category()["mlp"]
    assert after < before


def _norm_class(family, module_name):
    import importlib
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), module_name)


@pytest.mark.parametrize("family,name,formula", [
    ("llama", "LlamaRMSNorm", ("rms", 0.0, "llama")), ("qwen3", "Qwen3RMSNorm", ("rms", 0.0, "llama")),
    ("phi3", "Phi3RMSNorm", ("rms", 0.0, "llama")), ("gemma", "GemmaRMSNorm", ("rms", 1.0, "gemma")),
    ("gemma3", "Gemma3RMSNorm", ("rms", 1.0, "gemma")), ("olmo2", "Olmo2RMSNorm", ("rms", 0.0, "gemma")),
    ("gpt_oss", "GptOssRMSNorm", ("rms", 0.0, "gemma")), ("gemma4", "Gemma4RMSNorm", ("rms", 0.0, "gemma")),
    ("qwen3_5", "Qwen3_5RMSNorm", ("rms", 1.0, "gemma")),
    ("cohere", "CohereLayerNorm", ("layer", 0.0, "gemma"))])
def test_each_hugging_face_norm_is_fused_with_the_formula_its_forward_computes(family, name, formula):
    from memkernels.fusions.norm.rule import _norm_formula

    norm = _norm_class(family, name)(24, eps=1e-5)
    weight = norm.weight.detach().clone()
    assert _norm_formula(norm) == formula
    assert torch.equal(norm.weight, weight)  # the probe ran on a copy


class _HalfPrecisionRMSNorm(torch.nn.Module):  # the name apply() probes
    """An RMSNorm computed in the input's dtype: none of the fused formulas."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return self.weight.to(x.dtype) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _GatedRMSNorm(_HalfPrecisionRMSNorm):
    def forward(self, x, gate):
        return super().forward(x) * torch.sigmoid(gate)


class _BiasedRMSNorm(_HalfPrecisionRMSNorm):
    def __init__(self, hidden):
        super().__init__(hidden)
        self.bias = torch.nn.Parameter(torch.zeros(hidden))


class _WeightlessRMSNorm(torch.nn.Module):  # OLMo-1's and NanoChat's kind: nothing to take a shape from
    def __init__(self):
        super().__init__()
        self.eps = 1e-6

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _PerHeadLayerNorm(torch.nn.LayerNorm):  # a [heads, head_dim] weight, as Cohere's q/k norms have
    def __init__(self):
        super().__init__((4, 4))


@pytest.mark.parametrize("norm,reason", [
    (_HalfPrecisionRMSNorm(16), "none of the norm formulas memkernels fuses"),
    (_BiasedRMSNorm(16), "none of the norm formulas memkernels fuses"),
    (_GatedRMSNorm(16), "did not run on a lone input: TypeError"),
    (_PerHeadLayerNorm(), "with a 1-D weight (and bias) alone"),
    (_WeightlessRMSNorm(), "has no weight (an unweighted norm)"),
    # normalizes dimension 1 of [batch, channels, height, width]: the probe's 3-D input shows it
    (_norm_class("convnext", "ConvNextLayerNorm")(16, data_format="channels_first"), "did not run on a lone input")])
def test_a_norm_computing_something_else_is_left_alone_with_the_reason(norm, reason):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), norm)
    report = apply(model, measure=False)
    assert model[1] is norm and report.replaced == []
    assert [(s["type"], reason in s["reason"]) for s in report.skipped] == [(type(norm).__name__, True)]


# ----------------------------------------------------------------------------- RoPE in attention

def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # Hugging Face's, as a model file defines it
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_interleaved_rotary(q, k, cos, sin):  # GPT-J's pairs (x0, x1), (x2, x3), ...: another formula
    def rotate(x):
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


class _Attention(torch.nn.Module):
    """q and k projections and a RoPE call through a module-level function, as Hugging Face's attention."""
    rotary = staticmethod(apply_rotary_pos_emb)

    def __init__(self, heads=2, dim=8):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.q_proj = torch.nn.Linear(heads * dim, heads * dim)
        self.k_proj = torch.nn.Linear(heads * dim, heads * dim)

    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], self.heads, self.dim)
        q, k = self.q_proj(x).view(shape).transpose(1, 2), self.k_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return (q * k).sum()


class _InterleavedAttention(_Attention):
    def forward(self, x, cos, sin):
        shape = (*x.shape[:-1], self.heads, self.dim)
        q, k = self.q_proj(x).view(shape).transpose(1, 2), self.k_proj(x).view(shape).transpose(1, 2)
        q, k = apply_interleaved_rotary(q, k, cos, sin)
        return (q * k).sum()


def _tables(seq=5, dim=8):
    angles = torch.arange(seq, dtype=torch.float32)[None, :, None] * torch.rand(1, 1, dim // 2)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def test_rope_is_redirected_per_class_and_the_model_file_keeps_its_function():
    from transformers.models.llama import modeling_llama
    model, other = _llama(), _llama()
    original = modeling_llama.apply_rotary_pos_emb
    report = apply(model, norms=False, mlp=False, loss=False, measure=False)
    attention = [m for m in model.modules() if type(m).__name__.endswith("LlamaAttention")]
    assert [(r["before"], r["after"]) for r in report.replaced] == [
        ("LlamaAttention", "MemkernelsRopeLlamaAttention")] * len(attention) and len(attention) == 2
    # the model's module is untouched: another Llama in the process runs Hugging Face's RoPE
    assert modeling_llama.apply_rotary_pos_emb is original
    assert type(other.model.layers[0].self_attn) is modeling_llama.LlamaAttention
    # the redirected forward keeps the original's signature and its decorator (deprecate_kwarg)
    assert inspect.signature(type(attention[0]).forward) == inspect.signature(modeling_llama.LlamaAttention.forward)


def test_rope_calls_reach_the_fused_op_once_per_layer(monkeypatch):
    from memkernels.fusions.rope import op as rope_module
    calls = []
    real = rope_module.rope_checked  # what the redirected attention calls once unsupported() has passed

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(rope_module, "rope_checked", counting)
    model = _llama()
    apply(model, norms=False, mlp=False, loss=False, measure=False)
    ids, labels = _batch()
    _loss(model, ids, labels).backward()
    assert len(calls) == 2 and calls[0] == (2, 4, 24, 16)


def test_rope_parity_in_a_model_with_rope_alone():
    model = _qwen3().train()
    patched = copy.deepcopy(model)
    report = apply(patched, norms=False, mlp=False, loss=False, measure=False)
    assert {r["after"] for r in report.replaced} == {"MemkernelsRopeQwen3Attention"}
    assert_patched_parity(model, patched, *_batch())


def test_rope_false_and_a_pickled_model():
    import pickle
    model = _llama()
    report = apply(model, rope=False, measure=False)
    assert not any("Rope" in r["after"] for r in report.replaced)
    apply(model, measure=False)
    restored = pickle.loads(pickle.dumps(model))
    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(_loss(restored, ids, labels), _loss(model, ids, labels))


def test_a_rope_of_another_formula_is_left_alone_with_the_reason():
    attention = _InterleavedAttention()
    report = apply(torch.nn.Sequential(attention), measure=False)
    assert type(attention) is _InterleavedAttention and report.replaced == []
    assert [(s["type"], "is not the rotate-half RoPE" in s["reason"]) for s in report.skipped] == [
        ("_InterleavedAttention", True)]


def test_calls_the_fused_rope_does_not_take_run_the_original():
    attention = _Attention()
    x = torch.randn(2, 5, 16)
    cos, sin = _tables()
    expected = attention(x, cos, sin)
    apply(torch.nn.Sequential(attention), measure=False)
    assert type(attention).__name__ == "MemkernelsRope_Attention"
    torch.testing.assert_close(attention(x, cos, sin), expected)
    fused = type(attention).forward.__globals__["apply_rotary_pos_emb"]
    q = torch.randn(2, 5, 2, 8)  # [batch, seq, heads, dim]: the layout unsqueeze_dim=2 is for
    for call in (lambda: fused(q, q, cos, sin, unsqueeze_dim=2),                        # another layout
                 lambda: fused(q.transpose(1, 2), q.transpose(1, 2), cos.requires_grad_(), sin)):  # table grads
        got = call()
        torch.testing.assert_close(got[0], (apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)[0]
                                            if got[0].shape == q.shape else
                                            apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)[0]))
    cos.grad = None


def test_a_model_with_its_rope_redirected_compiles():
    # torch.compile finds a function's globals through their module's name: the redirected forward's globals
    # are a module of their own in sys.modules, so the compiled graph calls memkernels' RoPE (no guard on the
    # model module's function of that name, which is Hugging Face's)
    model = _llama().train()
    patched = copy.deepcopy(model)
    apply(patched, norms=False, mlp=False, loss=False, measure=False)
    targets = []

    def recording_backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    ids, labels = _batch()
    loss = _loss(torch.compile(patched, backend=recording_backend), ids, labels)
    loss.backward()
    assert targets.count("memkernels.rope.default") == 2, targets  # one a layer
    torch.testing.assert_close(loss, _loss(model, ids, labels))
    assert patched.model.layers[0].self_attn.q_proj.weight.grad is not None
