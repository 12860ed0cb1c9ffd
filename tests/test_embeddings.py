"""Textual-inversion embeddings: files read in webui's layouts (sdxl/checkpoints/embeddings.py), and prompts
that name them conditioned as webui conditions them (the oracle, tests/a1111_reference.py), on tiny random
SDXL and SD 1.x models; the token count, and programs that do not recompile."""

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch

import a1111_reference as webui
import kdiffusion_reference as kdiffusion
from reference import sd_pipeline, sdxl_pipeline
from sdxl.serving.models import Model
from sdxl import read_parameters
from sdxl.checkpoints import CheckpointError, embeddings
from sdxl.engine import infotext
from sdxl.engine.infotext import infotext_quote
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.inputs import clip_layers
from sdxl.engine.prepared import PreparedRequest
from sdxl.engine.text_encoding import encode_text
from sdxl.engine.request import Request


def write_sdxl_embedding(path, vectors: int, seed: int = 0, widths=(32, 64)):
    """An SDXL embedding file as webui reads it: `clip_l` and `clip_g`, `vectors` rows each."""
    rng = np.random.default_rng(seed)
    tensors = {key: rng.normal(size=(vectors, width)).astype(np.float32) for key, width in zip(("clip_l", "clip_g"),
                                                                                                 widths)}
    safetensors.numpy.save_file(tensors, str(path))
    return tensors


def write_sd1_embedding(path, vectors: int, seed: int = 0, width: int = 32, key: str = "emb_params"):
    """An SD 1.x embedding file: one tensor under `key` (kohya's `emb_params`, webui's `string_to_param.*`)."""
    tensor = np.random.default_rng(seed).normal(size=(vectors, width)).astype(np.float32)
    safetensors.numpy.save_file({key: tensor}, str(path))
    return tensor


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """(diffusers' modules, our pipeline with "myemb" (3 vectors) and "neg" (2) loaded, {name: vectors})."""
    folder = tmp_path_factory.mktemp("sdxl-embeddings")
    ref = sdxl_pipeline(folder)
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=8)
    widths = tuple(config.hidden_size for config in pipe.spec.text_encoders)
    vectors = {"myemb": write_sdxl_embedding(folder / "myemb.safetensors", 3, 1, widths),
               "neg": write_sdxl_embedding(folder / "neg.safetensors", 2, 2, widths)}
    pipe.load_textual_inversion([folder / "myemb.safetensors", folder / "neg.safetensors"])
    return ref, pipe, {name: {k: torch.from_numpy(v) for k, v in tensors.items()} for name, tensors in vectors.items()}


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """SD 1.x (its final norm's bias shifted, as tests/test_prompts.py's) with an `emb_params` embedding "sks"."""
    folder = tmp_path_factory.mktemp("sd1-embeddings")
    ref = sd_pipeline(folder)
    with torch.no_grad():
        ref.text_encoder.final_layer_norm.bias += 0.5
    ref.text_encoder.save_pretrained(folder / "text_encoder", safe_serialization=True)
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=8)
    vectors = write_sd1_embedding(folder / "sks.safetensors", 4, 3, pipe.spec.text_encoders[0].hidden_size)
    pipe.load_textual_inversion(folder / "sks.safetensors")
    return ref, pipe, {"sks": torch.from_numpy(vectors)}


def our_conditioning(pipe, text, negative=False):
    """The program's text conditioning of one prompt: ([1, 77k, D], pooled or None)."""
    ids, weights = pipe.prompts.read(text, negative=negative)
    layers = clip_layers(pipe.spec, Request.from_prompt(text, num_images=1, height=64, width=64))  # clip skip 1
    return encode_text(pipe.spec, pipe.params, jnp.asarray(ids[None]), jnp.asarray(weights[None]),
                       jnp.array([True]), jnp.array([[layer for layer, _ in layers]]),
                       jnp.array([[norm for _, norm in layers]]), jnp.float32)


# A name alone, weighted, beside a comma, twice; in a longer word, which the tokenizer reads as other ids
# (webui matches names on token ids, not on text); and one whose vectors do not fit the chunk's last two
# positions and open the next.
SDXL_PROMPTS = ["myemb", "a red cube, (myemb:1.2)", "[neg] myemb, myemb", "myembs on a table", "x" * 73 + "myemb"]


@pytest.mark.parametrize("prompt", SDXL_PROMPTS, ids=["alone", "weighted", "twice", "in a word", "next chunk"])
@pytest.mark.parametrize("negative", [False, True], ids=["positive", "negative"])
def test_sdxl_embeddings_condition_as_webui(sdxl, prompt, negative):
    ref, pipe, vectors = sdxl
    encoders = (ref.tokenizer, ref.tokenizer_2), (ref.text_encoder, ref.text_encoder_2)
    expected, expected_pooled = webui.sdxl_conditioning(prompt, *encoders, negative=negative, embeddings=vectors)
    plain, _ = webui.sdxl_conditioning(prompt, *encoders, negative=negative)
    z, pooled = our_conditioning(pipe, prompt, negative)
    assert z.shape == tuple(expected.shape)
    np.testing.assert_allclose(np.asarray(z), expected.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pooled), expected_pooled.numpy(), rtol=1e-5, atol=1e-5)
    changed = plain.shape != expected.shape or np.abs(plain - expected).max() > 1e-2
    assert changed == ("myembs" not in prompt), "a name counts where it is a word of its own"


def test_an_embedding_that_does_not_fit_opens_the_next_chunk(sdxl):
    _, pipe, _ = sdxl
    ids, _ = pipe.prompts.read("x" * 73 + "myemb")
    vocab = pipe.spec.text_encoders[0].vocab_size
    assert ids.shape == (2, 2 * 77)
    assert not (ids[:, :77] >= vocab).any()
    np.testing.assert_array_equal(ids[:, 78:81], [[vocab, vocab + 1, vocab + 2]] * 2)  # after the BOS


@pytest.mark.parametrize("prompt", ["sks", "a photo of (sks:0.8) dog", "sks, sks sks"])
def test_sd1_emb_params_embedding_conditions_as_webui(sd1, prompt):
    ref, pipe, vectors = sd1
    expected = webui.sd1_conditioning(prompt, ref.tokenizer, ref.text_encoder, embeddings=vectors)
    z, _ = our_conditioning(pipe, prompt)
    np.testing.assert_allclose(np.asarray(z), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_the_token_count_counts_an_embeddings_vectors(sdxl):
    _, pipe, _ = sdxl
    assert pipe.prompts.length_text("myemb") == "3 tokens, 1 chunk"
    assert pipe.prompts.length_text("x" * 73 + "myemb") == "78 tokens, 2 chunks"  # 75 for the first, closed early


def test_the_embeddings_a_prompt_names(sdxl):
    _, pipe, _ = sdxl
    named = pipe.prompts.embeddings_in("neg, <lora:x:1> (myemb:1.1) neg")
    assert [embedding.name for embedding in named] == ["neg", "myemb"]
    assert pipe.prompts.embeddings_in("no names here") == []


def test_embeddings_keep_the_programs_of_prompts_without_them_and_text_changes_none(sdxl, tmp_path):
    _, pipe, _ = sdxl
    def program(text):
        return pipe.programs_for(Request.from_prompt(text, num_images=1, steps=2, height=64, width=64))[0]

    assert program("a red cube").embedding_rows == 0
    named = [program(text) for text in ("myemb", "a (neg:1.3) cube, myemb")]
    assert named[0] == named[1] and named[0].embedding_rows == embeddings.ROW_BLOCK
    widths = tuple(config.hidden_size for config in pipe.spec.text_encoders)
    write_sdxl_embedding(tmp_path / "more.safetensors", 5, 4, widths)
    pipe.load_textual_inversion(tmp_path / "more.safetensors")
    assert program("more myemb") == named[0], "a block holds them all"
    keys = [pipe.prepare(Request.from_prompt(text, num_images=1, steps=2, height=64, width=64)).batch_key
            for text in ("a red cube", "a red myemb")]
    assert keys[0] != keys[1], "the device queue merges requests of one program only"


@pytest.mark.compiles
def test_a_grid_merging_a_cell_without_embeddings_first_draws_the_embedding_cell_as_alone(sdxl):
    """A grid's cells merge by their settings alone: the merged program reads the vectors where any cell does."""
    _, pipe, _ = sdxl
    plain, named = (pipe.prepare(Request.from_prompt(text, num_images=1, steps=2, height=64, width=64, seed=3),
                                 output_type="np") for text in ("a red cube", "a red cube, myemb"))
    merged = PreparedRequest.merged([plain, named], pipe.padded_batch(2))
    assert merged.program.embedding_rows == named.program.embedding_rows
    np.testing.assert_allclose(pipe.render(merged).images[1], pipe.render(named).images[0], atol=1e-5)


# --- files ---

SDXL_WIDTHS = (32, 64)


@pytest.fixture(scope="module")
def specs(sdxl, sd1):
    return sdxl[1].spec, sd1[1].spec


def test_reads_sdxl_files_and_names_them_by_stem_or_token(specs, tmp_path):
    sdxl_spec, _ = specs
    widths = tuple(config.hidden_size for config in sdxl_spec.text_encoders)
    tensors = write_sdxl_embedding(tmp_path / "Style Word.safetensors", 2, widths=widths)
    read = embeddings.read(tmp_path / "Style Word.safetensors", sdxl_spec)
    assert read.name == "Style Word" and read.count == 2
    np.testing.assert_array_equal(read.vectors[0], tensors["clip_l"])
    np.testing.assert_array_equal(read.vectors[1], tensors["clip_g"])
    assert embeddings.read(tmp_path / "Style Word.safetensors", sdxl_spec, "other").name == "other"


@pytest.mark.parametrize("key", ["emb_params", "string_to_param.*", "<concept>"])
def test_reads_sd1_files_of_one_tensor(specs, tmp_path, key):
    _, sd1_spec = specs
    tensor = write_sd1_embedding(tmp_path / "e.safetensors", 3, width=sd1_spec.text_encoders[0].hidden_size, key=key)
    read = embeddings.read(tmp_path / "e.safetensors", sd1_spec)
    np.testing.assert_array_equal(read.vectors[0], tensor)


def test_a_single_vector_is_one_row(specs, tmp_path):
    _, sd1_spec = specs
    vector = np.arange(sd1_spec.text_encoders[0].hidden_size, dtype=np.float32)
    safetensors.numpy.save_file({"emb_params": vector}, str(tmp_path / "one.safetensors"))
    assert embeddings.read(tmp_path / "one.safetensors", sd1_spec).vectors[0].shape == (1, vector.size)


def test_the_hash_is_webuis_shorthash(specs, tmp_path):
    import hashlib

    _, sd1_spec = specs
    path = tmp_path / "e.safetensors"
    write_sd1_embedding(path, 1, width=sd1_spec.text_encoders[0].hidden_size)
    assert embeddings.read(path, sd1_spec).short_hash == hashlib.sha256(path.read_bytes()).hexdigest()[:12]


@pytest.mark.parametrize("suffix", [".pt", ".bin"])
def test_pickled_embeddings_are_refused_with_a_sentence(specs, tmp_path, suffix):
    path = tmp_path / f"e{suffix}"
    path.write_bytes(b"not read")
    with pytest.raises(CheckpointError, match=r"pickled file; it is never loaded .* Use the embedding's .safetensors"):
        embeddings.read(path, specs[0])


def test_files_of_another_model_are_refused(specs, tmp_path):
    sdxl_spec, sd1_spec = specs
    write_sdxl_embedding(tmp_path / "xl.safetensors", 2, widths=SDXL_WIDTHS)
    write_sd1_embedding(tmp_path / "one.safetensors", 2, width=sd1_spec.text_encoders[0].hidden_size)
    with pytest.raises(CheckpointError, match="one tensor expected .* found clip_g, clip_l"):
        embeddings.read(tmp_path / "xl.safetensors", sd1_spec)
    with pytest.raises(CheckpointError, match="not an SDXL embedding .* has emb_params"):
        embeddings.read(tmp_path / "one.safetensors", sdxl_spec)
    write_sd1_embedding(tmp_path / "wide.safetensors", 2, width=7)
    with pytest.raises(CheckpointError, match=r"vectors of shape \(2, 7\) do not fit"):
        embeddings.read(tmp_path / "wide.safetensors", sd1_spec)
    with pytest.raises(CheckpointError, match="no such file"):
        embeddings.read(tmp_path / "missing.safetensors", sd1_spec)


def test_the_tables_hold_the_vectors_in_blocks(specs, tmp_path):
    sdxl_spec, _ = specs
    widths = tuple(config.hidden_size for config in sdxl_spec.text_encoders)
    read = []
    for i, count in enumerate((3, 2)):
        write_sdxl_embedding(tmp_path / f"e{i}.safetensors", count, i, widths)
        read.append(embeddings.read(tmp_path / f"e{i}.safetensors", sdxl_spec))
    tables = embeddings.table(read, sdxl_spec)
    assert [t.shape for t in tables] == [(embeddings.ROW_BLOCK, w) for w in widths]
    np.testing.assert_array_equal(tables[1][:5], np.concatenate([e.vectors[1] for e in read]))
    assert not tables[1][5:].any()
    assert [t.shape for t in embeddings.table([], sdxl_spec)] == [(0, w) for w in widths]


# --- pictures: an infotext pasted as `pipe.generate(**read_parameters(text), num_images=2)`, as A1111 draws it ---

PICTURE = dict(height=64, width=96, seed=11, steps=6, cfg=5.0)


def a1111_infotext(prompt: str, negative: str, sampler: str, schedule_type: str, rng: str, ti_hashes: str,
                   clip_skip: int = 1) -> str:
    p = PICTURE
    skip = f"Clip skip: {clip_skip}, " if clip_skip > 1 else ""  # where webui writes it
    return (f"{prompt}\nNegative prompt: {negative}\nSteps: {p['steps']}, Sampler: {sampler}, Schedule type: "
            f"{schedule_type}, CFG scale: {p['cfg']:g}, Seed: {p['seed']}, Size: {p['width']}x{p['height']}, "
            f"Model hash: 0123456789, {skip}RNG: {rng}, TI hashes: {infotext_quote(ti_hashes)}, Version: v1.10.1")


def a1111_pictures(ref, pipe, conditioning, prompt, negative, sampler, schedule_type, rng) -> np.ndarray:
    """[2, H, W, 3] A1111's txt2img of two images over k-diffusion, given a conditioning function
    (text, negative) -> the model's cond dict for one image."""
    config = ref.scheduler.config
    is_sdxl = hasattr(ref, "text_encoder_2")

    def unet(x, t, cond):
        extra = {"added_cond_kwargs": {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]}} if is_sdxl else {}
        return ref.unet(x, t.flatten(), encoder_hidden_states=cond["crossattn"], **extra).sample

    model = kdiffusion.model_wrap(kdiffusion.CompVisModel(unet, config.beta_start, config.beta_end,
                                                          config.num_train_timesteps))
    h, w, c = pipe.spec.latent_shape(PICTURE["height"], PICTURE["width"])
    batch = lambda cond: {key: value.repeat(2, *[1] * (value.ndim - 1)) for key, value in cond.items()}  # noqa: E731
    with torch.no_grad():
        latents = kdiffusion.txt2img(
            model, batch(conditioning(prompt, False)), batch(conditioning(negative, True)), sampler=sampler,
            scheduler=schedule_type, steps=PICTURE["steps"], cfg_scale=PICTURE["cfg"], seed=PICTURE["seed"],
            subseed=0, subseed_strength=0.0, ensd=0, source=rng, shape=(c, h, w))
        images = ref.vae.decode(latents / ref.vae.config.scaling_factor).sample
    return (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


SDXL_PICTURES = {
    "in the negative prompt": ("a red cube on a table", "blurry, neg"),
    "weighted in the prompt": ("a red cube, (myemb:1.2)", "blurry"),
}


@pytest.mark.oracle
@pytest.mark.parametrize("case", SDXL_PICTURES)
def test_sdxl_embeddings_draw_a1111s_images(sdxl, case):
    ref, pipe, vectors = sdxl
    prompt, negative = SDXL_PICTURES[case]
    hashes = ", ".join(f"{e.name}: {e.short_hash}" for e in pipe.prompts.embeddings)
    ours = pipe.generate(**read_parameters(a1111_infotext(prompt, negative, "Euler a", "Karras", "CPU", hashes),
                                           pipe), num_images=2, output_type="np")
    encoders = (ref.tokenizer, ref.tokenizer_2), (ref.text_encoder, ref.text_encoder_2)

    def conditioning(text, negative):
        z, pooled = webui.sdxl_conditioning(text, *encoders, negative=negative, embeddings=vectors)
        time_ids = torch.tensor([[PICTURE["height"], PICTURE["width"], 0, 0, PICTURE["height"], PICTURE["width"]]],
                                dtype=torch.float32)
        return {"crossattn": z, "pooled": pooled, "time_ids": time_ids}

    theirs = a1111_pictures(ref, pipe, conditioning, prompt, negative, "Euler a", "Karras", "CPU")
    diff = np.abs(ours - theirs).max()
    print(f"{case}: max abs diff {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.oracle
def test_sd1_emb_params_embedding_with_clip_skip_draws_a1111s_images(sd1):
    """The issue's SD 1.x case: an emb_params embedding, and "Clip skip: 2"."""
    ref, pipe, vectors = sd1
    prompt, negative = "a photo of (sks:1.1) dog", "blurry, sks"
    hashes = f"sks: {pipe.prompts.embeddings[0].short_hash}"
    text = a1111_infotext(prompt, negative, "DPM++ 2M", "Karras", "NV", hashes, clip_skip=2)
    ours = pipe.generate(**read_parameters(text, pipe), num_images=2, output_type="np")

    def conditioning(text, negative):
        return {"crossattn": webui.sd1_conditioning(text, ref.tokenizer, ref.text_encoder, clip_skip=2,
                                                    embeddings=vectors)}

    theirs = a1111_pictures(ref, pipe, conditioning, prompt, negative, "DPM++ 2M", "Karras", "NV")
    diff = np.abs(ours - theirs).max()
    print(f"max abs diff {diff:.2e}")
    assert diff <= 1e-4


# --- infotexts ---

def test_infotexts_write_ti_hashes_and_read_them_back(sdxl):
    _, pipe, _ = sdxl
    request = pipe.prepare(Request.from_prompt("a cube, (myemb:1.1), neg", "neg, blurry", num_images=1, seed=3,
                                               steps=2, height=64, width=64)).request
    hashes = {e.name: e.short_hash for e in pipe.prompts.embeddings}
    text = infotext.png_parameters(pipe, request, 0, "tiny")
    assert f'TI hashes: "myemb: {hashes["myemb"]}, neg: {hashes["neg"]}"' in text, "the prompt's, then the negative's"
    found, unused = infotext.read_infotext(text, pipe)
    assert found["prompt"] == "a cube, (myemb:1.1), neg" and not [u for u in unused if u.startswith("embedding ")]
    plain_request = pipe.prepare(Request.from_prompt("a cube", num_images=1, steps=2, height=64, width=64)).request
    plain = infotext.png_parameters(pipe, plain_request, 0, "tiny")
    assert "TI hashes" not in plain


def test_a_pasted_text_naming_embeddings_not_loaded_warns_with_their_names(sdxl):
    _, pipe, _ = sdxl
    myemb = next(e for e in pipe.prompts.embeddings if e.name == "myemb")
    # webui's SDXL texts name each embedding once per encoder
    text = (f"easynegative, myemb\nSteps: 20, Sampler: Euler a, Seed: 1, Size: 64x64, "
            f'TI hashes: "easynegative: 0123456789ab, myemb: ffffffffffff, easynegative: 0123456789ab, '
            f'myemb: {myemb.short_hash}"')
    with pytest.warns(UserWarning, match=r"parameters not applied: embedding easynegative \(not loaded\), "
                                         rf"embedding myemb \(hash ffffffffffff; loaded: {myemb.short_hash}\)$"):
        read_parameters(text, pipe)


# --- the CLI and the demo's launch ---

def test_the_cli_refuses_pickled_or_missing_embeddings_before_loading(capsys, tmp_path):
    from sdxl.__main__ import main

    for path, reason in ((tmp_path / "e.pt", f"error: {tmp_path / 'e.pt'}: a pickled file; it is never loaded"),
                         (tmp_path / "gone.safetensors", f"error: embedding {tmp_path / 'gone.safetensors'}: no such "
                                                         "file or folder")):
        assert main(["generate", "--model", "tiny", "--prompt", "a fox", "--embedding", str(path)]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(reason) and err.count("\n") == 1 and "loaded" not in out


def test_the_demo_lists_the_embeddings_loaded_at_launch_with_their_token_counts(tmp_path):
    from sdxl.serving import launch
    from sdxl.serving.options import demo_parser
    from sdxl.serving.choices import choices_of
    from sdxl.serving.demo import DemoService

    spec = Pipeline.from_pretrained("tiny", dtype="float32").spec
    widths = tuple(config.hidden_size for config in spec.text_encoders)
    (tmp_path / "folder").mkdir()
    write_sdxl_embedding(tmp_path / "folder/b-neg.safetensors", 2, 1, widths)
    write_sdxl_embedding(tmp_path / "folder/a-style.safetensors", 1, 2, widths)
    write_sdxl_embedding(tmp_path / "solo.safetensors", 3, 3, widths)
    options = demo_parser("SDXL on JAX").parse_args(
        ["--model", "tiny", "--dtype", "float32", "--cache-dir", str(tmp_path / "xla"),
         "--embedding", str(tmp_path / "solo.safetensors"), "--embedding", str(tmp_path / "folder")])
    pipe = launch.load(options).pipe
    assert [e.name for e in pipe.prompts.embeddings] == ["solo", "a-style", "b-neg"]
    line = choices_of(DemoService([Model("tiny", pipe)], max_images_per_core=1)).embeddings
    assert line == "Embeddings, by name in a prompt: `solo` (3 tokens), `a-style` (1 token), `b-neg` (2 tokens)"
    assert [e.name for e in pipe.prompts.embeddings_in("solo b-neg")] == ["solo", "b-neg"]
    assert pipe.prompts.length_text("solo b-neg") == "5 tokens, 1 chunk"


def test_tokens_name_embeddings_and_a_name_loaded_again_takes_the_new_vectors(tmp_path):
    pipe = Pipeline.from_pretrained("tiny", dtype="float32")
    widths = tuple(config.hidden_size for config in pipe.spec.text_encoders)
    first = write_sdxl_embedding(tmp_path / "a.safetensors", 2, 1, widths)
    write_sdxl_embedding(tmp_path / "b.safetensors", 1, 2, widths)
    pipe.load_textual_inversion([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], token=["style", "b"])
    again = write_sdxl_embedding(tmp_path / "c.safetensors", 3, 3, widths)
    pipe.load_textual_inversion(tmp_path / "c.safetensors", token="style")
    assert [(e.name, e.count) for e in pipe.prompts.embeddings] == [("b", 1), ("style", 3)]
    tables = [np.asarray(t) for t in pipe.params["embeddings"]]
    np.testing.assert_array_equal(tables[1][1:4], again["clip_g"])
    assert not any(np.array_equal(tables[0][i:i + 2], first["clip_l"]) for i in range(4)), "the old vectors are gone"
    with pytest.raises(ValueError, match=r"one token per embedding file: 2 file\(s\), 1 token\(s\)"):
        pipe.load_textual_inversion([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], token=["x"])
