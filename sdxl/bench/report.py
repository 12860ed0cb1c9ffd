"""The benchmark's results as an aligned table for the terminal and as BENCHMARKS.md rows."""

from pathlib import Path


def _number(value, unit="") -> str:
    return "n/a" if value is None else f"{value:.3g}{unit}"


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f} MiB"


def _load_rows(r: dict) -> list[tuple[str, str]]:
    def against(raw: str, load: str = "load_s") -> str:
        return f"{r[load]:.2f} s / {r[raw]:.2f} s = {r[load] / r[raw]:.2f}x"

    rss = f"{_mib(r['load_peak_rss_bytes'])} / {_mib(r['param_bytes_bf16'])} = {r['load_rss_over_bf16']:.2f}x"
    return [
        (f"load / raw read of {_mib(r['weight_bytes'])}, page cache", against("raw_read_s")),
        ("load / raw read, from the disk", against("raw_read_cold_s", "load_cold_s")),
        ("load / raw read into fresh memory", against("raw_read_fresh_s")),
        ("peak RSS loading / bf16 params", f"{rss} (+{r['load_rss_increase_over_bf16']:.2f}x)"),
    ]


def _aligned(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def format_load_table(r: dict) -> str:
    return _aligned([("model", f"{r['model']} into {r['dtype']}"), ("device", r["machine"]), *_load_rows(r)])


def _kernels(r: dict) -> str:
    """The kernels the program called, and the environment's overrides that chose them (`speed.overrides`)."""
    kernels = f"{r['attention']} attention, {r['convolution']} convolutions"
    return f"{kernels}, {r['overrides']}" if r.get("overrides") else kernels


def _progress(r: dict) -> str:
    if "progress_overhead" not in r:
        return "not measured (--no-progress)"
    return f"{r['progress_overhead']:+.1%} ({_number(r['progress_s_per_image'])} s/image)"


def format_table(r: dict) -> str:
    """The results as an aligned two-column table."""
    mfu = "n/a (no known peak)" if r["mfu"] is None else f"{r['mfu']:.1%} of {r['peak_tflops']:g} TFLOP/s per device"
    rows = [
        (
            "model",
            f"{r['model']} {r['width']}x{r['height']}, {r['steps']} steps, batch {r['batch']}, {r['dtype']}, "
            f"{_kernels(r)}",
        ),
        ("device", f"{r['n_devices']}x {r['device']} ({r['machine']})"),
        ("images/s", _number(r["images_per_s"])),
        ("s/image", f"{_number(r['s_per_image'])} (median of {r['runs']}; {_number(r['cpu_s_per_image'])} CPU s)"),
    ]
    if "ratio" in r:
        rows += [
            ("diffusers images/s", f"{_number(r['ref_images_per_s'])} ({r['reference']})"),
            ("ratio (ours / diffusers)", _number(r["ratio"])),
        ]
    rows += [
        ("achieved TFLOP/s", f"{_number(r['tflops'])} ({_number(r['flops_per_image'] / 1e12)} TFLOP/image)"),
        ("MFU", mfu),
        ("compile cold / warm cache", f"{_number(r['compile_s'], ' s')} / {_number(r.get('warm_compile_s'), ' s')}"),
        (
            "start to first image cold / warm",
            f"{_number(r['first_image_s'], ' s')} / {_number(r.get('first_image_warm_s'), ' s')}",
        ),
        ("peak device memory", _mib(r["peak_device_memory_bytes"])),
        ("progress overhead", _progress(r)),
    ]
    if "profile" in r:
        p = r["profile"]
        rows.append(("profile", f"{p['step_ms']:.2f} ms of device time per denoising step; top ops in "
                                f"{p['table']}"))
    rows += _weights_rows(r)
    if not r["quick"]:
        rows += _full_rows(r)
    rows.append(("load average before / after", " / ".join(f"{x:.1f}" for x in r["load_average"])))
    return _aligned(rows)


def _weights_rows(r: dict) -> list[tuple[str, str]]:
    """With --compare-weights: each mode's speed against the baseline's, and its parameters' bytes per device."""
    if "weights_default_param_bytes_per_device" not in r:
        return []
    rows = [("parameters per device", _mib(r["weights_default_param_bytes_per_device"]))]
    for mode in (key.removeprefix("weights_").removesuffix("_cost") for key in r if key.endswith("_cost")
                 and key.startswith("weights_")):
        rows.append((f"{mode} weights", f"{_number(r[f'weights_{mode}_images_per_s'])} images/s, "
                     f"{r[f'weights_{mode}_cost']:.2f}x the time; "
                     f"{_mib(r[f'weights_{mode}_param_bytes_per_device'])} of parameters per device"))
    return rows


def _full_rows(r: dict) -> list[tuple[str, str]]:
    """What a run without `--quick` measures besides."""
    return [
        *_load_rows(r),
        ("peak host RSS (fresh process)", _mib(r["peak_rss_bytes"])),
        (
            "without guidance (scale 0)",
            f"{_number(r['unguided_images_per_s'])} images/s, {r['unguided_speedup']:.2f}x those with guidance",
        ),
        (
            f"a prompt of {r['long_prompt_chunks']} chunks",
            f"{_number(r['long_prompt_images_per_s'])} images/s, {r['long_prompt_cost']:.2f}x the time of one chunk",
        ),
        (
            "one ControlNet",
            f"{_number(r['controlnet_images_per_s'])} images/s, {r['controlnet_cost']:.2f}x the time without; "
            f"{r['controlnet_step_flops_ratio']:.2f}x a guided step's FLOPs; "
            f"{_mib(r['controlnet_param_bytes_per_device'])} of parameters per device",
        ),
        (
            "an IP-Adapter's image prompt (Plus, its tiny random image encoder)",
            f"{_number(r['ip_adapter_images_per_s'])} images/s, {r['ip_adapter_cost']:.2f}x the time without; "
            f"{_mib(r['ip_adapter_param_bytes_per_device'])} of parameters per device",
        ),
        (
            "a hires fix (2x by Latent, half as many steps again)",
            f"{_number(r['hires_images_per_s'])} images/s, {r['hires_cost']:.2f}x the time of the first pass alone; "
            f"its pass holds {_mib(r['hires_bytes'])} beside the weights, {r['hires_bytes_ratio']:.2f}x the first's",
        ),
        (
            f"model upscaler (realesr-general-x4v3's shape), {r['upscaler_from']} to {r['upscaler_to']}",
            f"{_number(r['upscaler_images_per_s'])} images/s",
        ),
        ("recompilations over the sweep", f"{r['recompiles']} in {r['sweep_runs']} calls"),
        (
            "A1111's noise (NV, CPU; Euler a), and its Brownian trees (NV; DPM++ 2M SDE)",
            f"{_number(r['noise_nv_s'], ' s')}, {_number(r['noise_cpu_s'], ' s')}; "
            f"{_number(r['noise_sde_nv_s'], ' s')} on the host per request: {r['noise_nv_cost']:.2f}x, "
            f"{r['noise_cpu_cost']:.2f}x; {r['noise_sde_nv_cost']:.2f}x one call's time",
        ),
        (
            f"LoRA, rank 32 on {r['lora_layers']} layers",
            f"{_number(r['lora_first_s'], ' s')} to read and apply, {_number(r['lora_scale_s'], ' s')} to rescale, "
            f"{_number(r['lora_clear_s'], ' s')} to clear, {r['lora_recompiles']} recompilations",
        ),
    ]


MARKDOWN_HEADER = (
    "| Date | Machine | Devices | Model | Size, steps, batch | img/s | diffusers img/s | Ratio "
    "| TFLOP/s (MFU) | Compile cold / warm | Load / raw read | Load RSS / bf16 | Progress overhead | Recompiles |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def markdown_row(r: dict) -> str:
    """One BENCHMARKS.md table row for a result."""
    mfu = "" if r["mfu"] is None else f" ({r['mfu']:.0%})"
    cells = [
        r["date"],
        f"{r['machine']}; load {r['load_average'][0]:.1f} to {r['load_average'][1]:.1f}",
        f"{r['n_devices']}x {r['device']}",
        f"{r['model']} {r['dtype']}, {_kernels(r)}",
        f"{r['width']}x{r['height']}, {r['steps']}, {r['batch']}",
        f"{r['images_per_s']:.3g}",
        f"{r['ref_images_per_s']:.3g}" if "ratio" in r else "",
        f"{r['ratio']:.2f}x" if "ratio" in r else "",
        f"{r['tflops']:.3g}{mfu}",
        f"{r['compile_s']:.1f} s (quick: no warm)" if r["quick"]
        else f"{r['compile_s']:.1f} / {r['warm_compile_s']:.1f} s",
        "" if r["quick"] else _load_cell(r),
        "" if r["quick"] else f"{r['load_rss_over_bf16']:.2f}x",
        f"{r['progress_overhead']:+.1%}" if "progress_overhead" in r else "",
        "" if r["quick"] else str(r["recompiles"]),
    ]
    return "| " + " | ".join(cells) + " |\n"


def _load_cell(r: dict) -> str:
    return (
        f"{r['load_s']:.2f} / {r['raw_read_s']:.2f} s ({r['load_over_raw_read']:.1f}x); "
        f"disk {r['load_cold_s']:.2f} / {r['raw_read_cold_s']:.2f} s ({r['load_over_raw_read_cold']:.1f}x); "
        f"into fresh memory {r['raw_read_fresh_s']:.2f} s ({r['load_over_raw_read_fresh']:.1f}x)"
    )


LOAD_MARKDOWN_HEADER = (
    "| Date | Machine | Model | Weights | Load / raw read: page cache; disk; into fresh memory "
    "| Load RSS / bf16 (increase) |\n"
    "|---|---|---|---|---|---|\n"
)


def load_markdown_row(r: dict) -> str:
    cells = [
        r["date"],
        r["machine"],
        f"{r['model']} into {r['dtype']}",
        _mib(r["weight_bytes"]),
        _load_cell(r),
        f"{r['load_rss_over_bf16']:.2f}x ({r['load_rss_increase_over_bf16']:+.2f}x)",
    ]
    return "| " + " | ".join(cells) + " |\n"


def append_markdown(path: Path, header: str, row: str) -> None:
    """Appends a row to the table with `header` (starting one at the end of `path` if there is none)."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    end = text.find(header)
    if end < 0:
        text += ("\n" if text and not text.endswith("\n\n") else "") + header + row
    else:
        end += len(header)
        while end < len(text) and text.startswith("|", end):  # past the table's rows
            end = text.index("\n", end) + 1
        text = text[:end] + row + text[end:]
    path.write_text(text)
