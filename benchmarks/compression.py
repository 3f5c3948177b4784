"""How well each codec compresses each kind of training state, how fast, and how far from the bound.

Per tensor class of a trained TinyGPT — FP32 weights, the same weights as BF16, Adam's exp_avg
and exp_avg_sq, FP32 gradients (BF16 autocast on a GPU) and the same gradients as BF16 — it
measures on one sample of the class (a slice of every tensor, up to ``--sample-bytes``):

* the order-0 entropy of each byte plane, and the ratio bound it implies for a coder that
  splits planes and codes each byte on its own (and the bound without the split);
* every asyncckpt codec, through the library's own encoders (``build_backend``): ratio,
  compression and decompression throughput, and what ``auto`` chose;
* on a GPU, nvCOMP directly as well (every algorithm, float-aware data types, byte planes);
* on the CPU, zstd with and without byte planes (level 1 and 3), and ``none``.

Throughput is raw bytes per second of wall time, the device synchronised (GPU) after each call.

    python -m benchmarks.compression            # defaults for this machine
    python -m benchmarks.compression --tiny     # the CI smoke test
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from asyncckpt._codecs import ZstdCodec, get_decoder
from asyncckpt.options import CODEC_NAMES

from .common import (
    BarProgress,
    Progress,
    Workload,
    command_line,
    describe_machine,
    fmt_bytes,
    fmt_ratio,
    machine_label,
    median,
    result_name,
    sized_workload,
    synchronize,
    utc_stamp,
    versions,
    write_report,
)

FORMAT_VERSION = 1
NO_COPY_BYTES_PER_SECOND = 5e12
"""Faster than any memory can copy: the codec returned a view of its input (``none``), not a throughput."""
CLASS_DTYPES = {"weights_fp32": torch.float32, "weights_bf16": torch.bfloat16, "exp_avg": torch.float32,
                "exp_avg_sq": torch.float32, "grads_fp32": torch.float32, "grads_bf16": torch.bfloat16}  # fmt: skip
SIZES = {
    "tiny": {"width": 64, "layers": 1, "context": 32, "batch": 2, "train_steps": 5, "sample_bytes": 1 << 20,
             "cpu_sample_bytes": 1 << 20},
    "gpu": {"width": 1024, "layers": 12, "context": 128, "batch": 16, "train_steps": 200,
            "sample_bytes": 256 << 20, "cpu_sample_bytes": 64 << 20},
    "cpu": {"width": 512, "layers": 4, "context": 64, "batch": 4, "train_steps": 200,
            "sample_bytes": 32 << 20, "cpu_sample_bytes": 32 << 20},
}  # fmt: skip
"""The size defaults for ``--tiny``, a GPU and a CPU (what the command line leaves unset)."""
_SOURCE = {"weights_fp32": "weights", "weights_bf16": "weights", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
           "grads_fp32": "grads", "grads_bf16": "grads"}  # fmt: skip


def build_parser(prog: str = "python -m benchmarks.compression") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (CI)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--width", type=int, default=None, help="model width (default: 512 CPU, 1024 GPU)")
    p.add_argument("--layers", type=int, default=None, help="layers (default: 4 CPU, 12 GPU)")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--train-steps", type=int, default=None, help="training steps first (default 200)")
    p.add_argument("--sample-bytes", type=int, default=None,
                   help="raw bytes per class measured (default: 32 MB CPU, 256 MB GPU)")  # fmt: skip
    p.add_argument("--cpu-sample-bytes", type=int, default=None,
                   help="bytes per class for the CPU codecs on a GPU machine (default 64 MB)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/bench"))
    p.add_argument("--name", default=None, help="output stem (default: compression-<UTC>-<gpu|cpu>)")
    p.add_argument("--quiet", action="store_true")
    return p


# ------------------------------------------------------------------------------------------------ samples
def class_sample(tensors: Sequence[torch.Tensor], dtype: torch.dtype, cap_bytes: int) -> torch.Tensor:
    """One 1-D uint8 buffer: the leading elements of every tensor, in ``dtype``, ``cap_bytes`` at most in all.

    Each tensor contributes in proportion to its size, so large matrices dominate as they do
    in the state; BF16 classes are the FP32 tensors cast (what a BF16 model or gradient holds).
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    total = sum(t.numel() for t in tensors) * itemsize
    fraction = min(1.0, cap_bytes / max(1, total))
    parts = []
    for t in tensors:
        count = t.numel() if fraction >= 1.0 else int(t.numel() * fraction)
        if count:
            parts.append(t.detach().reshape(-1)[:count].to(dtype).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def plane_entropy(raw: torch.Tensor, planes: int) -> dict[str, Any]:
    """Order-0 entropy (bits per byte) of each byte plane, of the interleaved bytes, and the ratio bounds."""
    n = raw.numel() // planes * planes
    grid = raw[:n].view(-1, planes)

    def entropy(values: torch.Tensor) -> float:
        counts = torch.bincount(values.reshape(-1), minlength=256).double()  # uint8 in: no int64 copy
        p = counts[counts > 0] / counts.sum()
        return float(-(p * torch.log2(p)).sum())

    per_plane = [entropy(grid[:, i]) for i in range(planes)]
    mixed = entropy(grid)
    split_bits = sum(per_plane) / planes
    return {"plane_bits_per_byte": per_plane, "interleaved_bits_per_byte": mixed,
            "bound_ratio_planes": 8 / split_bits if split_bits > 0 else math.inf,
            "bound_ratio_interleaved": 8 / mixed if mixed > 0 else math.inf}  # fmt: skip


# ------------------------------------------------------------------------------------------------ timing
def timed(fn: Callable[[], Any], device: torch.device, min_seconds: float = 0.2,
          max_repeats: int = 3, first: list[float] | None = None) -> tuple[Any, float]:  # fmt: skip
    """Run ``fn`` once to warm up (its seconds appended to ``first``), then until ``min_seconds`` or
    ``max_repeats``; return (result, median seconds of the timed runs)."""
    began = time.perf_counter()
    result = fn()
    synchronize(device)
    if first is not None:
        first.append(time.perf_counter() - began)
    times: list[float] = []
    while len(times) < max_repeats and (not times or sum(times) < min_seconds):
        began = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - began)
    return result, median(times) or 0.0


def measure_encoder(name: str, encoder: Any, raw: torch.Tensor, dtype: torch.dtype, key: str) -> dict[str, Any]:
    """Ratio and throughputs of one asyncckpt encoder on ``raw`` (its decoder too, where this machine has one).

    ``key`` is the tensor's name for the encoder: ``auto`` remembers its choice per key, so the
    first (warm-up) encode probes the candidates and the timed ones run the chosen codec.
    """
    device = raw.device
    first: list[float] = []
    blob, seconds = timed(partial(encoder.encode, raw, dtype, key), device, first=first)
    out: dict[str, Any] = {"codec": blob.codec, "params": dict(blob.params), "stored_bytes": blob.stored_bytes,
                           "ratio": raw.numel() / max(1, blob.stored_bytes),
                           "compress_bytes_per_second": raw.numel() / seconds if seconds else None,
                           "first_encode_seconds": first[0]}  # fmt: skip
    errors = []
    # Decode where the blob is; a CPU-decodable GPU blob (RAW zstd, ...) may also be decoded on the host.
    for where in ("device", "host") if blob.data.is_cuda else ("host",):
        try:
            decoder = get_decoder(blob.codec, f"benchmark {name}")
            data = blob.data if where == "device" else blob.data.cpu()
            target = torch.empty(raw.numel(), dtype=torch.uint8, device=data.device)
            _, dseconds = timed(partial(decoder.decode, data, list(blob.chunks), blob.params, target), device)
            out["decompress_bytes_per_second"] = raw.numel() / dseconds if dseconds else None
            out["decompress_where"] = where
            out["roundtrip_exact"] = bool(torch.equal(target.to(raw.device), raw))
            break
        except Exception as exc:  # noqa: BLE001 - a missing decoder is a finding, not a crash
            errors.append(f"{where}: {type(exc).__name__}: {exc}".splitlines()[0][:200])
    else:
        out["decompress_error"] = "; ".join(errors)
    return out


def library_encoders(device: torch.device) -> dict[str, Any]:
    """asyncckpt's encoder for every codec name, as its checkpointer would build it (or why it cannot)."""
    from asyncckpt._backend import build_backend
    from asyncckpt.options import resolve_options

    snapshot = "device" if device.type == "cuda" else "host"
    found: dict[str, Any] = {}
    for codec in CODEC_NAMES:
        try:
            found[codec] = build_backend(resolve_options(codec=codec, snapshot=snapshot))
        except Exception as exc:  # noqa: BLE001 - MissingDependencyError, CheckpointError: recorded
            found[codec] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return found


class CpuCodecs:
    """CPU zstd with and without byte planes (planes=1 is what zstd sees when told the bytes are uint8)."""

    def __init__(self) -> None:
        self.level1, self.level3 = ZstdCodec(level=1), ZstdCodec(level=3)

    def variants(self) -> dict[str, Callable[[torch.Tensor, torch.dtype], Any]]:
        return {
            "zstd-1 planes": lambda raw, dtype: self.level1.encode(raw, dtype, "bench"),
            "zstd-3 planes": lambda raw, dtype: self.level3.encode(raw, dtype, "bench"),
            "zstd-1 no planes": lambda raw, dtype: self.level1.encode(raw, torch.uint8, "bench"),
        }

    def close(self) -> None:
        self.level1.close()
        self.level3.close()


# ------------------------------------------------------------------------------------------------ nvCOMP
def nvcomp_variants(dtype: torch.dtype) -> list[tuple[str, str, str | None, bool]]:
    """(label, algorithm, data_type, byte-plane split) for every nvCOMP configuration worth a row."""
    typed = "<f2" if dtype.itemsize == 2 else "<f4"
    return [
        (f"ANS {typed}", "ANS", typed, False), ("ANS |u1", "ANS", "|u1", False), ("ANS planes", "ANS", "|u1", True),
        ("Zstd", "Zstd", None, False), ("Zstd planes", "Zstd", None, True), ("LZ4", "LZ4", None, False),
        ("GDeflate", "GDeflate", None, False), ("Deflate", "Deflate", None, False),
        (f"Bitcomp {typed}", "Bitcomp", typed, False), ("Cascaded", "Cascaded", None, False),
    ]  # fmt: skip


def measure_nvcomp(raw: torch.Tensor, dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """nvCOMP itself (default bitstream, default chunk size) on a device buffer, on a private stream."""
    from nvidia import nvcomp

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the sample was made on the default stream
    results: dict[str, dict[str, Any]] = {}
    planes = dtype.itemsize
    for label, algorithm, data_type, split in nvcomp_variants(dtype):
        try:
            kwargs: dict[str, Any] = {"algorithm": algorithm, "cuda_stream": stream.cuda_stream}
            if data_type is not None:
                kwargs["data_type"] = data_type
            codec = nvcomp.Codec(**kwargs)
            view = {"<f2": torch.float16, "<f4": torch.float32}.get(data_type or "", torch.uint8)

            def encode(codec: Any = codec, split: bool = split, view: torch.dtype = view) -> Any:
                with torch.cuda.stream(stream):
                    src = raw.view(-1, planes).t().contiguous().view(-1) if split else raw
                    encoded = codec.encode(nvcomp.as_array(src.view(view), cuda_stream=stream.cuda_stream))
                stream.synchronize()
                return encoded

            encoded, seconds = timed(encode, raw.device)
            rate = raw.numel() / seconds if seconds else None
            entry: dict[str, Any] = {"ratio": raw.numel() / max(1, int(encoded.buffer_size)),
                                     "compress_bytes_per_second": rate}  # fmt: skip

            def decode(codec: Any = codec, encoded: Any = encoded) -> Any:
                decoded = codec.decode(encoded)
                stream.synchronize()
                return decoded

            try:
                _, dseconds = timed(decode, raw.device)
                entry["decompress_bytes_per_second"] = raw.numel() / dseconds if dseconds else None
            except Exception as exc:  # noqa: BLE001
                entry["decompress_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            results[label] = entry
        except Exception as exc:  # noqa: BLE001 - one configuration nvCOMP rejects is a row with its reason
            results[label] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
    return results


# ------------------------------------------------------------------------------------------------ run
def measure_classes(workload: Workload, sample_bytes: int, cpu_sample_bytes: int, progress: Progress,
                    on_class: Callable[[dict[str, Any]], object] | None = None) -> dict[str, Any]:  # fmt: skip
    device = workload.device
    classes = workload.tensor_classes()
    encoders = library_encoders(device)
    unavailable = {k: v for k, v in encoders.items() if isinstance(v, str)}
    cpu = CpuCodecs()
    if isinstance(progress, BarProgress):
        progress.start_bar("tensor classes", len(CLASS_DTYPES), unit="classes")
    try:
        out: dict[str, Any] = {"classes": {}, "library_unavailable": unavailable}
        for cls, dtype in CLASS_DTYPES.items():
            tensors = classes[_SOURCE[cls]]
            total = sum(t.numel() for t in tensors) * torch.empty(0, dtype=dtype).element_size()
            raw = class_sample(tensors, dtype, sample_bytes)
            entry: dict[str, Any] = {"dtype": str(dtype).replace("torch.", ""), "class_bytes": total,
                                     "sample_bytes": raw.numel(),
                                     "entropy": plane_entropy(raw, dtype.itemsize)}  # fmt: skip
            library: dict[str, Any] = {}
            for codec, backend in encoders.items():
                if isinstance(backend, str):
                    continue
                try:
                    library[codec] = measure_encoder(codec, backend.encoder, raw, dtype, f"bench/{cls}")
                except Exception as exc:  # noqa: BLE001
                    library[codec] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
            entry["library"] = library
            auto = library.get("auto") or {}
            entry["auto_chose"] = {"codec": auto.get("codec"), "params": auto.get("params")}
            host = raw if device.type == "cpu" else class_sample(tensors, dtype, cpu_sample_bytes).cpu()
            entry["cpu_sample_bytes"] = host.numel()
            cpu_results: dict[str, Any] = {}
            for label, fn in cpu.variants().items():
                blob, seconds = timed(partial(fn, host, dtype), torch.device("cpu"))
                rate = host.numel() / seconds if seconds else None
                cpu_results[label] = {"ratio": host.numel() / max(1, blob.stored_bytes),
                                      "compress_bytes_per_second": rate}  # fmt: skip
            entry["cpu"] = cpu_results
            if device.type == "cuda":
                try:
                    entry["nvcomp"] = measure_nvcomp(raw, dtype)
                except ImportError as exc:
                    entry["nvcomp"] = {"error": f"nvCOMP not importable: {exc}"}
            out["classes"][cls] = entry
            if isinstance(progress, BarProgress):
                progress.advance()
            if on_class is not None:
                on_class(out)
            ent = entry["entropy"]
            progress.say(f"{cls}: {fmt_bytes(raw.numel())} sample, bound {ent['bound_ratio_planes']:.3f}x (planes); "
                         f"auto -> {entry['auto_chose']['codec']} {auto.get('ratio', 0):.3f}x")  # fmt: skip
            del raw, host
        return out
    finally:
        if isinstance(progress, BarProgress):
            progress.close_bar()
        cpu.close()
        for backend in encoders.values():
            if not isinstance(backend, str):
                backend.close()


def markdown(report: dict[str, Any]) -> str:
    classes = report["classes"]
    names = list(classes)
    m = report["machine"]
    lines = [f"### Compression per tensor class — {machine_label(m)}", "",
             f"{report['created_utc']}, torch {report['versions']['torch']}. State of a "
             f"{report['model']['parameters'] / 1e6:.3g}M-parameter TinyGPT after {report['model']['train_steps']} "
             f"steps on {report['model']['device']}. Cells: ratio @ compression throughput (GB/s of raw bytes).", "",
             "| class | dtype | sample | order-0 limit, planes (interleaved) | bits/byte per plane, low→high "
             "| auto chose | auto ratio |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for cls in names:
        e = classes[cls]
        ent = e["entropy"]
        auto = e["library"].get("auto") or {}
        chose = e["auto_chose"]
        params = chose.get("params") or {}
        chose_text = f"{chose.get('codec')}" + (f" {params}" if params else "")
        lines.append(f"| {cls} | {e['dtype']} | {fmt_bytes(e['sample_bytes'])} "
                     f"| {ent['bound_ratio_planes']:.3f}x ({ent['bound_ratio_interleaved']:.3f}x) "
                     f"| {' / '.join(f'{b:.2f}' for b in ent['plane_bits_per_byte'])} | {chose_text} "
                     f"| {fmt_ratio(auto.get('ratio'))} |")  # fmt: skip
    rows: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any] | None]]] = []
    first = classes[names[0]] if names else {}
    for codec in first.get("library", {}):
        rows.append((f"asyncckpt `{codec}`", partial(_section, "library", codec)))
    for label in first.get("cpu", {}):
        rows.append((f"CPU {label}", partial(_section, "cpu", label)))
    nv = first.get("nvcomp") or {}
    if "error" in nv:
        lines += ["", f"nvCOMP direct: {nv['error']}"]
    else:
        labels: list[str] = []
        for cls in names:  # data-type labels differ between FP32 and BF16 classes: "ANS <f4" vs "ANS <f2"
            for label in classes[cls].get("nvcomp", {}):
                key = _untyped(label)
                if key not in labels:
                    labels.append(key)
        rows += [(f"nvCOMP {key}", partial(_typed, key)) for key in labels]
    lines += ["", "| codec | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, get in rows:
        cells = []
        for cls in names:
            r = get(classes[cls])
            if not r:
                cells.append("-")
            elif "error" in r:
                cells.append("error")
            else:
                rate, ratio = r.get("compress_bytes_per_second"), fmt_ratio(r.get("ratio"))
                if rate and rate > NO_COPY_BYTES_PER_SECOND:
                    cells.append(f"{ratio} (no copy)")
                else:
                    cells.append(f"{ratio} @ {rate / 1e9:.3g}" if rate else ratio)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "The order-0 limit is the best ratio of a coder that codes every byte on its own (as ANS does), from "
              "the entropy of each byte plane; LZ coders such as zstd can pass it by exploiting repeats. "
              "`none` stores the staged bytes as they are (no copy, hence no throughput)."]  # fmt: skip
    if report.get("library_unavailable"):
        by_error: dict[str, list[str]] = {}
        for codec, why in report["library_unavailable"].items():
            by_error.setdefault(why.split(":")[0], []).append(f"`{codec}`")
        lines += ["", "Not available here: " + "; ".join(f"{', '.join(c)} ({e})" for e, c in by_error.items())
                  + " - see the JSON for the messages."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _section(section: str, name: str, entry: dict[str, Any]) -> dict[str, Any] | None:
    found = entry.get(section, {}).get(name)
    return dict(found) if found else None


def _untyped(label: str) -> str:
    return label.replace("<f2", "typed").replace("<f4", "typed")


def _typed(key: str, entry: dict[str, Any]) -> dict[str, Any] | None:
    for label, value in (entry.get("nvcomp") or {}).items():
        if _untyped(label) == key:
            return dict(value)
    return None


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.compression") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    progress = BarProgress(args.quiet)
    config = sized_workload(args, SIZES)
    machine = describe_machine()
    name = args.name or result_name("compression", machine, args.tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        workload = Workload(config)
        progress.say(f"compression benchmark on {machine_label(machine)}: {workload.parameters / 1e6:.3g}M-parameter "
                     f"model, training {args.train_steps} steps")  # fmt: skip
        workload.train(args.train_steps, progress)
        head = {"benchmark": "compression", "format": FORMAT_VERSION, "created_utc": utc_stamp(),
                "command": command_line(prog, argv), "tiny": args.tiny, "machine": machine,
                "versions": versions(),
                "model": {"parameters": workload.parameters, "width": config.width, "layers": config.layers,
                          "train_steps": args.train_steps, "device": workload.device.type,
                          "final_loss": workload.last_loss}}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)

        def write(measured: dict[str, Any]) -> dict[str, Any]:  # after every class: a killed run keeps its rows
            report = {**head, **measured}
            write_report(args.out, name, report, markdown(report))
            return report

        report = write(measure_classes(workload, args.sample_bytes, args.cpu_sample_bytes, progress, write))
    text = markdown(report)
    print(text)
    progress.say(f"wrote {args.out / name}.json/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
