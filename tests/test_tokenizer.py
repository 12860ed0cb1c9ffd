import concurrent.futures

import numpy as np
import pytest
from transformers import CLIPTokenizer

from sdxl.checkpoints.tokenizer import load_tokenizer, tokenize, write_byte_level_tokenizer
from sdxl.checkpoints.weights import CheckpointError


def test_byte_level_tokenizer_pads_to_length_and_flags_truncation(tmp_path):
    write_byte_level_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    ids, truncated = tokenize(tokenizer, ["a cat", "x" * 200], 77)
    assert ids.shape == (2, 77) and ids.dtype == np.int32
    assert truncated == [False, True]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert ids[0, 0] == bos and ids[0, 5] == eos  # <start> a</w> c a t</w> <end>
    assert (ids[0, 5:] == eos).all()  # padded with the pad (= end) token
    assert ids[1, -1] == eos  # truncation keeps the end token


def test_tokenizer_json_only_folder_gives_the_same_ids(tmp_path):
    write_byte_level_tokenizer(tmp_path / "bpe")
    CLIPTokenizer.from_pretrained(tmp_path / "bpe").save_pretrained(tmp_path / "json")
    assert not (tmp_path / "json" / "vocab.json").exists()  # transformers 5 writes tokenizer.json only
    prompts = ["A photo of an astronaut, riding a horse!", "Élan vital, 42"]
    a, _ = tokenize(load_tokenizer(tmp_path / "bpe"), prompts, 77)
    b, _ = tokenize(load_tokenizer(tmp_path / "json"), prompts, 77)
    np.testing.assert_array_equal(a, b)


def test_folder_without_tokenizer_files_is_explained(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_threads_tokenizing_at_once_get_what_one_thread_gets(tmp_path):
    """The demo tokenizes in each submitting request's thread; a fast tokenizer's padding settings
    are shared state, and interleaved calls once padded ids to the wrong length (CI, issue 21)."""
    write_byte_level_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    prompts = [["a red circle"], ["word " * 40, "a fox"], ["x" * 300]]
    expected = [tokenize(tokenizer, p, 77) for p in prompts]

    def work(i):
        return [tokenize(tokenizer, prompts[(i + k) % 3], 77) for k in range(60)]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i, results in enumerate(pool.map(work, range(8))):
            for k, (ids, truncated) in enumerate(results):
                want_ids, want_truncated = expected[(i + k) % 3]
                np.testing.assert_array_equal(ids, want_ids)
                assert truncated == want_truncated
