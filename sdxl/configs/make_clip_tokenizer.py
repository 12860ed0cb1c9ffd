"""Writes CLIP's BPE tokenizer files (vocab.json, merges.txt) from OpenAI's BPE merges.

Every Stable Diffusion text encoder (CLIP ViT-L/14's, OpenCLIP ViT-H/14's and ViT-bigG/14's)
tokenizes with the BPE vocabulary OpenAI released with CLIP. OpenAI ships it as the list of merges
`bpe_simple_vocab_16e6.txt.gz` (MIT licence, Copyright (c) 2021 OpenAI), which the pip package
`open_clip_torch` carries as `open_clip/bpe_simple_vocab_16e6.txt.gz`. This script builds from it
the two files that Hugging Face's `CLIPTokenizer` reads, with the vocabulary built exactly as
OpenAI's `clip.simple_tokenizer.SimpleTokenizer` builds it:

- the 256 byte symbols of `bytes_to_unicode` (ids 0-255), then the same symbols with "</w>"
  appended (256-511), then the first 49152 - 256 - 2 = 48894 merges, each pair joined
  (512-49405), then "<|startoftext|>" (49406) and "<|endoftext|>" (49407): 49408 entries;
- merges.txt: "#version: 0.2", then those 48894 merges, one per line.

Usage (writes into every `tokenizer*/` folder of the config folders beside this script unless
--out is given; the other tokenizer files there, tokenizer_config.json and
special_tokens_map.json, are left as they are):

    pip download open_clip_torch --no-deps -d /tmp/oc
    unzip -o /tmp/oc/open_clip_torch-*.whl 'open_clip/bpe_simple_vocab_16e6.txt.gz' -d /tmp/oc
    python sdxl/configs/make_clip_tokenizer.py /tmp/oc/open_clip/bpe_simple_vocab_16e6.txt.gz

It needs only the standard library, and its output is the same from run to run.
"""

import argparse
import gzip
import json
from pathlib import Path

NUM_MERGES = 49152 - 256 - 2  # CLIP's vocabulary: 49152 BPE tokens less the bytes and specials
SPECIAL_TOKENS = ("<|startoftext|>", "<|endoftext|>")
CONFIGS = Path(__file__).resolve().parent


def bytes_to_unicode() -> list[str]:
    """The reversible byte -> printable character table of GPT-2 and CLIP, in byte order of the
    printable bytes first (as OpenAI's `bytes_to_unicode().values()`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            codes.append(256 + n)
            n += 1
    return [chr(c) for c in codes]


def read_merges(bpe_path: Path) -> list[tuple[str, str]]:
    """The first NUM_MERGES merges of OpenAI's file (its first line is a header)."""
    lines = gzip.open(bpe_path).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]
    if len(merges) != NUM_MERGES or any(len(m) != 2 for m in merges):
        raise ValueError(f"{bpe_path}: expected {NUM_MERGES} merges of two symbols each")
    return merges


def build(bpe_path: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) as OpenAI's SimpleTokenizer builds them."""
    merges = read_merges(bpe_path)
    symbols = bytes_to_unicode()
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + list(SPECIAL_TOKENS)
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(vocab) != 49408:
        raise ValueError(f"expected 49408 distinct tokens, got {len(vocab)} of {len(tokens)}")
    return vocab, merges


def write(folder: Path, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8")
    lines = ["#version: 0.2", *(" ".join(m) for m in merges)]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def default_folders() -> list[Path]:
    """Every tokenizer folder of the config folders beside this script."""
    return sorted(p.parent for p in CONFIGS.glob("*/tokenizer*/tokenizer_config.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bpe", type=Path, help="path to bpe_simple_vocab_16e6.txt.gz")
    parser.add_argument(
        "--out", type=Path, action="append", help="folder to write (repeatable; default: every tokenizer folder here)"
    )
    args = parser.parse_args()
    vocab, merges = build(args.bpe)
    for folder in args.out or default_folders():
        write(folder, vocab, merges)
        print(f"wrote {folder}/vocab.json ({len(vocab)} tokens) and merges.txt ({len(merges)} merges)")


if __name__ == "__main__":
    main()
