"""Where a generation's device time goes: a `jax.profiler` trace of a few warm steps, summed per HLO op.

`python -m sdxl bench --profile DIR` renders the benchmark's batch once more with `PROFILE_STEPS`
steps (the same compiled program: the step count is one of its inputs) under `jax.profiler.trace`,
which writes DIR/plugins/profile/RUN/HOST.xplane.pb for TensorBoard's or XProf's viewers. That file
is read back here with `jax.profiler.ProfileData` (part of jaxlib) into DIR/profile.md: the top ops
by device time, what kind of work each is, and its share of a denoising step.

An op's time is its device time. On a GPU it is the kernels it launched, the events of the GPU's
stream lines, each of which names its HLO op; on a CPU, whose trace has no device, it is the XLA
thunks' events on the host's threads, less the ops they contain (a loop's body). What an op is comes
from the compiled program's HLO text: its opcode, the opcodes inside its fusion, its custom call's
target and the kernel's name (the kind of work), and its op_name, the Flax module path it was traced
in (which part of the program: a denoising step's `UNet2DConditionModel/...`, the VAE's
`AutoencoderKL.decode/...`).
"""

import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import jax

PROFILE_STEPS = 3  # enough to average over; the loop's body is the same program every step
TOP_OPS = 25

STEP = "denoising step"
# The part of the program an op belongs to, by the first of these its op_name holds.
PARTS = (
    ("AutoencoderKL", "VAE decode"),
    ("CLIPText", "text encoders"),
    ("UNet2DConditionModel", STEP),
    ("/while/body/", STEP),  # the sampler's update between UNet evaluations
)
CATEGORIES = (
    "attention", "convolution", "gemm", "groupnorm/reduction", "copy/transpose", "elementwise fusion", "other",
)
# Opcodes that only move or relabel data: a fusion of nothing else is a copy or a transpose.
DATA_MOVEMENT = {
    "bitcast", "broadcast", "concatenate", "constant", "copy", "dynamic-slice", "dynamic-update-slice",
    "get-tuple-element", "iota", "pad", "parameter", "reshape", "reverse", "slice", "transpose", "tuple",
}
# Lines that XProf derives from the stream lines (on a device plane they would count each kernel twice).
DERIVED_LINES = {"XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code", "XLA TraceMe",
                 "Launch Stats"}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?(?P<name>[\w.\-]+) = .*? (?P<opcode>[a-z][a-z0-9\-]*)\(")
_ATTRIBUTES = (r'op_name="([^"]*)"', r'custom_call_target="([^"]*)"', r"(?:calls|to_apply)=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class HloOp:
    opcode: str
    op_name: str  # the jax op_name: where in the model it was traced
    target: str  # a custom call's target
    calls: str  # the computation a fusion or call runs


def hlo_ops(hlo_text: str) -> tuple[str, dict[str, HloOp], dict[str, list[HloOp]]]:
    """(module name, instructions by name, instructions by computation) of a compiled program's HLO text."""
    module = re.search(r"^HloModule ([\w.\-]+)", hlo_text, re.M)
    ops, computations, computation = {}, defaultdict(list), ""
    for line in hlo_text.splitlines():
        if header := _COMPUTATION.match(line):
            computation = header["name"]
        elif instruction := _INSTRUCTION.match(line):
            op_name, target, calls = (_attribute(pattern, line) for pattern in _ATTRIBUTES)
            op = HloOp(instruction["opcode"], op_name, target, calls)
            ops[instruction["name"]] = op
            computations[computation].append(op)
    return (module[1] if module else ""), ops, computations


def _attribute(pattern: str, line: str) -> str:
    found = re.search(pattern, line)
    return found[1] if found else ""


def _inside(op: HloOp, computations: dict[str, list[HloOp]]) -> list[HloOp]:
    """The op and those of the computations it calls (fusions nested in fusions too)."""
    found, pending = [op], [op.calls]
    while pending:
        for inner in computations.get(pending.pop(), ()):
            found.append(inner)
            if inner.calls:
                pending.append(inner.calls)
    return found


def category(opcodes: set[str], machine: str, op_names: str) -> str:
    """The kind of work of an op that runs `opcodes`, with `machine` its custom call targets and kernel
    names (lower case) and `op_names` the jax op_names of what it computes."""
    if any(word in machine for word in ("fmha", "sdpa", "flash")) or "_attention/" in op_names:
        return "attention"  # cuDNN's kernel, or XLA's attention in `attention.dot_product_attention`'s scope
    if "convolution" in opcodes or "conv" in machine or "fprop" in machine:
        return "convolution"
    if "dot" in opcodes or any(word in machine for word in ("gemm", "cublas", "matmul", "nvjet")):
        return "gemm"
    if any(opcode.startswith("reduce") for opcode in opcodes) or "norm" in op_names:
        return "groupnorm/reduction"  # the statistics, and the normalising pass (norm1/..., conv_norm_out/...)
    computed = opcodes - {"fusion"}
    if computed and computed <= DATA_MOVEMENT or any(word in machine for word in ("memcpy", "copy", "transpose")):
        return "copy/transpose"
    if "fusion" in opcodes:
        return "elementwise fusion"
    return "other"


def part(op_names: list[str]) -> str:
    for op_name in op_names:
        for pattern, name in PARTS:
            if pattern in op_name:
                return name
    return "other"


def _device_events(xplane: Path, module: str) -> list[tuple[str | None, str, int, int, int, int]]:
    """(HLO op, kernel name, plane, start ns, ns, ns less those of the ops it contains) of each op of
    `module` run in the trace; a device's kernel that names no HLO op (a copy) has None for it.

    The device planes' events where any names an HLO op, else the host's thunks' (a CPU's). Should no
    event name `module`, those of every module (a trace that names the program otherwise)."""
    planes = list(jax.profiler.ProfileData.from_file(str(xplane)).planes)
    for named in (module, None):
        for device, prefix in ((True, "/device:"), (False, "/host:")):
            events = _plane_events([p for p in planes if p.name.startswith(prefix)], named, device)
            if any(op is not None for op, *_ in events):
                return events
    return []


def _plane_events(planes, module: str | None, device: bool) -> list[tuple[str | None, str, int, int, int, int]]:
    found = []
    for index, plane in enumerate(planes):
        lines = list(plane.lines)
        if device and any(line.name == "XLA Ops" for line in lines):  # a TPU's own op line
            lines = [line for line in lines if line.name == "XLA Ops"]
        for line in lines:
            if line.name in DERIVED_LINES:
                continue
            spans = []
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                # A device's kernels without an HLO op (copies, a command buffer's) count; a host's events
                # without one are the runtime's, not the program's.
                if (op is None and not device) or (module and stats.get("hlo_module", module) != module):
                    continue
                spans.append([op, event.name, index, int(event.start_ns), int(event.duration_ns)])
            found += _self_times(spans)
    return found


def _self_times(spans: list[list]) -> list[tuple]:
    """Each event's duration less those of the events it contains (on one line: a thunk's nested ops)."""
    spans.sort(key=lambda s: (s[3], -s[4]))
    open_spans = []
    for span in spans:
        while open_spans and open_spans[-1][3] + open_spans[-1][4] <= span[3]:
            open_spans.pop()
        if open_spans:
            open_spans[-1].append(span[4])
        open_spans.append(span)
    return [(op, kernel, plane, start, duration, duration - sum(children))
            for op, kernel, plane, start, duration, *children in spans]


def _busy_ns(events) -> tuple[int, int]:
    """(ns some op ran, ns from the first op's start to the last's end), over all planes together."""
    intervals = sorted((start, start + duration) for _, _, _, start, duration, _ in events)
    busy, end = 0, intervals[0][0]
    for start, stop in intervals:
        busy += max(0, stop - max(start, end))
        end = max(end, stop)
    return busy, end - intervals[0][0]


def summarise(xplane: Path, hlo_text: str, steps: int, top: int = TOP_OPS) -> dict:
    """The trace's device time by op, category and part of the program (`markdown` shows it)."""
    module, ops, computations = hlo_ops(hlo_text)
    events = _device_events(xplane, module)
    if not events:
        raise ValueError(f"no op of {module} in {xplane}")
    busy_ns, span_ns = _busy_ns(events)
    totals, calls, kernels = defaultdict(int), defaultdict(int), defaultdict(lambda: defaultdict(int))
    for op, kernel, _, _, _, own in events:
        op = op or kernel
        totals[op] += own
        calls[op] += 1
        kernels[op][kernel] += own
    rows = []
    for op, ns in totals.items():
        kernel = max(kernels[op], key=kernels[op].get)
        inside = _inside(ops[op], computations) if op in ops else []
        machine = " ".join([*kernels[op], *(o.target for o in inside)]).lower()
        op_names = [o.op_name for o in inside if o.op_name]
        rows.append(dict(op=op, category=category({o.opcode for o in inside}, machine, " ".join(op_names)),
                         part=part(op_names), kernel=kernel, calls=calls[op], ms=ns / 1e6))
    rows.sort(key=lambda row: -row["ms"])
    parts, step_categories = defaultdict(float), defaultdict(float)
    for row in rows:
        parts[row["part"]] += row["ms"]
        if row["part"] == STEP:
            step_categories[row["category"]] += row["ms"] / steps
    return dict(
        steps=steps,
        device_ms=sum(parts.values()),
        busy=busy_ns / span_ns if span_ns else None,
        span_ms=span_ns / 1e6,
        parts=dict(parts),
        step_ms=parts[STEP] / steps,
        step_categories={c: step_categories[c] for c in CATEGORIES if c in step_categories},
        top=rows[:top],
    )


def markdown(summary: dict, title: str) -> str:
    """The summary as Markdown: the parts, the categories of a step, and the top ops."""
    step_ms, steps = summary["step_ms"], summary["steps"]
    parts = ", ".join(f"{name} {ms:.1f} ms" for name, ms in sorted(summary["parts"].items(), key=lambda p: -p[1]))
    busy = "" if summary["busy"] is None else (
        f" Some op ran during {summary['busy']:.1%} of the {summary['span_ms']:.1f} ms from the first op's start to "
        "the last's end."
    )
    lines = [
        f"## {title}",
        "",
        f"Device time of {steps} denoising steps and the rest of one generation: {summary['device_ms']:.1f} ms "
        f"({parts}); a step {step_ms:.2f} ms.{busy}",
        "",
        "| Category | ms per step | Share of a step |",
        "|---|---|---|",
        *(f"| {c} | {ms:.2f} | {ms / step_ms:.1%} |" for c, ms in summary["step_categories"].items()),
        "",
        "| # | HLO op | Category | Part | Longest kernel | Calls | ms in the trace | Share of a step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank, row in enumerate(summary["top"], 1):
        share = f"{row['ms'] / steps / step_ms:.1%}" if row["part"] == STEP and step_ms else ""
        kernel = row["kernel"] if len(row["kernel"]) <= 48 else row["kernel"][:45] + "..."
        lines.append(f"| {rank} | `{row['op']}` | {row['category']} | {row['part']} | `{kernel}` | {row['calls']} "
                     f"| {row['ms']:.2f} | {share} |")
    return "\n".join(lines) + "\n"


HLO_TEXT = "program.hlo.txt"  # beside the trace: what `write_summary` reads the ops' kinds and parts from
TABLE = "profile.md"


def write_summary(directory: Path, title: str, steps: int = PROFILE_STEPS) -> dict:
    """Summarises the newest trace in `directory` with the program's HLO text saved beside it, into
    directory/profile.md; returns the summary."""
    xplane = max(directory.glob("plugins/profile/*/*.xplane.pb"), key=lambda path: path.stat().st_mtime)
    summary = summarise(xplane, (directory / HLO_TEXT).read_text(), steps)
    (directory / TABLE).write_text(markdown(summary, title))
    return summary | {"trace": str(xplane), "table": str(directory / TABLE)}


def trace(render: Callable[[], object], directory: Path) -> Path:
    """Runs `render` under `jax.profiler.trace` into `directory`; returns the .xplane.pb it wrote."""
    before = set(directory.glob("plugins/profile/*/*.xplane.pb"))
    with jax.profiler.trace(str(directory)):
        render()
    (written,) = set(directory.glob("plugins/profile/*/*.xplane.pb")) - before
    return written


if __name__ == "__main__":
    # A lease's trace summarised again here, without a GPU: `python -m sdxl.bench.profile DIR TITLE`.
    import sys

    print(markdown(write_summary(Path(sys.argv[1]), sys.argv[2]), sys.argv[2]))
