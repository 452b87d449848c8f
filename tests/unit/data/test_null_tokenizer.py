"""Megatron-LM's ``NullTokenizer`` (``--tokenizer-type NullTokenizer --vocab-size N``): ids in, ids out, the
end-of-document id is ``N`` and the tokenizer has ``N + 1`` ids; and the ``.bin/.idx`` of ids that Megatron-Core
wrote for the checkpoint fixture gives, through our GPT dataset, the samples Megatron-Core's ``GPTDataset`` gave."""

import json
import os

import pytest

from megatron.core.datasets.builder import build_gpt_datasets
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.preprocessing import PreprocessConfig, preprocess
from megatron.core.tokenizer import NullTokenizer, build_tokenizer
from megatron.training.arguments import ConfigError, parse_config

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "checkpoint", "fixtures")


def test_null_tokenizer_follows_megatron_lm():
    tok = build_tokenizer("NullTokenizer", vocab_size=63)
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod) == (64, 63)
    assert tok.tokenize("5 17 3 63") == [5, 17, 3, 63]
    assert tok.tokenize_batch(["1 2", "0"]) == [[1, 2], [0]]
    assert tok.detokenize([5, 17, 3]) == "5 17 3"
    with pytest.raises(ValueError, match="id 64 is outside 0..63"):
        tok.tokenize("1 64")
    with pytest.raises(ValueError, match="decimal token ids"):
        tok.tokenize("hello")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_vocab_size_flag_is_checked():
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data"]
    cfg, _ = parse_config(base + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "63"])
    assert (cfg.data.tokenizer_type, cfg.data.vocab_size) == ("NullTokenizer", 63)
    with pytest.raises(ConfigError, match="NullTokenizer needs --vocab-size"):
        parse_config(base + ["--tokenizer-type", "NullTokenizer"])
    with pytest.raises(ConfigError, match="--vocab-size 63 is read by --tokenizer-type NullTokenizer only"):
        parse_config(base + ["--vocab-size", "63"])


def test_fixture_ids_give_megatron_cores_samples(tmp_path):
    golden = json.load(open(os.path.join(FIXTURES, "megatron_gpt", "megatron_core_resume_on_data.json")))
    prefix = os.path.join(FIXTURES, "megatron_gpt_data", "ids_text_document")
    train, _, _ = build_gpt_datasets([prefix], "100,0,0", 16, 1234, (26, 0, 0), cache_dir=str(tmp_path))
    first = golden["first_iteration"] * 2
    got = [train[i]["text"].tolist() for i in range(first, first + len(golden["samples"]))]
    assert got == golden["samples"]


def test_preprocess_writes_the_ids_with_the_end_of_document(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n{"text": "62 0"}\n')
    preprocess(PreprocessConfig(input=str(tmp_path / "ids.jsonl"), output_prefix=str(tmp_path / "ids"),
                                tokenizer_type="NullTokenizer", vocab_size=63, append_eod=True, quiet=True))
    ds = IndexedDataset(str(tmp_path / "ids_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3, 63], [62, 0, 63]]
