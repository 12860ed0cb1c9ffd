"""Prompts as the text encoders read them, the way AUTOMATIC1111's webui reads them (`sdxl.prompts.syntax`):
weights, BREAK, prompts longer than 77 tokens in chunks, LoRA tags taken out of the text, textual-inversion
embeddings' names read as their vectors, and prompt editing and alternation (`sdxl.prompts.editing`).

`Prompts.tokens(prompts, negative_prompts)` gives a batch its `Tokens`: every prompt's chunks for every text encoder,
ids and weights, padded to the request's chunk count (one of `CHUNK_COUNTS`), with each prompt's own
count. The program leaves the padding out of cross-attention, so a prompt's images are the same
whatever the other prompts of its batch.

A prompt with editing or alternation is read as its schedule's distinct texts, its conditionings, each
with the last sampling step it serves; a batch holds C of them per prompt (one of `CONDITIONING_COUNTS`,
1 where no prompt has any), and the program picks each step's (`Tokens.readings`).
"""

import copy
import dataclasses
from collections.abc import Sequence

import numpy as np

from ..checkpoints import ModelSpec
from ..checkpoints.embeddings import Embedding
from ..checkpoints.tokenizer import one_call_at_a_time
from . import editing
from . import syntax as prompt_syntax
from .syntax import CHUNK_TOKENS, MAX_CHUNKS, Chunk

TOKENS_PER_CHUNK = CHUNK_TOKENS + 2  # with the start and end tokens: what an encoder reads at once
# The chunk counts programs are compiled for: a request's longest prompt picks the smallest that holds it,
# so that at most four programs per size serve every prompt length.
CHUNK_COUNTS = tuple(2**i for i in range(MAX_CHUNKS.bit_length()) if 2**i <= MAX_CHUNKS)
# A prompt's most distinct texts over its schedule (an alternation makes one per step at most), and the
# counts programs are compiled for, as for chunks.
MAX_CONDITIONINGS = 64
CONDITIONING_COUNTS = tuple(2**i for i in range(MAX_CONDITIONINGS.bit_length()))


def chunk_count(chunks: int) -> int:
    """The compiled chunk count that holds `chunks`."""
    return next(count for count in CHUNK_COUNTS if count >= chunks)


def conditioning_count(conditionings: int) -> int:
    """The compiled conditioning count that holds `conditionings`."""
    return next(count for count in CONDITIONING_COUNTS if count >= conditionings)


@dataclasses.dataclass(frozen=True, eq=False)
class Tokens:
    """A request's prompts as its images' text encoders read them, N images by (negative, positive)
    prompt by C conditionings (a prompt's schedule's texts) by E encoders, in K chunks of 77 tokens."""

    ids: np.ndarray  # [N, 2, C, E, K * 77] int32
    weights: np.ndarray  # [N, 2, C, E, K * 77] float32: each token's weight; 1 for the frame and the padding
    chunks: np.ndarray  # [N, 2, C] int32: each text's chunks; those after them are padding, left unread
    rescale: np.ndarray  # [N] bool: weighted chunks keep their mean ("original" emphasis), or not ("no-norm")
    # [N, 2, T] int32: the conditioning webui's denoiser call s reads (`editing.conditioning_index`), for
    # s from 0 to the schedule's steps; a call past them reads the first.
    readings: np.ndarray

    @property
    def num_chunks(self) -> int:
        return self.ids.shape[-1] // TOKENS_PER_CHUNK

    @property
    def num_conditionings(self) -> int:
        return self.ids.shape[2]

    def padded(self, num_chunks: int, num_conditionings: int, num_readings: int) -> "Tokens":
        """These tokens with `num_chunks` chunks, `num_conditionings` conditionings (the added ones repeat
        each prompt's last, never read) and `num_readings` readings (the added ones past the end: 0)."""
        extra = (num_chunks - self.num_chunks) * TOKENS_PER_CHUNK
        pad = [(0, 0)] * 4 + [(0, extra)]
        more = [(0, 0), (0, 0), (0, num_conditionings - self.num_conditionings)]
        ids = np.pad(np.pad(self.ids, pad), more + [(0, 0)] * 2, mode="edge")
        weights = np.pad(np.pad(self.weights, pad, constant_values=1), more + [(0, 0)] * 2, mode="edge")
        chunks = np.pad(self.chunks, more, mode="edge")
        readings = np.pad(self.readings, [(0, 0), (0, 0), (0, num_readings - self.readings.shape[-1])])
        return Tokens(ids, weights, chunks, self.rescale, readings)

    @classmethod
    def merged(cls, tokens: Sequence["Tokens"]) -> "Tokens":
        """The images of several requests' tokens in order, padded to the longest's chunk count, the most
        conditionings and the longest schedule."""
        sizes = (max(t.num_chunks for t in tokens), max(t.num_conditionings for t in tokens),
                 max(t.readings.shape[-1] for t in tokens))
        padded = [t.padded(*sizes) for t in tokens]
        return cls(*(np.concatenate([getattr(t, f.name) for t in padded]) for f in dataclasses.fields(cls)))

    def conditioning_steps(self, evaluations: int, first: int) -> np.ndarray:
        """[N, 2, evaluations] int32: which conditioning each loop iteration reads. webui's denoiser counts
        its calls from 0 at the first that runs (iteration `first`); iterations before it never run."""
        calls = np.arange(evaluations) - first
        past = calls >= self.readings.shape[-1]
        return np.where(past, 0, self.readings[..., np.clip(calls, 0, self.readings.shape[-1] - 1)]).astype(np.int32)


class Prompts:
    """A model's tokenizers, one per text encoder, reading prompts as webui does."""

    def __init__(self, spec: ModelSpec, tokenizers: Sequence):
        self.spec = spec
        self.tokenizers = list(tokenizers)
        self.embeddings: tuple[Embedding, ...] = ()  # textual inversion, in the order of their rows
        # Per tokenizer: a name's token ids -> its vectors' ids (rows past the encoder's vocabulary).
        self._embedding_ids: list[dict[tuple[int, ...], tuple[int, ...]]] = [{} for _ in self.tokenizers]

    def with_embeddings(self, embeddings: Sequence[Embedding]) -> "Prompts":
        """These tokenizers reading prompts with these textual-inversion embeddings (in place of any
        others): where a prompt names one, its vectors take its place, the vectors of all of them, in
        order, being the rows past each encoder's vocabulary (`sdxl.checkpoints.embeddings.table`).

        Raises:
          ValueError: a name the tokenizers read as no tokens.
        """
        lookups = [{} for _ in self.tokenizers]
        row = 0
        for embedding in embeddings:
            for lookup, tokenizer, config in zip(lookups, self.tokenizers, self.spec.text_encoders, strict=True):
                name_ids = tuple(self._reading(tokenizer)["tokenize"]([embedding.name])[0])
                if not name_ids:
                    raise ValueError(f"the embedding name {embedding.name!r} is no word a prompt can hold")
                first = config.vocab_size + row
                lookup[name_ids] = tuple(range(first, first + embedding.count))
            row += embedding.count
        reading = copy.copy(self)
        reading.embeddings, reading._embedding_ids = tuple(embeddings), lookups
        return reading

    def embeddings_in(self, text: str, emphasis: str = "original", *, negative: bool = False) -> list[Embedding]:
        """The embeddings a prompt names, in the order they first appear."""
        if not self.embeddings:
            return []
        if not negative:
            text, _ = prompt_syntax.lora_tags(text)
        pieces = prompt_syntax.prompt_pieces(text, emphasis)
        chunks = prompt_syntax.chunks(pieces, **self._reading(self.tokenizers[0]), embeddings=self._embedding_ids[0])
        first_row = self.spec.text_encoders[0].vocab_size
        starts = np.cumsum([0, *(embedding.count for embedding in self.embeddings)])
        rows = [i - first_row for chunk in chunks for i in chunk.ids if i >= first_row]
        used = dict.fromkeys(int(np.searchsorted(starts, row, side="right")) - 1 for row in rows)
        return [self.embeddings[i] for i in used]

    def tokens(
        self, prompts: Sequence[str], negative_prompts: Sequence[str], emphasis: str = "original", *,
        steps: int = 1, hires_steps: int | None = None,
    ) -> Tokens:
        """The `Tokens` of a batch's prompts and negative prompts (one of each per image): made where a
        request is prepared, so that a device queue's one worker never spends its time on text.

        `steps` (and a hires pass's `hires_steps`) are what a prompt's edits are scheduled over
        (`editing.prompt_schedule`): webui's step count, its model evaluations in a whole run.

        Raises:
          ValueError: a prompt is over `MAX_CHUNKS` chunks, or weighs a word outside `WEIGHT_RANGE`.
        """
        read = {}  # each distinct text once: a batch usually repeats one prompt for all its images
        scheduled = {}  # (prompt, negative): (its distinct texts, the one each call reads)
        for texts, negative in ((negative_prompts, True), (prompts, False)):
            for text in texts:
                if (text, negative) not in scheduled:
                    scheduled[text, negative] = self._scheduled(text, negative, steps, hires_steps)
                    for variant in scheduled[text, negative][0]:
                        if (variant, negative) not in read:
                            read[variant, negative] = self.read(variant, emphasis, negative=negative, tagged=False)
        rows = [[scheduled[text, negative] for text, negative in ((n, True), (p, False))]
                for n, p in zip(negative_prompts, prompts)]
        count = conditioning_count(max(len(variants) for row in rows for variants, _ in row))
        readings = np.array([[reading for _, reading in row] for row in rows], np.int32)
        # Each image's (negative, positive) C texts: the padding repeats a prompt's last text, never read.
        row_texts = [[[variants[min(c, len(variants) - 1)] for c in range(count)] for variants, _ in row]
                     for row in rows]
        chunks = np.array([[[read[v, negative][0].shape[-1] // TOKENS_PER_CHUNK for v in texts]
                            for texts, negative in zip(row, (True, False))] for row in row_texts], np.int32)
        length = chunk_count(int(chunks.max())) * TOKENS_PER_CHUNK
        shape = (len(rows), 2, count, len(self.tokenizers), length)
        ids, weights = np.zeros(shape, np.int32), np.ones(shape, np.float32)
        for i, row in enumerate(row_texts):
            for j, (texts, negative) in enumerate(zip(row, (True, False))):
                for c, variant in enumerate(texts):
                    prompt_ids, prompt_weights = read[variant, negative]
                    ids[i, j, c, :, : prompt_ids.shape[-1]] = prompt_ids
                    weights[i, j, c, :, : prompt_ids.shape[-1]] = prompt_weights
        rescale = np.full(len(rows), emphasis == "original")
        return Tokens(ids, weights, chunks, rescale, readings)

    @staticmethod
    def _scheduled(text: str, negative: bool, steps: int, hires_steps: int | None) -> tuple[list[str], list[int]]:
        """A prompt's distinct texts over its schedule (LoRA tags out of a positive prompt's), and the one
        each of webui's denoiser calls 0..steps reads.

        Raises:
          ValueError: over `MAX_CONDITIONINGS` texts.
        """
        if not negative:
            text, _ = prompt_syntax.lora_tags(text)
        schedule = editing.prompt_schedule(text, steps, hires_steps)
        variants = list(dict.fromkeys(variant for _, variant in schedule))
        if len(variants) > MAX_CONDITIONINGS:
            raise ValueError(
                f"the {'negative prompt' if negative else 'prompt'} reads {len(variants)} different texts over "
                f"its steps, over the limit of {MAX_CONDITIONINGS}"
            )
        total = schedule[-1][0]
        calls = [variants.index(schedule[editing.conditioning_index(schedule, s)][1]) for s in range(total + 1)]
        return variants, calls

    def read(
        self, text: str, emphasis: str = "original", *, negative: bool = False, tagged: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """One prompt's ids and weights for every encoder, [E, k * 77] each, k its chunks. A positive
        prompt's LoRA tags are not read (webui reads a negative prompt's as text); `tagged=False`: they
        are already out.

        Raises:
          ValueError: over `MAX_CHUNKS` chunks, or a weight outside `WEIGHT_RANGE`.
        """
        if tagged and not negative:
            text, _ = prompt_syntax.lora_tags(text)
        what = "negative prompt" if negative else "prompt"
        per_encoder = [
            prompt_syntax.prompt_chunks(text, **self._reading(tokenizer), emphasis=emphasis, what=what,
                                        embeddings=embedding_ids)
            for tokenizer, embedding_ids in zip(self.tokenizers, self._embedding_ids)
        ]
        count = max(len(chunks) for chunks in per_encoder)  # the same but for tokenizers of other vocabularies
        framed = [self._framed(tokenizer, chunks, count) for tokenizer, chunks in zip(self.tokenizers, per_encoder)]
        return np.stack([ids for ids, _ in framed]), np.stack([weights for _, weights in framed])

    def length_text(self, text: str, emphasis: str = "original", *, negative: bool = False, steps: int = 20) -> str:
        """How long a prompt is, as a UI shows it: "84 tokens, 2 chunks"; for a prompt with editing or
        alternation, its longest text over `steps` steps (as webui's counter)."""
        if not negative:
            text, _ = prompt_syntax.lora_tags(text)
        reading = self._reading(self.tokenizers[0])
        texts = dict.fromkeys(variant for _, variant in editing.prompt_schedule(text, steps))
        lengths = [  # unchecked: a count to show; an embedding counts as its vectors
            prompt_syntax.chunks(prompt_syntax.prompt_pieces(variant, emphasis), **reading,
                                 embeddings=self._embedding_ids[0])
            for variant in texts
        ]
        chunks = max(lengths, key=prompt_syntax.token_count)
        over = f" (at most {MAX_CHUNKS})" if len(chunks) > MAX_CHUNKS else ""
        return prompt_syntax.length_text(chunks) + over

    @staticmethod
    def _reading(tokenizer) -> dict:
        """What `sdxl.prompts.syntax` needs of a tokenizer to chunk a prompt: tokenize, comma_id, eos."""

        def tokenize(texts: list[str]) -> list[list[int]]:
            with one_call_at_a_time:
                return tokenizer(texts, add_special_tokens=False, verbose=False).input_ids

        comma = tokenizer.convert_tokens_to_ids(",</w>")
        comma = -1 if comma == tokenizer.unk_token_id else comma  # a vocabulary without one: no backtrack
        return {"tokenize": tokenize, "comma_id": comma, "eos": tokenizer.eos_token_id}

    @staticmethod
    def _framed(tokenizer, chunks: list[Chunk], count: int) -> tuple[np.ndarray, np.ndarray]:
        """[count * 77] ids and weights: each chunk framed for this encoder, then empty chunks to `count`."""
        eos = tokenizer.eos_token_id
        pad = eos if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        empty = Chunk((eos,) * CHUNK_TOKENS, (1.0,) * CHUNK_TOKENS, 0, True)
        framed = [
            prompt_syntax.encoder_ids(chunk, bos=tokenizer.bos_token_id, eos=eos, pad=pad)
            for chunk in [*chunks, *[empty] * (count - len(chunks))]
        ]
        return np.concatenate([ids for ids, _ in framed]), np.concatenate([weights for _, weights in framed])
