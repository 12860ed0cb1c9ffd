"""Prompt tokenization with the checkpoint's own CLIP tokenizers (transformers, tokenizers backend)."""

import json
import logging
import threading
from pathlib import Path

import numpy as np

# transformers, used here for its tokenizers alone, advises at import that without PyTorch "models
# won't be available": true, and no concern of a project that owns its models. The runtime has no
# PyTorch, so every start printed it. The filter drops that one message and no other.
logging.getLogger("transformers").addFilter(lambda record: "PyTorch was not found" not in record.getMessage())
from transformers import CLIPTokenizer  # noqa: E402

from .weights import CheckpointError

# A fast tokenizer keeps its padding and truncation settings in shared state that each call sets
# before it encodes: two threads tokenizing at once (the demo tokenizes in each submitting request's
# thread) could pad one call's ids by the other's settings. One call at a time: each takes well under a millisecond.
one_call_at_a_time = threading.Lock()


def load_tokenizer(folder: Path) -> CLIPTokenizer:
    """Loads a CLIP tokenizer from a folder with vocab.json + merges.txt or with tokenizer.json."""
    folder = Path(folder)
    has_bpe_files = (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    if not (has_bpe_files or (folder / "tokenizer.json").is_file()):
        raise CheckpointError(f"{folder}: no tokenizer files (vocab.json + merges.txt, or tokenizer.json)")
    return CLIPTokenizer.from_pretrained(str(folder))


def tokenize(tokenizer: CLIPTokenizer, prompts: list[str], length: int) -> tuple[np.ndarray, list[bool]]:
    """Token ids padded or truncated to `length`, as the diffusers pipelines make them.

    Returns:
      ids: [len(prompts), length] int32.
      truncated: for each prompt, whether tokens beyond `length` were dropped.
    """
    with one_call_at_a_time:
        full = tokenizer(prompts, truncation=False, padding=False).input_ids
        ids = tokenizer(prompts, padding="max_length", max_length=length, truncation=True).input_ids
    return np.asarray(ids, dtype=np.int32), [len(f) > length for f in full]


def write_byte_level_tokenizer(folder: Path, max_length: int = 77) -> int:
    """Writes a CLIP tokenizer whose vocabulary is the 256 byte symbols and no merges.

    Every character becomes one token, so any text tokenizes without a learned vocabulary. It keeps
    CLIP's conventions (lower-casing, `</w>` end-of-word symbols, start/end tokens). Returns the
    vocabulary size.
    """
    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols + [s + "</w>" for s in symbols])}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "CLIPTokenizer",
                "model_max_length": max_length,
                "bos_token": "<|startoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
            },
            indent=2,
        )
    )
    return len(vocab)


def _byte_symbols() -> list[str]:
    """GPT-2's reversible byte -> printable character table, which CLIP's BPE also uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    codes = printable + [256 + n for n in range(len(extra))]
    return [chr(c) for c in codes]
