"""A whole training step of a Llama-3-8B-shaped decoder: eager, torch.compile, Liger, memkernels apply().

    python benchmarks/bench_step.py [--layers N] [--tokens N] [--hidden N] [--intermediate N] [--heads N]
                                    [--kv-heads N] [--vocab N] [--dtype bf16|fp32] [--steps 10] [--warmup 3]
                                    [--columns eager,compile,liger,memkernels,recompute]
    pytest benchmarks/bench_step.py --benchmark-only [--benchmark-json step.json]

The model: transformers' LlamaForCausalLM built from a LlamaConfig (random weights, nothing downloaded): SDPA
attention, RMSNorm, SwiGLU MLP, RoPE, untied LM head, ``use_cache=False`` (a training step has no use for the KV
cache; with it Hugging Face copies K and V into a DynamicCache in every layer), trained by AdamW with
``fused=True`` (transformers.Trainer's default optimizer, "adamw_torch_fused") on one synthetic sequence of
``--tokens`` token ids (labels = the ids; the model shifts them). A step is forward with labels, backward,
``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``.
Defaults: with CUDA, Llama-3-8B's dims (H 4096, I 14336, 32 heads, 8 KV heads, vocab 128256) with 4 layers at
8192 tokens in bf16 (what fits an 80 GB card in every column; --layers for a bigger one); on a CPU, H 64, I 224,
2 heads, 1 KV head, vocab 512, 2 layers, 128 tokens, fp32 (the Triton interpreter's cost grows with the tokens).
The launches per layer do not depend on the tokens; in memkernels' columns the step's launches and saved bytes
do, through the loss: apply()'s linear cross-entropy runs with strategy "auto" (what a user gets), which takes
"recompute" under 119 float32 tokens at this shape and "chunked" from there (apply()'s step: 124 launches at 8
tokens, 126 at 128; tests/test_bench_step.py pins the 8-token figures).

Columns, one at a time in the same run, each a fresh model built from the same seed (the same weights):
  eager;  compile: ``torch.compile(model)`` (not on a CPU: inductor makes C++ loops there, not the GPU's kernels,
  so its launches and memory would not be the GPU's);  Liger: ``apply_liger_kernel_to_llama(model=model)`` (RoPE,
  RMSNorm, SwiGLU, fused linear cross-entropy), when liger_kernel imports; its module-level patches (the rotary
  function, the RMSNorm and MLP classes) are undone after its column;  apply(): ``memkernels.apply(model)``;
  recompute: ``memkernels.apply(model, mlp="recompute")``.

Rows:
  step ms        GPU: median over --steps steps after --warmup, each from a drained GPU to its end
                 (torch.cuda.synchronize).
  tokens/s       tokens / step time (on a CPU: / host time, a CPU figure).
  host ms/step   GPU: median time for the host to issue a step (until its last launch returns, the GPU not
                 awaited; a step that reads the device back waits there: see syncs). CPU: the step's wall time,
                 compute included, on the CPU's default path (memkernels' PyTorch reference; Liger has no CPU
                 path, "-").
  peak MiB       GPU: torch.cuda.max_memory_allocated over the timed steps (weights, gradients, AdamW state,
                 activations). CPU: memkernels.meters.PeakBytesMeter over the counted step: what the step
                 allocates on top of the resident weights and AdamW state.
  saved B/token  memkernels.meters.SavedBytesMeter over the forward: new storages saved for backward
                 (deduplicated), per token. torch.compile's saves are not visible to saved-tensor hooks (under
                 them dynamo runs the frame eagerly, which would give eager's figure): for it, the GPU's
                 memory_allocated after the forward minus before, marked "~".
  launches/step  see below.
  launches/layer (launches of the L-layer model - launches of a 1-layer model) / (L - 1), the 1-layer model
                 counted the same way (2 layers when L is 1): what one decoder layer adds to a step, forward,
                 backward and optimizer. Not for torch.compile (a second compile).
  syncs/step     CPU only: aten ops that read device memory back (gpu_audit.SYNC_OPS: .item(), nonzero, equal).

How launches are counted:
  - GPU: torch.profiler with the CUDA activity over one step after the warm-up: every device activity
    (kernels, memcpys, memsets), whoever launched it: Triton, cuBLAS, flash attention, inductor, PyTorch.
  - CPU: memkernels.audit.gpu_audit.count() over one steady step (AdamW's state made beforehand): one launch for
    every aten op that would run a kernel (views and bare allocations such as ``empty`` are not counted; ``zeros``
    is a fill and is) plus one for every Triton grid launch, the Triton kernels run by the interpreter
    (TRITON_INTERPRET=1, which this script sets before triton's first import when there is no CUDA).
    memkernels runs its Triton path there (``set_backend("triton")``): the launches a GPU gets, GEMMs as aten
    ``mm`` (cuBLAS) and the fused passes as Triton grids. Liger's kernels run under gpu_audit's interpreter shim
    (triton 3.9's interpreter hands them bare float arguments and empty libdevice stubs). An aten op counts one
    launch where CUDA may run a few kernels for it (SDPA's backward, fused AdamW over more tensors than one
    multi_tensor_apply launch takes, a split reduction): the same ops in every column, so columns compare, but
    the GPU's profiler count is the real one. Where Liger cannot run (not installed, or no interpreter), its
    launches per layer are LIGER_LAUNCHES_PER_LAYER_FROM_SOURCE, derived from its source below.

Done-when of issue 31.4: apply()'s launches per layer <= Liger's; the last line says whether it is met and the
exit status is 1 when it is not.
"""
import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import: Triton launches run on the CPU

try:
    import transformers
except ImportError:  # main() says so; tests/test_bench_step.py skips
    transformers = None

import memkernels  # noqa: E402
from memkernels._backend import get_backend, set_backend  # noqa: E402
from memkernels.audit import gpu_audit  # noqa: E402
from memkernels.meters import PeakBytesMeter, SavedBytesMeter  # noqa: E402

try:
    import pytest
except ImportError:  # the script runs without pytest; only its pytest-benchmark test needs it
    pytest = None

SEED = 0
COLUMNS = ("eager", "compile", "liger", "memkernels", "recompute")
HEADERS = {"eager": "eager", "compile": "torch.compile", "liger": "Liger", "memkernels": "apply()",
           "recompute": 'mlp="recompute"'}

# Launches one Llama decoder layer adds to a training step under apply_liger_kernel_to_llama, read from
# liger-kernel 0.8.5's source (transformers/monkey_patch.py apply_liger_kernel_to_llama; ops/rms_norm.py,
# ops/rope.py, ops/swiglu.py) and Hugging Face's LlamaDecoderLayer, in the counting rule above (fp32, SDPA,
# use_cache=False, fused AdamW); tests/test_bench_step.py checks it against the count of Liger's run where
# liger_kernel is installed:
#   21  GEMMs (aten mm): q, k, v, o, gate, up, down forward (7), and each one's dX and dW backward (14)
#    2  SDPA forward, SDPA backward
#    7  adds: the two residual adds forward; backward, the gradient sums where a tensor has several consumers:
#       the residual stream at each of the two residual adds (2), the normed input of q, k and v (2), of gate
#       and up (1)
#    6  LigerRMSNorm x 2: _rms_norm_forward_kernel; _rms_norm_backward_kernel and the aten sum of its
#       per-program dW partials (rms_norm_backward: ``_dW.sum(dim=0).to(W.dtype)``, the cast one more launch
#       when the weights are not fp32)
#    2  liger_rotary_pos_emb: _triton_rope forward and backward, q and k in one launch each
#    2  LigerSwiGLUMLP: _swiglu_forward_kernel, _swiglu_backward_kernel
#   AdamW adds no launch per layer (one _fused_adamw_ over every parameter).
LIGER_LAUNCHES_PER_LAYER_FROM_SOURCE = 21 + 2 + 7 + 6 + 2 + 2


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    dtype: torch.dtype
    device: str


GPU_DEFAULTS = dict(layers=4, tokens=8192, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
                    dtype=torch.bfloat16)
CPU_DEFAULTS = dict(layers=2, tokens=128, hidden=64, intermediate=224, heads=2, kv_heads=1, vocab=512,
                    dtype=torch.float32)


def default_shape(device=None, **overrides):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    values = dict(GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS)
    values.update({key: value for key, value in overrides.items() if value is not None})
    return Shape(device=device, **values)


def llama_config(shape, layers=None):
    return transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers if layers is None else layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=max(shape.tokens, 8192), rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
        use_cache=False, attn_implementation="sdpa")


def interpreting():
    """True when Triton kernels run in the interpreter (memkernels' were decorated under TRITON_INTERPRET=1)."""
    from memkernels.fusions.norm import kernels as _norm_kernels
    return type(_norm_kernels._norm_fwd_kernel).__name__ == "InterpretedFunction"


def liger_missing():
    """None when liger_kernel's Hugging Face patches import, else why not."""
    try:
        with _quiet_liger():
            import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed (pip install liger-kernel --no-deps)"
    except Exception as error:  # noqa: BLE001 - a liger-kernel built for another triton or transformers
        return f"liger-kernel does not import here ({type(error).__name__}: {error})"
    return None


def column_notes(device):
    """{column: why it is not run} for this machine."""
    notes = {}
    if device != "cuda":
        notes["compile"] = ("not run on a CPU: inductor makes C++ loops there, not the GPU's kernels, so its "
                            "launches, memory and time would not be the GPU's")
    missing = liger_missing()
    if missing:
        notes["liger"] = missing
    elif device != "cuda" and not interpreting():
        notes["liger"] = "its Triton kernels need a GPU or the interpreter (TRITON_INTERPRET=1 before triton's import)"
    return notes


@contextlib.contextmanager
def _quiet_liger():
    """Liger's import logs the backends it cannot load (CuTe DSL, Ascend); its Llama forward warns about
    transformers 5's renamed arguments. Neither is news to a reader of this table."""
    logger = logging.getLogger("liger_kernel")
    level = logger.level
    verbosity = transformers.logging.get_verbosity()
    logger.setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)
        transformers.logging.set_verbosity(verbosity)


@contextlib.contextmanager
def _liger_column():
    """Liger quiet, and apply_liger_kernel_to_llama's module-level patches undone afterwards, so that the
    columns after it run Hugging Face's own RoPE."""
    from transformers.models.llama import modeling_llama
    names = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")
    saved = {name: getattr(modeling_llama, name) for name in names}
    forward = modeling_llama.LlamaForCausalLM.forward
    try:
        with _quiet_liger():
            yield
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)
        modeling_llama.LlamaForCausalLM.forward = forward


@contextlib.contextmanager
def fresh_model(column, shape, layers=None):
    """Yield (model, runner, optimizer): a fresh LlamaForCausalLM from SEED with ``column``'s patches, what a
    step calls (the torch.compile'd module for "compile", else the model) and its AdamW. Freed on exit."""
    with contextlib.ExitStack() as stack:
        if column == "liger":
            stack.enter_context(_liger_column())
        torch.manual_seed(SEED)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(shape.dtype)  # as from_pretrained(dtype=...) builds: the rotary inv_freq stays fp32
        try:
            with torch.device(shape.device):
                model = transformers.LlamaForCausalLM(llama_config(shape, layers))
        finally:
            torch.set_default_dtype(default_dtype)
        model.train()
        runner = model
        if column == "compile":
            runner = torch.compile(model)
        elif column == "liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama
            apply_liger_kernel_to_llama(model=model)
        elif column == "memkernels":
            memkernels.apply(model)
        elif column == "recompute":
            memkernels.apply(model, mlp="recompute")
        elif column != "eager":
            raise ValueError(f"unknown column {column!r}; one of {', '.join(COLUMNS)}")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        try:
            yield model, runner, optimizer
        finally:
            del model, runner, optimizer
            gc.collect()
            if column == "compile":
                torch._dynamo.reset()
            if shape.device == "cuda":
                torch.cuda.empty_cache()


def token_ids(shape):
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, shape.vocab, (1, shape.tokens), generator=generator).to(shape.device)


def train_step(runner, optimizer, ids):
    loss = runner(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _prime_optimizer(model, optimizer):
    """AdamW's first step makes its state (exp_avg, exp_avg_sq, step): done here on zero gradients, so that a
    counted step is a steady one without a forward and backward to pay for (the interpreter is slow)."""
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _counted_path(column):
    """The path a CPU count runs: memkernels' Triton kernels (the GPU's launches) under the interpreter, Liger's
    under gpu_audit's shim for it; eager as it is."""
    if column == "liger":
        with gpu_audit._liger_interpreter_shim():
            yield
    elif column in ("memkernels", "recompute") and interpreting():
        previous = get_backend()
        set_backend("triton")
        try:
            yield
        finally:
            set_backend(previous)
    else:
        yield


@contextlib.contextmanager
def _interpreter_cycles_collected():
    """Collect garbage after every interpreted Triton launch. Triton 3.9's interpreter leaves reference cycles
    around a launch's arguments, so the tensors it was given die at the next garbage collection instead of when
    their last reference goes: the peak then depends on when the collector happens to run (a 2-layer step at 32
    tokens: 0.76 or 0.79 MB, 1.36 MB with the collector off; 0.71 MB every way with this). A compiled launch
    holds nothing. The cycles are young: a generation-1 collection (microseconds) frees them."""
    if not interpreting():
        yield
        return
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    launch = executor.__call__

    def launch_and_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect(1)
    executor.__call__ = launch_and_collect
    try:
        yield
    finally:
        executor.__call__ = launch


def counted_step(column, model, runner, optimizer, ids):
    """gpu_audit.count() over one steady step on the CPU: (launches, saved new bytes of the forward, peak bytes).

    PeakBytesMeter is entered before the counter, so the counter is the top dispatch mode: it runs a custom op
    (reached only under torch.compile; eager mode calls memkernels' autograd.Function twins) as its aten and
    Triton insides, which the peak meter below it then sees; SavedBytesMeter, on top during the forward, needs
    only the saved tensors' storages. The counts, saved bytes and peak are the same as each meter's alone."""
    _prime_optimizer(model, optimizer)
    with _counted_path(column), _interpreter_cycles_collected():
        with PeakBytesMeter() as peak, gpu_audit.count() as counts:
            with SavedBytesMeter() as saved:
                loss = runner(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return counts.launches, saved.new_bytes, peak.peak_bytes


def count_column(column, shape):
    """CPU figures of ``column`` that need no timing: {"launches", "launches_per_layer", "syncs", "saved",
    "peak", "by_kernel"} (saved and peak in bytes; by_kernel: {"aten:mm": n, "triton:...": n} of the step)."""
    other_layers = 1 if shape.layers > 1 else 2
    ids = token_ids(shape)
    launches = {}
    for layers in (shape.layers, other_layers):
        with fresh_model(column, shape, layers) as (model, runner, optimizer):
            launches[layers], saved, peak = counted_step(column, model, runner, optimizer, ids)
        if layers == shape.layers:
            figures = {"launches": len(launches[layers]), "syncs": sum(launch.sync for launch in launches[layers]),
                       "saved": saved, "peak": peak}
    figures["launches_per_layer"] = ((len(launches[shape.layers]) - len(launches[other_layers]))
                                     / (shape.layers - other_layers))
    by_kernel = {}
    for launch in launches[shape.layers]:
        key = f"{launch.kind}:{launch.name}"
        by_kernel[key] = by_kernel.get(key, 0) + 1
    figures["by_kernel"] = by_kernel
    return figures


def _median_times(step, steps, warmup, sync):
    """(median wall s, median host s) of ``steps`` steps after ``warmup``; each from a drained device."""
    for _ in range(warmup):
        step()
    sync()
    walls, hosts = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        sync()
        walls.append(time.perf_counter() - start)
        hosts.append(issued - start)
    return statistics.median(walls), statistics.median(hosts)


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread: the CPU dims are too small to split, and on a shared machine OpenMP's waits swamped
    the work (a 2-layer step: 576 ms on 2 loaded cores, 7 ms on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_cpu(column, shape, steps=10, warmup=3, benchmark=None):
    """Every CPU figure of ``column``: count_column's, and the host time of a step on the CPU's default path (one
    thread). ``benchmark``: a pytest-benchmark fixture that also times the step (Liger's: one round in the
    interpreter, its only CPU path)."""
    with _one_thread():
        figures = count_column(column, shape)
        figures["host_s"] = figures["step_s"] = None
        ids = token_ids(shape)
        if column != "liger":  # Liger has no CPU path: its step runs only in the interpreter
            with fresh_model(column, shape) as (_, runner, optimizer):
                step = lambda: train_step(runner, optimizer, ids)  # noqa: E731
                _, figures["host_s"] = _median_times(step, steps, warmup, lambda: None)
                if benchmark is not None:
                    benchmark.pedantic(step, rounds=steps, iterations=1)
        elif benchmark is not None:
            with fresh_model(column, shape) as (_, runner, optimizer), _counted_path(column):
                benchmark.pedantic(lambda: train_step(runner, optimizer, ids), rounds=1, iterations=1)
    return figures


def _cuda_launches(step):
    """Device activities (kernels, memcpys, memsets) of one ``step``, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == DeviceType.CUDA)


def _cuda_saved(column, runner, optimizer, ids):
    """(saved bytes of the forward, exact?): SavedBytesMeter; torch.compile: memory_allocated after minus before."""
    if column == "compile":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = runner(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        held, exact = torch.cuda.memory_allocated() - before, False
    else:
        with SavedBytesMeter() as saved:
            loss = runner(input_ids=ids, labels=ids).loss
        held, exact = saved.new_bytes, True
    loss.backward()
    del loss
    optimizer.zero_grad(set_to_none=True)
    return held, exact


def measure_cuda(column, shape, steps=10, warmup=3, benchmark=None):
    """Every GPU figure of ``column`` (see the module docstring). ``benchmark``: a pytest-benchmark fixture that
    also times the step, synchronized, on the same model after the table's figures."""
    ids = token_ids(shape)
    sync = torch.cuda.synchronize
    with fresh_model(column, shape) as (_, runner, optimizer):
        step = lambda: train_step(runner, optimizer, ids)  # noqa: E731
        for _ in range(warmup):  # compiles, autotuning, AdamW's state
            step()
        saved, exact = _cuda_saved(column, runner, optimizer, ids)
        launches = _cuda_launches(step)
        torch.cuda.reset_peak_memory_stats()
        step_s, host_s = _median_times(step, steps, 0, sync)
        peak = torch.cuda.max_memory_allocated()
        if benchmark is not None:
            benchmark.pedantic(lambda: (step(), sync()), rounds=steps, iterations=1)
    per_layer = None
    if column != "compile":
        other_layers = 1 if shape.layers > 1 else 2
        with fresh_model(column, shape, other_layers) as (_, runner, optimizer):
            step = lambda: train_step(runner, optimizer, ids)  # noqa: E731
            for _ in range(2):
                step()
            per_layer = (launches - _cuda_launches(step)) / (shape.layers - other_layers)
    return {"launches": launches, "launches_per_layer": per_layer, "syncs": None, "saved": saved,
            "saved_exact": exact, "peak": peak, "step_s": step_s, "host_s": host_s}


def measure(column, shape, steps=10, warmup=3, benchmark=None):
    """The figures of one column; a column that runs out of GPU memory gets {"error": "out of memory"}."""
    try:
        if shape.device == "cuda":
            return measure_cuda(column, shape, steps, warmup, benchmark)
        return measure_cpu(column, shape, steps, warmup, benchmark)
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return {"error": "out of memory"}


def _cell(value, fmt):
    return "-" if value is None else fmt(value)


def format_table(shape, results, notes):
    """The table: one row per figure, one column per measured column; then the notes and the verdict lines."""
    columns = [c for c in COLUMNS if c in results]
    tokens = shape.tokens
    gpu = shape.device == "cuda"
    lines = [f"Training step of a Llama-shaped decoder on {_device_name(shape)}: {shape.layers} layers, "
             f"H {shape.hidden}, I {shape.intermediate}, {shape.heads} heads, {shape.kv_heads} KV head"
             f"{'s' if shape.kv_heads > 1 else ''}, vocab "
             f"{shape.vocab}, {tokens} tokens, {str(shape.dtype).replace('torch.', '')}, SDPA, AdamW (fused)",
             f"{'':<18}" + "".join(f"{HEADERS[c]:>17}" for c in columns)]

    def row(label, cell):
        lines.append(f"{label:<18}" + "".join(
            f"{'OOM' if 'error' in results[c] else cell(results[c]):>17}" for c in columns))

    if gpu:
        row("step ms", lambda r: _cell(r["step_s"], lambda s: f"{s * 1e3:.1f}"))
        row("tokens/s", lambda r: _cell(r["step_s"], lambda s: f"{tokens / s:,.0f}"))
    else:
        row("tokens/s (CPU)", lambda r: _cell(r["host_s"], lambda s: f"{tokens / s:,.0f}"))
    row("host ms/step", lambda r: _cell(r["host_s"], lambda s: f"{s * 1e3:.1f}"))
    row("peak MiB", lambda r: f"{r['peak'] / 2**20:,.{0 if gpu else 2}f}")
    row("saved B/token", lambda r: f"{'' if r.get('saved_exact', True) else '~'}{r['saved'] / tokens:,.0f}")
    row("launches/step", lambda r: f"{r['launches']}")
    row("launches/layer", lambda r: _cell(r["launches_per_layer"], lambda n: f"{n:g}"))
    if not gpu:
        row("syncs/step", lambda r: f"{r['syncs']}")
    if gpu:
        lines.append("step ms: median of the timed steps from a drained GPU; host ms: issuing them; peak: "
                     "max_memory_allocated;")
        lines.append("  launches: torch.profiler's device activities (kernels, memcpys, memsets) in one step")
    else:
        lines.append("host ms: a whole step's CPU wall time on the CPU's default path (memkernels' PyTorch "
                     "reference), one thread;")
        lines.append("  peak: PeakBytesMeter over the counted step, above the weights and AdamW state;")
        lines.append("  launches: gpu_audit.count(), aten ops + Triton grids: memkernels on its Triton path and "
                     "Liger's kernels, in the interpreter")
    if any(not r.get("saved_exact", True) for r in results.values()):
        lines.append("~ torch.compile: memory_allocated after the forward minus before (saved-tensor hooks make "
                     "dynamo run the frame eagerly)")
    for column, why in notes.items():
        lines.append(f"{HEADERS[column]}: {why}")
    lines.extend(verdict_lines(results))
    return "\n".join(lines)


def _device_name(shape):
    return torch.cuda.get_device_name() if shape.device == "cuda" else "the CPU"


def liger_per_layer(results):
    """(Liger's launches per layer, where it comes from)."""
    figures = results.get("liger", {})
    if figures.get("launches_per_layer") is not None:
        return figures["launches_per_layer"], "counted through its kernels"
    return LIGER_LAUNCHES_PER_LAYER_FROM_SOURCE, "from its source (LIGER_LAUNCHES_PER_LAYER_FROM_SOURCE)"


def done(results):
    """Issue 31.4's done-when: apply()'s launches per layer <= Liger's. (mlp="recompute" runs the two GEMMs it
    recomputes on top, by design: the verdict line shows its count beside.)"""
    liger, _ = liger_per_layer(results)
    mine = results.get("memkernels", {}).get("launches_per_layer")
    return mine is not None and mine <= liger


def verdict_lines(results):
    liger, source = liger_per_layer(results)
    mine = results.get("memkernels", {}).get("launches_per_layer")
    if mine is None:
        return []
    recompute = results.get("recompute", {}).get("launches_per_layer")
    beside = (f" ({HEADERS['recompute']}: {recompute:g}, its two recomputed GEMMs on top)"
              if recompute is not None else "")
    return [f"launches per layer <= Liger's ({liger:g}, {source}): {HEADERS['memkernels']} {mine:g}{beside}: "
            f"{'met' if done(results) else 'NOT met'}"]


# The order columns are measured in: torch.compile's (minutes of compiling on a GPU) last, so that a run cut at
# its time limit (benchmarks/gpu_check.sh) has printed the others' lines.
MEASURE_ORDER = ("eager", "memkernels", "recompute", "liger", "compile")


def summary_line(column, figures, shape):
    """One column's figures on one line, printed as soon as it is measured."""
    if "error" in figures:
        return f"{HEADERS[column]}: {figures['error']}"
    parts = [f"step {figures['step_s'] * 1e3:.1f} ms" if figures.get("step_s") is not None else None,
             f"host {figures['host_s'] * 1e3:.1f} ms" if figures.get("host_s") is not None else None,
             f"peak {figures['peak'] / 2**20:,.2f} MiB",
             f"saved {figures['saved'] / shape.tokens:,.0f} B/token",
             f"{figures['launches']} launches"
             + (f" ({figures['launches_per_layer']:g} a layer)" if figures.get("launches_per_layer") is not None
                else "")]
    return f"{HEADERS[column]}: " + ", ".join(part for part in parts if part)


def run(shape, columns=COLUMNS, steps=10, warmup=3, progress=None):
    """Measure every runnable column of ``columns``: ({column: figures}, {column: why not run}).
    ``progress(line)``: called with each column's summary_line as it is measured."""
    notes = {c: why for c, why in column_notes(shape.device).items() if c in columns}
    results = {}
    for column in MEASURE_ORDER:
        if column in columns and column not in notes:
            results[column] = measure(column, shape, steps, warmup)
            if progress is not None:
                progress(summary_line(column, results[column], shape))
    return results, notes


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("layers", "tokens", "hidden", "intermediate", "heads", "kv-heads", "vocab"):
        parser.add_argument(f"--{name}", type=int, help="default: Llama-3-8B's on CUDA, small dims on a CPU")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: bf16 on CUDA, fp32 on a CPU")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median), at least 10")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--columns", default=",".join(COLUMNS), help="comma-separated subset of " + ",".join(COLUMNS))
    args = parser.parse_args(argv)
    columns = tuple(c.strip() for c in args.columns.split(",") if c.strip())
    unknown = set(columns) - set(COLUMNS)
    if unknown:
        parser.error(f"unknown columns {', '.join(sorted(unknown))}")
    if args.steps < 10:
        parser.error("--steps: at least 10 (the step time is a median)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}[args.dtype]
    shape = default_shape(layers=args.layers, tokens=args.tokens, hidden=args.hidden, intermediate=args.intermediate,
                          heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, dtype=dtype)
    return shape, columns, args


def main(argv=None):
    if transformers is None:
        print("bench_step: needs transformers (pip install transformers): the model is its LlamaForCausalLM")
        return 1
    shape, columns, args = _parse(argv)
    results, notes = run(shape, columns, args.steps, args.warmup, progress=lambda line: print(line, flush=True))
    print()
    print(format_table(shape, results, notes), flush=True)
    return 0 if done(results) or not ({"memkernels", "recompute"} & set(results)) else 1


# ------------------------------------------------------------------------------------------------- pytest-benchmark
# pytest benchmarks/bench_step.py --benchmark-only: one test per column at this machine's default shape. Each
# measures the table's figures, keeps them in pytest-benchmark's extra_info (so --benchmark-json has them) and
# has pytest-benchmark time the step: on a GPU to its end, synchronized; on a CPU on the default path, one
# thread (Liger's in the interpreter, one round: not a speed). The table prints at the end.

def pytest_generate_tests(metafunc):
    if "column" in metafunc.fixturenames:
        metafunc.parametrize("column", COLUMNS)


if pytest is not None:
    @pytest.fixture(scope="module")
    def step_table(request):
        shape = default_shape()
        results = {}
        yield shape, results
        notes = column_notes(shape.device)
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print("\n" + format_table(shape, results, {c: n for c, n in notes.items() if c not in results}))


def test_step(benchmark, column, step_table):
    shape, results = step_table
    if transformers is None:
        pytest.skip("needs transformers: the model is its LlamaForCausalLM")
    why = column_notes(shape.device).get(column)
    if why:
        pytest.skip(why)
    figures = measure(column, shape, benchmark=benchmark)
    results[column] = figures
    benchmark.extra_info.update({key: value for key, value in figures.items() if key != "by_kernel"})
    benchmark.extra_info["shape"] = {key: str(value) for key, value in vars(shape).items()}
    benchmark.extra_info["timed"] = ("the step, synchronized" if shape.device == "cuda" else
                                     "the Triton interpreter: not a speed" if column == "liger" else
                                     "the CPU's default path, one thread")
    if "error" in figures:
        pytest.skip(f"{column}: {figures['error']}")


if __name__ == "__main__":
    sys.exit(main())
