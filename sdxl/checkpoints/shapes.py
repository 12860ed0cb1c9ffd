"""The `shapes` model's world: a caption grammar, a renderer of captioned images, and the model's configs.

The data set is generated on the fly. A scene is one flat-coloured circle, square or triangle on a
flat background; its caption follows the grammar

    a [small|large] <color> <shape> [in the center|at the top|at the bottom|on the left|on the right]
        on a <color> background

with the colours of `COLORS` and the shapes of `SHAPES`. "a" and "an" are both used before every
noun phrase (mostly the grammatical one), so "a orange" and "an orange" mean the same. Without a
size, the object's size is anything from small to large; without a position, it sits at one of the
five named places.

`CONFIGS` are the model's configs in the diffusers layout (an SDXL pipeline at 64x64: two CLIP text
encoders, a UNet with the pooled-text and size conditioning, a 4x VAE), `write_tokenizer` writes its
word-level CLIP tokenizer, and `write_model` writes a trained parameter set as a diffusers folder.
"""

import copy
import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from .weights import flatten, write_params

NATIVE_SIZE = 64  # pixels; the VAE's latents are 16x16

COLORS = {  # name -> RGB
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (245, 215, 30),
    "orange": (245, 135, 20),
    "purple": (135, 45, 175),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": (5.5, 8.0), "large": (11.5, 14.0)}  # half the object's width, in pixels at 64x64
ANY_SIZE = (5.5, 14.0)
POSITIONS = {  # phrase -> the object's centre, as a fraction of the image size
    "in the center": (0.5, 0.5),
    "at the top": (0.5, 0.28),
    "at the bottom": (0.5, 0.72),
    "on the left": (0.28, 0.5),
    "on the right": (0.72, 0.5),
}
JITTER = 0.03  # of the image size, on each axis of the centre

# Every word of the grammar is one token of the tokenizer.
WORDS = sorted(
    {"a", "an", "on", "background", *COLORS, *SHAPES, *SIZES, *(w for p in POSITIONS for w in p.split())}
)


def vocabulary() -> str:
    """The words the model draws by, for people: its colours, shapes, sizes, places and "background"."""
    places = [phrase.split()[-1] for phrase in POSITIONS]
    return ", ".join([*COLORS, *SHAPES, *SIZES, *places, "background"])


@dataclasses.dataclass(frozen=True)
class Scene:
    """What a caption says (None: not said), and how the image realises it."""

    color: str
    shape: str
    background: str
    size: str | None = None  # "small", "large"
    position: str | None = None  # a key of POSITIONS
    half_size: float = 10.0  # pixels at 64x64
    center: tuple[float, float] = (0.5, 0.5)  # (x, y), fractions of the image size

    def caption(self, rng: np.random.Generator | None = None) -> str:
        """The caption; with `rng`, each article is "a" or "an" at random (mostly the grammatical one)."""
        words = [w for w in (self.size, self.color, self.shape) if w]
        text = f"{_article(words[0], rng)} {' '.join(words)}"
        if self.position:
            text += f" {self.position}"
        return text + f" on {_article(self.background, rng)} {self.background} background"


def _article(word: str, rng: np.random.Generator | None) -> str:
    grammatical = "an" if word[0] in "aeiou" else "a"
    if rng is not None and rng.random() < 0.3:
        return "a" if grammatical == "an" else "an"
    return grammatical


def random_scene(
    rng: np.random.Generator,
    *,
    color: str | None = None,
    shape: str | None = None,
    background: str | None = None,
    size: str | None = None,
    position: str | None = None,
    p_size: float = 0.6,
    p_position: float = 0.7,
) -> Scene:
    """A random scene; the named attributes are fixed, a size and a position are said with p_size, p_position."""
    names = list(COLORS)
    color = color or names[rng.integers(len(names))]
    background = background or [n for n in names if n != color][rng.integers(len(names) - 1)]
    shape = shape or SHAPES[rng.integers(len(SHAPES))]
    if size is None and rng.random() < p_size:
        size = list(SIZES)[rng.integers(len(SIZES))]
    if position is None and rng.random() < p_position:
        position = list(POSITIONS)[rng.integers(len(POSITIONS))]
    low, high = SIZES[size] if size else ANY_SIZE
    place = POSITIONS[position] if position else list(POSITIONS.values())[rng.integers(len(POSITIONS))]
    center = tuple(float(c + rng.uniform(-JITTER, JITTER)) for c in place)
    return Scene(color, shape, background, size, position, float(rng.uniform(low, high)), center)


def render(scenes: list[Scene], size: int = NATIVE_SIZE, supersample: int = 4) -> np.ndarray:
    """[N, size, size, 3] uint8 images of the scenes, anti-aliased by supersampling.

    Circles are discs, squares axis-aligned, triangles isosceles and pointing up, with the base and
    height of the square: each fills pi/4, 1 and 1/2 of its bounding box.
    """
    n = size * supersample
    coords = (np.arange(n) + 0.5) / supersample  # pixel units
    y, x = coords[:, None], coords[None, :]
    images = np.empty((len(scenes), size, size, 3), np.uint8)
    scale = size / NATIVE_SIZE
    for i, s in enumerate(scenes):
        r = s.half_size * scale
        dx, dy = x - s.center[0] * size, y - s.center[1] * size
        if s.shape == "circle":
            inside = dx**2 + dy**2 <= r**2
        elif s.shape == "square":
            inside = (np.abs(dx) <= r) & (np.abs(dy) <= r)
        else:  # apex (0, -r), base corners (+-r, r): |dx| <= (dy + r) / 2
            inside = (np.abs(dy) <= r) & (2 * np.abs(dx) <= dy + r)
        coverage = inside.reshape(size, supersample, size, supersample).mean(axis=(1, 3))[..., None]
        color, background = np.array(COLORS[s.color], float), np.array(COLORS[s.background], float)
        images[i] = np.round(coverage * color + (1 - coverage) * background).astype(np.uint8)
    return images


def training_batch(seed: int, step: int, batch: int, size: int = NATIVE_SIZE) -> tuple[np.ndarray, list[str]]:
    """Batch `step` of the data set of `seed`: (uint8 images [batch, size, size, 3], captions)."""
    rng = np.random.default_rng([seed, step])
    scenes = [random_scene(rng) for _ in range(batch)]
    return render(scenes, size), [s.caption(rng) for s in scenes]


# ---------------------------------------------------------------------------------------------
# The model's configs (diffusers layout) and writing a trained model.

SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")


def tokenizer_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP BPE vocabulary in which every word of `WORDS` is one token.

    The 256 byte symbols (with and without CLIP's end-of-word mark `</w>`) are in it too, so any other
    text still tokenizes, one character per token. Each word is built by merging its characters left
    to right; longer words' merges rank first, so a shorter word's merge never splits a longer word.
    """
    symbols = _byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols]
    merges = []
    for word in sorted(WORDS, key=lambda w: (-len(w), w)):
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        merged = parts[0]
        for part in parts[1:]:
            if (merged, part) not in merges:
                merges.append((merged, part))
                tokens.append(merged + part)
            merged += part
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    for special in SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    return vocab, merges


def _byte_symbols() -> list[str]:
    """GPT-2's reversible byte -> printable character table, which CLIP's BPE uses (as `sdxl.checkpoints.tokenizer`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable + [256 + n for n in range(len(extra))]]


def write_tokenizer(folder: Path, max_length: int = 77) -> None:
    """Writes the word-level CLIP tokenizer (vocab.json, merges.txt, tokenizer_config.json)."""
    vocab, merges = tokenizer_vocab()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    bos, eos = SPECIAL_TOKENS
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": max_length,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": eos,
        "pad_token": eos,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _text_encoder(architecture: str, hidden_act: str) -> dict:
    vocab, _ = tokenizer_vocab()
    return {
        "architectures": [architecture],
        "vocab_size": len(vocab),
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 77,
        "hidden_act": hidden_act,
        "layer_norm_eps": 1e-05,
        "projection_dim": 64,
        "bos_token_id": vocab[SPECIAL_TOKENS[0]],
        "eos_token_id": vocab[SPECIAL_TOKENS[1]],
        "pad_token_id": vocab[SPECIAL_TOKENS[1]],
    }


# SDXL's Euler scheduler, with DDPM's linear betas (1e-4 to 0.02) in place of SDXL's scaled-linear
# 0.00085 to 0.012, and "trailing" spacing, so that sampling starts at the last training timestep.
# SDXL's schedule leaves sqrt(alphas_cumprod) = 0.068 of the image in its noisiest latents; at 16x16
# latents that is enough for a small model to read an object's position off the noise, and it then
# ignored the position words (it drew where the seed's noise suggested, 22% right). DDPM's leaves
# 0.0064 (and the "trailing" first step sees exactly that level).
SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler",
    "_diffusers_version": "0.19.0.dev0",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 0,
    "timestep_spacing": "trailing",
    "trained_betas": None,
    "use_karras_sigmas": False,
}

TEXT_ENCODER = _text_encoder("CLIPTextModel", "quick_gelu")  # CLIP ViT-L's role: penultimate states only
TEXT_ENCODER_2 = _text_encoder("CLIPTextModelWithProjection", "gelu")  # OpenCLIP bigG's: states + pooled
ADDITION_TIME_EMBED_DIM = 16

CONFIGS = {
    "model_index.json": {
        "_class_name": "StableDiffusionXLPipeline",
        "_diffusers_version": "0.42.0",
        "force_zeros_for_empty_prompt": True,
        "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    },
    "unet/config.json": {
        "_class_name": "UNet2DConditionModel",
        "sample_size": NATIVE_SIZE // 4,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": [32, 64, 128],  # 16x16, 8x8 and 4x4 latent pixels
        "layers_per_block": 1,
        "norm_num_groups": 16,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "cross_attention_dim": TEXT_ENCODER["hidden_size"] + TEXT_ENCODER_2["hidden_size"],
        "attention_head_dim": [1, 2, 4],  # heads per level, as diffusers names it
        "transformer_layers_per_block": [1, 1, 1],
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": ADDITION_TIME_EMBED_DIM,
        "projection_class_embeddings_input_dim": TEXT_ENCODER_2["projection_dim"] + 6 * ADDITION_TIME_EMBED_DIM,
    },
    "vae/config.json": {
        "_class_name": "AutoencoderKL",
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * 3,
        "up_block_types": ["UpDecoderBlock2D"] * 3,
        "block_out_channels": [16, 32, 64],
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 8,
        "sample_size": NATIVE_SIZE,
        "scaling_factor": 1.0,  # set from the trained encoder's latents (see `configs`)
        "force_upcast": False,
    },
    "text_encoder/config.json": TEXT_ENCODER,
    "text_encoder_2/config.json": TEXT_ENCODER_2,
    "scheduler/scheduler_config.json": SCHEDULER,
}


def configs(scaling_factor: float = 1.0) -> dict:
    """`CONFIGS`, with the VAE's latent scaling factor (1 / the latents' standard deviation)."""
    result = copy.deepcopy(CONFIGS)
    result["vae/config.json"]["scaling_factor"] = float(scaling_factor)
    return result


def component_config(name: str):
    """The model's config object of component `name` ("unet", "vae", "text_encoder", "text_encoder_2")."""
    from ..models import clip, unet, vae
    from ..config import config_from_dict

    cls = {"unet": unet.UNetConfig, "vae": vae.VAEConfig}.get(name, clip.CLIPTextConfig)
    return config_from_dict(cls, CONFIGS[f"{name}/config.json"])


def write_model(folder: Path, params: dict, scaling_factor: float, dtype="float32") -> Path:
    """Writes trained parameters as a diffusers folder that `sdxl.Pipeline.from_pretrained` loads.

    Args:
      params: {"unet", "vae", "text_encoder", "text_encoder_2"} Flax parameter trees.
      scaling_factor: the VAE's latent scaling factor.
      dtype: the stored dtype ("float32" or "float16").
    """
    folder = Path(folder)
    for name, config in configs(scaling_factor).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(config, indent=2) + "\n")
    for component, tree in params.items():
        library = CONFIGS["model_index.json"][component][0]
        filename = "model.safetensors" if library == "transformers" else "diffusion_pytorch_model.safetensors"
        write_params(folder / component / filename, tree, np.dtype(dtype), functools.partial(_leaf, flatten(tree)))
    for tokenizer in ("tokenizer", "tokenizer_2"):
        write_tokenizer(folder / tokenizer, TEXT_ENCODER["max_position_embeddings"])
    return folder


def _leaf(flat: dict, path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(flat[path]).reshape(shape)
