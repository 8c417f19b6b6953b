"""memkernels.functional.rope against Hugging Face's RoPE in float64, on both backends (the Triton kernel
through the interpreter without a GPU), and its contract: layout, saved bytes, errors."""
import pytest
import torch

from memkernels.fusions.rope import op as rope_module
from memkernels.fusions.rope import reference
from memkernels.fusions.rope.op import rope
from memkernels.meters import SavedBytesMeter
from memkernels.testing import check_against_reference

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


eager_rope = reference.eager  # Hugging Face's apply_rotary_pos_emb, op for op


def fused_rope(q, k, cos, sin):
    return rope(q, k, cos, sin)


def hf_inputs(batch, q_heads, k_heads, seq, dim, dtype, table_dtype=None, table_batch=1, hf_tables=True):
    """q and k as Hugging Face's attention passes them (a projection's [batch, seq, heads * dim] output viewed
    and transposed), cos and sin as its rotary embedding makes them (repeated halves) or any values."""
    q = torch.randn(batch, seq, q_heads, dim).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(batch, seq, k_heads, dim).to(dtype).transpose(1, 2).requires_grad_()
    if hf_tables:
        angles = torch.arange(seq, dtype=torch.float64)[None, :, None] * torch.rand(table_batch, 1, dim // 2).double() * 3
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
    else:
        cos, sin = torch.randn(table_batch, seq, dim), torch.randn(table_batch, seq, dim)
    table_dtype = table_dtype or dtype
    return [q, k, cos.to(table_dtype), sin.to(table_dtype)]


# (batch, q_heads, k_heads, seq, head_dim, table batch): Llama's GQA shape at small width; one KV head;
# head_dim 6 (halves of 3: the kernel's masked columns); 33 heads of 128 (past one 32-head tile of the
# kernel's head loop); per-sequence tables (batch 2, as with position_ids per row)
SHAPES = [(2, 4, 2, 5, 8, 1), (1, 3, 1, 4, 6, 1), (1, 33, 1, 2, 128, 1), (2, 2, 2, 3, 16, 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_hugging_face_in_float64(backend, dtype, shape):
    *dims, table_batch = shape
    inputs = hf_inputs(*dims, dtype, table_batch=table_batch)
    check_against_reference(fused_rope, eager_rope, inputs, name=f"rope {backend}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_q_and_k_with_float32_tables_promote_as_eager(backend, dtype):
    # Under autocast Hugging Face's tables are float32 (built in the hidden states' dtype): eager's products
    # promote to float32, and so do rope's outputs; the gradients come back in q's and k's dtype.
    inputs = hf_inputs(2, 4, 2, 5, 8, dtype, table_dtype=torch.float32)
    q_out, k_out = fused_rope(*inputs)
    assert q_out.dtype == k_out.dtype == torch.float32
    report = check_against_reference(fused_rope, eager_rope, inputs, name=f"rope {backend} mixed")
    assert report.rows


def test_any_tables_not_only_repeated_halves(backend):
    # The kernel reads both halves of cos and sin; Hugging Face's tables repeat them, other models' need not.
    inputs = hf_inputs(2, 3, 1, 4, 8, torch.float32, table_batch=2, hf_tables=False)
    check_against_reference(fused_rope, eager_rope, inputs, name=f"rope {backend} tables")


def test_contiguous_and_strided_inputs(backend):
    q = torch.randn(2, 3, 4, 8, requires_grad=True)  # [b, h, s, d] contiguous
    wide = torch.randn(2, 4, 1, 16)
    k = wide[..., :8].transpose(1, 2).detach().requires_grad_()  # a slice of a wider packed projection
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    check_against_reference(fused_rope, eager_rope, [q, k, cos, sin], name=f"rope {backend} strides")


def test_outputs_and_gradients_are_laid_out_as_a_projection_output(backend):
    # [batch, seq, heads, head_dim] in memory: attention reads it as Hugging Face's outputs, and q's gradient
    # reaches q_proj's [batch, seq, hidden] output through view and transpose with no copy.
    q, k, cos, sin = hf_inputs(2, 4, 2, 5, 8, torch.float32)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.stride() == (5 * 4 * 8, 8, 4 * 8, 1) and k_out.stride() == (5 * 2 * 8, 8, 2 * 8, 1)
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.stride() == q_out.stride() and k.grad.stride() == k_out.stride()


def test_only_the_tables_are_saved_as_eager_saves():
    q, k, cos, sin = hf_inputs(2, 4, 2, 5, 8, torch.float32)
    with SavedBytesMeter() as fused:
        q_out, k_out = rope(q, k, cos, sin)
    with SavedBytesMeter() as eager:
        eager_rope(q, k, cos, sin)
    assert fused.new_bytes == eager.new_bytes == 0
    assert fused.aliased_bytes == cos.untyped_storage().nbytes() + sin.untyped_storage().nbytes()


def test_one_launch_each_way(backend, monkeypatch):
    if backend != "triton":
        pytest.skip("counts Triton launches")
    launches = []
    kernel = rope_module._rope_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(rope_module, "_rope_kernel", Counting())
    q, k, cos, sin = hf_inputs(2, 4, 2, 5, 8, torch.float32)
    q_out, k_out = rope(q, k, cos, sin)
    assert launches == [(10,)]  # one program per (batch, position), q and k together
    (q_out.sum() + k_out.sum()).backward()
    assert launches == [(10,), (10,)]


def test_only_one_output_reaching_the_loss(backend):
    q, k, cos, sin = hf_inputs(1, 2, 1, 3, 8, torch.float32)
    q_out, _ = rope(q, k, cos, sin)
    q_out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))
    expected, _ = eager_rope(q.detach().requires_grad_(), k.detach(), cos, sin)
    torch.testing.assert_close(q_out, expected)


def test_no_rows(backend):
    q, k, cos, sin = hf_inputs(2, 4, 2, 0, 8, torch.float32)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.shape == q.shape


def test_float64_on_the_torch_path():
    inputs = hf_inputs(2, 3, 1, 4, 8, torch.float64)
    q_out, k_out = rope(*inputs, backend="torch")
    expected = eager_rope(*inputs)
    torch.testing.assert_close(q_out, expected[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(k_out, expected[1], rtol=0, atol=1e-14)


def test_compiles_whole_as_custom_ops():
    # torch.compile keeps the op whole (no graph break) and differentiates through its backward op
    q, k, cos, sin = hf_inputs(1, 2, 1, 3, 8, torch.float32)
    compiled = torch.compile(lambda *args: rope(*args, backend="torch"), backend="aot_eager", fullgraph=True)
    q_out, k_out = compiled(q, k, cos, sin)
    (q_out.sum() + 2 * k_out.sum()).backward()
    q2, k2 = q.detach().requires_grad_(), k.detach().requires_grad_()
    e_q, e_k = eager_rope(q2, k2, cos, sin)
    (e_q.sum() + 2 * e_k.sum()).backward()
    torch.testing.assert_close(q_out, e_q)
    torch.testing.assert_close(q.grad, q2.grad)
    torch.testing.assert_close(k.grad, k2.grad)


def test_meta_tensors_give_shapes_at_once():
    q = torch.empty(2, 5, 4, 8, device="meta").transpose(1, 2)
    k = torch.empty(2, 5, 2, 8, device="meta").transpose(1, 2)
    cos = sin = torch.empty(1, 5, 8, device="meta")
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.device.type == "meta" and q_out.shape == q.shape and k_out.stride() == (80, 8, 16, 1)


@pytest.mark.parametrize("change,error,message", [
    (lambda a: a.update(q=a["q"][0]), ValueError, "q has shape (4, 5, 8); expected [batch, heads, seq, head_dim]"),
    (lambda a: a.update(k=torch.randn(2, 2, 6, 8)), ValueError, "must share batch, seq and head_dim"),
    (lambda a: a.update(q=torch.randn(2, 4, 5, 7), k=torch.randn(2, 2, 5, 7), cos=torch.randn(1, 5, 7),
                        sin=torch.randn(1, 5, 7)), ValueError, "head_dim 7 is odd"),
    (lambda a: a.update(sin=torch.randn(1, 5, 8, dtype=torch.float64)), ValueError, "they must match"),
    (lambda a: a.update(cos=torch.randn(3, 5, 8), sin=torch.randn(3, 5, 8)), ValueError, "expected (2 or 1, 5, 8)"),
    (lambda a: a.update(cos=a["cos"].requires_grad_()), ValueError, "pass cos.detach() and sin.detach()"),
    (lambda a: a.update(k=a["k"].long()), TypeError, "k is torch.int64; pass a floating-point tensor"),
    (lambda a: a.update(cos=a["cos"].tolist()), TypeError, "cos must be a torch.Tensor"),
    (lambda a: a.update(backend="cuda"), ValueError, "backend='cuda' is not supported"),
    (lambda a: a.update(backend="triton", q=a["q"].double(), k=a["k"].double()), TypeError,
     "the Triton backend takes float32, float16 or bfloat16"),
    (lambda a: a.update(backend="triton", cos=a["cos"].double(), sin=a["sin"].double()), TypeError,
     "rope: cos is torch.float64; the Triton backend takes float32, float16 or bfloat16"),
])
def test_bad_input_is_a_clear_error(change, error, message):
    q, k, cos, sin = hf_inputs(2, 4, 2, 5, 8, torch.float32)
    arguments = {"q": q, "k": k, "cos": cos, "sin": sin, "backend": None}
    change(arguments)
    with pytest.raises(error) as raised:
        rope(arguments.pop("q"), arguments.pop("k"), arguments.pop("cos"), arguments.pop("sin"), **arguments)
    assert message in str(raised.value)


def test_reference_rotation_is_orthogonal():
    # backward is the transpose of forward: rotating forward then back gives the input when cos^2 + sin^2 = 1
    q, k, cos, sin = hf_inputs(1, 2, 1, 4, 8, torch.float64)
    there = reference.rotate(q.detach(), k.detach(), cos, sin, torch.float64, torch.float64, False)
    back = reference.rotate(*there, cos, sin, torch.float64, torch.float64, True)
    torch.testing.assert_close(back[0], q.detach(), rtol=0, atol=1e-13)
    torch.testing.assert_close(back[1], k.detach(), rtol=0, atol=1e-13)


def test_under_autocast_the_inputs_are_taken_as_they_are(backend):
    # Hugging Face's RoPE is mul, cat and add, which autocast leaves alone: bf16 q and k with the float32 tables
    # the rotary embedding makes under autocast promote to float32, in eager and here
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q, k, cos, sin = hf_inputs(2, 4, 2, 5, 8, torch.bfloat16, table_dtype=torch.float32)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = rope(q, k, cos, sin)
        expected = eager_rope(q, k, cos, sin)
    assert [t.dtype for t in got] == [t.dtype for t in expected] == [torch.float32] * 2
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
