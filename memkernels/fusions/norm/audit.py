"""The norms at the shapes of real models, for the GPU audit: RMSNorm and LayerNorm, plain and with the
fused residual add, at Llama's hidden sizes, against Hugging Face's eager forms and Liger's kernels.

The audit (memkernels.audit.gpu_audit) collects this module's :func:`cases`; the contract is
memkernels/fusions/audit_case.py. Nothing here imports the audit: a training process loads none of it.
"""
import contextlib
import importlib
import inspect

import torch

from memkernels.fusions.audit_case import H100_SMS, TOKENS, Case, Problem, leaf


def _eager_rms(x, weight, eps=1e-6):
    # Hugging Face's LlamaRMSNorm: float32 math, result cast back, times the weight.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _norm_problem(op, is_rms, with_residual):
    def build(shape, dtype, impl):
        import torch.nn.functional as F
        from memkernels import functional
        n, h = shape["N"], shape["H"]
        x, w = leaf(n, h, dtype=dtype), leaf(h, dtype=dtype)
        b = None if is_rms else leaf(h, dtype=dtype)
        r = leaf(n, h, dtype=dtype) if with_residual else None
        grads = [torch.randn(n, h).to(dtype) for _ in range(2)]

        def forward():
            if impl == "liger":
                return _liger_norm(is_rms, with_residual, x, r, w, b)
            if impl == "memkernels":
                fn = getattr(functional, op)
                args = (x, r, w) if with_residual else (x, w)
                out = fn(*args) if is_rms else fn(*args, b)
                return out if with_residual else (out,)
            s = x + r if with_residual else x
            y = _eager_rms(s, w) if is_rms else F.layer_norm(s, (h,), w, b)
            return (y, s) if with_residual else (y,)

        def backward(outputs):
            torch.autograd.backward(outputs, grads[:len(outputs)])
        return Problem(forward, backward)
    return build


def _norm_minimum(is_rms, with_residual):
    def minimum(shape, e):
        n, h = shape["N"], shape["H"]
        params = h * e * (1 if is_rms else 2)
        inputs = n * h * e * (2 if with_residual else 1) + params
        outputs = n * h * e * (2 if with_residual else 1)
        # backward: the incoming gradients, x (or what stands for it) and the weight in; dx (and the
        # residual's), dw (and db) out
        backward = outputs + n * h * e + params + n * h * e * (2 if with_residual else 1) + params
        return {"forward": (inputs + outputs, 0), "backward": (backward, 0)}
    return minimum


def _norm_backward_programs(hidden):
    """memkernels' norm backward programs on an H100 at rows of ``hidden`` (kernels.num_programs)."""
    from memkernels.fusions.norm import kernels
    num_warps = kernels.backward_config(hidden)[1]
    return kernels.programs_per_sm(num_warps) * H100_SMS


def _norm_real_shape(shape, dtype, phase):
    """The shape with the backward's programs at its own H (case_at moves H: a benchmark's rows of 1024
    run two programs per SM where the case's 4096 run one)."""
    return dict(shape, P=_norm_backward_programs(shape["H"]))


@contextlib.contextmanager
def _norm_programs(shape):
    """Give the norm backward ``shape["P"]`` programs (the GPU's count at the real shape; the interpreter's
    default is a fixed few). Each program owns one float32 row of dw/db partial sums."""
    from memkernels.fusions.norm import kernels
    original = kernels.num_programs
    kernels.num_programs = lambda rows, device, num_warps: min(rows, shape["P"])
    try:
        yield
    finally:
        kernels.num_programs = original


# Liger's norm backwards, each with one program per SM, one float32 partial row (of dw, and of db) each.
_LIGER_NORM_BACKWARDS = (("rms_norm", "rms_norm_backward"), ("fused_add_rms_norm", "fused_add_rms_norm_backward"),
                         ("layer_norm", "layer_norm_backward"))


@contextlib.contextmanager
def _liger_norm_programs(shape):
    """Give Liger's norm backwards ``shape["P"]`` programs. Their grid is the device's SM count, which they
    ask only of a CUDA (XPU, NPU) tensor and take as 1 otherwise: counted on the CPU as they are, their
    partial rows would be an H100's 132 short. Each function is rebuilt from its own source with that one
    line (``sm_count = 1``) made the fit's value, and put back afterwards."""
    import importlib
    patched = []  # (module, name, original)
    try:
        for module_name, name in _LIGER_NORM_BACKWARDS:
            module = importlib.import_module(f"liger_kernel.ops.{module_name}")
            original = getattr(module, name)
            source = inspect.getsource(original)
            if source.count("    sm_count = 1\n") != 1:
                raise RuntimeError(f"memkernels.gpu_audit: liger_kernel.ops.{module_name}.{name} no longer sets "
                                   "'sm_count = 1' once; its grid cannot be set for the count")
            namespace = dict(vars(module), _AUDIT_PROGRAMS=shape["P"])
            code = compile(source.replace("    sm_count = 1\n", "    sm_count = _AUDIT_PROGRAMS\n"),
                           inspect.getsourcefile(original), "exec")
            exec(code, namespace)  # noqa: S102 - Liger's own function, one constant changed
            setattr(module, name, namespace[name])
            patched.append((module, name, original))
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def _liger_norm(is_rms, with_residual, x, r, w, b):
    from liger_kernel.transformers.functional import liger_fused_add_rms_norm, liger_layer_norm, liger_rms_norm
    if is_rms and with_residual:  # Liger's fused add + RMSNorm: (y, x + r)
        return liger_fused_add_rms_norm(x, r, w, 1e-6)
    s = x + r if with_residual else x
    y = liger_rms_norm(s, w, 1e-6) if is_rms else liger_layer_norm(s, w, b, 1e-5)
    return (y, s) if with_residual else (y,)


def cases():
    cases = []
    for op, is_rms, residual in (("rms_norm", True, False), ("add_rms_norm", True, True),
                                 ("layer_norm", False, False), ("add_layer_norm", False, True)):
        for h in (4096, 8192):
            # At least 8 rows per program, as at the real shape (31): a wide row's second pass then
            # re-reads rows from beyond the program's L2 share at the small shapes too, so the counts
            # are the polynomial the fit assumes.
            cases.append(Case(op, f"H={h}", {"N": TOKENS, "H": h, "P": _norm_backward_programs(h)},
                              ("N", "P"), {"N": (32, 64), "P": (2, 4)}, ({"N": 48, "P": 3},),
                              _norm_problem(op, is_rms, residual), _norm_minimum(is_rms, residual),
                              setup=_norm_programs, real_shape=_norm_real_shape,
                              liger_setup=_liger_norm_programs,
                              liger_real_shape=lambda shape: dict(shape, P=H100_SMS),
                              aot_kernels=("norm_fwd", "norm_bwd", "norm_reduce_partials"), liger=True))
    return cases
