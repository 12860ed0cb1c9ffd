"""Generation parameters as text ("infotexts"): what the PNGs this project writes carry, and what it
reads from them and from AUTOMATIC1111's and Forge's, in their "parameters" PNG-chunk format.

`png_parameters` writes an image's settings; `read_parameters` reads a text back as the keyword
arguments `Pipeline.generate` takes, so pasting an infotext is `pipe.generate(**read_parameters(text))`.
"""

import json
import re
import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..checkpoints import hashes, lora
from ..models.controlnet_union import CONTROL_MODES
from ..prompts import syntax as prompt_syntax
from ..prompts.syntax import A1111_EMPHASIS_NAMES
from ..sampling import kdiffusion, methods, noise
from ..sampling.methods import SAMPLER_NAMES
from .hires import Hires
from .image_prompts import SCALE_PRESETS, preset_named, preset_scale


def parameters_text(prompt: str, negative_prompt: str, settings: dict[str, object]) -> str:
    """Generation parameters in the widely read "parameters" PNG-chunk format, as webui writes it: the
    prompt, the negative prompt, then the settings as "Key: value" pairs (quoted where a value holds a
    comma, colon or newline), in order; None values left out."""
    lines = [prompt]
    if negative_prompt:
        lines.append(f"Negative prompt: {negative_prompt}")
    values = (f"{key}: {_infotext_value(value)}" for key, value in settings.items() if value is not None)
    lines.append(", ".join(values))
    return "\n".join(lines)


def _infotext_value(value) -> str:
    return infotext_quote(_number(value))


def _number(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def png_parameters(pipe, request, i: int, model: str, left_out: str | None = None) -> str:
    """The parameters of image `i` of a rendered request, rendered with `pipe` (the `LoadedModel` it was
    prepared against, its refiner included; or a `Pipeline`, for its current one), as the CLI and the
    demo save them: the prompts as written, weights and LoRA tags included; webui's fields where it
    has them ("Schedule type", "Emphasis", "Lora hashes", "TI hashes": the embeddings the prompt, then the
    negative prompt, name; "Noise Schedule" for a zero-terminal-SNR model, "CFG Rescale" as webui's CFG
    Rescale extension writes it), then ours. diffusers' samplers write their
    schedule type as "diffusers". `left_out`: what the settings named that the picture is drawn without
    (a demo's "Failed to find networks: ..."), as the field "Left out", which webui ignores."""
    loras = request.loras or ()
    readable = [prompt_syntax.lora_tags(request.prompts[i])[0], request.negative_prompts[i]]
    rescale = request.guidance_rescales[i] if request.guidance_rescales else 0.0
    return parameters_text(request.prompts[i], request.negative_prompts[i], {
        "Steps": request.steps, "Sampler": SAMPLER_NAMES[request.sampler], "Schedule type": request.schedule_type,
        "CFG scale": float(request.guidance_scales[i]), **_seed_fields(request, i),
        "CFG Rescale": float(rescale) or None,
        "Size": f"{request.width}x{request.height}",
        "Model hash": None if pipe.weights_file is None else hashes.model_hash(pipe.weights_file), "Model": model,
        "VAE": pipe.vae_name,
        # Ours, which webui reads past: the UNet's weights stored in 8 bits, not in the dtype it computes in.
        "Weights dtype": None if pipe.weights_dtype == "default" else pipe.weights_dtype,
        **_noise_fields(request, i),
        "Noise Schedule": ZERO_TERMINAL_SNR if pipe.spec.scheduler.rescale_betas_zero_snr else None,
        "Denoising strength": None if request.images is None else float(request.strength),
        **clip_skip_infotext(request, pipe.spec),
        **hires_infotext(request),
        "Refiner": None if request.refine_from is None else pipe.refiner.name,
        "Refiner switch at": None if request.refine_from is None else float(request.refine_from),
        "Emphasis": emphasis_infotext(request.emphasis, readable),
        "LoRAs": " ".join(f"{lora.display_name(source)}:{scale:g}" for source, scale in loras) or None,
        "Lora hashes": hashes_text(
            (lora.display_name(source), pipe.lora_files[source].short_hash) for source, _ in loras
        ) or None,
        "TI hashes": hashes_text(
            (embedding.name, embedding.short_hash) for text, negative in ((request.prompts[i], False),
                                                                          (request.negative_prompts[i], True))
            for embedding in pipe.prompts.embeddings_in(text, request.emphasis, negative=negative)
        ) or None,
        **controlnet_infotext(pipe, request, i),
        "Left out": left_out,
    })


# The image encoder's width of ViT-bigG, which h94's SDXL adapters read; the others read ViT-H's.
VIT_BIG_G_WIDTH = 1664


def clip_skip_infotext(request, spec) -> dict:
    """A request's clip skip as webui writes it, "Clip skip" when above 1 (on SDXL too, which ignores it
    unless its setting is on); and that setting, which webui does not write, as "Clip skip SDXL"
    (its label) where it applies."""
    return {"Clip skip": request.clip_skip if request.clip_skip > 1 else None,
            "Clip skip SDXL": "True" if request.sdxl_clip_l_skip and spec.is_sdxl else None}


def hires_infotext(request) -> dict:
    """A request's hires fix in webui's fields (and Forge's "Hires CFG Scale"): its second pass's
    settings where they are not the first pass's."""
    hires = request.hires
    if hires is None:
        return {}
    return {
        "Denoising strength": float(hires.strength),
        "Hires upscale": float(hires.scale) if hires.by_scale else None,
        "Hires resize": None if hires.by_scale else f"{hires.resize_width}x{hires.resize_height}",
        "Hires steps": hires.steps or None,
        "Hires upscaler": hires.upscaler,
        "Hires sampler": SAMPLER_NAMES[hires.sampler] if hires.sampler != request.sampler else None,
        "Hires schedule type": hires.schedule_type if hires.schedule_type != request.schedule_type else None,
        "Hires CFG Scale": None if hires.guidance_scale is None else float(hires.guidance_scale),
        "Hires prompt": hires.prompt, "Hires negative prompt": hires.negative_prompt,
    }


def _seed_fields(request, i: int) -> dict:
    """Image i's seed as the tool whose noise it has writes it: A1111's (a noise source drawn per image),
    the image's own seed, from which A1111 draws it again alone; else ours, the request's seed and the
    image's index in it. (With one generator per batch, a stochastic sampler's later draws depend on the
    batch's size too, as in diffusers.)"""
    if request.noise_source == "jax" or request.batch_noise:
        return {"Seed": request.seeds[i], "Image index": request.image_index[i]}
    (seed,), _ = noise.a1111_seeds(request.seeds[i], [request.image_index[i]], 0, request.variation_strength)
    return {"Seed": seed}


def _noise_fields(request, i: int) -> dict:
    """Where image i's noise comes from, in A1111's fields (and "Batch noise", ours): "RNG" always, as
    A1111 reads a text without one as its GPU source."""
    varied = request.variation_strength != 0
    (subseed,) = noise.a1111_seeds(0, [request.image_index[i]], request.variation_seed, 1)[1] if varied else (None,)
    return {
        "Variation seed": subseed, "Variation seed strength": float(request.variation_strength) if varied else None,
        "ENSD": request.ensd or None, "RNG": RNG_NAMES[request.noise_source],
        "Batch noise": "True" if request.batch_noise else None,
    }


def controlnet_infotext(pipe, request, i: int) -> dict[str, str]:
    """Image `i`'s ControlNets as A1111's ControlNet extension records them: "ControlNet 0" (and 1,
    2, ...) with "Module: canny, Model: ..., Weight: 0.7, Threshold A: 100, Threshold B: 200, Guidance
    Start: 0, Guidance End: 0.8" as its value. The module is how the control map was made from a
    picture ("none": given as the map)."""
    entries = {}
    for k, (controlnet, control) in enumerate(zip(pipe.controlnets, request.controls[i] if request.controls else ())):
        fields = {**control.made_by.infotext(), "Model": controlnet_label(controlnet.name), "Weight": control.scale,
                  "Guidance Start": control.start, "Guidance End": control.end,
                  **({} if control.mode is None else {"Union Control Type": CONTROL_MODES[control.mode][0]})}
        order = ("Module", "Model", "Weight", "Threshold A", "Threshold B", "Guidance Start", "Guidance End",
                 "Union Control Type")
        entries[f"ControlNet {k}"] = ", ".join(f"{key}: {_number(fields[key])}" for key in order if key in fields)
    return entries | ip_adapter_infotext(pipe, request, i, len(entries))


def ip_adapter_infotext(pipe, request, i: int, first: int = 0) -> dict[str, str]:
    """Image `i`'s IP-Adapters as A1111's ControlNet extension records an IP-Adapter unit, numbered on
    from the ControlNets' (`first`): "ControlNet 1" with "Module: ip-adapter_clip_sdxl, Model:
    ip-adapter_sdxl, Weight: 0.6, Guidance Start: 0, Guidance End: 1", its module the image encoder the
    extension names (ViT-bigG's ip-adapter_clip_sdxl, ViT-H's ip-adapter_clip_h), its model the file's
    name. An adapter at scale 0 (which sits out) is left out; InstantStyle's layers, which the extension
    has no field for, are our own "IP-Adapter layers" (a dict of blocks of no preset is written as its
    largest scale, and its blocks are lost)."""
    entries, layers = {}, None
    for adapter, prompt in zip(pipe.ip_adapters, request.image_prompts[i] if request.image_prompts else ()):
        preset, weight = preset_named(prompt.scale) or (None, max(float(s) for s in prompt.scales))
        if not np.any(prompt.scales):
            continue
        layers = layers or (preset if preset != "all" else None)
        big_g = adapter.config.encoder.hidden_size == VIT_BIG_G_WIDTH
        module = "ip-adapter_clip_sdxl" if big_g else "ip-adapter_clip_h"
        entries[f"ControlNet {first + len(entries)}"] = (f"Module: {module}, Model: {Path(adapter.name).stem}, "
                                                         f"Weight: {weight:g}, Guidance Start: 0, Guidance End: 1")
    return entries | ({"IP-Adapter layers": layers} if layers else {})


def controlnet_label(source: str) -> str:
    """How results and the demo name a ControlNet: a Hub repo id as it is, a file or folder by its name."""
    path = Path(source)
    if source.endswith(".safetensors"):
        return path.stem
    return path.name if path.is_dir() else source


def hashes_text(files: Iterable[tuple[str, str]]) -> str:
    """The value of webui's "Lora hashes" or "TI hashes" field from (name as written in the prompt, short
    hash) pairs: "name: hash, name: hash", names without ":" and ",", one entry per name (a repeated name
    keeps its first place and its last hash). In the infotext it is written quoted (`infotext_quote`)."""
    entries: dict[str, str] = {}
    for name, short_hash in files:
        entries[name.translate(str.maketrans("", "", ":,"))] = short_hash
    return ", ".join(f"{name}: {short_hash}" for name, short_hash in entries.items())


def infotext_quote(value: str) -> str:
    """A value as webui writes it in the infotext: JSON-quoted when it holds a comma, colon or newline."""
    value = str(value)
    if "," not in value and ":" not in value and "\n" not in value:
        return value
    return json.dumps(value, ensure_ascii=False)


def emphasis_infotext(emphasis: str, texts: Iterable[str]) -> str | None:
    """webui's "Emphasis" infotext value: written only when the mode is not "original" and some prompt
    (positive or negative, tags removed) holds "(" or "["."""
    if emphasis == "original" or not any("(" in text or "[" in text for text in texts):
        return None
    return A1111_EMPHASIS_NAMES[emphasis]


def read_parameters(text: str, pipe=None) -> dict:
    """The keyword arguments of `Pipeline.generate` that a "parameters" text (`png_parameters`', or
    webui's and Forge's) gives, so that `pipe.generate(**read_parameters(text))` draws its picture:
    prompt and negative_prompt; and of steps, sampler and schedule_type (A1111's k-diffusion sampler
    and schedule type, or for our own texts and A1111's DDIM, PLMS and the like, diffusers'),
    guidance_scale, guidance_rescale ("CFG Rescale"), seed, width, height, emphasis, clip_skip (and our
    "Clip skip SDXL" as sdxl_clip_l_skip), noise_source, variation_seed, variation_strength, ensd and
    batch_noise, those it gives; and its hires fix as `hires` (`sdxl.engine.hires.Hires`);
    with `pipe`, its IP-Adapter units (A1111's ControlNet extension's) as `ip_adapter_scale`, one per
    adapter loaded, 0 for those it names not (the pictures are not in it: give them as
    `ip_adapter_image`); a unit naming an adapter not loaded is named in the warning. The noise source
    is webui's RNG (a text without one is webui's default GPU source, on NVIDIA cards its NV; this
    project's own texts say JAX). Settings it gives that `generate` cannot apply (a sampler not
    here, ...) are named in one warning; so are its "Model", "VAE" and "Noise Schedule", unless `pipe`
    (a `Pipeline`) has loaded them (for webui's "Zero Terminal SNR" or "Default", a model with zero
    terminal SNR), and the textual-inversion embeddings its "TI hashes" names that `pipe` has not.

    Raises:
      ValueError: it has no settings line.
    """
    found, unused = read_infotext(text, pipe)
    if unused:
        warnings.warn(f"parameters not applied: {', '.join(unused)}", stacklevel=2)
    return found


def read_infotext(text: str, pipe=None) -> tuple[dict, tuple[str, ...]]:
    """`read_parameters`' arguments, and the settings it leaves out: their names, or for a "Model" or
    "VAE" that `pipe` (given) has not loaded, what the text names and what is loaded. Raises ValueError."""
    prompt, negative, fields = _parts(text)
    found, used = {"prompt": prompt, "negative_prompt": negative}, set(_METADATA)
    for key, (name, parse) in _SETTINGS.items():
        if key in fields:
            try:
                found[name] = parse(fields[key])
                used.add(key)
            except ValueError:
                pass  # a value generate cannot use is named as unused
    if "x" in fields.get("Size", ""):
        found["width"], found["height"] = (int(v) for v in fields["Size"].split("x"))
        used.add("Size")
    sampler = _sampler_named(fields)
    if sampler is not None:
        found["sampler"], found["schedule_type"] = sampler
        used.add("Sampler")
        if fields.get("Schedule type", "Automatic") in (*_SCHEDULE_TYPES, methods.DIFFUSERS):
            used.add("Schedule type")
    emphasis = {label: mode for mode, label in A1111_EMPHASIS_NAMES.items()}.get(fields.get("Emphasis", "Original"))
    if emphasis is not None:
        found["emphasis"] = emphasis
        used.add("Emphasis")
    # Before it wrote "RNG", this project's texts were the ones with an image index.
    source = _RNG_SOURCES.get(fields.get("RNG", "JAX" if "Image index" in fields else "NV"))
    if source is not None:
        found["noise_source"] = source
        used.update(("RNG", "Image index"))
    hires, hires_used = _hires_named(fields)
    if hires is not None:
        found["hires"] = hires
        used.update(hires_used)
    others = {}
    if pipe is not None:
        scales, units, others = _ip_adapters_named(fields, pipe)
        if units:
            found["ip_adapter_scale"] = scales
            used.update(units)
    if pipe is not None:
        others |= _not_loaded(fields, pipe) | _embeddings_not_loaded(fields.get("TI hashes", ""), pipe)
        used.update(key for key in ("Model", "VAE", "Noise Schedule") if key in fields and key not in others)
    return found, tuple(others.get(key, key) for key in fields if key not in used) + tuple(
        others[key] for key in others if key not in fields)


def settings_of(text: str) -> dict[str, str]:
    """A "parameters" text's settings line, by field ("Model": ..., "Model hash": ...). Raises ValueError."""
    return _parts(text)[2]


def _parts(text: str) -> tuple[str, str, dict[str, str]]:
    """A "parameters" text's prompt, negative prompt and settings by field. Raises ValueError."""
    lines = text.strip().split("\n")
    settings_line = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Steps: ")), None)
    if settings_line is None:
        raise ValueError("no generation parameters in this image (no 'Steps:' line)")
    prompt_lines, negative = lines[:settings_line], ""
    for i, line in enumerate(prompt_lines):
        if line.startswith("Negative prompt: "):
            negative = "\n".join([line[len("Negative prompt: "):], *prompt_lines[i + 1:]])
            prompt_lines = prompt_lines[:i]
            break
    fields = {key: json.loads(value) if value.startswith('"') else value
              for key, value in _SETTING.findall(lines[settings_line])}
    return "\n".join(prompt_lines), negative, fields


def _not_loaded(fields: dict, pipe) -> dict[str, str]:
    """For a text's "Model" and "VAE" (webui writes a separate VAE's file name; none: the model's own)
    that name another than `pipe` has loaded, a sentence saying both, by field."""
    found = {}
    if "Model" in fields and file_stem(fields["Model"]) != file_stem(pipe.name):
        found["Model"] = f"Model {fields['Model']} (loaded: {file_stem(pipe.name)})"
    if file_stem(fields.get("VAE")) != file_stem(pipe.vae_name):
        own = "the model's own"
        found["VAE"] = f"VAE {fields.get('VAE', own)} (loaded: {file_stem(pipe.vae_name) or own})"
    # webui writes its "Noise schedule" setting for a model with zero terminal SNR (a `ztsnr` key: then
    # "Default", the model's own) or where the setting asks for it; the loaded model's is static.
    schedule, zero_snr = fields.get("Noise Schedule"), pipe.spec.scheduler.rescale_betas_zero_snr
    if schedule is not None and (schedule in (ZERO_TERMINAL_SNR, "Default")) != zero_snr:
        found["Noise Schedule"] = f"Noise Schedule {schedule} (loaded: {'with' if zero_snr else 'without'} " \
            "zero terminal SNR)"
    return found


def file_stem(name: str | None) -> str | None:
    """How a text's "Model" or "VAE" compares with a loaded one: by its last part without an extension
    ("sdxl_vae.safetensors" is the VAE "madebyollin/sdxl_vae")."""
    return None if name is None else Path(str(name).rstrip("/")).name.removesuffix(".safetensors")


def _embeddings_not_loaded(ti_hashes: str, pipe) -> dict[str, str]:
    """For the embeddings a text's "TI hashes" names that `pipe` has not loaded, or has loaded from another
    file (another hash), a sentence naming them: a prompt then reads their names as words."""
    if not ti_hashes:
        return {}
    loaded = {embedding.name.translate(str.maketrans("", "", ":,")): embedding.short_hash
              for embedding in pipe.prompts.embeddings}
    unknown = {}  # webui's SDXL texts name an embedding once per encoder
    for entry in filter(None, (part.strip() for part in ti_hashes.split(","))):
        name, _, short_hash = (part.strip() for part in entry.rpartition(":"))
        if name not in loaded:
            unknown[name] = f"embedding {name} (not loaded)"
        elif loaded[name] != short_hash:
            unknown[name] = f"embedding {name} (hash {short_hash}; loaded: {loaded[name]})"
    return {"embeddings": ", ".join(unknown.values())} if unknown else {}


def _ip_adapters_named(fields: dict, pipe) -> tuple[list, set[str], dict[str, str]]:
    """A text's IP-Adapter units (A1111's ControlNet extension's, `ip_adapter_infotext`) as one scale per
    adapter `pipe` has loaded (0 for those no unit names), the units it took, and for each unit naming
    an adapter not loaded, a sentence saying so."""
    stems = [Path(adapter.name).stem for adapter in pipe.ip_adapters]
    scales, used, others = [0.0] * len(stems), set(), {}
    layers = fields.get("IP-Adapter layers", "all")
    for key, value in fields.items():
        unit = dict(_SETTING.findall(value)) if re.fullmatch(r"ControlNet \d+", key) else {}
        if not unit.get("Module", "").startswith("ip-adapter"):
            continue
        model = re.sub(r"\s*\[\w+\]$", "", unit.get("Model", ""))  # the extension writes "name [hash]"
        if model not in stems:
            others[key] = f"IP-Adapter {model} (loaded: {', '.join(stems) or 'none'})"
            continue
        try:
            scales[stems.index(model)] = preset_scale(pipe.spec.unet, layers if layers in SCALE_PRESETS else "all",
                                                      float(unit.get("Weight", 1)))
        except ValueError:
            continue  # a weight out of range, or a preset this model lacks: the unit is named as unused
        used.update((key, "IP-Adapter layers"))
    return scales, used, others


def _hires_named(fields: dict) -> tuple[Hires | None, set[str]]:
    """A text's hires fix, as webui reads one (`infotext_utils`: a text with "Hires upscale", "Hires
    resize" or "Hires upscaler" has one), and the fields it took. Its sampler is read as the
    "Sampler" field is; a field whose value does not parse is left unused."""
    if not any(key in fields for key in ("Hires upscale", "Hires resize", "Hires upscaler")):
        return None, set()
    values, used = {}, set()

    def take(key, name, parse):
        try:
            values[name] = parse(fields[key])
            used.add(key)
        except (KeyError, ValueError):
            pass

    take("Hires upscale", "scale", float)
    take("Hires resize", "resize", lambda value: tuple(int(v) for v in value.split("x")))
    take("Hires steps", "steps", int)
    take("Hires upscaler", "upscaler", str)
    take("Denoising strength", "strength", float)
    take("Hires CFG Scale", "guidance_scale", float)
    take("Hires prompt", "prompt", str)
    take("Hires negative prompt", "negative_prompt", str)
    width, height = values.pop("resize", (0, 0))
    if "Hires sampler" in fields:
        sampler = _sampler_named({"Sampler": fields["Hires sampler"], "Schedule type": fields.get(
            "Hires schedule type", fields.get("Schedule type", "Automatic"))})
        if sampler is not None:
            values["sampler"], values["schedule_type"] = sampler
            used.update(("Hires sampler", "Hires schedule type"))
    elif fields.get("Hires schedule type") in (*_SCHEDULE_TYPES, methods.DIFFUSERS):
        label = fields["Hires schedule type"]
        values["schedule_type"] = _SCHEDULE_TYPES.get(label, label)
        used.add("Hires schedule type")
    return Hires(resize_width=width, resize_height=height, **values), used


# "Key: value" pairs of a settings line; a value runs to the next comma (webui quotes values with commas).
_SETTING = re.compile(r'\s*([\w ]+): ("(?:[^"\\]|\\.)*"|[^,]*)(?:,|$)')
_SETTINGS = {
    "Steps": ("steps", int), "CFG scale": ("guidance_scale", float), "Seed": ("seed", int),
    "Variation seed": ("variation_seed", int), "Variation seed strength": ("variation_strength", float),
    "ENSD": ("ensd", int), "Batch noise": ("batch_noise", lambda value: value == "True"),
    "Clip skip": ("clip_skip", int), "Clip skip SDXL": ("sdxl_clip_l_skip", lambda value: value == "True"),
    "CFG Rescale": ("guidance_rescale", float),  # the field of webui's CFG Rescale extension
}
ZERO_TERMINAL_SNR = "Zero Terminal SNR"  # webui's "Noise schedule" setting for a rescaled schedule
# What names files or programs rather than settings: nothing to apply, so never reported as unused.
_METADATA = ("Version", "Model hash", "VAE hash", "Lora hashes", "TI hashes", "LoRAs", "Left out", "Weights dtype")
# The noise sources by webui's RNG names (and ours, JAX); webui's GPU source on NVIDIA cards is its NV.
RNG_NAMES = {"jax": "JAX", "nv": "NV", "cpu": "CPU"}
_RNG_SOURCES = {name: source for source, name in RNG_NAMES.items()} | {"GPU": "nv"}
# A1111's schedule types by their labels, and by its names for them ("sgm_uniform") and aliases.
_SCHEDULE_TYPES = {
    **{label: label for label in kdiffusion.SCHEDULE_TYPES},
    **{label.lower().replace(" ", "_"): label for label in kdiffusion.SCHEDULE_TYPES},
    "SGMUniform": "SGM Uniform",
}


def _sampler_named(fields: dict) -> tuple[str, str] | None:
    """(Our sampler, its schedule type) for a text's "Sampler" and "Schedule type", as A1111 reads them
    (`sd_samplers.get_sampler_and_scheduler`): a sampler's name may end in a schedule type ("DPM++ 2M
    Karras", as A1111 wrote both before 1.9), which then overrides the field. Our own texts name
    diffusers' samplers with the schedule type "diffusers"; before they wrote "RNG" they were the texts
    with an "Image index", and named diffusers' DPM++ 2M with Karras sigmas "DPM++ 2M" with "Karras".
    A schedule type we do not know is A1111's "Automatic", as A1111 reads it. None for a sampler we
    have none like."""
    sampler, schedule = fields.get("Sampler"), fields.get("Schedule type", "Automatic")
    if sampler is None:
        return None
    if schedule == methods.DIFFUSERS or ("Image index" in fields and "RNG" not in fields):
        legacy_karras = sampler == "DPM++ 2M" and schedule == "Karras"
        sampler = "DPM++ 2M Karras" if legacy_karras else sampler
        return (name, methods.DIFFUSERS) if (name := _named(sampler, methods.ON_DIFFUSERS_SCHEDULE)) else None
    for option, label in _SCHEDULE_TYPES.items():
        if sampler.endswith(" " + option):
            sampler, schedule = sampler.removesuffix(" " + option), label
            break
    schedule = _SCHEDULE_TYPES.get(schedule, "Automatic")
    if (name := _named(sampler, methods.ON_A1111_SCHEDULES)) is not None:
        return name, schedule
    # A1111's DDIM, PLMS, LCM and the like are not k-diffusion's: the nearest here are diffusers'.
    return (name, methods.DIFFUSERS) if (name := _named(sampler, methods.ON_DIFFUSERS_SCHEDULE)) else None


def _named(label: str, names) -> str | None:
    """The sampler among `names` that `label` names, or None."""
    try:
        name = methods.sampler_name(label)
    except ValueError:
        return None
    return name if name in names else None
