"""``MemoryMonitor``: memory of every training step, written as you train, and OOM post-mortems.

Each step the monitor records peak allocated and peak reserved bytes, fragmentation at the
peak (1 - peak allocated / peak reserved), the largest free block, allocation retries and
OOMs, and the peak of each phase (forward / backward / optimizer, from module and optimizer
hooks). It writes CSV and/or JSONL rows, TensorBoard scalars (``tensorboard`` installed: the
``monitor`` extra) and a PNG timeline at the end, and warns once when fragmentation passes
30%, naming the remedies with what each would have reserved on this run's own trace.

Where the figures come from (the ``source`` column says which):

* ``torch``: PyTorch's caching allocator, ``torch.cuda.memory_stats()``; peaks are absolute
  (all live memory on the device), reset at each step's start. PyTorch's statistics have no
  largest free block: that column stays empty (``memkernels explain`` finds it in a snapshot).
* ``memkernels``: memkernels' pool (installed, or a ``memkernels._C.Pool`` given), its own
  statistics; absolute peaks, largest free block included.
* ``cpu``: :class:`~memkernels.meters.PeakBytesMeter`, live tensor bytes allocated since the
  step began (what the step needed on top of what was live when it started). There is no
  allocator cache on the CPU, so reserved, fragmentation and free blocks stay empty.

An ``OutOfMemoryError`` (PyTorch's, or memkernels' pool's) inside the ``with`` block records a
snapshot (with ``record_history=N`` the allocator keeps the last N events and their stacks),
writes it to ``oom_snapshot``, prints :func:`memkernels.explain`'s post-mortem and re-raises
the original exception. The hooks, the meter and memory-history recording end with the block.
"""
import csv
import json
import os
import pickle
import sys
import time

from memkernels.runtime.allocator import FRAGMENTATION_WARNING
from memkernels.runtime.sizes import format_size

__all__ = ["MemoryMonitor", "TorchCudaStats", "PoolStats", "CPUTensorStats", "FRAGMENTATION_WARNING"]

PHASES = ("forward", "backward", "optimizer")
COLUMNS = ("step", "source", "peak_allocated_bytes", "peak_reserved_bytes", "fragmentation_at_peak",
           "largest_free_block_bytes", "alloc_retries", "ooms") + tuple(f"peak_{p}_bytes" for p in PHASES) + (
    "seconds",)
# The scalars TensorBoard gets (every numeric column but the step).
SCALARS = tuple(c for c in COLUMNS if c not in ("step", "source"))


# ---------------------------------------------------------------------- sources


class TorchCudaStats:
    """PyTorch's caching allocator on one CUDA device (``torch.cuda.memory_stats``).

    Reads ``torch.cuda.memory_stats_as_nested_dict`` (the figures ``memory_stats`` flattens into
    ``"allocated_bytes.all.peak"``-style keys, without the flattening and sorting: the monitor
    reads it up to four times a step). ``nested_stats`` / ``reset_peak``: the functions to call
    (default PyTorch's); the benchmark passes stand-ins to time the monitor without CUDA.
    """

    name = "torch"

    def __init__(self, device=None, nested_stats=None, reset_peak=None):
        import torch

        self.device = device
        self._nested_stats = nested_stats or torch.cuda.memory.memory_stats_as_nested_dict
        self._reset_peak = reset_peak or torch.cuda.reset_peak_memory_stats
        self._recording = False

    def read(self):
        s = self._nested_stats(self.device)
        allocated, reserved = s.get("allocated_bytes", {}).get("all", {}), s.get("reserved_bytes", {}).get("all", {})
        return {"allocated": allocated.get("current", 0), "reserved": reserved.get("current", 0),
                "peak_allocated": allocated.get("peak", 0), "peak_reserved": reserved.get("peak", 0),
                "largest_free_block": None, "alloc_retries": s.get("num_alloc_retries", 0),
                "ooms": s.get("num_ooms", 0)}

    def reset_peak(self):
        self._reset_peak(self.device)

    def record_history(self, entries):
        import torch

        torch.cuda.memory._record_memory_history("all", max_entries=entries)
        self._recording = True

    def stop_history(self):
        if self._recording:
            import torch

            torch.cuda.memory._record_memory_history(None)
            self._recording = False

    def snapshot(self):
        import torch

        return torch.cuda.memory._snapshot()

    def device_index(self):
        import torch

        return torch.cuda._utils._get_device_index(self.device, optional=True)


class PoolStats:
    """memkernels' pool on one device: the installed pool, or a ``memkernels._C.Pool`` given."""

    name = "memkernels"

    def __init__(self, pool=None, device=0):
        if pool is None:
            from memkernels.runtime import allocator

            pool = allocator.installed_pool()
        self.pool, self.device = pool, device
        self._recording = False

    def read(self):
        s = self.pool.stats(self.device)
        return {"allocated": s["allocated_bytes"]["current"], "reserved": s["reserved_bytes"]["current"],
                "peak_allocated": s["allocated_bytes"]["peak"], "peak_reserved": s["reserved_bytes"]["peak"],
                "largest_free_block": s["largest_free_block"], "alloc_retries": s["num_alloc_retries"],
                "ooms": s["num_ooms"]}

    def reset_peak(self):
        self.pool.reset_peak_stats(self.device)

    def record_history(self, entries):
        self.pool.set_trace_capacity(entries, self.device)
        self._recording = True

    def stop_history(self):
        if self._recording:
            self.pool.set_trace_capacity(0, self.device)
            self._recording = False

    def snapshot(self):
        from memkernels.runtime.allocator import pool_snapshot

        return pool_snapshot(self.pool)

    def device_index(self):
        return self.device


class CPUTensorStats:
    """Live tensor bytes allocated since the step began, from a :class:`PeakBytesMeter` per step."""

    name = "cpu"

    def __init__(self):
        self._meter = None

    def open(self):
        from memkernels.runtime.meters import PeakBytesMeter

        self._meter = PeakBytesMeter().__enter__()

    def close(self):
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        meter = self._meter
        if meter is None:
            return
        stack = _get_current_dispatch_mode_stack()
        if not stack or stack[-1] is not meter._watch:
            # Exiting now would pop someone else's mode: a region opened inside the step is still open.
            raise RuntimeError("MemoryMonitor (cpu source): a TorchDispatchMode opened after the step began is "
                               "still active; close it (end its with-block) before monitor.step() or the monitor's end")
        self._meter = None
        meter.__exit__(None, None, None)

    def read(self):
        meter = self._meter
        peak = meter.peak_bytes if meter is not None else 0
        current = meter.current_bytes if meter is not None else 0
        return {"allocated": current, "reserved": None, "peak_allocated": peak, "peak_reserved": None,
                "largest_free_block": None, "alloc_retries": 0, "ooms": 0}

    def reset_peak(self):
        if self._meter is not None:
            self._meter.restart_peak()

    def new_step(self):
        """Peaks count from the step's start: a fresh meter each step."""
        self.close()
        self.open()

    def record_history(self, entries):
        pass  # nothing to record on the CPU; snapshot() says so

    def stop_history(self):
        pass

    def snapshot(self):
        return None

    def device_index(self):
        return 0


def _auto_source():
    import torch

    try:
        from memkernels import _C
        if _C.installed_device_pool() is not None:
            return PoolStats()
    except ImportError:
        pass
    if torch.cuda.is_available():
        return TorchCudaStats()
    return CPUTensorStats()


def _out_of_memory_types():
    import torch

    types = [torch.OutOfMemoryError]
    try:
        from memkernels import _C
        types.append(_C.OutOfMemoryError)
    except ImportError:
        pass
    return tuple(types)


# ---------------------------------------------------------------------- the monitor


class MemoryMonitor:
    """Record memory per training step; catch and explain an OOM.

    Usage::

        with MemoryMonitor(model=model, optimizer=opt, csv="memory.csv", log_dir="runs/mem",
                           png="memory.png") as monitor:
            for batch in loader:
                model(batch).loss.backward(); opt.step(); opt.zero_grad()
                monitor.step()

    Args:
        model: an ``nn.Module`` whose forward marks the forward phase (its end starts the
            backward phase, loss computation included).
        optimizer: a ``torch.optim.Optimizer`` (or a wrapper with ``.optimizer``) whose
            ``step()`` is the optimizer phase.
        source: ``"auto"`` (memkernels' pool if installed, else CUDA, else CPU), ``"torch"``,
            ``"memkernels"``, ``"cpu"``, or a source object (:class:`TorchCudaStats`,
            :class:`PoolStats`, :class:`CPUTensorStats`).
        csv / jsonl: paths to write one row per step to (columns: :data:`COLUMNS`).
        log_dir: TensorBoard log directory (needs ``tensorboard``: ``pip install memkernels[monitor]``).
        png: path of a timeline chart written when the block ends (needs matplotlib).
        record_history: keep the allocator's last N events with stacks, for the OOM snapshot and
            the fragmentation warning's replays (None: off).
        oom_snapshot: where to write the snapshot of an OOM (default ``memkernels-oom.pickle``
            in ``log_dir``, else the working directory).
        file: where the warning and the post-mortem are printed (default ``sys.stderr``).

    ``rows``: the rows recorded so far (dicts keyed by :data:`COLUMNS`; bytes are ints,
    ``None`` where the source has no such figure).
    """

    def __init__(self, *, model=None, optimizer=None, source="auto", csv=None, jsonl=None, log_dir=None, png=None,
                 record_history=None, oom_snapshot=None, file=None):
        if record_history is not None and (not isinstance(record_history, int) or isinstance(record_history, bool)
                                           or record_history <= 0):
            raise ValueError(f"MemoryMonitor(record_history={record_history!r}): a positive number of events or None")
        if model is not None and not hasattr(model, "register_forward_pre_hook"):
            raise ValueError(f"MemoryMonitor(model=...): needs an nn.Module, got {type(model).__name__}")
        inner = getattr(optimizer, "optimizer", optimizer)
        if optimizer is not None and not hasattr(inner, "register_step_pre_hook"):
            raise ValueError("MemoryMonitor(optimizer=...): needs a torch.optim.Optimizer, got "
                             f"{type(optimizer).__name__}")
        self.source = self._make_source(source)
        self.model, self.optimizer = model, inner
        self.csv_path, self.jsonl_path, self.log_dir, self.png_path = csv, jsonl, log_dir, png
        self.record_history = record_history
        self.oom_snapshot = oom_snapshot or os.path.join(log_dir or ".", "memkernels-oom.pickle")
        self.file = file
        self.rows = []
        self.warned = False
        self.snapshot_path = None  # set when an OOM snapshot was written
        self._handles, self._files, self._csv_writer, self._writer = [], [], None, None
        self._phase_gaps = {}  # phase -> most reserved-but-unallocated bytes seen at its end
        self._active = False

    @staticmethod
    def _make_source(source):
        if source == "auto":
            return _auto_source()
        makers = {"torch": TorchCudaStats, "memkernels": PoolStats, "cpu": CPUTensorStats}
        if isinstance(source, str):
            if source not in makers:
                raise ValueError(f"MemoryMonitor(source={source!r}): use 'auto', 'torch', 'memkernels', 'cpu' "
                                 "or a source object")
            return makers[source]()
        needed = ("read", "reset_peak", "snapshot", "record_history", "stop_history", "device_index")
        missing = [m for m in needed if not hasattr(source, m)]
        if missing:
            raise ValueError(f"MemoryMonitor(source=...): {type(source).__name__} lacks {', '.join(missing)}; use "
                             "TorchCudaStats, PoolStats or CPUTensorStats")
        return source

    # -------------------------------------------------------------- lifecycle

    def __enter__(self):
        if self._active:
            raise RuntimeError("MemoryMonitor is already active; use a new monitor for a nested region")
        self._active = True
        try:
            self._open_outputs()
            if self.record_history is not None:
                self.source.record_history(self.record_history)
            self._add_hooks()
            self._start_step()
        except BaseException:
            self._close(write_png=False)
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is not None and issubclass(exc_type, _out_of_memory_types()):
                self._post_mortem(exc)
        finally:
            self._close(write_png=True, error_in_flight=exc_type is not None)
        return False  # nothing is swallowed

    def close(self):
        """End monitoring outside a ``with`` block (the callback's path)."""
        if self._active:
            self._close(write_png=True)

    def _close(self, write_png, error_in_flight=False):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        failure = None
        if hasattr(self.source, "close"):
            try:
                self.source.close()
            except RuntimeError as error:
                failure = error
        self.source.stop_history()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for f in self._files:
            f.close()
        self._files, self._csv_writer = [], None
        self._active = False
        if write_png and self.png_path and self.rows:
            self._write_png()
        if failure is not None:
            if not error_in_flight:
                raise failure
            print(f"memkernels MemoryMonitor: {failure}", file=self.file or sys.stderr)  # never hide the error

    def _open_outputs(self):
        if self.log_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(f"MemoryMonitor(log_dir=...) writes TensorBoard scalars and needs tensorboard "
                                  f"({error}); pip install 'memkernels[monitor]' or leave log_dir out") from None
            self._writer = SummaryWriter(log_dir=self.log_dir)
        if self.csv_path is not None:
            f = open(self.csv_path, "w", newline="")
            self._files.append(f)
            self._csv_writer = csv.DictWriter(f, fieldnames=COLUMNS)
            self._csv_writer.writeheader()
        if self.jsonl_path is not None:
            self._files.append(open(self.jsonl_path, "w"))
            self._jsonl = self._files[-1]

    def _add_hooks(self):
        if self.model is not None:
            self._handles.append(self.model.register_forward_pre_hook(lambda *_: self._mark("forward")))
            self._handles.append(self.model.register_forward_hook(lambda *_: self._mark("backward"),
                                                                  always_call=True))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(lambda *_: self._mark("optimizer")))
            self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self._mark(None)))

    # -------------------------------------------------------------- steps

    def _start_step(self):
        if hasattr(self.source, "new_step"):
            self.source.new_step()
        self.source.reset_peak()
        self._phase = None
        self._phase_peaks = {}
        self._step_peak_reserved = 0
        self._step_peak_allocated = 0
        self._counters_at_start = self.source.read()
        self._started = time.perf_counter()

    def begin_step(self):
        """Start the step window now (what ran since the last :meth:`step` is not counted)."""
        self._require_active()
        self._start_step()

    def _mark(self, phase):
        """Close the running phase (its peak since the last mark) and start ``phase``.

        Returns None: a forward (pre-)hook's return value would replace the module's inputs/output.
        """
        self._last_figures = figures = self.source.read()
        self.source.reset_peak()
        self._fold(figures)
        if self._phase is not None:
            self._phase_end_gap(figures)
        self._phase = phase

    def _fold(self, figures):
        self._step_peak_allocated = max(self._step_peak_allocated, figures["peak_allocated"])
        if figures["peak_reserved"] is not None:
            self._step_peak_reserved = max(self._step_peak_reserved, figures["peak_reserved"])
        if self._phase is not None:
            self._phase_peaks[self._phase] = max(self._phase_peaks.get(self._phase, 0), figures["peak_allocated"])

    def _phase_end_gap(self, figures):
        if figures["reserved"] is not None:
            gap = figures["reserved"] - figures["allocated"]
            self._phase_gaps[self._phase] = max(self._phase_gaps.get(self._phase, 0), gap)

    def _require_active(self):
        if not self._active:
            raise RuntimeError("MemoryMonitor is not active: use it as `with MemoryMonitor(...) as monitor:`")

    def step(self, step=None):
        """End the current step: record its row, write it, warn on fragmentation; start the next.

        ``step``: the step number to record (default: the steps completed, this one included, so the first
        row is step 1, as a Hugging Face Trainer's global_step and MemoryCallback's). Returns the row.
        """
        self._require_active()
        self._mark(None)
        figures = self._last_figures
        seconds = time.perf_counter() - self._started
        start = self._counters_at_start
        peak_allocated = self._step_peak_allocated
        peak_reserved = self._step_peak_reserved if figures["peak_reserved"] is not None else None
        row = {
            "step": len(self.rows) + 1 if step is None else step,
            "source": self.source.name,
            "peak_allocated_bytes": peak_allocated,
            "peak_reserved_bytes": peak_reserved,
            "fragmentation_at_peak": 1 - peak_allocated / peak_reserved if peak_reserved else None,
            "largest_free_block_bytes": figures["largest_free_block"],
            "alloc_retries": figures["alloc_retries"] - start["alloc_retries"],
            "ooms": figures["ooms"] - start["ooms"],
            "seconds": seconds,
        }
        for phase in PHASES:
            row[f"peak_{phase}_bytes"] = self._phase_peaks.get(phase)
        row = {column: row[column] for column in COLUMNS}
        self.rows.append(row)
        self._write(row)
        if not self.warned and row["fragmentation_at_peak"] is not None \
                and row["fragmentation_at_peak"] > FRAGMENTATION_WARNING:
            self.warned = True
            print(self.fragmentation_warning(row), file=self.file or sys.stderr)
        self._start_step()
        return row

    def _write(self, row):
        if self._csv_writer is not None:
            self._csv_writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
            self._files[0].flush()
        if self.jsonl_path is not None:
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            # One Summary holding every scalar of the step: the records add_scalar writes one call
            # per value, for a quarter of the cost (benchmarks/bench_monitor.py).
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=f"memory/{name}", simple_value=float(row[name]))
                      for name in SCALARS if row[name] is not None]
            self._writer._get_file_writer().add_summary(Summary(value=values), row["step"])

    # -------------------------------------------------------------- fragmentation

    def fragmentation_warning(self, row):
        """The one-time warning: the figure, and each remedy with what it was measured to do."""
        lines = [f"memkernels MemoryMonitor: at step {row['step']} {row['fragmentation_at_peak']:.0%} of the memory "
                 f"reserved at the peak ({format_size(row['peak_reserved_bytes'])}) held no tensor "
                 f"(peak allocated {format_size(row['peak_allocated_bytes'])}; source: {self.source.name}). Remedies:"]
        lines += self._measured_remedies()
        if self._phase_gaps:
            phase, gap = max(self._phase_gaps.items(), key=lambda item: item[1])
            lines.append("  - empty_cache: call torch.cuda.empty_cache() (memkernels.allocator.empty_cache() under "
                         f"the pool) after the {phase} phase, which left the most reserved-but-unused memory "
                         f"({format_size(gap)}); it returns whole free segments only")
        else:
            lines.append("  - empty_cache: pass model= and optimizer= to see which phase leaves the most "
                         "reserved-but-unused memory, the place to call torch.cuda.empty_cache()")
        return "\n".join(lines)

    def _measured_remedies(self):
        snapshot = None
        if self.record_history is not None:
            try:
                snapshot = self.source.snapshot()
            except RuntimeError:
                snapshot = None
        device = self.source.device_index() or 0
        traces = (snapshot or {}).get("device_traces", [])
        if not any(e.get("action") == "alloc" for e in (traces[device] if device < len(traces) else [])):
            return ["  - expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or memkernels' pool "
                    "(memkernels.allocator.install()): not measured, no allocation history; pass "
                    "record_history=100_000 and the monitor replays this run's trace through both"]
        from memkernels.forensics.explain import counterfactuals, demand_events

        replay = demand_events(snapshot, device)  # what was live before the history began included
        results = counterfactuals(replay, None)
        base = results["pytorch"]["peak_reserved_bytes"]

        def versus(policy):
            peak = results[policy]["peak_reserved_bytes"]
            return f"peak reserved {format_size(peak)} ({(peak - base) / base:+.0%} vs PyTorch's policy)" if base else \
                f"peak reserved {format_size(peak)}"

        return ["  - expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): "
                f"{versus('pytorch_expandable')} on this run's trace ({len(replay)} allocations and frees), replayed",
                f"  - memkernels' pool (memkernels.allocator.install()): {versus('memkernels')}; with its expandable "
                f"segments {versus('memkernels_expandable')}"]

    # -------------------------------------------------------------- OOM

    def _post_mortem(self, error):
        out = self.file or sys.stderr
        try:
            snapshot = self.source.snapshot()
            if snapshot is None:
                print(f"memkernels MemoryMonitor: out of memory ({type(error).__name__}); the {self.source.name} "
                      "source has no allocator snapshot to explain", file=out)
                return
            with open(self.oom_snapshot, "wb") as f:
                pickle.dump(snapshot, f)
            self.snapshot_path = self.oom_snapshot
            from memkernels.forensics.explain import explain

            print(f"memkernels MemoryMonitor: out of memory ({type(error).__name__}); snapshot written to "
                  f"{self.oom_snapshot}", file=out)
            device = self.source.device_index() or 0
            traces = snapshot.get("device_traces", [])
            if not any(e.get("action") == "oom" for e in (traces[device] if device < len(traces) else [])):
                print("  the allocator recorded no history, so the failing request is not in the snapshot: pass "
                      "MemoryMonitor(record_history=100_000) to capture it and the events before it; the state "
                      "below is the allocator's at the snapshot", file=out)
            print(explain(snapshot, device=self.source.device_index()).text(), file=out)
        except Exception as failure:  # the post-mortem must never hide the OOM itself
            print(f"memkernels MemoryMonitor: the OOM post-mortem failed ({type(failure).__name__}: {failure}); "
                  "the original error follows", file=out)

    # -------------------------------------------------------------- chart

    def _write_png(self):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker

        steps = [r["step"] for r in self.rows]
        mib = 1 << 20
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ax.plot(steps, [r["peak_allocated_bytes"] / mib for r in self.rows], marker="o", label="peak allocated")
        if self.rows[0]["peak_reserved_bytes"] is not None:
            ax.plot(steps, [r["peak_reserved_bytes"] / mib for r in self.rows], marker="s", label="peak reserved")
        for phase in PHASES:
            values = [r[f"peak_{phase}_bytes"] for r in self.rows]
            if any(v is not None for v in values):
                ax.plot(steps, [v / mib if v is not None else float("nan") for v in values], linestyle="--",
                        label=f"peak {phase}")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_ylabel("MiB")
        ax.set_title(f"memory per step (source: {self.source.name})")
        ax.legend(loc="upper left")
        if self.rows[0]["fragmentation_at_peak"] is not None:
            twin = ax.twinx()
            twin.plot(steps, [r["fragmentation_at_peak"] for r in self.rows], color="grey", alpha=0.6,
                      label="fragmentation at peak")
            twin.axhline(FRAGMENTATION_WARNING, color="red", linestyle=":", linewidth=1)
            twin.set_ylim(0, 1)
            twin.set_ylabel("fragmentation")
        fig.tight_layout()
        fig.savefig(self.png_path, dpi=100)
        plt.close(fig)
