"""Ahead-of-time compile check: does each Triton kernel compile for sm_80 / sm_90, and how well?

No GPU is needed. ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``
lowers a kernel to PTX and assembles it with the ``ptxas`` bundled with
triton; ``ptxas -v`` reports registers per thread, spill stores/loads and
static shared memory. Triton allocates its shared memory dynamically, so the
shared memory reported is ptxas's static amount plus the dynamic amount in
the compiled metadata (what the launch requests), checked against the
per-block limit of the architecture (the 1 KB per block that CUDA reserves
for itself on sm_80+ is not included, as in the limits). Registers are
cross-checked against ``cuobjdump --dump-resource-usage`` of the cubin, which
guards the parsing of the ptxas log.

Ops register their kernels at import time::

    aot.register(_rms_norm_fwd_kernel, name="rms_norm_fwd", variants=[
        {"signature": {"x_ptr": "*fp32", "y_ptr": "*fp32", "n_cols": "i32"},
         "constexprs": {"BLOCK": 1024}, "num_warps": 4, "num_stages": 1, "label": "fp32-1024"},
    ])

A kernel decorated with ``@triton.jit`` while ``TRITON_INTERPRET=1`` cannot be
compiled, so :func:`check` compiles in a subprocess without that variable
(``python -m memkernels.aot --json ...``), which re-imports the modules that
registered the kernels. ``python -m memkernels.aot`` imports every
module of ``memkernels.fusions`` (:func:`ops_modules`), compiles every registered variant for each arch,
prints a table and exits non-zero on a compile failure, a spill, or shared
memory over the limit.
"""
import argparse
import contextlib
import importlib
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from memkernels._backend import triton_interpreted

__all__ = ["register", "registered", "expected_compiles", "compile_kernel", "check", "AotReport", "ARCHS"]

ARCHS = (80, 90)
# Largest shared memory one block may use (opt-in), per compute capability,
# from the CUDA C++ Programming Guide's table of technical specifications.
MAX_SHARED_BYTES_PER_BLOCK = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
VARIANT_KEYS = {"signature", "constexprs", "num_warps", "num_stages", "label"}
# "options": extra triton.compile options, e.g. {"maxnreg": 128}.
# "aligned": argument names the JIT will see as divisible by 16 (pointers 16-byte
# aligned, integers multiples of 16). The JIT specializes on exactly this at launch,
# and it decides whether loads vectorize, so a check without it compiles code that
# only misaligned inputs would run.
# "archs": the compute capabilities the launcher uses the variant on (default: every one
# checked), e.g. (90,) for tiles chosen only on Hopper.
OPTIONAL_VARIANT_KEYS = {"options", "aligned", "archs"}


@dataclass
class _Entry:
    name: str
    kernel: object
    module: str
    qualname: str
    variants: list
    importer: str  # the module whose import registers this entry (the compile subprocess imports it)


_REGISTRY = {}


def _python_function(kernel):
    """The plain Python function behind a jit/interpreted/autotuned/heuristics kernel."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def _validate_variant(name, index, variant):
    where = f"memkernels.aot.register(name={name!r}) variants[{index}]"
    if not isinstance(variant, dict):
        raise TypeError(f"{where}: expected a dict with keys {sorted(VARIANT_KEYS)}, got {type(variant).__name__}")
    missing = VARIANT_KEYS - set(variant)
    unknown = set(variant) - VARIANT_KEYS - OPTIONAL_VARIANT_KEYS
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                         f"a variant has {sorted(VARIANT_KEYS)} and optionally {sorted(OPTIONAL_VARIANT_KEYS)}")
    if not isinstance(variant["signature"], dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in variant["signature"].items()):
        raise TypeError(f"{where}['signature']: expected {{argument name: triton type string}}, e.g. "
                        "{'x_ptr': '*fp32', 'n': 'i32'}")
    if not isinstance(variant["constexprs"], dict):
        raise TypeError(f"{where}['constexprs']: expected {{argument name: value}}")
    num_warps = variant["num_warps"]
    if not isinstance(num_warps, int) or num_warps <= 0 or num_warps & (num_warps - 1):
        raise ValueError(f"{where}['num_warps']={num_warps!r}: must be a power of two (1, 2, 4, 8, ...)")
    if not isinstance(variant["num_stages"], int) or variant["num_stages"] <= 0:
        raise ValueError(f"{where}['num_stages']={variant['num_stages']!r}: must be a positive int")
    if not isinstance(variant["label"], str) or not variant["label"]:
        raise ValueError(f"{where}['label']: must be a non-empty string naming the variant")
    if not isinstance(variant.get("options", {}), dict):
        raise TypeError(f"{where}['options']: expected a dict of extra triton.compile options")
    aligned = variant.get("aligned", ())
    if not isinstance(aligned, (list, tuple)) or not all(isinstance(a, str) for a in aligned):
        raise TypeError(f"{where}['aligned']: expected a list of argument names, e.g. ['x_ptr', 'stride']")
    not_runtime = [a for a in aligned if a not in variant["signature"] or a in variant["constexprs"]]
    if not_runtime:
        raise ValueError(f"{where}['aligned']: {not_runtime} are not run-time arguments in 'signature'")
    archs = variant.get("archs", ARCHS)
    if not isinstance(archs, (list, tuple)) or not archs or not all(isinstance(a, int) and a >= 70 for a in archs):
        raise ValueError(f"{where}['archs']={archs!r}: expected compute capabilities as ints, e.g. (90,)")


def register(kernel, *, name, variants):
    """Register a Triton kernel's launch variants for the AOT check. Returns ``kernel``.

    Args:
      kernel: a ``@triton.jit`` function (possibly autotuned/heuristics-wrapped),
        defined at module level so a subprocess can import it.
      name: unique kernel name in reports.
      variants: list of dicts ``{"signature": {arg: type}, "constexprs": {arg: value},
        "num_warps": int, "num_stages": int, "label": str}`` and optionally
        ``"options"`` (extra ``triton.compile`` options), ``"aligned"``
        (argument names assumed divisible by 16, as the JIT specializes them
        at launch: 16-byte aligned pointers, integers that are multiples of 16)
        and ``"archs"`` (the compute capabilities it is launched on; default all).
        ``signature`` and
        ``constexprs`` are as for ``triton.compiler.ASTSource``; constexpr
        arguments may be left out of ``signature``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("memkernels.aot.register(name=...): name must be a non-empty string")
    fn = _python_function(kernel)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not callable(fn) or module is None:
        raise TypeError(f"memkernels.aot.register(name={name!r}): kernel must be a @triton.jit function, "
                        f"got {type(kernel).__name__}")
    if module == "__main__" or "<locals>" in qualname:
        raise ValueError(f"memkernels.aot.register(name={name!r}): kernel {qualname} must be defined at the top "
                         "level of an importable module; the compile check re-imports it in a subprocess")
    if not isinstance(variants, (list, tuple)) or not variants:
        raise ValueError(f"memkernels.aot.register(name={name!r}): variants must be a non-empty list of dicts")
    for index, variant in enumerate(variants):
        _validate_variant(name, index, variant)
    labels = [v["label"] for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"memkernels.aot.register(name={name!r}): variant labels must be unique, got {labels}")
    previous = _REGISTRY.get(name)
    if previous is not None and (previous.module, previous.qualname) != (module, qualname):
        raise ValueError(f"memkernels.aot.register(name={name!r}): already registered for "
                         f"{previous.module}.{previous.qualname}; pick another name")
    # A kernel may be registered by another module than the one that defines it: the subprocess must
    # import the registering module, not only the kernel's.
    importer = sys._getframe(1).f_globals.get("__name__", module)
    _REGISTRY[name] = _Entry(name, kernel, module, qualname, [dict(v) for v in variants],
                             module if importer == "__main__" else importer)
    return kernel


def registered():
    """{name: (module, qualname, [variant labels])} of everything registered in this process."""
    return {e.name: (e.module, e.qualname, [v["label"] for v in e.variants]) for e in _REGISTRY.values()}


def variant_warps():
    """{(name, variant label): num_warps} of everything registered in this process."""
    return {(e.name, v["label"]): v["num_warps"] for e in _REGISTRY.values() for v in e.variants}


def expected_compiles(names=None, archs=ARCHS):
    """{(name, label, arch)}: what check(names, archs) compiles, each variant on the archs it targets."""
    return {(e.name, v["label"], arch) for e in _select(names) for v in e.variants
            for arch in archs if arch in v.get("archs", archs)}


@dataclass
class AotReport:
    """What ptxas says about one kernel variant on one architecture."""

    kernel: str
    variant: str
    arch: int
    registers: int = -1  # per thread
    spill_stores: int = -1  # bytes
    spill_loads: int = -1  # bytes
    stack_bytes: int = -1  # per thread stack frame (spills live here)
    shared_bytes: int = -1  # static (ptxas) + dynamic (triton metadata) per block
    # Vectorized global reads in the PTX: ld.global.v2/.v4, and the 8- or 16-byte cp.async copies
    # that pipelined (num_stages > 1) tl.dot operands are loaded with on sm_80+.
    vector_loads: int = -1
    # fma instructions in the PTX: multiplies and adds the compiler contracted (unless the variant
    # compiles with enable_fp_fusion=False), plus any explicit tl.fma or libdevice ones.
    fused_multiply_adds: int = -1
    compile_seconds: float = 0.0
    error: str = ""

    @property
    def spills(self):
        return self.spill_stores + self.spill_loads

    @property
    def ok(self):
        return not self.error and self.spills == 0


_FMA = re.compile(r"\bfma\.rn")
_VECTOR_LOAD = re.compile(r"\bld\.global(?:\.[a-z0-9_]+)*\.v[24]\.")
_VECTOR_ASYNC_COPY = re.compile(  # cp.async... [shared], [global], <bytes>
    r"\bcp\.async(?:\.[a-z0-9_]+)*\.shared\.global\s+\[[^\]]*\],\s*\[[^\]]*\],\s*(?:0x10|0x8|16|8)\b")

_PTXAS_PATTERNS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "frame": re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"),
    "smem": re.compile(r"(\d+) bytes smem"),
}


def parse_ptxas_log(log):
    """(registers, stack bytes, spill store bytes, spill load bytes, static smem bytes) from ``ptxas -v``.

    A triton kernel is one entry function, so exactly one set of figures is
    expected; anything else raises ValueError rather than reporting zeros.
    """
    registers = _PTXAS_PATTERNS["registers"].findall(log)
    frames = _PTXAS_PATTERNS["frame"].findall(log)
    if len(registers) != 1 or len(frames) != 1:
        raise ValueError(f"expected one entry function in the ptxas -v output, found {len(registers)} "
                         f"register and {len(frames)} stack-frame lines:\n{log}")
    smem = _PTXAS_PATTERNS["smem"].findall(log)
    stack, stores, loads = (int(x) for x in frames[0])
    return int(registers[0]), stack, stores, loads, int(smem[0]) if smem else 0


def _cubin_registers(cubin):
    """Registers per thread of the cubin's one function, via the bundled cuobjdump."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", handle.name],
                             check=True, capture_output=True, text=True).stdout
    registers = re.findall(r"REG:(\d+)", out)
    if len(registers) != 1:
        raise ValueError(f"expected one function in cuobjdump --dump-resource-usage, got:\n{out}")
    return int(registers[0])


def _signature(variant):
    signature = dict(variant["signature"])
    for arg in variant["constexprs"]:
        signature.setdefault(arg, "constexpr")
    return signature


def compile_kernel(kernel, variant, arch, *, name=None):
    """Compile one variant of ``kernel`` for ``sm_<arch>`` in this process and report on it.

    Needs triton without the interpreter; use :func:`check` from a process that
    runs under ``TRITON_INTERPRET=1``. Compile errors are reported in
    ``AotReport.error``, not raised.
    """
    if triton_interpreted():
        raise RuntimeError("memkernels.aot.compile_kernel: triton runs under TRITON_INTERPRET=1 in this process, "
                           "so kernels cannot be compiled here; call memkernels.aot.check(), which compiles in a "
                           "subprocess without the interpreter")
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit_function = kernel
    while not isinstance(jit_function, triton.runtime.JITFunction) and hasattr(jit_function, "fn"):
        jit_function = jit_function.fn  # through autotune/heuristics wrappers
    report = AotReport(name or _python_function(kernel).__name__, variant["label"], arch)
    options = {"num_warps": variant["num_warps"], "num_stages": variant["num_stages"], **variant.get("options", {})}
    attrs = {(jit_function.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in variant.get("aligned", ())}
    source = ASTSource(jit_function, _signature(variant), dict(variant["constexprs"]), attrs)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        # A fresh cache makes ptxas run (and log) every time; the log is triton's
        # own ptxas -v run, with exactly the flags triton uses.
        with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope(), \
                contextlib.redirect_stdout(log):
            knobs.cache.dir = cache
            knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as error:  # noqa: BLE001 - any compile failure is the finding being reported
        report.error = f"{type(error).__name__}: {error}".strip()
        return report
    report.compile_seconds = time.perf_counter() - start
    try:
        registers, stack, stores, loads, static_smem = parse_ptxas_log(log.getvalue())
        cubin_registers = _cubin_registers(compiled.asm["cubin"])
    except (ValueError, subprocess.CalledProcessError) as error:
        report.error = str(error)
        return report
    report.registers, report.stack_bytes, report.spill_stores, report.spill_loads = registers, stack, stores, loads
    report.shared_bytes = static_smem + compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    report.vector_loads = len(_VECTOR_LOAD.findall(ptx)) + len(_VECTOR_ASYNC_COPY.findall(ptx))
    report.fused_multiply_adds = len(_FMA.findall(ptx))
    if cubin_registers != registers:
        report.error = f"ptxas -v says {registers} registers, the cubin {cubin_registers}"
    elif report.shared_bytes > MAX_SHARED_BYTES_PER_BLOCK.get(arch, float("inf")):
        report.error = (f"needs {report.shared_bytes} B shared memory per block, sm_{arch} allows "
                        f"{MAX_SHARED_BYTES_PER_BLOCK[arch]}")
    return report


def _select(names):
    if names is None:
        return list(_REGISTRY.values())
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"memkernels.aot: no kernel registered as {unknown}; registered: {sorted(_REGISTRY)} "
                         "(import the module that calls memkernels.aot.register first)")
    return [_REGISTRY[n] for n in names]


def _validate_archs(archs):
    archs = tuple(archs)
    if not archs or not all(isinstance(a, int) and a >= 70 for a in archs):
        raise ValueError(f"memkernels.aot: archs={archs!r} must be compute capabilities as ints, e.g. (80, 90)")
    return archs


def _compile_entries(entries, archs):
    return [compile_kernel(entry.kernel, variant, arch, name=entry.name)
            for entry in entries for variant in entry.variants for arch in archs
            if arch in variant.get("archs", archs)]


def _subprocess_env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The child must import the same memkernels and the same kernel modules as this process.
    paths = [package_root] + [os.path.abspath(p or os.curdir) for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # Triton 3.9 warns on every compile while this is unset and then fuses multiplies and adds (its default, what
    # the GPU's JIT launches do too); said explicitly here, so the check compiles the same code without the
    # warning. A caller's own setting is kept.
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def check(names=None, archs=ARCHS, *, timeout=None):
    """Compile registered kernels for each arch in a subprocess without the interpreter.

    Args:
      names: kernel names (default: everything registered in this process).
      archs: compute capabilities, default (80, 90).
      timeout: seconds for the whole subprocess; None (the default): no limit. Compiling every
        variant takes minutes on an idle machine and several times that on a loaded one, so a
        default limit would make the result depend on how busy the machine is (issue 32: a
        900 s default failed the AOT tests' fixtures under load).

    Returns a list of :class:`AotReport`, one per (kernel, variant, arch).
    Raises RuntimeError if the subprocess itself fails (e.g. a module cannot
    be imported without the interpreter).
    """
    archs = _validate_archs(archs)
    entries = _select(names)
    if not entries:
        return []
    with tempfile.TemporaryDirectory() as scratch:
        out_path = os.path.join(scratch, "reports.json")
        command = [sys.executable, "-m", "memkernels.aot", "--json", out_path]
        for module in sorted({e.importer for e in entries}):
            command += ["--module", module]
        for entry in entries:
            command += ["--name", entry.name]
        for arch in archs:
            command += ["--arch", str(arch)]
        child = subprocess.run(command, env=_subprocess_env(), capture_output=True, text=True, timeout=timeout)
        if not os.path.exists(out_path):
            raise RuntimeError(f"memkernels.aot.check: the compile subprocess failed (exit {child.returncode}):\n"
                               f"{child.stderr[-4000:]}")
        with open(out_path) as handle:
            return [AotReport(**row) for row in json.load(handle)]


def format_table(reports):
    """The reports as a fixed-width text table."""
    width = max([len(r.variant) + 2 for r in reports] + [22])  # labels never run into the arch column
    lines = [f"{'kernel':<28}{'variant':<{width}}{'arch':<7}{'regs':>6}{'spill st':>10}{'spill ld':>10}"
             f"{'smem B':>9}{'secs':>7}  status"]
    for r in reports:
        # A compile error's last line carries the reason (the lines above locate it).
        status = "ok" if r.ok else (f"ERROR {r.error.strip().splitlines()[-1]}" if r.error else "SPILLS")
        lines.append(f"{r.kernel:<28}{r.variant:<{width}}{'sm_' + str(r.arch):<7}{r.registers:>6}{r.spill_stores:>10}"
                     f"{r.spill_loads:>10}{r.shared_bytes:>9}{r.compile_seconds:>7.2f}  {status}")
    return "\n".join(lines)


def ops_modules():
    """Every module of ``memkernels.fusions`` (one folder per fusion): importing them registers every kernel."""
    try:
        fusions = importlib.import_module("memkernels.fusions")
    except ModuleNotFoundError:
        return []
    return [m.name for m in pkgutil.walk_packages(fusions.__path__, "memkernels.fusions.")
            if not m.ispkg and not m.name.rpartition(".")[2].startswith("_")]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m memkernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability (repeatable; default 80 90)")
    parser.add_argument("--module", action="append", help="module to import (default: every memkernels.fusions module)")
    parser.add_argument("--name", action="append", help="kernel to compile (default: all registered)")
    parser.add_argument("--json", metavar="PATH", help="write the reports as JSON to PATH instead of a table")
    args = parser.parse_args(argv)
    if triton_interpreted():  # triton is imported later, so clearing the variable in a child suffices
        return subprocess.run([sys.executable, "-m", "memkernels.aot", *(argv if argv is not None else sys.argv[1:])],
                              env=_subprocess_env()).returncode
    archs = _validate_archs(args.arch or ARCHS)
    for module in args.module or ops_modules():
        importlib.import_module(module)
    reports = _compile_entries(_select(args.name), archs)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(r) for r in reports], handle)
        return 0
    if not reports:
        print("memkernels.aot: no kernels registered (nothing in memkernels.fusions calls memkernels.aot.register yet)")
        return 0
    print(format_table(reports))
    failed = [r for r in reports if not r.ok]
    print(f"\n{len(reports) - len(failed)} of {len(reports)} compiled without spills"
          + (f"; {len(failed)} failed or spilled" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    # Run the imported module's main, so kernels registered by the modules it imports
    # land in the same registry (this file also exists here as __main__).
    from memkernels import aot

    sys.exit(aot.main())
