import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from sdxl.bench import report, speed, topology, workload
from sdxl.checkpoints import BUILTIN_CONFIGS, ModelSpec, random_models
from sdxl.config import config_from_dict
from sdxl.engine.hires import Hires
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import Request
from sdxl.models import controlnet, unet


@pytest.mark.cli
def test_bench_runs_end_to_end_on_tiny_and_reports_every_key(bench):
    # Each measurement once (a time is the median of --runs): what is checked is that each is made and reported.
    args = "--model tiny --height 32 --width 32 --steps 2 --batch 1 --devices 1 --runs 1 --compare diffusers".split()
    r, stdout, markdown = bench(*args)
    required = """images_per_s s_per_image compile_s warm_compile_s recompiles tflops mfu device n_devices
        ref_images_per_s ratio load_s raw_read_s load_cold_s raw_read_cold_s load_over_raw_read_cold
        first_image_s first_image_warm_s load_peak_rss_bytes param_bytes_bf16 peak_rss_bytes
        peak_device_memory_bytes progress_overhead unguided_images_per_s unguided_speedup lora_first_s lora_scale_s
        lora_clear_s lora_recompiles long_prompt_images_per_s long_prompt_cost controlnet_images_per_s controlnet_cost
        controlnet_param_bytes_per_device controlnet_step_flops controlnet_step_flops_ratio noise_nv_s noise_cpu_s
        noise_nv_cost noise_cpu_cost noise_sde_nv_s noise_sde_nv_cost hires_images_per_s hires_cost hires_bytes
        base_bytes hires_bytes_ratio upscaler_images_per_s ip_adapter_images_per_s ip_adapter_cost
        ip_adapter_param_bytes_per_device ip_adapter_compile_s""".split()
    assert not [key for key in required if key not in r]
    assert (r["model"], r["device"], r["n_devices"], r["batch"]) == ("tiny", "cpu", 1, 1)
    assert r["attention"] == "xla" and r["convolution"] == "xla"  # 4x4 latents: too small for Winograd
    assert r["images_per_s"] > 0 and np.isclose(r["s_per_image"] * r["images_per_s"], 1)
    assert np.isclose(r["ratio"], r["images_per_s"] / r["ref_images_per_s"])
    assert r["mfu"] is None and r["tflops"] > 0  # no known peak for a CPU
    assert r["recompiles"] == 0 and r["sweep_runs"] >= 5 and r["lora_recompiles"] == 0
    assert r["lora_first_s"] > 0 and r["lora_scale_s"] > 0 and r["lora_clear_s"] < r["lora_scale_s"]
    assert 0 < r["warm_compile_s"] < r["compile_s"]
    # A ControlNet is extra work: its encoder runs beside the UNet's at every step (no timing thresholds:
    # the ratios of the FLOPs and of the parameters are the model's; a timed cost on a busy machine can
    # come out below 1, as 0.79 did beside a TPU compile).
    assert r["controlnet_images_per_s"] > 0 and r["controlnet_cost"] > 0
    assert np.isclose(r["controlnet_cost"], r["images_per_s"] / r["controlnet_images_per_s"])
    assert 1.1 < r["controlnet_step_flops_ratio"] < 2 and r["controlnet_param_bytes_per_device"] > 0
    assert "one ControlNet" in stdout and "A1111's noise (NV, CPU; Euler a)" in stdout
    assert np.isclose(r["ip_adapter_cost"], r["images_per_s"] / r["ip_adapter_images_per_s"])
    assert r["ip_adapter_param_bytes_per_device"] > 0 and "an IP-Adapter's image prompt" in stdout
    # A hires fix's time and memory against the first pass are reported, not bounded: at 32x32 the
    # pass's buffers beside the weights came out 0.49x the first pass's (the programs' fixed inputs rule).
    assert r["hires_cost"] > 0 and r["hires_bytes"] > 0 and r["upscaler_images_per_s"] > 0
    assert "a hires fix (2x by Latent" in stdout and "32x32 to 128x128" in stdout
    assert r["noise_nv_s"] > 0 and np.isclose(r["noise_cpu_cost"], r["noise_cpu_s"] * r["images_per_s"] / r["batch"])
    assert r["load_s"] > 0 and r["raw_read_s"] > 0 and r["weight_bytes"] > r["param_bytes_bf16"]  # tiny is float32
    assert "ratio (ours / diffusers)" in stdout
    header, _, row = markdown.read_text().splitlines()[-3:]
    assert header.startswith("| Date |") and row.count("|") == header.count("|")
    # Then the environment's overrides, where set: here the tests' XLA_FLAGS (four host devices).
    assert "| tiny float32, xla attention, xla convolutions, XLA_FLAGS=" in row


@pytest.mark.cli
def test_quick_bench_measures_the_accelerator_targets_alone_and_times_each_weights_mode_beside_them(bench):
    """What fits a lease of minutes on a GPU: no fresh processes, other programs, sweep or LoRAs; the weights
    modes asked for (one run for both checks: each run compiles afresh, in a cache of its own)."""
    args = "--model tiny --height 32 --width 32 --steps 2 --batch 1 --devices 1 --runs 1 --quick".split()
    r, stdout, markdown = bench(*args, "--compare-weights", "fp8,int8")
    assert r["quick"] and r["images_per_s"] > 0 and r["tflops"] > 0 and r["compile_s"] > 0
    assert "progress_overhead" in r and "peak_device_memory_bytes" in r
    skipped = "warm_compile_s load_s recompiles unguided_speedup long_prompt_cost controlnet_cost lora_first_s"
    assert not [key for key in skipped.split() if key in r]
    assert "progress overhead" in stdout and "one ControlNet" not in stdout and "LoRA" not in stdout
    header, _, row = markdown.read_text().splitlines()[-3:]
    assert row.count("|") == header.count("|") and "(quick: no warm)" in row

    spec, default = topology.model_spec("tiny"), r["weights_default_param_bytes_per_device"]
    assert default == topology.param_bytes(spec, "float32")
    for mode in ("fp8_e4m3fn", "int8"):
        assert r[f"weights_{mode}_images_per_s"] > 0 and r[f"weights_{mode}_cost"] > 0
        # The tiny UNet's quantized weights, 4 bytes in float32, take 1 (and a float32 scale per channel),
        # as the topology bench counts them.
        loaded = r[f"weights_{mode}_param_bytes_per_device"]
        assert loaded == topology.param_bytes(spec, "float32", weights_dtype=mode) < 0.9 * default
        assert f"{mode} weights" in stdout


@pytest.mark.cli
def test_a_leases_variant_run_profiles_names_its_overrides_and_skips_progress(bench, tmp_path, monkeypatch):
    """What the GPU lease (.device/run.sh) runs for each variant: no progress programs, and for the
    baseline a profile of a few warm steps; each row names the environment it ran in."""
    monkeypatch.setenv("SDXL_GROUP_NORM", "shifted")
    args = "--model tiny --height 32 --width 32 --steps 2 --batch 2 --devices 1 --runs 1 --quick --no-progress "
    r, stdout, markdown = bench(*(args + f"--profile {tmp_path / 'trace'}").split())
    assert "progress_overhead" not in r and "progress_compile_s" not in r and "not measured" in stdout
    assert "SDXL_GROUP_NORM=shifted" in r["overrides"] and "SDXL_GROUP_NORM=shifted" in markdown.read_text()
    assert r["profile"]["steps"] == 3 and r["profile"]["step_ms"] > 0
    table = (tmp_path / "trace" / "profile.md").read_text()
    assert "| Category | ms per step | Share of a step |" in table and "| 1 | `" in table
    assert "SDXL_GROUP_NORM=shifted" in table.splitlines()[0]


@pytest.mark.cli
def test_load_only_measures_warm_and_cold_loads_into_its_own_table(bench, tmp_path):
    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text(report.MARKDOWN_HEADER + "| an earlier row |\n\nText after the table.\n")
    r, stdout, _ = bench("--model", "tiny", "--load-only", "--devices", "1", timeout=300)
    for suffix in ("", "_cold"):
        assert r[f"load{suffix}_s"] > 0 and r[f"raw_read{suffix}_s"] > 0
        assert np.isclose(r[f"load_over_raw_read{suffix}"], r[f"load{suffix}_s"] / r[f"raw_read{suffix}_s"])
    assert "images_per_s" not in r and "from the disk" in stdout
    text = markdown.read_text()
    assert text.startswith(report.MARKDOWN_HEADER + "| an earlier row |\n")  # the speed table is untouched
    load_table = text[text.index(report.LOAD_MARKDOWN_HEADER) :].splitlines()
    assert "| tiny into float32 |" in load_table[2] and load_table[2].count("|") == load_table[0].count("|")

    report.append_markdown(markdown, report.LOAD_MARKDOWN_HEADER, "| second |\n")
    rows = markdown.read_text().split(report.LOAD_MARKDOWN_HEADER)[1].splitlines()
    assert rows[1] == "| second |"  # appended to the end of its table, not after the text


def _taps(size: int, stride: int) -> int:
    """Kernel taps of a 3-wide, 1-padded conv that land inside the input, summed over the outputs.

    XLA counts a convolution's multiply-adds without those that hit the zero padding.
    """
    outputs = (size + 2 - 3) // stride + 1
    return sum(0 <= o * stride - 1 + k < size for o in range(outputs) for k in range(3))


def _analytic_unet_flops(config: unet.UNetConfig, height: int, width: int, context_length: int) -> float:
    """FLOPs (2 per multiply-add) of the convolutions, dense layers and attention matmuls of one
    UNet evaluation on one latent, counted from the architecture; elementwise work is left out."""
    flops = 0
    time_dim = 4 * config.block_out_channels[0]

    def conv3x3(h, w, c_in, c_out, stride=1):
        nonlocal flops
        flops += 2 * _taps(h, stride) * _taps(w, stride) * c_in * c_out

    def dense(tokens, c_in, c_out):
        nonlocal flops
        flops += 2 * tokens * c_in * c_out

    def resnet(h, w, c_in, c_out):
        conv3x3(h, w, c_in, c_out)
        dense(1, time_dim, c_out)
        conv3x3(h, w, c_out, c_out)
        if c_in != c_out:
            dense(h * w, c_in, c_out)  # 1x1 shortcut

    def transformer(h, w, c, layers):
        nonlocal flops
        t = h * w
        dense(t, c, c)  # proj_in
        for _ in range(layers):
            dense(t, c, 3 * c)  # self-attention q, k, v
            flops += 2 * 2 * t * t * c  # scores and weighted values
            dense(t, c, c)
            dense(t, c, c)  # cross-attention q
            dense(context_length, config.cross_attention_dim, 2 * c)  # k, v
            flops += 2 * 2 * t * context_length * c
            dense(t, c, c)
            dense(t, c, 8 * c)  # GEGLU
            dense(t, 4 * c, c)
        dense(t, c, c)  # proj_out

    channels = config.block_out_channels
    levels = len(channels)
    dense(1, channels[0], time_dim)
    dense(1, time_dim, time_dim)
    dense(1, config.projection_class_embeddings_input_dim, time_dim)
    dense(1, time_dim, time_dim)
    sizes = [(height // 2**level, width // 2**level) for level in range(levels)]
    conv3x3(*sizes[0], config.in_channels, channels[0])
    skips, c = [channels[0]], channels[0]
    for level, block in enumerate(config.down_block_types):
        for _ in range(config.layers_per_block):
            resnet(*sizes[level], c, channels[level])
            c = channels[level]
            if block.startswith("CrossAttn"):
                transformer(*sizes[level], c, config.transformer_layers[level])
            skips.append(c)
        if level < levels - 1:
            conv3x3(*sizes[level], c, c, stride=2)
            skips.append(c)
    resnet(*sizes[-1], c, c)
    transformer(*sizes[-1], c, config.transformer_layers[-1])
    resnet(*sizes[-1], c, c)
    for i, block in enumerate(config.up_block_types):
        level = levels - 1 - i
        for _ in range(config.layers_per_block + 1):
            resnet(*sizes[level], c + skips.pop(), channels[level])
            c = channels[level]
            if block.startswith("CrossAttn"):
                transformer(*sizes[level], c, config.transformer_layers[level])
        if level > 0:
            conv3x3(*sizes[level - 1], c, c)
    conv3x3(*sizes[0], c, config.out_channels)
    return flops


@pytest.mark.compiles
def test_unet_flop_count_matches_an_independent_count(monkeypatch):
    config = config_from_dict(unet.UNetConfig, random_models.MEDIUM_CONFIGS["unet/config.json"])
    expected = 2 * _analytic_unet_flops(config, 32, 24, 77)
    monkeypatch.setenv("SDXL_CONV", "xla")  # the analytic count is of direct convolutions
    counted = speed.unet_flops(config, batch=2, latent_height=32, latent_width=24, context_length=77)
    monkeypatch.delenv("SDXL_CONV")
    winograd = speed.unet_flops(config, batch=2, latent_height=32, latent_width=24, context_length=77)
    bfloat16 = speed.unet_flops(config, 2, 32, 24, 77, dtype=jnp.bfloat16)  # direct convolutions, as the pipeline's
    print(
        f"UNet FLOPs at 2x32x24: cost analysis {counted / 1e9:.3f} G ({winograd / 1e9:.3f} G with this CPU's "
        f"Winograd convolutions), analytic {expected / 1e9:.3f} G, ratio {counted / expected:.4f}"
    )
    assert 1 <= counted / expected < 1.05  # XLA also counts the elementwise work
    # The cost analysis counts the work done: Winograd's multiply-adds are fewer.
    assert winograd < 0.95 * counted
    assert 1 <= bfloat16 / expected < 1.05


@pytest.mark.compiles
def test_flops_are_the_models_work_whatever_the_attention_kernel_and_device_count(monkeypatch):
    """Counted on the host with XLA's attention (`bench.counting`): a kernel XLA cannot see into, or
    the batch split over more devices, changes nothing."""
    config = config_from_dict(unet.UNetConfig, random_models.MEDIUM_CONFIGS["unet/config.json"])
    xla = speed.unet_flops(config, 2, 16, 16, 77, dtype=jnp.bfloat16)
    monkeypatch.setenv("SDXL_ATTENTION", "splash")
    assert speed.unet_flops(config, 2, 16, 16, 77, dtype=jnp.bfloat16) == xla
    monkeypatch.delenv("SDXL_ATTENTION")
    request = workload.batch_request(4, 32, 32, 3)
    one, four = (Pipeline.from_pretrained("tiny", max_steps=4, devices=jax.devices()[:n]) for n in (1, 4))
    assert speed.generation_flops(one, request) == speed.generation_flops(four, request) > 0


def test_the_benchmark_controlnet_of_sdxl_base_is_the_published_sdxl_controlnet():
    """The random ControlNet is derived from the UNet as diffusers' `ControlNetModel.from_unet` derives
    one; at SDXL's size that is the published canny/depth ControlNets' config."""
    spec = ModelSpec.from_folder(BUILTIN_CONFIGS / "sdxl-base-1.0")
    published = json.loads((BUILTIN_CONFIGS / "controlnet-sdxl-1.0" / "config.json").read_text())
    assert random_models.controlnet_config(spec) == config_from_dict(controlnet.ControlNetConfig, published)


@pytest.mark.parametrize("guidance_scale, name", [(5.0, "hires"), (1.0, "hires-unguided")])
def test_the_topology_benchs_hires_programs_are_the_pipelines_second_pass(guidance_scale, name):
    """What `bench --topology --programs hires` compiles is the program the demo's pipeline (its VAE
    tiling on) runs for a latent upscaler's hires fix: at the upscaled size, from the upscaled latents."""
    pipe = Pipeline.from_pretrained("tiny", dtype="bfloat16", vae_tiling=True, devices=jax.devices()[:1])
    request = Request.from_prompt("a fox", num_images=1, height=128, width=96, steps=4,
                                  guidance_scale=guidance_scale)
    second = pipe.prepare(dataclasses.replace(request, hires=Hires(scale=2.0))).hires.program
    assert (second.height, second.width, second.start_from, second.vae_tiling) == (256, 192, "clean_latents", True)
    program = topology.hires_program(name, topology.model_spec("tiny"), 128, 96, 4, "bfloat16", 2.0)
    # The bench's own batch, the demo's padded schedule, and the family's previews, which the pipeline names.
    assert program == dataclasses.replace(second, batch=4, max_steps=topology.MAX_STEPS, preview_factors=None)


@pytest.mark.compiles
def test_compile_counter_sees_a_new_size_or_chunk_count_but_not_new_prompts_weights_seeds_guidance_or_steps():
    pipe = Pipeline.from_pretrained("tiny", max_steps=4, devices=jax.devices()[:1])
    long_prompt = workload.prompt_of_chunks(pipe.prompts, workload.LONG_PROMPT_CHUNKS)
    assert pipe.prompts.read(long_prompt)[0].shape[-1] == 3 * 77
    assert workload.count_compilations(pipe, [workload.batch_request(1, 16, 16, 1)]) >= 1
    assert workload.count_compilations(pipe, [workload.batch_request(1, 16, 16, 1, prompt=long_prompt)]) >= 1
    assert workload.count_compilations(pipe, workload.sweep_requests(1, 16, 16, 1, long_prompt)) == 0
    assert workload.count_compilations(pipe, [workload.batch_request(1, 32, 16, 1)]) >= 1


def test_write_checkpoint_streams_a_loadable_float16_checkpoint(tmp_path):
    random_models.write_checkpoint(tmp_path, random_models.configs_of("tiny"), dtype="float16", seed=3)
    path = tmp_path / "unet" / "diffusion_pytorch_model.safetensors"
    with safe_open(str(path), "np") as f:  # the reference parser accepts the layout
        kernel = f.get_tensor("conv_in.weight")
        assert kernel.dtype == np.float16 and kernel.shape == (32, 4, 3, 3)  # PyTorch's OIHW
        assert abs(kernel.std() * np.sqrt(4 * 3 * 3) - 1) < 0.25  # fan-in scaled, as random_models.random_tensor
    pipe = Pipeline.from_pretrained(str(tmp_path), dtype="bfloat16", devices=jax.devices()[:1])
    assert pipe.params["unet"]["conv_in"]["kernel"].shape == (3, 3, 4, 32)


def test_peak_table_matches_device_kinds():
    assert speed.peak_tflops("NVIDIA H100 80GB HBM3") == 989
    assert speed.peak_tflops("NVIDIA H100 PCIe") == 756
    assert speed.peak_tflops("TPU v5 lite") == 197
    assert speed.peak_tflops("TPU v5") == 459
    assert speed.peak_tflops("cpu") is None
