"""The GPU cost audit's table: bytes, FLOPs, matmul operand dtypes, host syncs and the model's
predicted A100 / H100 time of every op, against eager PyTorch (and Liger's kernels when
``liger-kernel`` is installed: ``pip install memkernels[bench]``, counted the same way through
the Triton interpreter).

    python benchmarks/bench_gpu_audit.py [--op rms_norm ...] [--dtype bf16] [--occupancy]

Runs on a CPU (the Triton kernels run in the interpreter, in a child process when needed).
The times are a model, see memkernels/audit/gpu_audit.py; benchmarks/gpu_check.sh prints
them next to the measured times on a GPU.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from memkernels.audit import gpu_audit  # noqa: E402


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--liger" not in argv and gpu_audit._liger_available():
        argv.append("--liger")
    elif not gpu_audit._liger_available():
        print("liger-kernel is not installed: the table has no Liger column (pip install liger-kernel)")
    return gpu_audit.main(argv)


if __name__ == "__main__":
    sys.exit(main())
