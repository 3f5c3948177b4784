"""What every benchmark shares: the training workload, the machine description, memory sampling, statistics.

The workload is real training state, not random tensors: :class:`~asyncckpt.testing.demo_model.TinyGPT`
trained on the Python standard library's source, in BF16 autocast on a GPU (so the FP32
gradients look like those of mixed-precision training), in FP32 on the CPU. Random tensors
compress nothing like trained weights and Adam moments do.

Everything here runs on the benchmark's main (training) thread, except :class:`MemorySampler`,
which polls memory from its own thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asyncckpt._commands._progress import Progress as TerminalBar
from asyncckpt.testing.demo_model import TextBatches, TinyGPT, stdlib_text

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class WorkloadConfig:
    """The model and training loop; ``heads=0`` means one head per 128 channels."""

    width: int
    layers: int
    heads: int = 0
    context: int = 128
    batch: int = 8
    device: str = "auto"
    seed: int = 0
    lr: float = 3e-4

    def resolved_device(self) -> torch.device:
        """The device with an explicit index: ``torch.cuda.mem_get_info`` and ``set_device`` reject a bare "cuda"."""
        name = ("cuda" if torch.cuda.is_available() else "cpu") if self.device == "auto" else self.device
        device = torch.device(name)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def resolved_heads(self) -> int:
        return self.heads or max(1, self.width // 128)


def sized_workload(args: Any, sizes: dict[str, dict[str, Any]]) -> WorkloadConfig:
    """The workload a benchmark's command line asks for. Every size it left None (``--width``,
    ``--train-steps``, ...) is set on ``args`` from ``sizes["tiny"]`` under ``--tiny``, else from
    ``sizes["gpu"]`` or ``sizes["cpu"]``, by the device ``--device`` resolves to."""
    cuda = WorkloadConfig(width=0, layers=0, device=args.device).resolved_device().type == "cuda"
    for key, value in sizes["tiny" if args.tiny else "gpu" if cuda else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return WorkloadConfig(width=args.width, layers=args.layers, heads=getattr(args, "heads", 0), context=args.context,
                          batch=args.batch, device=args.device)  # fmt: skip


class Workload:
    """A TinyGPT, its AdamW optimizer and a text stream; one :meth:`step` is one training step.

    On CUDA the forward pass runs under BF16 autocast and AdamW is the fused kernel. Gradients
    are set to None before each backward (the PyTorch default), so a checkpoint that holds last
    step's gradient tensors is never overwritten in place by the next backward.
    """

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.device = config.resolved_device()
        torch.manual_seed(config.seed)
        with torch.device(self.device):  # build on the device: a 1B model initialised on the CPU takes minutes
            self.model = TinyGPT(width=config.width, layers=config.layers, heads=config.resolved_heads(),
                                 context=config.context)  # fmt: skip
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, fused=fused)
        self.batches = TextBatches(stdlib_text(), config.context, config.batch, self.device, seed=config.seed)
        self.autocast = self.device.type == "cuda"
        self.steps_done = 0
        self.last_loss = float("nan")

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        """Run one training step; return its wall seconds (ends with a host sync: the loss is read)."""
        began = time.perf_counter()
        inputs, targets = self.batches.next()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256).float(), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.last_loss = float(loss.detach())
        self.steps_done += 1
        return time.perf_counter() - began

    def train(self, steps: int, progress: Progress | None = None, what: str = "training",
              deadline: float | None = None) -> float:  # fmt: skip
        """Train ``steps`` steps, or until ``time.perf_counter()`` passes ``deadline``; return the wall seconds."""
        began = time.perf_counter()
        report_every = max(1, steps // 5)
        for i in range(1, steps + 1):
            if deadline is not None and time.perf_counter() > deadline:
                if progress is not None:
                    progress.say(f"{what}: stopped after {i - 1} steps (time limit)")
                break
            self.step()
            if progress is not None and (i % report_every == 0 or i == steps):
                progress.say(f"{what}: step {i}/{steps}, loss {self.last_loss:.3f}")
        return time.perf_counter() - began

    def state(self) -> dict[str, Any]:
        """The state a training job checkpoints: weights, optimizer (Adam moments, step) and gradients."""
        grads = {name: p.grad for name, p in self.model.named_parameters() if p.grad is not None}
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "grads": grads,
                "step": self.steps_done}  # fmt: skip

    def tensor_classes(self) -> dict[str, list[torch.Tensor]]:
        """The state's tensors by kind: FP32 weights, Adam's two moments, gradients (the tied head counts once)."""
        weights = list({id(p): p.detach() for p in self.model.parameters()}.values())
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        exp_avg, exp_avg_sq = [], []
        for state in self.optimizer.state.values():
            exp_avg.append(state["exp_avg"])
            exp_avg_sq.append(state["exp_avg_sq"])
        return {"weights": weights, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "grads": grads}


def train_while_saving(work: Workload, save: Callable[[], Any], baseline_seconds: float,
                       settled: Callable[[], bool] | None = None) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """Call ``save()`` on the training thread, then train until the handle it returned is ``done()``
    (and ``settled()``, when given: background work the save started after it was durable).

    Returns the handle and what the save cost training: the call's seconds, and the time lost, which
    is the call plus every step's excess over ``baseline_seconds`` until then; with ``settled``, also
    the part of it lost after the checkpoint was durable, and the steps that ran then.
    """
    began = time.perf_counter()
    handle = save()
    call = time.perf_counter() - began
    steps: list[float] = []
    durable_after_steps = None
    while True:
        if durable_after_steps is None and handle.done():
            durable_after_steps = len(steps)
        if durable_after_steps is not None and (settled is None or settled()):
            break
        steps.append(work.step())

    def excess(seconds: list[float]) -> float:
        return sum(max(0.0, s - baseline_seconds) for s in seconds)

    cost = {"call_seconds": call, "lost_seconds": call + excess(steps), "steps_while_persisting": len(steps),
            "step_ms": [round(s * 1e3, 2) for s in steps]}  # fmt: skip
    if settled is not None:
        after = steps[durable_after_steps:]
        cost["lost_after_durable_seconds"] = excess(after)
        cost["steps_after_durable"] = len(after)
    return handle, cost


def synchronize(device: torch.device) -> None:
    """Wait for all work on the device, every stream's (for measuring throughput)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_training_stream(device: torch.device) -> None:
    """Wait for the training thread's current stream only.

    What a save costs training is what it queues on the training stream (a snapshot copy);
    a checkpointer's own streams (compression) run beside it, and a device-wide synchronize
    would wrongly charge their work to the save call.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def tensor_bytes(state: object) -> int:
    """Bytes of every distinct tensor in a nested state (aliases counted once)."""
    seen: dict[tuple[int, int], int] = {}  # (storage address, offset) -> bytes

    def visit(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            seen[(obj.untyped_storage().data_ptr(), int(obj.storage_offset()))] = obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, list | tuple):
            for value in obj:
                visit(value)

    visit(state)
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------- memory
def gpu_used_bytes(device: torch.device) -> int:
    """Device memory in use by every process (free/total from the driver): sees nvCOMP's allocations too."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


def host_rss_bytes() -> int:
    """Resident memory of this process (pinned staging memory included); 0 where /proc is missing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_memory(device: torch.device) -> None:
    """Give cached memory back (PyTorch's device and pinned-host caches, glibc's heap) so the next
    measurement starts from what is really held."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class MemorySampler:
    """Polls GPU memory in use and host RSS from a daemon thread; :meth:`window` reports the peaks.

    Peaks are sampled (every ``interval_seconds``), so a spike shorter than that can be missed;
    staging buffers live for a whole save and are not.
    """

    def __init__(self, device: torch.device, interval_seconds: float = 0.02) -> None:
        self.device = device
        self.interval_seconds = interval_seconds
        self._lock = threading.Lock()
        self._peak_gpu = 0
        self._peak_host = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory-sampler", daemon=True)
        self._thread.start()

    def current(self) -> tuple[int, int]:
        gpu = gpu_used_bytes(self.device) if self.device.type == "cuda" else 0
        return gpu, host_rss_bytes()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self._stop.wait(self.interval_seconds):
            gpu, host = self.current()
            with self._lock:
                self._peak_gpu = max(self._peak_gpu, gpu)
                self._peak_host = max(self._peak_host, host)

    def reset(self) -> tuple[int, int]:
        """Start a new window; return the memory in use now."""
        gpu, host = self.current()
        with self._lock:
            self._peak_gpu, self._peak_host = gpu, host
        return gpu, host

    def peaks(self) -> tuple[int, int]:
        gpu, host = self.current()
        with self._lock:
            return max(self._peak_gpu, gpu), max(self._peak_host, host)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------------------------------- statistics
def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def p95(values: Sequence[float]) -> float | None:
    """95th percentile by nearest rank (with fewer than 20 samples: the largest)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = -(-95 * len(ordered) // 100)  # ceil(0.95 n)
    return ordered[max(0, rank - 1)]


# ---------------------------------------------------------------------------------------------- files
def path_bytes(path: Path) -> int:
    """Size of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` in one rename, so a run killed mid-write leaves the previous version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_atomically(path, json.dumps(data, indent=1, sort_keys=False, default=_json_default) + "\n")


def write_report(out: Path, name: str, report: dict[str, Any], markdown: str) -> None:
    """``<out>/<name>.json`` and ``.md``, each replaced in one rename: a benchmark calls this after every
    part it measures, so a run killed by a time limit keeps what it had measured."""
    write_json(out / f"{name}.json", report)
    write_atomically(out / f"{name}.md", markdown)


def _json_default(obj: object) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)  # type: ignore[call-overload]
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


# ---------------------------------------------------------------------------------------------- machine
def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of everything that shapes the figures (None: not installed)."""
    from asyncckpt import __version__

    found: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "asyncckpt": __version__,
        "git_commit": _git_commit(),
    }
    for name in ("numpy", "zstandard", "lz4", "matplotlib", "nvidia-nvcomp-cu12", "nvidia-nvcomp-cu13",
                 "kvikio-cu12", "kvikio-cu13", "cupy-cuda12x", "cupy-cuda13x"):  # fmt: skip
        version = _package_version(name)
        if version is not None:
            found[name] = version
    with contextlib.suppress(ImportError, AttributeError):
        from nvidia import nvcomp

        found.setdefault("nvidia-nvcomp", getattr(nvcomp, "__version__", "importable"))
    return found


def _git_commit() -> str | None:
    """``git describe``, and for a dirty tree also the id of the tree that ran (``tree <hash>``).

    The device tool copies the working tree onto a checkout whose ``HEAD`` stays at the
    session's first commit, so there ``describe`` names an older commit and says ``dirty``; the
    tree id (the files as ``git add -A`` would stage them, through a scratch index) is what
    ``git log --format='%h %t'`` shows for the commit that actually ran.
    """
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    described = out.stdout.strip() or None
    if described is None or not described.endswith("-dirty"):
        return described
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        try:
            for command in (["add", "-A"], ["write-tree"]):
                tree = subprocess.run(["git", "-C", str(REPO_ROOT), *command], capture_output=True, text=True,
                                      timeout=60, check=True, env=env)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return described
    return f"{described}, tree {tree.stdout.strip()[:10]}"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _mem_total_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def filesystem_of(path: Path) -> dict[str, str]:
    """Mount point, device and type of the file system holding ``path`` (from /proc/mounts)."""
    best = {"mount": "?", "device": "?", "type": "?"}
    target = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best["mount"].replace("?", "")):
                best = {"mount": mount, "device": parts[0], "type": parts[2]}
    return best


def describe_machine(scratch: Path | None = None) -> dict[str, Any]:
    """What ran the benchmark: CPU, memory, GPU, the scratch file system."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "os": f"{platform.system()} {platform.release()}",
        "cpu": _cpu_model(),
        "cpu_cores": cores,
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": _mem_total_bytes(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = int(props.total_memory)
        info["gpu_count"] = torch.cuda.device_count()
    if scratch is not None:
        info["scratch_filesystem"] = filesystem_of(scratch)
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def machine_label(machine: dict[str, Any]) -> str:
    if machine.get("gpu"):
        return f"{machine['gpu']} ({machine['cpu_cores']} CPU cores)"
    return f"CPU only: {machine['cpu']}, {machine['cpu_cores']} cores"


# ---------------------------------------------------------------------------------------------- output
class Progress:
    """Progress lines on stderr with the seconds since start, so stdout stays the Markdown result."""

    def __init__(self, quiet: bool = False) -> None:
        self.began = time.perf_counter()
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def say(self, message: str) -> None:
        if not self.quiet:
            print(f"[{self.elapsed():7.1f}s] {message}", file=sys.stderr, flush=True)


class BarProgress(Progress):
    """Progress lines that scroll above a bar of work done, drawn only when stderr is a terminal.

    :meth:`start_bar` sets the total (in ``unit``); :meth:`advance` moves it; a pipe or a log file
    sees only the lines."""

    bar: TerminalBar | None = None

    def start_bar(self, what: str, total: int, unit: str) -> None:
        if not self.quiet:
            self.bar = TerminalBar(what, total, unit=unit)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.advance(n)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def say(self, message: str) -> None:
        if self.bar is not None:
            self.bar.clear()
        super().say(message)
        if self.bar is not None:
            self.bar.redraw()


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bytes_per_second: float | None) -> str:
    if not bytes_per_second:
        return "-"
    return f"{fmt_bytes(bytes_per_second)}/s"


def fmt_ratio(value: float | None, digits: int = 3) -> str:
    """``1.402x``; "-" where there is no ratio (None, zero, or an empty divisor's infinity)."""
    if not value or math.isinf(value):
        return "-"
    return f"{value:.{digits}f}x"


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The command that ran, as a shell would take it, for the report."""
    return f"{prog} {shlex.join(argv)}".strip()


def utc_stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def report_head(prog: str, argv: Sequence[str], machine: dict[str, Any]) -> dict[str, Any]:
    """What a report opens with: when it ran, on what, with which versions, by which command."""
    found = versions()
    return {"when": time.strftime("%Y-%m-%d %H:%MZ", time.gmtime()), "machine": machine, "versions": found,
            "versions_line": ", ".join(f"{k} {v}" for k, v in found.items() if v),
            "command": command_line(prog, argv)}  # fmt: skip


def result_name(prefix: str, machine: dict[str, Any], tiny: bool = False) -> str:
    """``<prefix>-<UTC date and time>-<gpu or cpu>``: sortable by date, GPU results told apart by name."""
    kind = "cpu" if not machine.get("gpu") else machine["gpu"].lower().replace("nvidia", "").strip().replace(" ", "")
    kind = "".join(c for c in kind if c.isalnum() or c == "-") or "gpu"
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{kind}{'-tiny' if tiny else ''}"
