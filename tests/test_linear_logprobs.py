"""memkernels linear_logprobs (per-token log-probs and entropy without the logits) vs float64 eager."""
import pytest
import torch

import memkernels
from memkernels.functional import linear_logprobs
from memkernels.fusions.loss import linear_cross_entropy as lce
from memkernels.fusions.loss import linear_logprobs as llp
from memkernels.fusions.loss.logprobs_reference import eager_linear_logprobs
from memkernels.meters import SavedBytesMeter
from memkernels.testing import check_against_reference

from backends import triton_device

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPTIONS = {
    "plain": {},
    "combined": {"temperature": 0.7, "softcap": 4.0, "bias": True},
    "temperature": {"temperature": 1.6},
    "softcap": {"softcap": 3.0},
}


def make_target(n_tokens, n_classes, ignored=(1,)):
    target = torch.randint(0, n_classes, (n_tokens,))
    for row in ignored:
        if row < n_tokens:
            target[row] = -100
    return target


def run_check(dtype, n_tokens, hidden_size, n_classes, option_name, chunk_size, with_entropy=True):
    options = dict(OPTIONS[option_name])
    hidden = torch.randn(n_tokens, hidden_size).to(dtype).requires_grad_()
    weight = (torch.randn(n_classes, hidden_size) / hidden_size**0.5).to(dtype).requires_grad_()
    bias = torch.randn(n_classes).to(dtype).requires_grad_() if options.pop("bias", False) else None
    target = make_target(n_tokens, n_classes)

    def fn(hidden, weight, target, bias):
        out = linear_logprobs(hidden, weight, target, bias=bias, return_entropy=with_entropy, chunk_size=chunk_size,
                              **options)
        out = out if with_entropy else (out,)
        return tuple(o.to(hidden.dtype) for o in out)  # float32 results; compared in eager's dtype

    def reference(hidden, weight, target, bias):
        logp, entropy = eager_linear_logprobs(hidden, weight, target, bias, **options)
        return (logp, entropy) if with_entropy else (logp,)

    # Random incoming gradients for both outputs (check_against_reference's default). dX sums over the V
    # classes, dW and dB over the tokens in GEMMs and sums of other shapes than eager's; the entropy sums over V.
    check_against_reference(fn, reference, (hidden, weight, target, bias),
                            name=f"linear_logprobs[{option_name}, entropy={with_entropy}]",
                            sum_length={**({"output[1]": n_classes} if with_entropy else {}),
                                        **({"grad inputs[3]": n_tokens} if bias is not None else {}),
                                        "grad inputs[0]": n_classes, "grad inputs[1]": n_tokens})


# (tokens, hidden, classes, chunk_size): chunk 3 at V = 37 makes forward chunks of 3 tokens (the last one
# short) and backward tiles of 15 classes (37 = 15 + 15 + 7: V not a multiple of the tile); None: one chunk and
# one tile holding every class (the whole-row backward). V = 1 and one token (M = 1).
SHAPES = [(7, 8, 37, 3), (7, 8, 37, None), (5, 4, 1, None), (1, 6, 11, None), (1, 6, 11, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("option_name", ["plain", "combined"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64(backend, dtype, option_name, shape):
    run_check(dtype, *shape[:3], option_name, shape[3])


@pytest.mark.parametrize("option_name", ["temperature", "softcap"])
def test_each_option_alone(backend, option_name):
    run_check(torch.bfloat16, 7, 8, 37, option_name, 3)


@pytest.mark.parametrize("chunk_size", [3, None])
def test_without_entropy(backend, chunk_size):
    run_check(torch.float32, 7, 8, 37, "combined", chunk_size, with_entropy=False)


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_one_output_used(backend, used):
    """Only one of the two outputs reaches the loss: the other's gradient arrives as None, counted as 0."""
    hidden = torch.randn(7, 8, requires_grad=True)
    weight = torch.randn(37, 8, requires_grad=True)
    target = make_target(7, 37)
    logp, entropy = linear_logprobs(hidden, weight, target, return_entropy=True, chunk_size=3, temperature=0.9)
    (logp if used == "logp" else entropy).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_logp, ref_entropy = eager_linear_logprobs(h64, w64, target, temperature=0.9)
    (ref_logp if used == "logp" else ref_entropy).sum().backward()
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_ignored_targets_give_zero_and_no_gradient(backend):
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    target = torch.tensor([3, -100, 7, -100, 0, 19])
    logp, entropy = linear_logprobs(hidden, weight, target, return_entropy=True, chunk_size=2)
    assert torch.equal(logp[[1, 3]], torch.zeros(2)) and torch.equal(entropy[[1, 3]], torch.zeros(2))
    assert (logp[[0, 2, 4, 5]] < 0).all() and (entropy[[0, 2, 4, 5]] > 0).all()
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(hidden.grad[[1, 3]], torch.zeros(2, 8)) and hidden.grad[[0, 2, 4, 5]].abs().sum() > 0
    # Every token ignored: zeros everywhere, and a zero (not NaN) gradient.
    hidden.grad = weight.grad = None
    logp, entropy = linear_logprobs(hidden, weight, torch.full((6,), -100), return_entropy=True)
    (logp.sum() + entropy.sum()).backward()
    assert not logp.any() and not entropy.any() and not hidden.grad.any() and not weight.grad.any()


def test_batched_shapes_and_module_layout(backend):
    """hidden (B, T, H) and target (B, T): results of target's shape, equal to the flattened call."""
    hidden = torch.randn(2, 5, 8)
    weight = torch.randn(30, 8)
    target = torch.randint(0, 30, (2, 5))
    logp, entropy = linear_logprobs(hidden, weight, target, return_entropy=True)
    flat_logp, flat_entropy = linear_logprobs(hidden.reshape(10, 8), weight, target.reshape(10), return_entropy=True)
    assert logp.shape == entropy.shape == (2, 5) and logp.dtype == entropy.dtype == torch.float32
    assert torch.equal(logp.reshape(10), flat_logp) and torch.equal(entropy.reshape(10), flat_entropy)


def test_empty_input():
    hidden = torch.randn(0, 8, requires_grad=True)
    logp, entropy = linear_logprobs(hidden, torch.randn(5, 8), torch.zeros(0, dtype=torch.long), return_entropy=True)
    assert logp.shape == entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == (0, 8)


class TestHeldBytes:
    n_tokens, hidden_size, n_classes = 20, 16, 60  # chunks of 7: three chunks, the last one short

    @pytest.mark.parametrize("with_entropy", [False, True])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_holds_the_row_statistics_only(self, backend, dtype, with_entropy):
        """Between forward and backward: (max, log-sum) per token, and the entropy with it: 8 or 12 bytes a
        token; hidden, weight, bias and target are the caller's (aliased, not counted)."""
        hidden = torch.randn(self.n_tokens, self.hidden_size, dtype=dtype, requires_grad=True)
        weight = torch.randn(self.n_classes, self.hidden_size, dtype=dtype, requires_grad=True)
        bias = torch.randn(self.n_classes, dtype=dtype, requires_grad=True)
        target = make_target(self.n_tokens, self.n_classes)
        with SavedBytesMeter() as saved:
            out = linear_logprobs(hidden, weight, target, bias=bias, temperature=0.8, softcap=5.0,
                                  return_entropy=with_entropy, chunk_size=7)
        assert saved.new_bytes == (12 if with_entropy else 8) * self.n_tokens
        # Eager holds the logits and the log-softmax (and the probabilities for the entropy): N x V each.
        with SavedBytesMeter() as eager_saved:
            eager_linear_logprobs(hidden, weight, target, bias, temperature=0.8, softcap=5.0)
        assert eager_saved.new_bytes >= 2 * self.n_tokens * self.n_classes * (torch.finfo(dtype).bits // 8)
        (sum(o.sum() for o in out) if with_entropy else out.sum()).backward()


def test_default_chunks_and_tiles_are_linear_cross_entropys_recompute_sizes(monkeypatch):
    """Forward chunks of recompute_chunk_tokens, backward tiles of recompute_tile_classes (compute-bound GEMMs on a
    GPU); chunk_size overrides both as it does for linear_cross_entropy."""
    calls = []
    for module in (llp, lce):  # the forward's chunks here, the backward's tiles in the shared tiled backward
        monkeypatch.setattr(module, "head_logits", lambda h, w, b, logits=lce.head_logits:
                            calls.append((len(h), len(w))) or logits(h, w, b))
    hidden = torch.randn(1300, 4, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(5000, 4, dtype=torch.bfloat16, requires_grad=True)
    linear_logprobs(hidden, weight, torch.randint(0, 5000, (1300,))).sum().backward()
    chunk = llp.recompute_chunk_tokens(5000, torch.bfloat16)
    tile = llp.recompute_tile_classes(1300, 5000, torch.bfloat16)
    assert chunk >= 590 and tile >= 2360
    forward = [(min(chunk, 1300 - s), 5000) for s in range(0, 1300, chunk)]
    backward = [(1300, min(tile, 5000 - s)) for s in range(0, 5000, tile)]
    assert calls == forward + backward


def test_deterministic(backend):
    hidden = torch.randn(30, 8, requires_grad=True)
    weight = torch.randn(70, 8, requires_grad=True)
    target = make_target(30, 70)
    grads = []
    for _ in range(2):
        hidden.grad = weight.grad = None
        logp, entropy = linear_logprobs(hidden, weight, target, return_entropy=True, chunk_size=4)
        (logp.sum() - entropy.sum()).backward()
        grads.append((logp, entropy, hidden.grad, weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_out_of_range_target_raises_on_the_cpu_reference():
    memkernels.set_backend("torch")
    try:
        with pytest.raises(ValueError, match="class id 9"):
            linear_logprobs(torch.randn(3, 4), torch.randn(9, 4), torch.tensor([0, 9, -100]))
    finally:
        memkernels.set_backend("auto")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on NaN
def test_out_of_range_target_gives_nan_on_the_triton_path():
    memkernels.set_backend("triton")
    try:
        device = triton_device()
        hidden = torch.randn(3, 4, device=device, requires_grad=True)
        weight = torch.randn(9, 4, device=device, requires_grad=True)
        logp, entropy = linear_logprobs(hidden, weight, torch.tensor([0, 9, -100], device=device),
                                        return_entropy=True)
        assert torch.isnan(logp[1]) and torch.isnan(entropy[1]) and torch.isfinite(logp[[0, 2]]).all()
        (logp.sum() + entropy.sum()).backward()
        assert torch.isnan(hidden.grad[1]).all() and torch.isfinite(hidden.grad[[0, 2]]).all()
    finally:
        memkernels.set_backend("auto")


@pytest.mark.parametrize("n_classes", [1, 7])
def test_whole_row_backward_takes_its_statistics_from_the_logits_it_recomputes(backend, n_classes):
    """As linear_cross_entropy's: saved statistics a GEMM's rounding moved change nothing when one tile holds every
    class, and one class gives log p = 0, entropy 0 and a zero gradient."""
    device = triton_device() if backend == "triton" else "cpu"
    hidden = torch.randn(6, 8, device=device)
    weight = torch.randn(n_classes, 8, device=device) / 3
    target = torch.randint(0, n_classes, (6,), device=device)
    _, _, stats, _ = llp._forward(hidden, weight, target, None, -100, 0.0, 1.0, True, False, 0, backend)
    off = stats.clone()
    off[:, 1:] += 1e-6
    grads = [llp._backward(torch.ones(6, device=device), torch.ones(6, device=device), hidden, weight, target, None,
                           saved, -100, 0.0, 1.0, True, False, 0, True, True, False, backend)
             for saved in (stats, off)]
    for exact, from_off in zip(*grads):
        assert torch.equal(exact, from_off)
    if n_classes == 1:
        assert not grads[0][0].any() and not grads[0][1].any()


def test_autocast_casts_the_head_as_f_linear_does():
    hidden = torch.randn(9, 8)
    weight = torch.randn(40, 8)
    target = torch.randint(0, 40, (9,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = linear_logprobs(hidden, weight, target, return_entropy=True)
    expected = linear_logprobs(hidden.bfloat16(), weight.bfloat16(), target, return_entropy=True)
    assert logp.dtype == torch.float32
    assert torch.equal(logp, expected[0]) and torch.equal(entropy, expected[1])


@pytest.mark.parametrize("dtype,compiler", [(torch.float32, "aot_eager"), (torch.bfloat16, "inductor")])
def test_compiled_model_with_ignored_targets_matches_eager(dtype, compiler):
    """torch.compile(fullgraph=True) keeps the op whole and gives eager's values with ignored targets present
    (Liger's issue 1338: a silently wrong compiled loss with ignore_index)."""
    torch._dynamo.reset()
    body = torch.nn.Linear(8, 64).to(dtype)
    head = torch.randn(203, 64, dtype=dtype, requires_grad=True)
    hidden = torch.randn(32, 8, dtype=dtype)
    target = torch.randint(0, 203, (32,))
    target[::3] = -100
    weights = torch.randn(32)

    def model(hidden, target):
        return linear_logprobs(body(hidden), head, target, temperature=0.9, return_entropy=True, chunk_size=10)

    def loss_of(logp, entropy):  # outside the compiled region: inductor would sum in another order
        return (logp * weights).sum() + 0.01 * entropy.sum()

    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    eager = model(hidden, target)
    eager_grads = torch.autograd.grad(loss_of(*eager), (head, body.weight))
    got = compiled(hidden, target)
    compiled_grads = torch.autograd.grad(loss_of(*got), (head, body.weight))
    for output, expected in zip(got, eager):
        torch.testing.assert_close(output, expected, rtol=0, atol=0)
    assert not got[0][::3].any() and not got[1][::3].any()
    for output, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(output, expected, rtol=0, atol=0)


def test_second_derivative_raises():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    logp = linear_logprobs(hidden, weight, torch.randint(0, 10, (4,)))
    (grad,) = torch.autograd.grad(logp.sum(), hidden, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        grad.sum().backward()


@pytest.mark.parametrize("call,error,match", [
    (lambda h, w, t: linear_logprobs(h, w.t(), t), ValueError, "weight has shape"),
    (lambda h, w, t: linear_logprobs(h, w.double(), t), ValueError, "must match hidden"),
    (lambda h, w, t: linear_logprobs(h.double(), w.double(), t), TypeError, "hidden has dtype torch.float64; supported"),
    (lambda h, w, t: linear_logprobs(h, w, t.float()), TypeError, "target must hold integer"),
    (lambda h, w, t: linear_logprobs(h, w, t[:3]), ValueError, "target has 3 elements"),
    (lambda h, w, t: linear_logprobs(h, w, [0] * 5), TypeError, "target must be a tensor"),
    (lambda h, w, t: linear_logprobs(h, w, t, bias=torch.zeros(4)), ValueError, "bias must have shape"),
    (lambda h, w, t: linear_logprobs(h, w, t, temperature=0.0), ValueError, "temperature must be"),
    (lambda h, w, t: linear_logprobs(h, w, t, temperature=float("inf")), ValueError, "temperature must be"),
    (lambda h, w, t: linear_logprobs(h, w, t, softcap=-1.0), ValueError, "softcap must be"),
    (lambda h, w, t: linear_logprobs(h, w, t, chunk_size=0), ValueError, "chunk_size"),
    (lambda h, w, t: linear_logprobs(h, w, t, ignore_index=-1.5), TypeError, "ignore_index"),
    (lambda h, w, t: linear_logprobs(h.int(), w, t), TypeError, "hidden must be a floating-point"),
    (lambda h, w, t: linear_logprobs(h, w[:0], t), ValueError, "at least one row"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(5, 4), torch.randn(7, 4), torch.zeros(5, dtype=torch.long))


def test_benchmark_llama_head_row_on_meta():
    """benchmarks/bench_logprobs.py's Llama-3-8B head at 8k tokens (meta: every allocation made and counted, no
    arithmetic): memkernels holds 12 bytes a token and peaks under an eighth of eager's extra bytes."""
    from bench_loader import load_benchmark

    bench = load_benchmark("bench_logprobs")
    inputs = bench.make_inputs(1, 8192, 4096, 128256, torch.bfloat16, "meta")
    ours = bench.measure_memory(bench._memkernels, *inputs)
    eager = bench.measure_memory(bench._eager, *inputs)
    assert ours["held"] == 12 * 8192
    assert eager["held"] >= 2 * 8192 * 128256 * 2  # the bf16 logits and their log-softmax at least
    assert ours["extra_peak"] <= eager["extra_peak"] / 8


@pytest.mark.parametrize("chunk_size", [3, None])
def test_metrics_match_float64_and_break_ties_as_argmax(backend, chunk_size):
    """return_metrics: is the target z's first argmax (torch.argmax's rule for ties), the mean of z and log sum p^2,
    from the forward's pass over each row; False / 0 for ignored tokens; logp, entropy and gradients unchanged."""
    hidden = torch.randn(9, 8, dtype=torch.float64).float()
    weight = (torch.randn(37, 8) / 3).requires_grad_()
    target = torch.randint(0, 37, (9,))
    z = (hidden.double() @ weight.detach().double().t()) / 0.7
    target[0] = z[0].argmax()
    target[2] = -100
    logp, entropy, metrics = linear_logprobs(hidden, weight, target, temperature=0.7, return_entropy=True,
                                             return_metrics=True, chunk_size=chunk_size)
    kept = target != -100
    p = torch.softmax(z, dim=-1)
    assert metrics.is_top1.dtype == torch.bool and metrics.is_top1[0]
    assert torch.equal(metrics.is_top1, kept & (z.argmax(1) == target.clamp(min=0)))
    torch.testing.assert_close(metrics.mean_logit.double(), torch.where(kept, z.mean(1), 0.0), rtol=0, atol=1e-5)
    torch.testing.assert_close(metrics.log_sum_sq_probs.double(), torch.where(kept, p.square().sum(1).log(), 0.0),
                               rtol=0, atol=1e-5)
    plain_logp, plain_entropy = linear_logprobs(hidden, weight, target, temperature=0.7, return_entropy=True,
                                                chunk_size=chunk_size)
    assert torch.equal(logp, plain_logp) and torch.equal(entropy, plain_entropy)
    assert not metrics.mean_logit.requires_grad and logp.requires_grad
    # Ties: all logits equal; only the first class is the argmax.
    tied = linear_logprobs(torch.ones(3, 4), torch.zeros(5, 4), torch.tensor([0, 3, 4]), return_metrics=True)[1]
    assert tied.is_top1.tolist() == [True, False, False]
