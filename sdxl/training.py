"""Training the `shapes` model from scratch: the example of how to train or fine-tune with this code.

    python -m sdxl train-shapes --out DIR [--seed 0] [--vae-steps N] [--steps N] [--decoder-steps N]

With the defaults it reproduces the shipped `assets/shapes` weights: about 3.5 hours on one core of
a 2-core CPU (another CPU, or other library versions, may round differently along the way).
    python -m sdxl train-shapes --init MODEL --out DIR ...   # fine-tune a shapes model instead

Up to three phases, each a jitted optax step over batches that `sdxl.checkpoints.shapes` renders on the fly:

1. The VAE: L1 reconstruction of a posterior sample, plus a small KL term towards N(0, 1).
2. Both text encoders and the UNet together, on the frozen VAE's scaled latents, with the epsilon
   loss of the model's scheduler (`shapes.SCHEDULER`: DDPM's linear betas, 1000 steps). The UNet is
   conditioned exactly as `sdxl.Pipeline` conditions it: both encoders' penultimate hidden states as the context, the
   second's projected pooled output and the size ids (h, w, 0, 0, h, w) as the added embedding. One
   caption in ten is dropped, with its conditioning zeroed as the pipeline zeroes an empty negative
   prompt (`force_zeros_for_empty_prompt`): that is the unconditional branch of classifier-free guidance.
3. The VAE's decoder alone (`--decoder-steps`; 0 skips it), the encoder frozen: sharper images
   from the same latents.

Everything follows from the seed: batch `s` of a phase is rendered from (seed, phase, s) and its
noise drawn from a key folded from the same, so a run stopped and resumed from a checkpoint (written
every `--checkpoint-every` steps to DIR/checkpoints) gives the weights an uninterrupted run gives. The
learning rate is constant after a warm-up, so the weights after N steps do not depend on the total.
Each checkpoint also exports the model (the UNet and text encoders' moving averages) to DIR/model,
a diffusers folder that `sdxl.Pipeline.from_pretrained` loads.

To fine-tune: `--init MODEL` starts phase 2 from a model's parameters (keeping its VAE); to train on
other data, feed your own batches to the same steps.
"""

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .checkpoints import shapes
from .checkpoints.tokenizer import load_tokenizer, tokenize
from .config import config_from_dict
from .models.clip import CLIPTextModel
from .models.unet import UNet2DConditionModel
from .models.vae import AutoencoderKL
from .sampling import schedulers

TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder for checkpoints/ and the exported model/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-steps", type=int, default=2400)
    parser.add_argument("--vae-batch", type=int, default=16)
    parser.add_argument("--vae-lr", type=float, default=1e-3)
    parser.add_argument("--kl-weight", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=10000, help="steps of the text encoders and UNet")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--ema", type=float, default=0.999, help="decay of the exported weights' moving average")
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--checkpoint-every", type=int, default=250)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"), help="of the exported weights")
    parser.add_argument("--init", help="a shapes model folder to fine-tune: its VAE is kept (no phase 1), "
                        "its text encoders and UNet are trained on")
    parser.add_argument("--decoder-steps", type=int, default=2000,
                        help="then sharpen the VAE's decoder alone, the encoder (so the latents) kept as they are")
    parser.add_argument("--decoder-lr", type=float, default=3e-4)


def command(args: argparse.Namespace) -> None:
    out = Path(args.out)
    start = time.perf_counter()
    if args.init:
        initial = load_model(args.init)
        vae_params, scaling_factor = initial.pop("vae"), initial.pop("scaling_factor")
        print(f"fine-tuning {args.init}; latent scaling factor {scaling_factor:.4f}", flush=True)
    else:
        initial = None
        vae_params = train_vae(args, out / "checkpoints" / "vae.msgpack")
        scaling_factor = latent_scaling_factor(vae_params, args.seed)
        print(f"VAE done; latent scaling factor {scaling_factor:.4f}", flush=True)
    diffusion = jax.device_get(train_diffusion(args, out, vae_params, scaling_factor, initial)["ema"])
    if args.decoder_steps:
        vae_params = train_decoder(args, out, vae_params, diffusion, scaling_factor)
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min; the model is in {out / 'model'}", flush=True)


# ---------------------------------------------------------------------------------------------
# The models and their parameters.

VAE = AutoencoderKL(shapes.component_config("vae"))
UNET = UNet2DConditionModel(shapes.component_config("unet"))
ENCODERS = {name: CLIPTextModel(shapes.component_config(name)) for name in TEXT_ENCODERS}
SIZE = shapes.NATIVE_SIZE
# diffusers' _get_add_time_ids: (original height, width, crop top, left, target height, width).
TIME_IDS = jnp.array([SIZE, SIZE, 0, 0, SIZE, SIZE], jnp.float32)


def run_once(fn: Callable, *args):
    """`fn(*args)` compiled without XLA's backend optimisations: the same numbers (initializers are
    random draws and copies), in half the compile time of a program that runs once (20 s of init_diffusion's 44).
    Traced (`restore` reads a state's shapes), it is `fn` itself."""
    if any(isinstance(arg, jax.core.Tracer) for arg in args):
        return fn(*args)
    return jax.jit(fn).lower(*args).compile(compiler_options={"xla_backend_optimization_level": 0})(*args)


def init_vae(key: jax.Array) -> dict:
    return VAE.init(key, jnp.zeros((1, SIZE, SIZE, 3)))["params"]


def init_diffusion(key: jax.Array) -> dict:
    """The trained parameters of phase 2: both text encoders and the UNet."""
    keys = jax.random.split(key, 3)
    ids = jnp.zeros((1, shapes.TEXT_ENCODER["max_position_embeddings"]), jnp.int32)
    params = {name: ENCODERS[name].init(k, ids)["params"] for name, k in zip(TEXT_ENCODERS, keys)}
    latent = SIZE // VAE.config.downscale_factor
    context = jnp.zeros((1, ids.shape[1], UNET.config.cross_attention_dim))
    pooled = jnp.zeros((1, shapes.TEXT_ENCODER_2["projection_dim"]))
    x = jnp.zeros((1, latent, latent, 4))
    params["unet"] = UNET.init(keys[2], x, jnp.zeros(1), context, pooled, TIME_IDS[None])["params"]
    return params


def load_model(folder: str) -> dict:
    """A shapes model's float32 parameters {"unet", "vae", "text_encoder", "text_encoder_2"}, and its
    "scaling_factor", loaded as the pipeline loads them."""
    from .checkpoints import resolve

    checkpoint = resolve(folder, dtype="float32")
    params = checkpoint.load(jnp.float32, jnp.asarray)
    return {**params, "scaling_factor": checkpoint.spec.vae.scaling_factor}


def to_model_input(images: np.ndarray) -> jax.Array:
    """uint8 [B, H, W, 3] -> float32 in [-1, 1], as the VAE takes (and the pipeline decodes to)."""
    return jnp.asarray(images, jnp.float32) / 127.5 - 1


def optimizer(lr: float) -> optax.GradientTransformation:
    warmup = optax.linear_schedule(0.0, lr, 200)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(warmup, weight_decay=1e-4))


# ---------------------------------------------------------------------------------------------
# Checkpoints: the whole training state, written atomically.


def save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_bytes(flax.serialization.to_bytes(state))
    os.replace(partial, path)


def restore(path: Path, new_state: Callable[[], dict]) -> dict:
    """The state saved at `path`, or `new_state()` when there is none.

    A saved state is read into `new_state`'s shapes alone: initializing the models' parameters takes
    most of a minute on a CPU, for nothing on a resume."""
    if not path.is_file():
        return new_state()
    state = flax.serialization.from_bytes(jax.eval_shape(new_state), path.read_bytes())
    print(f"resumed {path} at step {int(state['step'])}", flush=True)
    return state


# ---------------------------------------------------------------------------------------------
# Phase 1: the VAE.


def vae_loss(params: dict, images: jax.Array, key: jax.Array, kl_weight: float) -> jax.Array:
    mean, logvar = VAE.apply({"params": params}, images, method=VAE.encode)
    latents = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
    reconstruction = VAE.apply({"params": params}, latents, method=VAE.decode)
    kl = 0.5 * jnp.mean(mean**2 + jnp.exp(logvar) - 1 - logvar)
    return jnp.mean(jnp.abs(reconstruction - images)) + kl_weight * kl


def train_vae(args: argparse.Namespace, path: Path) -> dict:
    tx = optimizer(args.vae_lr)

    def new_state():
        params = run_once(init_vae, jax.random.key(args.seed))
        return {"step": jnp.int32(0), "params": params, "opt": tx.init(params)}

    state = restore(path, new_state)

    @jax.jit
    def step(state, images, key):
        loss, grads = jax.value_and_grad(vae_loss)(state["params"], images, key, args.kl_weight)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    return run(state, step, args.vae_steps, args, path, phase=1, batch=args.vae_batch)["params"]


def latent_scaling_factor(vae_params: dict, seed: int, batches: int = 8) -> float:
    """1 / the standard deviation of the VAE's latents, so that the UNet sees unit-variance latents."""
    encode = jax.jit(lambda images: VAE.apply({"params": vae_params}, images, method=VAE.encode)[0])
    latents = [encode(to_model_input(shapes.training_batch(seed + 3000, i, 32)[0])) for i in range(batches)]
    return float(1 / jnp.std(jnp.concatenate(latents)))


# ---------------------------------------------------------------------------------------------
# Phase 2: the text encoders and the UNet.


def alphas_cumprod() -> jax.Array:
    """The model's noise schedule, as its scheduler config (`shapes.SCHEDULER`) gives it to the pipeline."""
    return jnp.asarray(schedulers.alphas_cumprod(config_from_dict(schedulers.SchedulerConfig, shapes.SCHEDULER)))


def encode_text(params: dict, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """As the pipeline encodes a prompt: (both encoders' penultimate states concatenated, pooled output)."""
    states = []
    for name in TEXT_ENCODERS:
        out = ENCODERS[name].apply({"params": params[name]}, ids)
        states.append(out.hidden_states[-2])
    return jnp.concatenate(states, axis=-1), out.text_embeds


def diffusion_loss(params, latents, ids, keep, key, snr_gamma: float = 5.0):
    """The epsilon-prediction loss at a uniformly drawn timestep, weighted by min(SNR, 5) / SNR.

    Args:
      latents: [B, h, w, 4] scaled latents.
      ids: [B, T] token ids (both tokenizers are the same).
      keep: [B] 0 where the caption is dropped (its conditioning is then all zeros).
    """
    t_key, noise_key, offset_key = jax.random.split(key, 3)
    batch = latents.shape[0]
    t = jax.random.randint(t_key, (batch,), 0, shapes.SCHEDULER["num_train_timesteps"])
    # A little per-channel offset noise, so that the model does not read the image's mean colour
    # off the starting noise (the schedule leaves some signal at its last step).
    noise = jax.random.normal(noise_key, latents.shape) + 0.1 * jax.random.normal(offset_key, (batch, 1, 1, 4))
    alpha = alphas_cumprod()[t][:, None, None, None]
    noisy = jnp.sqrt(alpha) * latents + jnp.sqrt(1 - alpha) * noise

    context, pooled = encode_text(params, ids)
    context, pooled = context * keep[:, None, None], pooled * keep[:, None]
    time_ids = jnp.broadcast_to(TIME_IDS, (batch, 6))
    predicted = UNET.apply({"params": params["unet"]}, noisy, t, context, pooled, time_ids)

    snr = alpha[:, 0, 0, 0] / (1 - alpha[:, 0, 0, 0])
    weight = jnp.minimum(snr, snr_gamma) / snr  # Min-SNR weighting (Hang et al., 2023)
    return jnp.mean(weight * jnp.mean((predicted - noise) ** 2, axis=(1, 2, 3)))


def train_diffusion(args, out: Path, vae_params: dict, scaling_factor: float, initial: dict | None = None) -> dict:
    """Phase 2, from `initial` parameters (fine-tuning) or from random ones."""
    tx = optimizer(args.lr)

    def new_state():
        params = initial or run_once(init_diffusion, jax.random.key(args.seed + 1))
        return {"step": jnp.int32(0), "params": params, "opt": tx.init(params), "ema": params}

    path = out / "checkpoints" / "diffusion.msgpack"
    state = restore(path, new_state)
    tokenizer_folder = out / "tokenizer"
    shapes.write_tokenizer(tokenizer_folder)
    tokenizer = load_tokenizer(tokenizer_folder)
    max_tokens = shapes.TEXT_ENCODER["max_position_embeddings"]

    @jax.jit
    def step(state, images, ids, keep, key):
        encode_key, key = jax.random.split(key)
        mean, logvar = VAE.apply({"params": vae_params}, images, method=VAE.encode)
        latents = (mean + jnp.exp(0.5 * logvar) * jax.random.normal(encode_key, mean.shape)) * scaling_factor
        loss, grads = jax.value_and_grad(diffusion_loss)(state["params"], latents, ids, keep, key)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        decay = jnp.minimum(args.ema, (1 + state["step"]) / (10 + state["step"]))
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, state["ema"], params)
        return {"step": state["step"] + 1, "params": params, "opt": opt, "ema": ema}, loss

    def batch_inputs(images, captions, rng):
        keep = rng.random(len(captions)) >= args.caption_dropout
        captions = [c if k else "" for c, k in zip(captions, keep)]
        ids, _ = tokenize(tokenizer, captions, max_tokens)
        return ids, keep.astype(np.float32)

    def export(state):
        export_model(out, vae_params, jax.device_get(state["ema"]), scaling_factor, args.dtype)

    return run(state, step, args.steps, args, path, phase=2, batch=args.batch, inputs=batch_inputs, export=export)


def export_model(out: Path, vae_params: dict, diffusion_params: dict, scaling_factor: float, dtype: str) -> None:
    """Writes the model (the VAE, and the text encoders and UNet) to out/model, a diffusers folder."""
    shapes.write_model(out / "model", {"vae": vae_params, **diffusion_params}, scaling_factor, dtype)


# ---------------------------------------------------------------------------------------------
# Phase 3 (optional): the decoder alone.

DECODER_PARAMS = ("post_quant_conv", "decoder")


def train_decoder(args, out: Path, vae_params: dict, diffusion_params: dict, scaling_factor: float) -> dict:
    """The VAE with its decoder trained on for `--decoder-steps`, on the frozen encoder's posterior
    samples: sharper corners, from the same latents the UNet learnt to draw."""
    tx = optimizer(args.decoder_lr)
    frozen = {k: v for k, v in vae_params.items() if k not in DECODER_PARAMS}
    trained = {k: vae_params[k] for k in DECODER_PARAMS}
    path = out / "checkpoints" / "decoder.msgpack"
    state = restore(path, lambda: {"step": jnp.int32(0), "params": trained, "opt": tx.init(trained)})

    @jax.jit
    def step(state, images, key):
        # The KL term does not depend on the decoder; the reconstruction is all that is left.
        loss_fn = lambda decoder: vae_loss(frozen | decoder, images, key, kl_weight=0.0)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    def export(state):
        export_model(out, frozen | jax.device_get(state["params"]), diffusion_params, scaling_factor, args.dtype)

    state = run(state, step, args.decoder_steps, args, path, phase=3, batch=args.vae_batch, export=export)
    return frozen | jax.device_get(state["params"])


# ---------------------------------------------------------------------------------------------
# The loop both phases share.


def run(state, step, steps, args, path, *, phase, batch, inputs=None, export=None):
    """Runs `step` until state["step"] == steps, checkpointing (and exporting) every few steps."""
    first, losses, start = int(state["step"]), [], time.perf_counter()
    for s in range(first, steps):
        images, captions = shapes.training_batch(args.seed + 1000 * phase, s, batch)
        key = jax.random.fold_in(jax.random.key(args.seed + 1000 * phase), s)
        extra = inputs(images, captions, np.random.default_rng([args.seed, phase, s])) if inputs else ()
        state, loss = step(state, to_model_input(images), *extra, key)
        losses.append(float(loss))
        done = s + 1
        if done % 50 == 0 or done == steps:
            rate = (done - first) / (time.perf_counter() - start)
            loss = np.mean(losses[-50:])
            print(f"phase {phase} step {done}/{steps} loss {loss:.4f} ({rate:.2f} steps/s)", flush=True)
        if done % args.checkpoint_every == 0 or done == steps:
            save(path, state)
            if export:
                export(state)
    if export and first == steps:
        export(state)
    return state


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    command(parser.parse_args())
