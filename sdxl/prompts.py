"""Prompts as the text encoders read them: every encoder's token ids for a request's prompts, and
the part of a prompt that was read, for the parameters saved with its images."""

import dataclasses
from collections.abc import Sequence

import numpy as np

from .checkpoints import ModelSpec
from .request import Request
from .tokenizer import kept_text, tokenize


class PromptTruncatedWarning(UserWarning):
    """A prompt had more tokens than the text encoder takes; the rest was dropped."""


class Prompts:
    """A model's tokenizers, one per text encoder."""

    def __init__(self, spec: ModelSpec, tokenizers: Sequence):
        self.spec = spec
        self.tokenizers = list(tokenizers)

    def tokenized(self, request: Request) -> Request:
        """The request with its prompts tokenized (`Request.tokens`): done where a request is made, so
        that a device queue's one worker never spends its time on text."""
        positive, truncated = self.ids(request.prompts)
        negative, truncated_negative = self.ids(request.negative_prompts)
        ids = np.stack([negative, positive], axis=1).astype(np.int32)
        return dataclasses.replace(request, tokens=(ids, tuple(dict.fromkeys(truncated + truncated_negative))))

    def ids(self, prompts: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """[N, E, T] ids for every text encoder, and the prompts that were truncated. Each distinct
        prompt is tokenized once: a batch usually repeats one prompt for all its images."""
        distinct = list(dict.fromkeys(prompts))
        per_encoder, truncated = [], set()
        for tokenizer in self.tokenizers:
            ids, cut = tokenize(tokenizer, distinct, self.spec.max_tokens)
            per_encoder.append(ids)
            truncated.update(p for p, c in zip(distinct, cut) if c)
        row = {p: i for i, p in enumerate(distinct)}
        ids = np.stack(per_encoder, axis=1)[[row[p] for p in prompts]]
        return ids, [p for p in distinct if p in truncated]

    def read(self, prompt: str) -> str:
        """The part of `prompt` the text encoders read (`spec.max_tokens` tokens)."""
        return kept_text(self.tokenizers[0], prompt, self.spec.max_tokens)
