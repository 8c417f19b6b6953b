"""RMSNorm and LayerNorm: memory saved for backward and peak memory, memkernels vs eager PyTorch.

    python benchmarks/bench_rms_norm.py                    # CPU, PyTorch reference path
    python benchmarks/bench_rms_norm.py --backend triton   # CPU, Triton kernels in the interpreter (slow)
    pytest benchmarks/bench_rms_norm.py --benchmark-only   # forward + backward of each fused norm, timed

Memory (any machine): for each norm at [tokens, hidden] in fp32 and bf16,
  - new B/tok: bytes the norm creates and keeps for backward
    (memkernels.meters.SavedBytesMeter), per token; parameters and the input
    are aliased, not new;
  - keeps x: whether the norm keeps its input alive for backward;
  - cost B/tok: what the norm holds for backward beyond what the next layer
    (which keeps the norm's output y) holds anyway, counting x if kept. This is
    where memory_efficient=True (keep y, not x) pays off;
  - peak MB: the most bytes alive at once during forward + backward of the norm and
    the next layer (memkernels.meters.PeakBytesMeter), counting x: it is made inside
    the metered region, as an activation is made in a model's forward, so that
    freeing it early (memory_efficient=True) shows. The meter sees inside the
    torch.library custom ops too, so memkernels' peaks include the op's internal
    buffers: the PyTorch reference path's row-block temporaries (at most
    memkernels.fusions.norm.reference.TEMPORARY_BUDGET_BYTES), or the Triton backward's
    [programs, H] fp32 partial sums;
  - peak <= eager: "met" when memkernels' peak is at most the eager baseline's
    (the group's first row), compared in bytes; "allowance" when it is over by no
    more than what memkernels holds by design (fp32 statistics where eager CPU keeps
    them in bf16, and on the reference path its row-block temporaries, at most
    TEMPORARY_BUDGET_BYTES), with by how much; else "MISSED".

Host time: CPU time per call of each layer of FusedRMSNorm's path (launch, launcher, custom op,
its eager twin, module, step) beside eager nn.RMSNorm's step: on a GPU at [tokens, hidden]; with
--backend triton on a CPU at [8, 64] with the norm kernels' launches stubbed out (memkernels'
Python path alone).

GPU kernel time (only with CUDA): microseconds of GPU kernels per forward and per backward
(torch.profiler, no host time) of eager, memkernels and Liger-Kernel (when installed) at
[tokens, hidden] for RMSNorm and LayerNorm. With --sweep-backward, the backward's warps per row and
programs per SM over H = 1024..8192 instead, with each compiled variant's registers and spills.

GPU timing (only with CUDA): forward+backward GB/s of memkernels (Triton) vs eager
and torch.compile'd eager; otherwise the section says it skipped.

pytest-benchmark (test_norm_forward_backward): FusedRMSNorm's and FusedLayerNorm's forward + backward at
[64, 512] fp32 on a CPU (the PyTorch reference path) or at [tokens, hidden]'s defaults in bf16 with CUDA; the
saved bytes per token (measure_memory's "new B/tok") of the fused norm and its eager twin in extra_info.
Imported (by pytest) rather than run, the module reads no command line: ARGS holds the defaults.
"""
import argparse
import gc
import os
import sys
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--backend", choices=["torch", "triton"], default="torch",
                        help="memkernels path on the CPU: PyTorch reference (default) or Triton interpreter")
    parser.add_argument("--sweep-backward", action="store_true",
                        help="GPU only: sweep the norm backward's warps per row and programs per SM, then exit")
    return parser.parse_args(argv)


# The command line only when run as a script: imported (pytest benchmarks/ --benchmark-only), sys.argv is pytest's.
ARGS = _parse(None if __name__ == "__main__" else [])
if ARGS.backend == "triton":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import torch  # noqa: E402
from torch import nn  # noqa: E402

import memkernels  # noqa: E402
from memkernels.meters import PeakBytesMeter, SavedBytesMeter  # noqa: E402
from memkernels.testing import benchmark_step  # noqa: E402


def _groups(hidden, dtype, device):
    """[(takes_residual, [(name, module), ...])]: eager baseline first, then memkernels' modules.

    Eager add+norm is x + residual followed by the norm.
    """
    factory = {"device": device, "dtype": dtype}
    rms = {"eps": 1e-6, **factory}
    return [
        (False, [("eager nn.RMSNorm", nn.RMSNorm(hidden, **rms)),
                 ("memkernels FusedRMSNorm", memkernels.FusedRMSNorm(hidden, **rms)),
                 ("  memory_efficient=True", memkernels.FusedRMSNorm(hidden, memory_efficient=True, **rms))]),
        (True, [("eager add + nn.RMSNorm", nn.RMSNorm(hidden, **rms)),
                ("memkernels FusedAddRMSNorm", memkernels.FusedAddRMSNorm(hidden, **rms)),
                ("  memory_efficient=True", memkernels.FusedAddRMSNorm(hidden, memory_efficient=True, **rms))]),
        (False, [("eager nn.LayerNorm", nn.LayerNorm(hidden, **factory)),
                 ("memkernels FusedLayerNorm", memkernels.FusedLayerNorm(hidden, **factory)),
                 ("  memory_efficient=True", memkernels.FusedLayerNorm(hidden, memory_efficient=True, **factory))]),
        (True, [("eager add + nn.LayerNorm", nn.LayerNorm(hidden, **factory)),
                ("memkernels FusedAddLayerNorm", memkernels.FusedAddLayerNorm(hidden, **factory)),
                ("  memory_efficient=True", memkernels.FusedAddLayerNorm(hidden, memory_efficient=True, **factory))]),
    ]


def _forward(module, takes_residual, x, residual):
    if not takes_residual:
        return (module(x),)
    if isinstance(module, (memkernels.FusedAddRMSNorm, memkernels.FusedAddLayerNorm)):
        return module(x, residual)
    residual_out = x + residual
    return module(residual_out), residual_out


def measure_memory(module, takes_residual, tokens, hidden, dtype):
    """Bytes per token the norm costs for backward, and the peak bytes of forward + backward.

    x is an activation made at the start of the measured region, as in a model's
    forward, and the norm's output feeds a next layer that keeps it for its own backward (here
    ``y * scale``, a stand-in for the Linear that follows a norm). Returns
    (new bytes/token of the norm alone, whether it keeps x alive, bytes/token
    the norm holds beyond what the next layer holds anyway, peak bytes).
    """
    source = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    residual = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    next_scale = torch.randn(hidden, dtype=dtype, requires_grad=True)
    grads = [torch.randn(tokens, hidden, dtype=dtype) for _ in range(2)]
    with PeakBytesMeter() as peak:
        x = source * 2  # an activation (a scalar multiply saves nothing for backward)
        input_bytes = x.untyped_storage().nbytes()
        with SavedBytesMeter() as both_saved:
            with SavedBytesMeter() as norm_saved:
                outputs = _forward(module, takes_residual, x, residual)
            outputs = (outputs[0] * next_scale,) + outputs[1:]
        output_bytes = outputs[0].untyped_storage().nbytes()
        released = []
        watch = weakref.ref(x.untyped_storage(), released.append)  # noqa: F841 (keeps the callback alive)
        del x
        gc.collect()  # the Triton interpreter leaves reference cycles around launch arguments
        keeps_input = not released  # checked before backward releases everything
        # Storages are counted once however many layers save them; the next layer's y is not the norm's cost.
        cost = both_saved.new_bytes - output_bytes + (input_bytes if keeps_input else 0)
        torch.autograd.backward(outputs, grads[: len(outputs)])
        del outputs
    return norm_saved.new_bytes / tokens, keeps_input, cost / tokens, peak.peak_bytes


def memory_section(tokens, hidden, backend):
    memkernels.set_backend(backend)
    print(f"Memory, [{tokens}, {hidden}], CPU, memkernels backend {backend!r}")
    print("new: bytes/token the norm creates and saves; cost: bytes/token it holds for backward beyond\n"
          "what the next layer holds anyway (its input y), counting x if kept; peak: forward + backward\n"
          "(everything allocated, buffers inside the custom ops included)")
    header = (f"{'':<32}{'dtype':<10}{'new B/tok':>10}{'keeps x':>9}{'cost B/tok':>12}{'peak MB':>9}"
              f"{'peak <= eager':>20}")
    print(header)
    print("-" * len(header))
    from memkernels.fusions.norm.reference import TEMPORARY_BUDGET_BYTES

    verdicts = {"met": 0, "allowance": 0, "MISSED": 0}
    for dtype in (torch.float32, torch.bfloat16):
        # What memkernels holds by design beyond eager: fp32 statistics (eager CPU LayerNorm keeps
        # them in the input dtype) and, on the reference path, its row-block temporaries.
        allowance = tokens * 2 * (4 - dtype.itemsize) + (TEMPORARY_BUDGET_BYTES if backend == "torch" else 0)
        for takes_residual, modules in _groups(hidden, dtype, "cpu"):
            eager_peak = None
            for name, module in modules:
                new, keeps_input, cost, peak = measure_memory(module, takes_residual, tokens, hidden, dtype)
                if eager_peak is None:
                    eager_peak, verdict = peak, ""
                else:
                    over = f"+{(peak - eager_peak) / 2**10:.0f} KiB"
                    kind = "met" if peak <= eager_peak else "allowance" if peak <= eager_peak + allowance else "MISSED"
                    verdicts[kind] += 1
                    verdict = {"met": "met", "allowance": f"allowance {over}", "MISSED": f"MISSED {over}"}[kind]
                print(f"{name:<32}{str(dtype).replace('torch.', ''):<10}{new:>10.1f}"
                      f"{'yes' if keeps_input else 'no':>9}{cost:>12.1f}{peak / 2**20:>9.1f}{verdict:>20}")
        print()
    print(f"peak <= eager: met by {verdicts['met']} rows; within the allowance by {verdicts['allowance']} "
          f"(eager + fp32 statistics + the CPU path's row-block temporaries, at most "
          f"{TEMPORARY_BUDGET_BYTES // 2**20} MiB); MISSED by {verdicts['MISSED']}\n")
    memkernels.set_backend("auto")


# gpu_audit's op for each of _groups' groups, in order
_AUDITED_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")


def gpu_section(tokens, hidden):
    if not torch.cuda.is_available():
        print("GPU timing: skipped (no CUDA device on this machine)")
        return
    from triton.testing import do_bench

    from memkernels.audit.gpu_audit import prediction_line

    print(f"GPU timing, forward+backward, [{tokens}, {hidden}], {torch.cuda.get_device_name()}")
    header = f"{'':<32}{'dtype':<10}{'ms':>9}{'GB/s':>9}"
    print(header)
    print("-" * len(header))
    for dtype in (torch.float32, torch.bfloat16):
        for (takes_residual, modules), op in zip(_groups(hidden, dtype, "cuda"), _AUDITED_OPS):
            _, eager = modules[0]
            variants = [modules[0], ("  torch.compile", torch.compile(eager))] + modules[1:]
            for label, function in variants:
                x = torch.randn(tokens, hidden, dtype=dtype, device="cuda", requires_grad=True)
                residual = torch.randn_like(x, requires_grad=True)
                grads = [torch.randn_like(x) for _ in range(2)]

                def step():
                    outputs = _forward(function, takes_residual, x, residual)
                    torch.autograd.backward(outputs, grads[: len(outputs)])

                milliseconds = do_bench(step)
                # Compulsory traffic: forward reads x (and residual), writes y (and residual_out);
                # backward reads the kept input, dy (and d residual_out), writes dx (and d residual).
                tensors = 6 if takes_residual else 4
                gigabytes = tensors * x.numel() * x.element_size() / 1e9
                print(f"{label:<32}{str(dtype).replace('torch.', ''):<10}{milliseconds:>9.3f}"
                      f"{gigabytes / (milliseconds / 1e3):>9.1f}")
            # the model counts the default modules (not memory_efficient=True), eager as Hugging Face's RMSNorm
            print("  " + prediction_line(op, {"N": tokens, "H": hidden}, dtype, torch.cuda.get_device_name()))
        print()


def _kernel_microseconds(step, iters=20):
    """{kernel name: GPU microseconds per call of ``step``}, from torch.profiler (kernels only)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return {event.key: event.self_device_time_total / iters for event in prof.key_averages()
            if event.self_device_time_total > 0}


def _train_step(module, x, grad):
    """One forward + backward of ``module`` on ``x``, its gradients cleared first (no accumulation kernel)."""
    def step():
        x.grad = None
        for parameter in module.parameters():
            parameter.grad = None
        module(x).backward(grad)
    return step


def _liger_modules(hidden, dtype):
    """Liger-Kernel's RMSNorm and LayerNorm, or Nones when it is not installed."""
    try:
        from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm
    except ImportError:
        return None, None
    return (LigerRMSNorm(hidden, eps=1e-6).to("cuda", dtype), LigerLayerNorm(hidden).to("cuda", dtype))


def kernel_time_section(tokens, hidden):
    """GPU kernel time per forward and per backward: eager, memkernels, Liger (torch.profiler)."""
    print(f"GPU kernel time, [{tokens}, {hidden}], {torch.cuda.get_device_name()} (torch.profiler: us of GPU "
          "kernels per call, no host time)")
    header = f"{'':<32}{'dtype':<10}{'forward':>9}{'backward':>10}{'step':>9}"
    print(header)
    print("-" * len(header))
    liger_installed = True
    for dtype in (torch.bfloat16, torch.float32):
        groups = _groups(hidden, dtype, "cuda")
        liger = _liger_modules(hidden, dtype)
        liger_installed = liger[0] is not None
        for (_, modules), liger_module, label in ((groups[0][1], liger[0], "Liger LigerRMSNorm"),
                                                  (groups[2][1], liger[1], "Liger LigerLayerNorm")):
            rows = modules[:2] + ([(label, liger_module)] if liger_installed else [])
            for name, module in rows:
                x = torch.randn(tokens, hidden, dtype=dtype, device="cuda", requires_grad=True)

                def forward():
                    with torch.no_grad():
                        module(x)
                forward_us = sum(_kernel_microseconds(forward).values())
                step_us = sum(_kernel_microseconds(_train_step(module, x, torch.randn_like(x))).values())
                print(f"{name:<32}{str(dtype).replace('torch.', ''):<10}{forward_us:>9.1f}"
                      f"{step_us - forward_us:>10.1f}{step_us:>9.1f}")
        print()
    if not liger_installed:
        print("Liger rows: skipped (liger-kernel is not installed; pip install liger-kernel --no-deps)\n")


def sweep_backward(tokens, hidden_sizes=(1024, 2048, 4096, 8192)):
    """The norm backward's kernel time per launch configuration: warps per row and programs per SM,
    with the registers and spills of each compiled variant."""
    from memkernels.fusions.norm import kernels as _norm_kernels

    defaults = (_norm_kernels.backward_config, _norm_kernels.programs_per_sm)
    print(f"Norm backward sweep, {tokens} rows, {torch.cuda.get_device_name()} (us of GPU kernels per backward)")
    for dtype in (torch.bfloat16, torch.float32):
        for hidden in hidden_sizes:
            groups = _groups(hidden, dtype, "cuda")
            for name, module in (groups[0][1][1], groups[2][1][1]):
                x = torch.randn(tokens, hidden, dtype=dtype, device="cuda", requires_grad=True)
                step = _train_step(module, x, torch.randn_like(x))
                with torch.no_grad():
                    forward_us = sum(_kernel_microseconds(lambda: module(x)).values())
                for warps in (4, 8, 16, 32):
                    for per_sm in (1, 2):
                        block, _, single_pass = defaults[0](hidden)
                        _norm_kernels.backward_config = lambda *_, c=(block, warps, single_pass): c
                        _norm_kernels.programs_per_sm = lambda num_warps, n=per_sm: n
                        try:
                            backward_us = sum(_kernel_microseconds(step).values()) - forward_us
                            print(f"  {name.split()[-1]:<16}{hidden:>6} {str(dtype).replace('torch.', ''):<9}"
                                  f"{warps:>3} warps {per_sm} per SM {backward_us:9.1f} us")
                        finally:
                            _norm_kernels.backward_config, _norm_kernels.programs_per_sm = defaults
    try:  # triton's per-device kernel cache: (kernels by key, ...) in triton 3.6
        compiled = [k for cache in _norm_kernels._norm_bwd_kernel.device_caches.values() for k in cache[0].values()]
    except (AttributeError, IndexError, TypeError) as error:
        print(f"  registers and spills: not read from this triton's kernel cache ({error!r})")
        return
    for kernel in compiled:
        print(f"  compiled backward: {kernel.metadata.num_warps} warps, {kernel.n_regs} registers, "
              f"{kernel.n_spills} spills")


def host_time_section(tokens, hidden, calls=200, device="cuda"):
    """CPU time per call of each layer of FusedRMSNorm's path, issued without waiting for the GPU.

    On the H200 a forward + backward step took 1.2-1.5 ms of host time where its kernels took ~0.1 ms
    (docs/gpu-runs.md). These rows split it: an empty Triton kernel's launch, memkernels' launcher, the
    custom op (what torch.compile runs) and its autograd.Function twin (what eager mode runs,
    memkernels/fusions/common/custom_op.py), the module, the step. A row well above the one before it is where
    the time goes. On the CPU (``device="cpu"``, the Triton interpreter) the norm kernels' launches are
    stubbed out, so the rows are memkernels' Python path alone, beside eager nn.RMSNorm's CPU step."""
    import time

    import triton

    from memkernels.fusions.norm import kernels as _norm_kernels
    from memkernels.fusions.norm.op import NORM

    def wait():
        if device == "cuda":
            torch.cuda.synchronize()

    @triton.jit
    def _empty_kernel(X):  # X: [1] any dtype, never read
        pass

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    stubbed = {}
    if device == "cpu":
        memkernels.set_backend("triton")  # CPU tensors take the Triton path only when it is forced
        stubbed = {name: getattr(_norm_kernels, name) for name in dir(_norm_kernels)
                   if name.startswith("_norm_") and name.endswith("_kernel")}
        for name in stubbed:
            setattr(_norm_kernels, name, _NoLaunch())
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    module = memkernels.FusedRMSNorm(hidden, eps=1e-6, dtype=torch.bfloat16, device=device)
    eager = nn.RMSNorm(hidden, eps=1e-6, dtype=torch.bfloat16, device=device)
    grad = torch.randn_like(x)
    no_columns = x.new_empty(0, dtype=torch.int64)
    rows = {
        "empty Triton kernel launch": lambda: _empty_kernel[(1,)](x),
        "memkernels launcher (norm_forward)": lambda: _norm_kernels.norm_forward(
            x.detach(), None, module.weight.detach(), None, 1e-6, 0.0, True, 1, False, no_columns),
        "custom op norm_fwd, no grad": lambda: NORM.custom_op(
            x.detach(), None, module.weight.detach(), None, 1e-6, 0.0, True, 1, False, False, "triton"),
        "its eager twin, no grad": lambda: NORM.function.apply(
            x.detach(), None, module.weight.detach(), None, 1e-6, 0.0, True, 1, False, False, "triton"),
        "FusedRMSNorm forward, grad": lambda: module(x),
        "FusedRMSNorm forward + backward": lambda: module(x).backward(grad),
        "eager nn.RMSNorm forward + backward": lambda: eager(x).backward(grad),
    }
    if device == "cpu":
        del rows["empty Triton kernel launch"]  # the interpreter runs it: not a launch's cost
    print(f"Host time per call, bf16 [{tokens}, {hidden}] on {device} (CPU time to issue, GPU not awaited in the "
          f"loop{'; norm kernel launches stubbed out' if stubbed else ''})")
    try:
        for label, call in rows.items():
            for _ in range(10):
                call()
            wait()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            issued = (time.perf_counter() - start) / calls
            wait()
            waited = (time.perf_counter() - start) / calls
            print(f"  {label:<40}{issued * 1e6:9.1f} us issued{waited * 1e6:9.1f} us with the GPU's wait")
            x.grad = None
            module.weight.grad = eager.weight.grad = None
    finally:
        for name, kernel in stubbed.items():
            setattr(_norm_kernels, name, kernel)
        memkernels.set_backend("auto")


def main():
    if ARGS.sweep_backward:
        if not torch.cuda.is_available():
            sys.exit("--sweep-backward needs a CUDA GPU")
        sweep_backward(ARGS.tokens)
        return
    memory_section(ARGS.tokens, ARGS.hidden, ARGS.backend)
    if torch.cuda.is_available():
        host_time_section(ARGS.tokens, ARGS.hidden)  # first: seconds, where gpu_section compiles for minutes
        kernel_time_section(ARGS.tokens, ARGS.hidden)
    elif ARGS.backend == "triton":  # the interpreter: memkernels' Python path with the launches stubbed
        host_time_section(8, 64, calls=2000, device="cpu")
    gpu_section(ARGS.tokens, ARGS.hidden)


# ------------------------------------------------------------------------------------------------- pytest-benchmark
def _bench_shape(device):
    """(tokens, hidden, dtype) of the pytest-benchmark test: the script's defaults in bf16 with CUDA, a small
    shape on a CPU."""
    return (4096, 4096, torch.bfloat16) if device == "cuda" else (64, 512, torch.float32)


def pytest_generate_tests(metafunc):
    if "norm" in metafunc.fixturenames:
        metafunc.parametrize("norm", ["rms_norm", "layer_norm"])


def test_norm_forward_backward(benchmark, norm):
    """pytest-benchmark: the fused norm's forward + backward, synchronized on a GPU; saved bytes per token of it
    and of its eager twin (measure_memory, on the CPU) in extra_info."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens, hidden, dtype = _bench_shape(device)
    group = {"rms_norm": 0, "layer_norm": 2}[norm]  # _groups' plain RMSNorm and LayerNorm groups
    modules = _groups(hidden, dtype, "cpu")[group][1]  # [(label, eager), (label, fused), (label, memory_efficient)]
    saved = {label: measure_memory(module, False, 8, hidden, dtype)[0]
             for label, module in (("eager", modules[0][1]), ("memkernels", modules[1][1]))}
    module = _groups(hidden, dtype, device)[group][1][1][1]
    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn_like(x)

    def run():
        module(x).backward(grad)
        x.grad = None
        for parameter in module.parameters():
            parameter.grad = None

    benchmark_step(benchmark, run, device)
    benchmark.extra_info.update(shape=[tokens, hidden], dtype=str(dtype), module=type(module).__name__,
                                saved_bytes_per_token=saved)
    assert saved["memkernels"] <= saved["eager"]


if __name__ == "__main__":
    main()
