"""`python -m sdxl bench --soak-clients N --soak-hosts P`: one demo over P processes against one process.

One command runs the same soak (`soak.py`: N clients of `--soak-requests` requests each at `--steps`,
`--soak-killed` more killed mid-request) twice, on D forced CPU devices (`--devices`, default 2 per
process): first against the demo as one process of D devices, then as P processes of D/P devices
each, joined by jax.distributed with gloo collectives (`app.py --coordinator ...`), as several hosts
serve one demo (`sdxl.serving.hosts`). The same model, clients, seeds and steps in both, so their ratios
are the comparison; the absolute times move with the machine's load between the two.

Reported for each: images/s and latency percentiles (p50, p90, p99, max), and their ratios (P
processes over one). For the P processes, what process 0's messages to the followers cost during
the load, from the counters `sdxl.serving.hosts` keeps (written where `SDXL_HOSTS_STATS` names): their
bytes (written once to the coordination service's key-value store, which each follower reads) and
the seconds process 0 spent pickling and writing them, per completed request and per message of
each kind (a batch's request, each step's go-on-or-give-up), and their share of the load's wall
time. And per step, on average over the followers' steps: how long after process 0 sent its decision
a follower read it (the follower's lag), and how long the follower waited for it, having finished
the step first.
"""

import os
from collections.abc import Callable

from .report import _aligned
from .soak import _latencies, run_soak

BATCH_KINDS = ("render", "step")  # the messages a batch sends: its request, then one per progress report


def run_hosts_soak(model: str, clients: int, requests: int, killed: int, steps: int, *, processes: int,
                   devices: int, log: Callable[[str], None] = print) -> dict:
    """The soak against one process of `devices` CPU devices, then against `processes` processes of
    `devices / processes` each; the fields are described in BENCHMARKS.md ("One demo over two hosts")."""
    if processes < 2 or devices % processes:
        raise ValueError(f"--soak-hosts needs 2 processes or more, and --devices a multiple of them; got "
                         f"{processes} processes, {devices} devices")
    load_before = os.getloadavg()[0]
    runs = {}
    for label, count in (("one", 1), ("hosts", processes)):
        log(f"the demo as {layout(count, devices)}")
        runs[label] = run_soak(model, clients, requests, killed, steps, log, devices=devices, processes=count)
    one, hosts = runs["one"], runs["hosts"]
    return dict(
        date=one["date"], machine=one["machine"], demo=one["demo"], steps=steps, clients=clients,
        requests_per_client=requests, killed_clients=killed, devices=devices, processes=processes,
        one=one, hosts=hosts,
        **{f"{key}_ratio": _ratio(hosts[key], one[key])
           for key in ("images_per_s", "latency_p50_s", "latency_p90_s", "latency_p99_s", "latency_max_s")},
        **broadcasts(hosts["hosts_counters"], hosts["completed"], hosts["wall_s"]),
        load_average=[load_before, os.getloadavg()[0]],
    )


def broadcasts(counters: list[dict], completed: int, wall: float) -> dict:
    """What process 0's messages to the followers cost over a load, from each process's counters over
    it (`counters[0]` process 0's, the followers' after it): `broadcast_*` keys."""
    sent = counters[0].get("sent", {})
    tally = {kind: {field: sent.get(kind, {}).get(field, 0) for field in ("messages", "bytes", "seconds")}
             for kind in ("render", "step", "compile")}
    sent_bytes = sum(tally[kind]["bytes"] for kind in BATCH_KINDS)
    sent_s = sum(tally[kind]["seconds"] for kind in BATCH_KINDS)
    lag_steps = sum(follower.get("steps", 0) for follower in counters[1:])
    lag, wait = (sum(follower.get(key, 0.0) for follower in counters[1:])
                 for key in ("step_lag_seconds", "step_wait_seconds"))
    per_message = {f"broadcast_{kind}_{field}": _ratio(tally[kind][field], tally[kind]["messages"])
                   for kind in BATCH_KINDS for field in ("bytes", "seconds")}
    return dict(
        broadcast_batches=tally["render"]["messages"], broadcast_steps=tally["step"]["messages"],
        broadcast_compiles=tally["compile"]["messages"], broadcast_bytes=sent_bytes, broadcast_s=sent_s,
        broadcast_bytes_per_request=_ratio(sent_bytes, completed),
        broadcast_s_per_request=_ratio(sent_s, completed),
        broadcast_share_of_wall=sent_s / wall, **per_message,
        follower_steps=lag_steps, follower_lag_per_step_s=_ratio(lag, lag_steps),
        follower_wait_per_step_s=_ratio(wait, lag_steps),
    )


def layout(processes: int, devices: int) -> str:
    each = devices // processes
    return f"{processes} process{'es' if processes > 1 else ''} x {each} device{'s' if each > 1 else ''}"


def _ratio(a, b) -> float | None:
    return None if a is None or not b else a / b


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"x{value:.2f}"


def _run(r: dict) -> str:
    """One run's throughput and latencies."""
    return (f"{r['completed']} of {r['requests']}: {r['images']} images in {r['wall_s']:.1f} s "
            f"({r['images_per_s']:.2f} images/s); latency p50 / p90 / p99 / max {_latencies(r)}")


def _faults(r: dict) -> str:
    return f"{r['errors']}, {r['lost']}, {r['wrong_images']}, {r['server_tracebacks']}"


def _bytes(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1024:.1f} KiB" if value >= 1024 else f"{value:.0f} B"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.2f} ms"


def _per_request(r: dict) -> str:
    return (f"{_bytes(r['broadcast_bytes_per_request'])}, {_ms(r['broadcast_s_per_request'])} of process 0's time "
            f"({r['broadcast_share_of_wall']:.2%} of the wall time)")


def _per_message(r: dict, kind: str) -> str:
    return f"{_bytes(r[f'broadcast_{kind}_bytes'])}, {_ms(r[f'broadcast_{kind}_seconds'])}"


def format_hosts_table(r: dict) -> str:
    one, many = layout(1, r["devices"]), layout(r["processes"], r["devices"])
    return _aligned([
        ("demo", f"{r['demo']}, {r['steps']} steps ({r['machine']})"),
        ("load", f"{r['clients']} clients x {r['requests_per_client']} requests, + {r['killed_clients']} killed "
                 f"mid-request, against each"),
        (one, _run(r["one"])),
        (many, _run(r["hosts"])),
        (f"ratio ({r['processes']} processes / 1)",
         f"images/s {_times(r['images_per_s_ratio'])}, latency p50 {_times(r['latency_p50_s_ratio'])}, "
         f"p90 {_times(r['latency_p90_s_ratio'])}"),
        ("errors, lost, wrong, tracebacks", f"{_faults(r['one'])} / {_faults(r['hosts'])}"),
        ("broadcasts per request", _per_request(r)),
        ("per batch's request message", f"{_per_message(r, 'render')} ({r['broadcast_batches']} batches)"),
        ("per step message", f"{_per_message(r, 'step')} ({r['broadcast_steps']} steps)"),
        ("follower lag per step", f"{_ms(r['follower_lag_per_step_s'])}; waited for process 0's decision "
                                  f"{_ms(r['follower_wait_per_step_s'])} (means of {r['follower_steps']} steps)"),
        ("load average before / after", " / ".join(f"{x:.1f}" for x in r["load_average"])),
    ])


HOSTS_MARKDOWN_HEADER = (
    "| Date | Machine | Demo, steps | Clients x requests, killed | 1 process: images/s, latency p50 / p90 "
    "| N processes x devices: images/s, latency p50 / p90 | Ratio: images/s, p50, p90 "
    "| Broadcasts per request: bytes, process 0's time (share of wall) | Per request message, per step message "
    "| Follower lag per step (waited) | Errors, lost, wrong, tracebacks | Load average |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def hosts_markdown_row(r: dict) -> str:
    def run(s: dict) -> str:
        p50, p90 = (f"{s[key]:.2f}" if s[key] is not None else "n/a" for key in ("latency_p50_s", "latency_p90_s"))
        return f"{s['images_per_s']:.2f}, {p50} / {p90} s"

    cells = [
        r["date"], r["machine"], f"{r['demo']}, {r['steps']}",
        f"{r['clients']} x {r['requests_per_client']}, {r['killed_clients']}",
        run(r["one"]), f"{layout(r['processes'], r['devices'])}: {run(r['hosts'])}",
        ", ".join(_times(r[f"{key}_ratio"]) for key in ("images_per_s", "latency_p50_s", "latency_p90_s")),
        _per_request(r),
        f"{_per_message(r, 'render')}; {_per_message(r, 'step')}",
        f"{_ms(r['follower_lag_per_step_s'])} (waited {_ms(r['follower_wait_per_step_s'])})",
        f"{_faults(r['one'])} / {_faults(r['hosts'])}",
        " to ".join(f"{x:.1f}" for x in r["load_average"]),
    ]
    return "| " + " | ".join(cells) + " |\n"
