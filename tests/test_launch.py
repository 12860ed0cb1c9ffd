import argparse
import re
from pathlib import Path

import pytest

from sdxl.serving.models import Model
from sdxl.checkpoints import shapes
from sdxl.serving import launch
from sdxl.serving.options import add_shared_options, demo_parser, source_and_scale
from tests.fake_hub import hub_at


def test_the_demos_help_names_each_options_environment_variable(monkeypatch):
    for name in ("SDXL_MODEL", "SDXL_DTYPE", "SDXL_PORT"):
        monkeypatch.delenv(name, raising=False)
    parser = demo_parser("SDXL on JAX")
    for action in parser._actions:
        if action.dest not in ("help", "lora", "upscaler", "embedding"):  # the repeatable ones have no variable
            assert re.search(r"\[env: SDXL_[A-Z_]+", action.help or ""), action.option_strings
    text = " ".join(parser.format_help().split())
    assert "--dtype {float32,bfloat16}" in text and "None" not in text
    assert "'shapes' (built in" in text and "[env: SDXL_MAX_IMAGES_PER_CORE]" in text
    # The CLI reads no variable, and its help names none.
    cli = argparse.ArgumentParser()
    add_shared_options(cli)
    assert "env:" not in cli.format_help()


def test_a_bad_environment_variable_gets_argparses_message(monkeypatch, capsys):
    monkeypatch.setenv("SDXL_DTYPE", "fp16")
    with pytest.raises(SystemExit) as exit:
        demo_parser("SDXL on JAX").parse_args([])
    assert exit.value.code == 2
    assert "argument --dtype: must be one of float32, bfloat16, got 'fp16'" in capsys.readouterr().err


def test_the_weights_dtype_option_loads_the_model_so_and_takes_comfyuis_names(tmp_path):
    parser = argparse.ArgumentParser()
    add_shared_options(parser)
    options = parser.parse_args(["--model", "shapes", "--weights-dtype", "fp8", "--cache-dir", str(tmp_path)])
    pipe = launch.load(options).pipe
    assert pipe.weights_dtype == "fp8_e4m3fn"
    assert launch.dtypes_label(pipe) == "float32, fp8_e4m3fn weights"  # the startup line's
    assert parser.parse_args([]).weights_dtype == "default"
    fast = launch.load(parser.parse_args(["--model", "shapes", "--weights-dtype", "fp8_e4m3fn_fast", "--cache-dir",
                                          str(tmp_path)])).pipe
    assert launch.dtypes_label(fast) == "float32, fp8_e4m3fn weights multiplied in fp8_e4m3fn", "ComfyUI's name"


def test_the_shapes_models_notice_says_it_knows_only_its_english_words(tmp_path, monkeypatch):
    """Offline, the demo serves the built-in model in place of the one asked for, and says that other
    words (another language) give blobs unrelated to the prompt, listing the words it knows."""
    parser = argparse.ArgumentParser()
    add_shared_options(parser)
    options = parser.parse_args(["--model", "nobody/no-model", "--cache-dir", str(tmp_path / "xla")])
    with hub_at(None, tmp_path / "hf", monkeypatch):
        model = launch.load(options, fallback=True)
    assert model.label == "shapes"
    assert "Showing the built-in shapes model instead" in model.notice
    assert "It knows only the English words of its captions (red, green, blue" in model.notice
    assert all(word in model.notice for word in (*shapes.COLORS, *shapes.SHAPES, "background"))
    assert "other languages, give blobs unrelated to the prompt" in model.notice


def test_the_demo_refuses_an_images_per_core_that_does_not_fit_before_it_serves(tmp_path, monkeypatch):
    """On a device that reports its memory, the launch measures the largest batch of each kind it
    serves (text, image-to-image, inpainting) and refuses one that cannot fit, naming what does."""
    from sdxl.engine import memory

    measured = []

    def needed(pipe, programs, in_use, progress=True):  # 100 bytes an image a device, whatever the kind
        measured.append(sorted({(p.start_from, p.inpaint) for p in programs}))
        return in_use + 100 * programs[0].batch // pipe.num_devices

    monkeypatch.setattr(memory, "device_memory", lambda pipe: (1000 + 250, 1000))
    monkeypatch.setattr(memory, "bytes_needed", needed)
    options = demo_parser("SDXL on JAX").parse_args(
        ["--model", "tiny", "--max-images-per-core", "4", "--cache-dir", str(tmp_path / "xla")])
    with pytest.raises(memory.DoesNotFitError, match=r"^--max-images-per-core 4 needs 0.00 GiB on each cpu, which "
                       r"holds 0.00 GiB; 2 per device fit: --max-images-per-core 2$"):
        launch.demo_service(options)
    assert measured[0] == [("image", False), ("image", True), ("noise", False)], "every kind of request it serves"
    assert len(measured) == 3, "4, 3, then 2 per device, which fits"


@pytest.mark.compiles
def test_without_a_count_asked_for_the_demo_serves_the_most_images_per_core_that_fit(tmp_path, monkeypatch):
    """The default count (4) that does not fit is no reason to show an error instead of a demo (a Space
    on a small GPU): the launch serves the most that fit, and says so."""
    from sdxl.engine import memory

    def needed(pipe, programs, in_use, progress=True):  # 100 bytes an image a device
        return in_use + 100 * programs[0].batch // pipe.num_devices

    monkeypatch.setattr(memory, "device_memory", lambda pipe: (1000 + 250, 1000))
    monkeypatch.setattr(memory, "bytes_needed", needed)
    monkeypatch.setattr(launch, "_compiled_in_background", lambda *args: {})  # the other batches: not here
    monkeypatch.delenv("SDXL_MAX_IMAGES_PER_CORE", raising=False)
    options = demo_parser("SDXL on JAX").parse_args(["--model", "tiny", "--cache-dir", str(tmp_path / "xla")])
    service = launch.demo_service(options)
    assert service.max_images_per_core == 2 and service.queue.max_batch_images == 2 * service.pipe.num_devices
    assert service.launch_notes == [
        "Serving 2 image(s) per core, the most that fit: the default 4 do not (--max-images-per-core 4 needs 0.00 GiB "
        "on each cpu, which holds 0.00 GiB; 2 per device fit: --max-images-per-core 2)."]


@pytest.mark.parametrize("env, cache_dir, hub_cache, compilation_cache", [
    ({"SDXL_PERSISTENT_STORAGE": "{root}"}, None, "{root}/.huggingface/hub", "{root}/sdxl-jax/xla"),
    ({"SDXL_PERSISTENT_STORAGE": "{root}", "HF_HOME": "/hf"}, None, None, "{root}/sdxl-jax/xla"),
    ({"SDXL_PERSISTENT_STORAGE": "{root}", "HF_HUB_CACHE": "/hf"}, "/xla", None, None),
])
def test_persistent_storage_keeps_the_caches_the_user_did_not_place(tmp_path, env, cache_dir, hub_cache,
                                                                    compilation_cache):
    storage = launch.persistent_storage({k: v.format(root=tmp_path) for k, v in env.items()}, cache_dir)
    expected = [None if path is None else Path(path.format(root=tmp_path)) for path in (hub_cache, compilation_cache)]
    assert [storage.hub_cache, storage.compilation_cache] == expected
    if hub_cache:
        assert storage.describe() == (f"Persistent storage at {tmp_path} keeps the models' files in {expected[0]} and "
                                      f"the compiled programs in {expected[1]}: a restart skips the download and the "
                                      "compilation.")


def test_without_persistent_storage_the_caches_stay_where_they_are(tmp_path, monkeypatch):
    assert launch.persistent_storage({}, None) is None  # not on a Space, nothing named
    assert launch.persistent_storage({"SDXL_PERSISTENT_STORAGE": str(tmp_path / "missing")}, None) is None
    monkeypatch.setattr(launch, "SPACES_STORAGE", str(tmp_path / "missing"))  # a Space without persistent storage
    assert launch.persistent_storage({"SYSTEM": "spaces"}, None) is None


def test_the_launch_says_whether_a_hires_fix_at_the_forms_default_fits(monkeypatch, capsys):
    """A hires fix is off by default: its second pass at the form's default upscale is checked, and
    what fits said, not refused."""
    from sdxl.engine import memory
    from sdxl.engine.pipeline import Pipeline
    from sdxl.serving.demo import DemoService
    from sdxl.serving.forms import Settings

    measured = []

    def needed(pipe, programs, in_use, progress=True):  # 100 bytes an image a device
        measured.append({(p.start_from, p.width, p.height) for p in programs})
        return in_use + 100 * programs[0].batch // pipe.num_devices

    monkeypatch.setattr(memory, "device_memory", lambda pipe: (1000 + 250, 1000))
    monkeypatch.setattr(memory, "bytes_needed", needed)
    service = DemoService([Model("tiny", Pipeline.from_pretrained("tiny"))], max_images_per_core=4)
    settings = Settings(prompt="warm-up", steps=2)
    launch._report_hires_fit(service, settings)
    first_pass = service.images(settings).request
    width, height = (int(side * Settings.hires_scale) for side in (first_pass.width, first_pass.height))
    assert measured[0] == {("clean_latents", width, height)}, "the second pass alone: the first's fits as text's"
    assert capsys.readouterr().out == (
        f"warning: a hires fix at its default 1.5x ({width}x{height}): --max-images-per-core 4 needs 0.00 GiB on "
        "each cpu, which holds 0.00 GiB; 2 per device fit: --max-images-per-core 2\n")
    monkeypatch.setattr(memory, "device_memory", lambda pipe: (1000 + 400, 1000))
    launch._report_hires_fit(service, settings)
    fits = f"a hires fix at its default 1.5x ({width}x{height}): fits at --max-images-per-core 4\n"
    assert capsys.readouterr().out == fits


@pytest.mark.parametrize("text, expected", [
    ("style.safetensors", ("style.safetensors", 1.0)),
    ("style.safetensors:0.7", ("style.safetensors", 0.7)),
    ("C:/loras/style.safetensors:-1", ("C:/loras/style.safetensors", -1.0)),
    ("owner/repo:.5", ("owner/repo", 0.5)),
])
def test_a_source_and_its_scale(text, expected):
    assert source_and_scale(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("h94/IP-Adapter/sdxl_models/ip-adapter_sdxl.safetensors",
     ("h94/IP-Adapter", "sdxl_models", "ip-adapter_sdxl.safetensors", "image_encoder")),
    ("h94/IP-Adapter/sdxl_models/ip-adapter-plus_sdxl_vit-h.safetensors",
     ("h94/IP-Adapter", "sdxl_models", "ip-adapter-plus_sdxl_vit-h.safetensors", "models/image_encoder")),
    ("h94/IP-Adapter/models/ip-adapter_sd15.safetensors",
     ("h94/IP-Adapter", "models", "ip-adapter_sd15.safetensors", "image_encoder")),
    ("someone/adapter/ip.safetensors", ("someone/adapter", "", "ip.safetensors", "image_encoder")),
])
def test_an_ip_adapter_on_the_hub_is_its_repo_folder_and_file(text, expected):
    found = launch.ip_adapter_file(text)
    assert (found.source, found.subfolder, found.weight_name, found.image_encoder_folder) == expected


def test_a_local_ip_adapter_reads_its_folder_as_the_hubs_layout(tmp_path):
    """A local file's folder is the subfolder of its parent, so that a vit-h file finds models/image_encoder."""
    (tmp_path / "sdxl_models").mkdir()
    for name in ("ip-adapter_sdxl.safetensors", "ip-adapter_sdxl_vit-h.safetensors"):
        (tmp_path / "sdxl_models" / name).touch()
    plain = launch.ip_adapter_file(str(tmp_path / "sdxl_models/ip-adapter_sdxl.safetensors"))
    assert (plain.source, plain.subfolder, plain.image_encoder_folder) == (str(tmp_path), "sdxl_models",
                                                                          "image_encoder")
    assert launch.ip_adapter_file(str(tmp_path / "sdxl_models/ip-adapter_sdxl_vit-h.safetensors")
                                  ).image_encoder_folder == "models/image_encoder"


@pytest.mark.parametrize("text, message", [
    ("h94/IP-Adapter/models/ip-adapter_sd15.bin", "names an adapter's .safetensors file"),
    ("h94/IP-Adapter", "names an adapter's .safetensors file"),
    ("./missing/ip.safetensors", "no such file here, and not a Hub file"),
    ("ip.safetensors", "no such file here, and not a Hub file"),
])
def test_a_bad_ip_adapter_is_refused_in_one_sentence_before_the_model_loads(text, message, tmp_path):
    parser = argparse.ArgumentParser()
    add_shared_options(parser)
    options = parser.parse_args(["--model", "nobody/no-model", "--ip-adapter", text])
    with pytest.raises(launch.CheckpointError, match=message):
        launch.load(options)  # no Hub is asked for the model: it would say so


def test_the_demo_loads_the_ip_adapter_its_variable_names(tmp_path, monkeypatch):
    from sdxl.checkpoints.random_models import write_ip_adapter
    from sdxl.engine.pipeline import Pipeline

    write_ip_adapter(tmp_path / "ip", Pipeline.from_pretrained("tiny", dtype="float32").spec.unet,
                     kinds=("plain", "plus"))
    monkeypatch.setenv("SDXL_IP_ADAPTER", str(tmp_path / "ip/sdxl_models/ip-adapter.safetensors"))
    options = demo_parser("SDXL on JAX").parse_args(
        ["--model", "tiny", "--dtype", "float32", "--cache-dir", str(tmp_path / "xla"),
         "--ip-adapter", str(tmp_path / "ip/sdxl_models/ip-adapter-plus.safetensors")])
    pipe = launch.load(options).pipe
    assert [a.name.rsplit("/", 1)[1] for a in pipe.ip_adapters] == ["ip-adapter.safetensors",
                                                                    "ip-adapter-plus.safetensors"]


def test_with_ip_adapters_the_launch_checks_the_program_with_an_image_prompt(tmp_path, monkeypatch):
    """The image encoder and the adapters' layers run only in a program with image prompts: the fit
    check measures one."""
    from sdxl.checkpoints.random_models import write_ip_adapter
    from sdxl.engine import memory
    from sdxl.engine.pipeline import Pipeline

    write_ip_adapter(tmp_path / "ip", Pipeline.from_pretrained("tiny", dtype="float32").spec.unet)
    measured = []

    def needed(pipe, programs, in_use, progress=True):
        measured.append({len(p.ip_adapters) for p in programs})
        return in_use + 100

    monkeypatch.setattr(memory, "device_memory", lambda pipe: (1000 + 50, 1000))
    monkeypatch.setattr(memory, "bytes_needed", needed)
    options = demo_parser("SDXL on JAX").parse_args(
        ["--model", "tiny", "--max-images-per-core", "1", "--cache-dir", str(tmp_path / "xla"),
         "--ip-adapter", str(tmp_path / "ip/sdxl_models/ip-adapter.safetensors")])
    with pytest.raises(memory.DoesNotFitError):
        launch.demo_service(options)
    assert measured[0] == {0, 1}, "with and without the image prompt"


@pytest.mark.server
def test_on_persistent_storage_a_second_launch_compiles_nothing(tmp_path):
    """A Space's restart: with persistent storage (a temporary folder standing in for /data) and no
    cache variables set, the first launch compiles into it, and the second reads every program back."""
    import os
    import urllib.request

    from sdxl.bench.soak import running_app

    storage = tmp_path / "data"
    storage.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SDXL_", "HF_HOME", "HF_HUB_CACHE", "GRADIO_"))}
    env |= dict(SDXL_PERSISTENT_STORAGE=str(storage), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
                GRADIO_TEMP_DIR=str(tmp_path / "gradio"), PYTHONUNBUFFERED="1")
    startups = []
    for start in ("cold", "warm"):
        log = tmp_path / f"{start}.log"
        with running_app(["--model", "shapes", "--max-images-per-core", "1"], log, env) as (_, url):
            page = urllib.request.urlopen(url + "config", timeout=30).read().decode()
        startups.append(re.search(r"compile [\d.]+ s \((\d+) of (\d+) programs from the cache\)", log.read_text()))
    (cold_cached, cold_all), (warm_cached, warm_all) = (map(int, startup.groups()) for startup in startups)
    assert cold_cached == 0 and warm_cached == warm_all == cold_all > 0
    assert any((storage / "sdxl-jax" / "xla").iterdir())
    assert f"Persistent storage at {storage} keeps the models' files in {storage}/.huggingface/hub" in page


def test_the_prediction_type_and_zero_terminal_snr_override_what_the_checkpoint_says(tmp_path, monkeypatch):
    """As ComfyUI's ModelSamplingDiscrete node and A1111's Noise schedule setting, for files that carry no key."""
    from sdxl.engine.loading import scheduler_overrides

    monkeypatch.setenv("SDXL_ZERO_TERMINAL_SNR", "1")
    options = demo_parser("SDXL on JAX").parse_args(
        ["--model", "tiny", "--dtype", "float32", "--cache-dir", str(tmp_path / "xla"), "--prediction-type",
         "v_prediction"])
    spec = launch.load(options).pipe.spec
    assert (spec.scheduler.prediction_type, spec.scheduler.rescale_betas_zero_snr, spec.scheduler.timestep_spacing,
            spec.sampling) == ("v_prediction", True, "trailing", "v-prediction, zero terminal SNR")
    # The library's: a timestep spacing the caller gives wins; False turns a file's ztsnr off.
    assert scheduler_overrides({"timestep_spacing": "leading"}, None, True) == {
        "timestep_spacing": "leading", "rescale_betas_zero_snr": True}
    assert scheduler_overrides(None, None, False) == {"rescale_betas_zero_snr": False}
    assert scheduler_overrides(None, None, None) is None
    with pytest.raises(ValueError, match="prediction type must be one of"):
        scheduler_overrides(None, "v", None)
