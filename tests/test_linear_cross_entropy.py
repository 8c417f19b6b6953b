"""memkernels linear_cross_entropy (LM head + CE without the logits) vs float64 eager."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memkernels
from memkernels.fusions.loss import linear_cross_entropy as lce
from memkernels.fusions.loss.linear_cross_entropy import linear_cross_entropy, pick_strategy
from memkernels.fusions.loss.module import LinearCrossEntropyLoss
from memkernels.fusions.loss.reference import eager_cross_entropy
from memkernels.meters import PeakBytesMeter, SavedBytesMeter
from memkernels.testing import check_against_reference

from backends import triton_device
from loss_cases import case_id

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPTIONS = {
    "plain": {},
    "combined": {"label_smoothing": 0.1, "softcap": 4.0, "z_loss": 1e-2, "class_weight": True},
}
# Each option alone (test_each_option_alone): what "combined" could hide, e.g. a z-term scale that
# only matters without smoothing.
SINGLE_OPTIONS = {
    "smoothing": {"label_smoothing": 0.1},
    "softcap": {"softcap": 4.0},
    "z_loss": {"z_loss": 1e-2},
    "class_weight": {"class_weight": True},
}


def make_target(n_tokens, n_classes):
    target = torch.randint(0, n_classes, (n_tokens,))
    if n_tokens > 1:
        target[1] = -100
    return target


def run_check(dtype, n_tokens, hidden_size, n_classes, reduction, strategy, option_name, chunk_size,
              unit_grad=False):
    options = dict({**OPTIONS, **SINGLE_OPTIONS}[option_name])
    hidden = torch.randn(n_tokens, hidden_size).to(dtype).requires_grad_()
    weight = (torch.randn(n_classes, hidden_size) / hidden_size**0.5).to(dtype).requires_grad_()
    bias = torch.randn(n_classes).to(dtype).requires_grad_()
    target = make_target(n_tokens, n_classes)
    class_weight = torch.rand(n_classes).add(0.5).to(dtype) if options.pop("class_weight", False) else None

    def fn(hidden, weight, target, bias, class_weight):
        loss = linear_cross_entropy(hidden, weight, target, bias=bias, class_weight=class_weight,
                                    reduction=reduction, strategy=strategy, chunk_size=chunk_size, **options)
        return loss.to(hidden.dtype)  # memkernels returns float32; compare in eager's dtype

    def reference(hidden, weight, target, bias, class_weight):
        logits = torch.nn.functional.linear(hidden, weight, bias)
        if logits.dtype == torch.float16 and options.get("label_smoothing"):
            # Eager fp16 label smoothing overflows (sum of -log p over V classes): eager in
            # float32, rounded to fp16, is the baseline then (see test_cross_entropy.py).
            weight32 = None if class_weight is None else class_weight.float()
            return eager_cross_entropy(logits.float(), target, weight32, reduction=reduction,
                                       **options).to(logits.dtype)
        return eager_cross_entropy(logits, target, class_weight, reduction=reduction, **options)

    # dX sums over the V classes, dW and dB over the tokens, in GEMMs and sums of other shapes than eager's
    # (chunks of tokens, tiles of classes), whose summation order, and so accuracy, differs by BLAS and CPU
    # (dB's K was left at 1: float32, 6 tokens, 1 class failed on an AMD EPYC CPU by 8.9e-10 against 8.2e-10).
    check_against_reference(fn, reference, (hidden, weight, target, bias, class_weight),
                            name=f"linear_cross_entropy[{strategy}, {option_name}]",
                            grad_outputs=torch.ones(()) if unit_grad else None,
                            sum_length={"grad inputs[0]": n_classes, "grad inputs[1]": n_tokens,
                                        "grad inputs[3]": n_tokens})


CASES = [("chunked", r) for r in ("mean", "sum")] + [("recompute", r) for r in ("none", "mean", "sum")]


# At the widest shape (several chunks, the last partial; several class tiles) every strategy x reduction x
# option runs in bfloat16, and each other dtype once per strategy with every option: its loads, stores and
# roundings at that shape, without the interpreter's seconds for each dtype x option again (issue 32: one
# widest case per kernel path, not per dtype x option). The small shapes run everything in every dtype.
WIDEST = (24, 8, 300)
OTHER_DTYPES_AT_THE_WIDEST = [("chunked", "mean"), ("recompute", "none")]
MATCH_CASES = [(dtype, shape, strategy, reduction, option_name)
               for shape in [(6, 8, 1), (1, 16, 41), WIDEST] for dtype in DTYPES for strategy, reduction in CASES
               for option_name in OPTIONS
               if shape != WIDEST or dtype == torch.bfloat16
               or (option_name == "combined" and (strategy, reduction) in OTHER_DTYPES_AT_THE_WIDEST)]


@pytest.mark.parametrize("dtype,shape,strategy,reduction,option_name", MATCH_CASES, ids=case_id)
def test_matches_float64(backend, dtype, shape, strategy, reduction, option_name):
    # chunk_size=5 tokens: several chunks, the last one partial.
    run_check(dtype, *shape, reduction, strategy, option_name, chunk_size=5)


# Each option alone at the widest shape: every strategy x reduction in bfloat16, the other dtypes at one
# (strategy, reduction) each (an option's formula is the same in every dtype; "combined" above runs each
# dtype through all of them).
@pytest.mark.parametrize("dtype,strategy,reduction,option_name", [
    (torch.bfloat16, strategy, reduction, option_name) for strategy, reduction in CASES
    for option_name in SINGLE_OPTIONS
] + [(torch.float32, "chunked", "mean", option_name) for option_name in SINGLE_OPTIONS]
  + [(torch.float16, "recompute", "mean", option_name) for option_name in SINGLE_OPTIONS], ids=case_id)
def test_each_option_alone(backend, dtype, strategy, reduction, option_name):
    run_check(dtype, *WIDEST, reduction, strategy, option_name, chunk_size=5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_not_a_block_multiple(backend, dtype, strategy):
    # Chunked computes the gradients in the forward at incoming gradient 1 and scales them in backward
    # (as PyTorch's chunked op does): its error is eager's at incoming gradient 1, so that is the
    # gradient it is checked at; test_chunked_backward_only_scales pins the scaling. (At a random
    # incoming gradient eager with smoothing + class weights + z-loss is often ~2x more accurate than
    # at 1, and chunked's float32 dX missed "2x eager" in 19 of 400 runs.)
    run_check(dtype, 8, 16, 32003, "mean", strategy, "combined", chunk_size=3, unit_grad=strategy == "chunked")


@pytest.mark.parametrize("grouped", [True, False], ids=["bmm-groups", "block-by-block"])
@pytest.mark.parametrize("n_rows", [1, 2, 3, 5, 8])
def test_chunked_float32_hidden_grad_error_grows_with_the_block_not_the_vocabulary(n_rows, grouped, monkeypatch):
    """A chunk's float32 dX sums V = 32003 products per element. MKL's GEMM for a few rows sums them in
    one running total (error ~ sqrt(V) roundings: ~100 ulps of max|dX| measured at 1-5 rows, ~10 at 8);
    _hidden_grad sums blocks of HIDDEN_GRAD_VOCAB_BLOCK classes in float64, so its error is that of a
    block's sum, ~sqrt(block) roundings in any order: bound 4 * sqrt(block) half-ulps (45). Both ways of summing
    the blocks: in bmm groups, and one block at a time (what a chunk too large for a group of two takes)."""
    if not grouped:
        monkeypatch.setattr(lce, "HIDDEN_GRAD_GROUP_BYTES", 1)
        monkeypatch.setattr(torch, "bmm", None)  # this path must not batch
    n_classes = 32003
    grad_logits = torch.randn(n_rows, n_classes) / n_classes
    weight = torch.randn(n_classes, 16) / 4
    out = torch.empty(n_rows, 16)
    lce._hidden_grad(grad_logits, weight, out)
    exact = grad_logits.double() @ weight.double()
    half_ulp = torch.finfo(torch.float32).eps / 2 * exact.abs().max().item()
    error_half_ulps = (out.double() - exact).abs().max().item() / half_ulp
    assert error_half_ulps <= 4 * lce.HIDDEN_GRAD_VOCAB_BLOCK**0.5, error_half_ulps


def test_hidden_grad_blocks_only_float32_on_the_cpu():
    grad_logits = torch.empty(2, 1000)
    assert lce._hidden_grad_block(grad_logits) == lce.HIDDEN_GRAD_VOCAB_BLOCK
    assert lce._hidden_grad_block(grad_logits.bfloat16()) == 1000  # its rounding dwarfs the sum's error
    assert lce._hidden_grad_block(torch.empty(2, 1000, device="meta")) == 1000  # not the CPU: one GEMM
    assert lce._hidden_grad_block(torch.empty(2, 7)) == 7


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_backward_only_scales(backend, dtype):
    """Chunked's gradients at incoming gradient g are those at 1 scaled by g in float32: dX (held in
    its dtype) is one rounding of dX(1) * g; dW and dB are rounded once from their float32/float64
    accumulators times g, so they differ from round(dW(1)) * g by at most the two roundings."""
    hidden = torch.randn(10, 16).to(dtype).requires_grad_()
    weight = (torch.randn(300, 16) / 4).to(dtype).requires_grad_()
    bias = torch.randn(300).to(dtype).requires_grad_()
    target = make_target(10, 300)
    incoming = -1.37  # not a bfloat16/float16 number: scaling by a rounded g would show in dX
    grads = {}
    for g in (1.0, incoming):
        hidden.grad = weight.grad = bias.grad = None
        loss = linear_cross_entropy(hidden, weight, target, bias=bias, strategy="chunked", chunk_size=3,
                                    label_smoothing=0.1, z_loss=1e-3)
        loss.backward(torch.tensor(g))
        grads[g] = (hidden.grad, weight.grad, bias.grad)
    (dx1, dw1, db1), (dx, dw, db) = grads[1.0], grads[incoming]
    assert torch.equal(dx, (dx1.float() * incoming).to(dtype))
    info = torch.finfo(dtype)
    subnormal_spacing = info.tiny * info.eps  # where relative rounding error is unbounded
    for at_g, at_one in ((dw, dw1), (db, db1)):
        torch.testing.assert_close(at_g, (at_one.double() * incoming).to(dtype), rtol=info.eps,
                                   atol=2 * subnormal_spacing)


@pytest.mark.parametrize("chunks", ["one", "several"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
def test_default_chunking_matches_float64(backend, strategy, dtype, chunks, monkeypatch):
    """The default chunks: "one" has fewer tokens than a chunk. "several": 163 tokens with the 16 MiB floor off
    and every dtype at float32's ridge (20 FLOPs per byte; bfloat16's 295 would take 2363 tokens, minutes in
    the interpreter; test_chunked_default_chunks_keep_the_update_compute_bound checks that rule at its own
    values) and the 1024-token floor off: chunked takes two chunks of at least its minimum 4 * 20 = 80 tokens,
    the second a token shorter
    (82 + 81), recompute forward chunks of its minimum (float32 80, bfloat16 2 * 20 * 2 / 2 = 40) and a last
    one of 3 tokens."""
    if chunks == "one":
        run_check(dtype, 33, 16, 129, "mean", strategy, "combined", chunk_size=None)
        return
    monkeypatch.setattr(lce, "DEFAULT_CHUNK_BYTES", 1)
    monkeypatch.setattr(lce, "CHUNKED_MIN_TOKENS", 1)
    monkeypatch.setitem(lce.RIDGE_FLOPS_PER_BYTE, dtype, 20)
    assert lce.chunked_chunk_tokens(163, 16, 129, dtype, bias=True) == 82
    assert 163 % lce.recompute_chunk_tokens(129, dtype) == 3
    run_check(dtype, 163, 16, 129, "mean", strategy, "plain", chunk_size=None)


@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
def test_all_targets_ignored_matches_pytorch(backend, strategy):
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    target = torch.full((5,), -100)
    loss = linear_cross_entropy(hidden, weight, target, strategy=strategy)
    expected = torch.nn.functional.cross_entropy(hidden.double() @ weight.double().t(), target)
    assert torch.isnan(loss) and torch.isnan(expected)  # PyTorch's mean over no targets: 0/0
    loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


class TestHeldBytes:
    n_tokens, hidden_size, n_classes = 48, 16, 200

    def inputs(self, dtype):
        hidden = torch.randn(self.n_tokens, self.hidden_size, dtype=dtype, requires_grad=True)
        weight = torch.randn(self.n_classes, self.hidden_size, dtype=dtype, requires_grad=True)
        bias = torch.randn(self.n_classes, dtype=dtype, requires_grad=True)
        return hidden, weight, bias, make_target(self.n_tokens, self.n_classes)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_recompute_holds_eight_bytes_per_token(self, backend, dtype):
        hidden, weight, bias, target = self.inputs(dtype)
        with SavedBytesMeter() as saved:
            loss = linear_cross_entropy(hidden, weight, target, bias=bias, strategy="recompute", z_loss=1e-3,
                                        label_smoothing=0.1, chunk_size=7)
        assert saved.new_bytes == 8 * self.n_tokens  # the (max, log-sum) float32 pair; inputs aliased
        loss.backward()

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_chunked_holds_dx_fp32_dw_and_fp64_db_only(self, backend, dtype):
        hidden, weight, bias, target = self.inputs(dtype)
        with SavedBytesMeter() as saved:
            loss = linear_cross_entropy(hidden, weight, target, bias=bias, strategy="chunked", chunk_size=7)
        element = torch.finfo(dtype).bits // 8
        expected = self.n_tokens * self.hidden_size * element + self.n_classes * (self.hidden_size * 4 + 8)
        assert saved.new_bytes == expected
        # dW accumulates in float32 (4 bytes per element, counted above): float32 dW itself, or for half
        # inputs two float32 tensors of V / 2 rows (the first one's storage becomes dW in backward)
        accumulator = [((self.n_classes, self.hidden_size), torch.float32)]
        if dtype != torch.float32:
            accumulator = [((self.n_classes // 2, self.hidden_size), torch.float32)] * 2
        assert [(tuple(r["shape"]), r["dtype"]) for r in saved.records
                if r["new"] and len(r["shape"]) == 2 and r["shape"][0] != self.n_tokens] == accumulator
        loss.backward()

    @pytest.mark.parametrize("n_classes", [200, 41])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_weight_grad_is_one_float32_gemm_per_chunk_and_part_rounded_once(self, backend, dtype, n_classes):
        """The chunked dW: per chunk one GEMM with a float32 result (memkernels::addmm_float32_: aten addmm with
        out_dtype float32 on half operands, as cuBLAS runs it) into each part of the float32 accumulator (float32: dW itself; half: its
        first ceil(V / 2) rows, whose storage becomes dW, and the rest); backward rounds it once into that storage.
        The recorded GEMMs, replayed in float32 (products of half numbers are exact there), give every bit
        of dW at incoming gradient g: (accumulator * g) rounded once. The backward allocates no V x H copy of
        dW, only the finish's first block (1/16 of the front's rows, in the dtype)."""
        hidden, weight, bias, target = self.inputs(dtype)
        weight = weight.detach()[:n_classes].clone().requires_grad_()
        target = target % n_classes
        grad_output = torch.rand(())
        gemms = []

        class GemmLog(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                # addmm_ (float32), or memkernels' GEMM of half operands into a float32 result (addmm with
                # out_dtype on a GPU: memkernels/fusions/common/half_gemm.py)
                if func.__name__.split(".")[0] in ("addmm", "addmm_", "addmm_float32_"):
                    accumulator = kwargs.get("out", args[0])
                    if accumulator.dtype == torch.float32 and accumulator.shape[1] == weight.shape[1]:
                        gemms.append((func.__name__, accumulator.untyped_storage().data_ptr(),
                                      accumulator.storage_offset(), accumulator.shape[0], args[1].clone(),
                                      args[2].clone()))
                return func(*args, **kwargs)

        chunk = 7
        with GemmLog():
            loss = linear_cross_entropy(hidden, weight, target, strategy="chunked", chunk_size=chunk)
        with PeakBytesMeter() as backward:
            loss.backward(grad_output)
        n_chunks = -(-self.n_tokens // chunk)
        front = n_classes - n_classes // 2
        parts = [n_classes] if dtype == torch.float32 else [front, n_classes // 2]
        assert len(gemms) == n_chunks * len(parts)
        dw_storage = weight.grad.untyped_storage().data_ptr()
        for index, (name, storage, offset, rows, grad_rows, hidden_rows) in enumerate(gemms):
            part = index % len(parts)
            assert rows == parts[part]
            assert (grad_rows.dtype, hidden_rows.dtype) == (dtype, dtype)  # tensor-core operands
            if dtype == torch.float32:
                assert (name, storage, offset) == ("addmm_.default", dw_storage, 0)  # dW accumulates itself
            else:
                # aten's overload on CUDA, memkernels' op (the operands widened inside) elsewhere
                assert name == ("addmm.dtype_out" if weight.is_cuda else "addmm_float32_.default")
                assert (storage == dw_storage and offset == 0) == (part == 0)  # the front's storage becomes dW
        accumulator = torch.zeros(n_classes, weight.shape[1])
        for index, (*_, rows, grad_rows, hidden_rows) in enumerate(gemms):
            start = 0 if index % len(parts) == 0 else front
            accumulator[start:start + rows] += (grad_rows.float() @ hidden_rows.float()).cpu()
        expected = (accumulator * grad_output.cpu()).to(dtype)
        if weight.grad.is_cuda:
            # cuBLAS's half-operand GEMM and the float32 replay may order their float32 sums differently
            # (the H200 run of the split accumulator's test): one ulp after the rounding, never what a
            # half-precision accumulator would lose
            torch.testing.assert_close(weight.grad.cpu(), expected, rtol=torch.finfo(dtype).eps, atol=0)
        else:
            assert torch.equal(weight.grad.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8))
        # dW's storage: the float32 front's, V x H x 2 bytes in half (2 H more for an odd V), V x H x 4 in float32
        assert weight.grad.untyped_storage().nbytes() == parts[0] * weight.shape[1] * 4
        if dtype != torch.float32:
            first_block = max(1, int(front * lce.FINISH_FIRST_BLOCK_FRACTION)) * weight.shape[1] * 2
            assert backward.peak_bytes <= first_block + 16  # + the float32 incoming gradient
            assert backward.peak_bytes < weight.numel() * 2 / 4

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_chunked_default_chunk_is_its_documented_budget(self, backend, dtype, monkeypatch):
        """Default chunks, where the budget decides: N tokens in C equal chunks (the last one shorter), C as small
        as keeps a chunk within max(DEFAULT_CHUNK_BYTES, (dX + float32 dW) / 8) with the float32 gradient of half
        inputs with a bias, and the transient peak stays within that budget."""
        monkeypatch.setattr(lce, "DEFAULT_CHUNK_BYTES", 1)  # so the held-bytes fraction decides
        monkeypatch.setitem(lce.RIDGE_FLOPS_PER_BYTE, dtype, 1)  # and not the 4 * ridge tokens minimum,
        monkeypatch.setattr(lce, "CHUNKED_MIN_TOKENS", 1)  # nor the 1024-token floor
        n_tokens, hidden_size, n_classes = 64, 64, 512  # several chunks of several tokens in every dtype
        hidden = torch.randn(n_tokens, hidden_size, dtype=dtype, requires_grad=True)
        weight = torch.randn(n_classes, hidden_size, dtype=dtype, requires_grad=True)
        bias = torch.randn(n_classes, dtype=dtype, requires_grad=True)
        target = make_target(n_tokens, n_classes)
        budget = (hidden.numel() * hidden.element_size() + weight.numel() * 4) // 8
        assert lce.chunked_budget(n_tokens, hidden_size, n_classes, dtype) == budget
        bytes_per_logit = hidden.element_size() + (0 if dtype == torch.float32 else 4)
        fit = budget // bytes_per_logit // n_classes  # float32 9 tokens, half 5
        rows_per_chunk = -(-n_tokens // -(-n_tokens // fit))  # 8 chunks of 8; 13 chunks of 5 (the last 4)
        assert lce.chunked_chunk_tokens(n_tokens, hidden_size, n_classes, dtype, bias=True) == rows_per_chunk
        chunks = []
        monkeypatch.setattr(lce, "head_logits", lambda h, w, b, logits=lce.head_logits: chunks.append(len(h)) or logits(h, w, b))
        with SavedBytesMeter() as saved, PeakBytesMeter() as peak:
            loss = linear_cross_entropy(hidden, weight, target, bias=bias, strategy="chunked")
        assert 1 < rows_per_chunk <= fit < n_tokens
        assert chunks == [min(rows_per_chunk, n_tokens - start) for start in range(0, n_tokens, rows_per_chunk)]
        # The chunk with its float32 gradient (budget), or the reference path's float32 working copy of a chunk
        # (budget), the CPU's float64 sums of float32 dX blocks, O(N) row statistics. Measured: at most 1.78
        # budgets (2.06 with the split accumulator's float32 scratch block, a quarter budget, gone).
        assert peak.peak_bytes - saved.new_bytes <= 2.25 * budget + 16 * n_tokens
        loss.backward()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_recompute_default_chunks_keep_the_gemms_compute_bound(self, dtype, monkeypatch):
        """Default "recompute" chunks: at least RIDGE_HEADROOM * ridge * e / 2 tokens per forward chunk (each
        re-reads the weight) and RIDGE_HEADROOM * 4 * ridge classes per backward tile (each reads and writes the
        float32 dX), when the 16 MiB budget would give fewer. The chunks and tiles are cut in code both backends
        share (only the row kernels differ), so the PyTorch path alone checks them: through the interpreter the
        bf16 case (1183 tokens x 4725 classes) took 36 s of the suite (issue 32)."""
        monkeypatch.setattr(lce, "DEFAULT_CHUNK_BYTES", 1)  # so the minimums decide
        ridge = lce.RIDGE_FLOPS_PER_BYTE[dtype] * lce.RIDGE_HEADROOM
        tokens, classes = ridge * (torch.finfo(dtype).bits // 8) // 2, 4 * ridge  # fp32: 80, 160; bf16: 590, 2360
        n_tokens, n_classes = 2 * tokens + 3, 2 * classes + 5  # two full chunks and tiles and a partial one
        hidden = torch.randn(n_tokens, 8, dtype=dtype, requires_grad=True)
        weight = torch.randn(n_classes, 8, dtype=dtype, requires_grad=True)
        calls = []
        monkeypatch.setattr(lce, "head_logits", lambda h, w, b, logits=lce.head_logits: calls.append((len(h), len(w)))
                            or logits(h, w, b))
        linear_cross_entropy(hidden, weight, make_target(n_tokens, n_classes), strategy="recompute").backward()
        forward = [(rows, n_classes) for rows in (tokens, tokens, 3)]
        backward = [(n_tokens, cols) for cols in (classes, classes, 5)]
        assert calls == forward + backward

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_chunked_default_chunks_keep_the_update_compute_bound(self, dtype, monkeypatch):
        """Default "chunked" chunks: no chunk under m = max(1024, 4 * ridge) tokens (fp32 1024, bf16 1180; each
        reads and writes the float32 dW for 2 r V H FLOPs; issue 31.3 asks >= 1,024 in every dtype) when the
        budget would give fewer, and equal chunks, so that the last one is not short: 2 m + 3 tokens are two
        chunks (m + 2, m + 1), not two of m and one of 3; under 2 m tokens, one chunk."""
        monkeypatch.setattr(lce, "DEFAULT_CHUNK_BYTES", 1)  # so the minimum decides
        minimum = max(1024, 4 * lce.RIDGE_FLOPS_PER_BYTE[dtype])
        assert minimum == {torch.float32: 1024, torch.bfloat16: 1180}[dtype]
        assert lce.chunked_chunk_tokens(2 * minimum + 3, 8, 5, dtype) == minimum + 2
        calls = []
        monkeypatch.setattr(lce, "head_logits", lambda h, w, b, logits=lce.head_logits: calls.append(len(h)) or logits(h, w, b))
        for n_tokens, expected in ((2 * minimum + 3, [minimum + 2, minimum + 1]), (2 * minimum - 1, [2 * minimum - 1]),
                                   (minimum - 7, [minimum - 7])):
            hidden = torch.randn(n_tokens, 8, dtype=dtype, requires_grad=True)
            weight = torch.randn(5, 8, dtype=dtype, requires_grad=True)
            calls.clear()
            linear_cross_entropy(hidden, weight, make_target(n_tokens, 5), strategy="chunked").backward()
            assert calls == expected, n_tokens

    def test_no_grad_holds_nothing_and_stays_within_a_chunk(self, backend):
        hidden, weight, bias, target = self.inputs(torch.float32)
        chunk_size = 6
        with torch.no_grad(), SavedBytesMeter() as saved, PeakBytesMeter() as peak:
            loss = linear_cross_entropy(hidden, weight, target, bias=bias, chunk_size=chunk_size)
        assert saved.total_bytes == 0 and not loss.requires_grad
        logits_chunk = chunk_size * self.n_classes * 4
        # one logits chunk, the reference path's float32 working copies of it, and O(N) row stats
        assert peak.peak_bytes <= 4 * logits_chunk + 64 * self.n_tokens
        assert peak.peak_bytes < self.n_tokens * self.n_classes * 4 / 2  # well under the full logits

    def test_auto_rule(self, backend):
        """pick_strategy: "recompute" where "chunked" cannot serve; else the faster by the audit's cost model,
        counted where the two differ in FLOPs at the dtype's GEMM peak (a byte counts ridge FLOPs: 295 for
        bf16/fp16, 20 for float32). recompute adds a logits GEMM (2 N H V) and a read of the logits (ridge N V e);
        chunked adds its dW updates' bytes beyond their FLOPs (per chunk of r tokens (8 ridge - 2 r) V H when
        positive), and zeroing and finishing the float32 accumulator (10 bytes per element for half dW, 12 for
        float32, times ridge)."""
        f32, bf16 = torch.float32, torch.bfloat16
        head = (4096, 128256)  # Llama-3-8B's head: H, V
        assert pick_strategy("auto", 8192, *head, bf16, False, "mean") == "recompute"  # loss only
        assert pick_strategy("auto", 8192, *head, bf16, True, "none") == "recompute"  # chunked cannot
        assert pick_strategy("chunked", 1, *head, bf16, True, "mean") == "chunked"  # named: taken as is
        # 8192 tokens, bf16: 6 chunks of 1366 >= 4 x 295 tokens, whose updates cost their FLOPs only; 10 x 295 =
        # 2950 V H against 2 x 8192 + 295 x 8192 x 2 / 4096 = 17564 V H. float32: 8 chunks of 1024 >= 80, 12 x 20
        # = 240 V H against 16384 + 20 x 8192 x 4 / 4096 = 16544 V H.
        assert lce.chunked_chunk_tokens(8192, *head, bf16) == 1366
        assert lce.chunked_chunk_tokens(8192, *head, f32) == 1024  # the budget alone: 544 tokens
        for dtype in (bf16, torch.float16, f32):
            assert pick_strategy("auto", 8192, *head, dtype, True, "mean") == "chunked"
        # One chunk of N >= 4 ridge tokens: 2950 H against N (2 H + 590): bf16 from N = 1376 (12,083,200 against
        # 1376 x 8782 = 12,084,032); float32 240 H against N (2 H + 80): from N = 119
        assert pick_strategy("auto", 1376, *head, bf16, True, "mean") == "chunked"
        assert pick_strategy("auto", 1375, *head, bf16, True, "mean") == "recompute"
        assert pick_strategy("auto", 119, *head, f32, True, "mean") == "chunked"
        assert pick_strategy("auto", 118, *head, f32, True, "mean") == "recompute"
        # a chunk under 4 ridge tokens moves more than its FLOPs: 512 bf16 tokens, (2360 - 1024) + 2950 V H
        # against 1024 + 590 x 512 / 4096 = 1097.75 V H
        assert pick_strategy("auto", 512, *head, bf16, True, "mean") == "recompute"
        # a chunk_size the caller names is what chunked would run: 8192 tokens in chunks of 64 make 128 update
        # passes of (2360 - 128) V H
        assert pick_strategy("auto", 8192, *head, bf16, True, "mean", chunk_size=64) == "recompute"
        hidden = torch.randn(96, self.hidden_size, requires_grad=True)
        weight = torch.randn(self.n_classes, self.hidden_size, requires_grad=True)
        # 96 tokens, H 16, V 200, one chunk. float32: 240 V H against 2 x 96 + 20 x 96 x 4 / 16 = 672 V H.
        # bf16: (2360 - 192) + 2950 = 5118 V H against 192 + 295 x 96 x 2 / 16 = 3732 V H.
        for dtype, strategy in ((f32, "chunked"), (bf16, "recompute")):
            inputs = hidden.to(dtype), weight.to(dtype), make_target(96, self.n_classes)
            with SavedBytesMeter() as saved:
                linear_cross_entropy(*inputs)
            # chunked holds dX and the float32 dW; recompute the (max, log-sum) pair per token
            assert saved.new_bytes == (96 * 8 if strategy == "recompute" else
                                       96 * self.hidden_size * 4 + self.n_classes * self.hidden_size * 4)

    def test_auto_rule_takes_chunked_only_where_it_fits_on_the_device(self, monkeypatch):
        """Where chunked is faster, "auto" takes it on a CUDA device only if its peak (chunked_peak_bytes) is free
        now: the driver's free memory, else with what the caching allocator holds unused (PyTorch's, or
        memkernels' pool when installed). Off CUDA and while torch.compile traces, memory is not asked."""
        import memkernels.allocator
        args = ("auto", 8192, 4096, 128256, torch.bfloat16, True, "mean")
        peak = lce.chunked_peak_bytes(*args[1:5])
        # dX 64 MiB, the float32 accumulator 2004 MiB (dW's storage its first half), a 1366-token chunk 334 MiB
        # and 12 bytes of row statistics per token and per chunk row: 2402 MiB
        assert peak == 8192 * 4096 * 2 + 4 * 128256 * 4096 + 1366 * (128256 * 2 + 12) + 12 * 8192
        cuda = torch.device("cuda", 0)
        device = {"free": peak - 1, "reserved": 0, "allocated": 0}
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (device["free"], 80 * 2**30))
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda index=None: {
            "reserved_bytes.all.current": device["reserved"], "allocated_bytes.all.current": device["allocated"]})
        assert pick_strategy(*args, device=cuda) == "recompute"
        device.update(reserved=5, allocated=4)  # one byte unused in PyTorch's cache
        assert pick_strategy(*args, device=cuda) == "chunked"
        device.update(free=peak, reserved=0)
        assert pick_strategy(*args, device=cuda) == "chunked"
        device["free"] = peak - 10
        monkeypatch.setattr(memkernels.allocator, "installed", lambda: True)
        for pool_free, strategy in ((9, "recompute"), (10, "chunked")):
            monkeypatch.setattr(memkernels.allocator, "stats", lambda index=None, free=pool_free: {"free_bytes": free})
            assert pick_strategy(*args, device=cuda) == strategy
        device["free"] = 0
        assert pick_strategy(*args, device=torch.device("cpu")) == "chunked"
        assert pick_strategy(*args) == "chunked"
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert pick_strategy(*args, device=cuda) == "chunked"

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_chunked_peak_bytes_is_what_the_gpu_path_allocates(self, dtype, monkeypatch):
        """chunked_peak_bytes, what "auto" asks the device for, against the forward's measured peak on the Triton
        path (the GPU's; under the interpreter on a CPU), float32 dX in one GEMM per chunk as on a GPU: the
        formula's dX, accumulator, chunk and row statistics, and at most a byte per token more (the mask of kept
        targets; measured: 28 bytes)."""
        from backends import use_backend
        monkeypatch.setattr(lce, "HIDDEN_GRAD_VOCAB_BLOCK", 1 << 62)
        n_tokens, hidden_size, n_classes = 200, 64, 601
        with use_backend("triton"):
            hidden = torch.randn(n_tokens, hidden_size, dtype=dtype, requires_grad=True)
            weight = torch.randn(n_classes, hidden_size, dtype=dtype, requires_grad=True)
            target = make_target(n_tokens, n_classes)
            with PeakBytesMeter() as peak:
                loss = linear_cross_entropy(hidden, weight, target, strategy="chunked")
            loss.backward()
        formula = lce.chunked_peak_bytes(n_tokens, hidden_size, n_classes, dtype)
        assert formula <= peak.peak_bytes <= formula + n_tokens

def test_deterministic(backend):
    hidden = torch.randn(30, 8, requires_grad=True)
    weight = torch.randn(70, 8, requires_grad=True)
    target = make_target(30, 70)
    grads = []
    for strategy in ("chunked", "chunked", "recompute", "recompute"):
        hidden.grad = weight.grad = None
        linear_cross_entropy(hidden, weight, target, strategy=strategy, chunk_size=4).backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    assert all(torch.equal(a, b) for a, b in zip(grads[2], grads[3]))


def test_out_of_range_target_raises_on_the_cpu_reference():
    memkernels.set_backend("torch")
    try:
        with pytest.raises(ValueError, match="class id 9"):
            linear_cross_entropy(torch.randn(3, 4), torch.randn(9, 4), torch.tensor([0, 9, -100]))
    finally:
        memkernels.set_backend("auto")


@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
def test_out_of_range_target_gives_nan_on_the_triton_path(strategy):
    memkernels.set_backend("triton")
    try:
        device = triton_device()
        hidden = torch.randn(3, 4, device=device, requires_grad=True)
        weight = torch.randn(9, 4, device=device, requires_grad=True)
        loss = linear_cross_entropy(hidden, weight, torch.tensor([0, 9, -100], device=device), strategy=strategy,
                                    reduction="sum")
        assert torch.isnan(loss)
        loss.backward()
        assert torch.isnan(hidden.grad[1]).all() and torch.isfinite(hidden.grad[[0, 2]]).all()
    finally:
        memkernels.set_backend("auto")


def test_second_backward_of_chunked_raises():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, make_target(6, 9), strategy="chunked")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("call,error,match", [
    (lambda h, w, t: linear_cross_entropy(h, w.t(), t), ValueError, "weight has shape"),
    (lambda h, w, t: linear_cross_entropy(h, w.double(), t), ValueError, "must match hidden"),
    (lambda h, w, t: linear_cross_entropy(h.double(), w.double(), t), TypeError, "hidden has dtype torch.float64; supported"),
    (lambda h, w, t: linear_cross_entropy(h, w, t.float()), TypeError, "target must hold integer"),
    (lambda h, w, t: linear_cross_entropy(h, w, t[:3]), ValueError, "target has 3 elements"),
    (lambda h, w, t: linear_cross_entropy(h, w, t, bias=torch.zeros(4)), ValueError, "bias must have shape"),
    (lambda h, w, t: linear_cross_entropy(h, w, t, strategy="fast"), ValueError, "strategy"),
    (lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=0), ValueError, "chunk_size"),
    (lambda h, w, t: linear_cross_entropy(h, w, t, strategy="chunked", reduction="none"), ValueError,
     "recompute"),
    (lambda h, w, t: linear_cross_entropy(h, w, t, class_weight=torch.ones(3)), ValueError,
     r"class_weight must have shape \(7,\)"),
])
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(5, 4), torch.randn(7, 4), torch.zeros(5, dtype=torch.long))


def test_module_matches_function(backend):
    hidden = torch.randn(2, 5, 8)
    weight = torch.randn(30, 8)
    target = torch.randint(0, 30, (2, 5))
    module = LinearCrossEntropyLoss(label_smoothing=0.1, softcap=5.0, reduction="none", strategy="recompute")
    expected = linear_cross_entropy(hidden, weight, target, label_smoothing=0.1, softcap=5.0, reduction="none",
                                    strategy="recompute")
    out = module(hidden, weight, target)
    assert out.shape == (2, 5)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype,compiler", [(torch.float32, "aot_eager"), (torch.bfloat16, "inductor")])
@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
def test_compiled_model_with_ignored_targets_matches_eager(strategy, dtype, compiler):
    # Liger PR #1338: ignore_index silently changed the compiled loss. aot_eager runs dynamo,
    # the fake impls and AOTAutograd around the custom ops; inductor also compiles the chunked
    # backward's functionalized writes (bf16 dW rounded in place into its float32 accumulator's
    # storage came out one ulp off in ~0.4% of the elements: V x H = 203 x 64 makes that certain).
    torch._dynamo.reset()
    body = torch.nn.Linear(8, 64).to(dtype)
    head = torch.randn(203, 64, dtype=dtype, requires_grad=True)
    hidden = torch.randn(32, 8, dtype=dtype)
    target = torch.randint(0, 203, (32,))
    target[::3] = -100

    def model(hidden, target):
        return linear_cross_entropy(body(hidden), head, target, strategy=strategy, label_smoothing=0.1,
                                    chunk_size=10)

    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    eager_loss = model(hidden, target)
    eager_grads = torch.autograd.grad(eager_loss, (head, body.weight))
    compiled_loss = compiled(hidden, target)
    compiled_grads = torch.autograd.grad(compiled_loss, (head, body.weight))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=0)
    for got, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_classes,hidden_size", [(1, 3), (2, 1), (3, 5), (33, 7), (100, 4), (101, 1)])
def test_finish_rounds_the_accumulator_once_in_the_front_storage(dtype, n_classes, hidden_size):
    """Half dW's float32 accumulator, the front (rows [0, ceil(V / 2))) and the rest, rounded in place into
    the front's storage by blocks (the first through a temporary, then blocks that overwrite only rows already
    rounded): dW is a V x H view of that storage with the bits of (accumulator * g) rounded once, whatever the
    bits (NaN, inf, subnormals, values the product overflows)."""
    weight = torch.empty(n_classes, hidden_size, dtype=dtype)
    front, rest = lce._weight_grad_accumulator(weight)
    parts = lce._weight_grad_parts(front, rest)
    assert [(part.shape[0], start) for part, start in parts][0] == (n_classes - n_classes // 2, 0)
    assert sum(part.shape[0] for part, _ in parts) == n_classes
    accumulator = torch.randint(-2**31, 2**31 - 1, (n_classes, hidden_size), dtype=torch.int32).view(torch.float32)
    accumulator.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-40, float("inf")])[:accumulator.numel()]
    accumulator.view(-1)[-1] = torch.finfo(torch.float32).max
    for part, start in parts:
        part.copy_(accumulator[start:start + part.shape[0]])
    scale = torch.tensor(-1.37)
    result = lce._finish_weight_grad(front, rest, scale, dtype)
    assert result.shape == weight.shape and result.dtype == dtype
    assert result.untyped_storage().data_ptr() == front.untyped_storage().data_ptr()
    expected = (accumulator * scale).to(dtype)
    assert torch.equal(result.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(result.view(torch.int16)[finite], expected.view(torch.int16)[finite])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on NaN
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_elements", [1, 1023, 2500])
def test_scale_kernel_rounds_the_float32_product_once(dtype, n_elements):
    """The chunked backward's dX scaling: x * g taken in float32 and rounded once to x's dtype, for
    any bits of x (NaN, inf, subnormals, values the product overflows) and a g no half type holds.
    (On a GPU, dX.mul_(g) with g a float32 CUDA tensor rounds g to dX's dtype first.)"""
    bits = torch.randint(-2**15, 2**15, (n_elements,), dtype=torch.int16)
    x = bits.view(dtype).clone()
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), torch.finfo(dtype).max])[:n_elements]
    x, scale = x.to(triton_device()), torch.tensor(-1.37, device=triton_device())
    expected = (x.float() * scale).to(dtype)
    lce._scale_triton(x, scale)
    finite = ~expected.isnan()
    assert torch.equal(x.view(torch.int16)[finite], expected.view(torch.int16)[finite])
    assert torch.equal(x.isnan(), expected.isnan())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on NaN
@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_hidden_gives_nan_gradients(backend, cuda_nans, dtype, strategy):
    """A NaN activation (every class of NaN arrives as some NaN logit) makes its token's dX and every dW/dB
    entry NaN, through half dW's float32 accumulator rounded in its own storage: nothing rounds a NaN into a
    number."""
    hidden = torch.randn(6, 16).to(dtype)
    hidden[2, 3] = float("nan")
    hidden.requires_grad_()
    weight = (torch.randn(50, 16) / 4).to(dtype).requires_grad_()
    bias = torch.randn(50).to(dtype).requires_grad_()
    target = torch.tensor([1, 4, 9, 16, 25, 36])
    linear_cross_entropy(hidden, weight, target, bias=bias, strategy=strategy, chunk_size=2).backward()
    assert torch.isnan(hidden.grad[2]).all() and torch.isfinite(hidden.grad[[0, 1, 3, 4, 5]]).all()
    assert torch.isnan(weight.grad).all() and torch.isnan(bias.grad).all()


@pytest.mark.parametrize("n_classes", [1, 7])
def test_recompute_backward_takes_a_whole_rows_logsumexp_from_the_logits_it_recomputes(backend, n_classes):
    """A GPU's forward rounds the logits through a GEMM of another shape than the backward's (token
    chunks, not class tiles), so the saved logsumexp can be off the recomputed logits' by roundings: at
    one class that made p - 1 != 0 and dW, dB nonzero (the H200 runs). When one tile holds every class
    the backward takes the logsumexp from its own logits, so a saved one that is off changes nothing."""
    device = triton_device() if backend == "triton" else "cpu"
    hidden = torch.randn(6, 8, device=device)
    weight = torch.randn(n_classes, 8, device=device) / 3
    bias = torch.randn(n_classes, device=device)
    target = torch.randint(0, n_classes, (6,), device=device)
    logits = hidden @ weight.t() + bias
    lse = torch.stack([logits.max(1).values, (logits - logits.max(1, keepdim=True).values).exp().sum(1).log()], 1)
    off = lse.clone()
    off[:, 1] += 1e-6  # what another GEMM's rounding of the logits moves it by, and more
    grads = {}
    for name, saved in (("exact", lse), ("off", off)):
        grads[name] = lce._recompute_backward_impl(torch.tensor(1.0, device=device), hidden, weight, target, bias,
                                                   saved, None, -100, 0.0, 0.0, 0.0, "mean", 0, True, True, True,
                                                   backend)
    for exact, from_off in zip(grads["exact"], grads["off"]):
        assert torch.equal(exact, from_off)
    if n_classes == 1:
        assert all(not g.any() for g in grads["off"])
