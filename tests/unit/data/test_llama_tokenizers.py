"""The tokenizers of Llama-family models, each trained here on the bundled corpus (about a second in all):

- ``HuggingFaceTokenizer`` on a Llama-3-shaped ``tokenizer.json`` (byte-level BPE, ``<|begin_of_text|>`` added by
  the post-processor, ``<|end_of_text|>`` as end of document) and on a Llama-2-shaped one (BPE with byte fallback),
  against Hugging Face's ``PreTrainedTokenizerFast`` (what Megatron-LM's ``AutoTokenizer`` path runs);
- ``SentencePieceTokenizer`` and ``Llama2Tokenizer`` on a SentencePiece BPE model, with Megatron-LM's special
  tokens, BOS and end-of-document ids;
- ``tools/preprocess_data.py --append-eod`` to ``.bin/.idx``, and ``pretrain_gpt.py`` training from that data with
  the same tokenizer flags; a missing or unreadable ``--tokenizer-model`` is one line naming the flag and file.
"""

import gzip
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizer import build_tokenizer
from tests.functional.harness import ROOT, gpt_args, parse_iterations, run_pretrain

CORPUS = os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz")
SAMPLE = "KING RICHARD III:\nNow is the winter of our discontent ☃ 1234!"
# Llama 3's pre-tokenising expression (contractions, letters, 1-3 digits, punctuation, newlines, spaces)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _texts():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _training_texts():
    """A third of the corpus: enough for the small vocabularies, a third of the training time."""
    return _texts()[:300]


def _llama3_tokenizer_json(texts, path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    tok.save(str(path))


def _byte_fallback_tokenizer_json(texts, path):
    """Llama 2 / Mistral as Hugging Face converts them: '▁' for spaces, BPE falling back to <0xXX> byte pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                                       limit_alphabet=60))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import sentencepiece

    d = tmp_path_factory.mktemp("llama_tokenizers")
    texts = _training_texts()
    (d / "llama3").mkdir()
    _llama3_tokenizer_json(texts, d / "llama3" / "tokenizer.json")
    (d / "llama3_instruct").mkdir()  # the same file, with the end of turn as end of document
    (d / "llama3_instruct" / "tokenizer.json").write_bytes((d / "llama3" / "tokenizer.json").read_bytes())
    (d / "llama3_instruct" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}}))
    _byte_fallback_tokenizer_json(texts, d / "llama2_hf.json")
    model = io.BytesIO()  # Llama 2's settings: BPE, byte fallback, digits split, text kept as it is
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=500, model_type="bpe", byte_fallback=True,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (d / "sp.model").write_bytes(model.getvalue())
    return d


@pytest.mark.parametrize("kind", ["llama3", "byte_fallback"])
def test_huggingface_tokenizer_json_matches_transformers(files, kind):
    from transformers import PreTrainedTokenizerFast

    model = str(files / "llama3") if kind == "llama3" else str(files / "llama2_hf.json")
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model)
    path = os.path.join(model, "tokenizer.json") if kind == "llama3" else model
    hf = PreTrainedTokenizerFast(tokenizer_file=path)
    bos, eos = ("<|begin_of_text|>", "<|end_of_text|>") if kind == "llama3" else ("<s>", "</s>")
    texts = [SAMPLE, "", "  two  spaces\n\nand lines", _texts()[3][:500]]
    ids = tok.tokenize_batch(texts)
    assert ids == [hf(t).input_ids for t in texts] == [tok.tokenize(t) for t in texts]
    assert all(i[0] == hf.convert_tokens_to_ids(bos) == tok.bos for i in ids)  # BOS from the post-processor
    assert tok.eod == hf.convert_tokens_to_ids(eos) and tok.vocab_size == len(hf)
    assert tok.detokenize(ids[0]) == hf.decode(ids[0]) and tok.detokenize(ids[0][1:]) == SAMPLE
    if kind == "llama3":
        instruct = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(files / "llama3_instruct"))
        assert instruct.eod == hf.convert_tokens_to_ids("<|eot_id|>") != tok.eod and instruct.bos == tok.bos
    if kind == "byte_fallback":  # the snowman is not in the vocabulary: its three UTF-8 bytes are
        snowman = [hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "☃".encode()]
        assert any(ids[0][k:k + 3] == snowman for k in range(len(ids[0])))


def test_sentencepiece_tokenizer_follows_megatron_lm(files):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(files / "sp.model"))
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(files / "sp.model"))
    n = sp.get_piece_size()
    # <CLS> <SEP> <EOD> <MASK> appended, then <PAD> (the model has no pad piece); <s> and </s> are the model's
    assert tok.vocab_size == n + 5 and (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == tuple(range(n, n + 5))
    assert (tok.bos, tok.eos) == (sp.bos_id(), sp.eos_id()) == (1, 2)
    assert tok.tokenize(SAMPLE) == sp.encode(SAMPLE)
    assert sp.decode(tok.tokenize(SAMPLE)) == SAMPLE
    # a special token written in the text is its id; detokenizing writes it between spaces
    mixed = tok.tokenize("Now is<EOD>the winter</s>")
    assert mixed == sp.encode("Now is") + [tok.eod] + sp.encode("the winter") + [2]
    assert tok.detokenize(mixed) == "Now is <EOD> the winter </s> "
    assert tok.tokenize_batch([SAMPLE, "", "a<CLS>"]) == [tok.tokenize(SAMPLE), [], sp.encode("a") + [tok.cls]]


def test_llama2_tokenizer_follows_megatron_lm(files):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(files / "sp.model"))
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=str(files / "sp.model"))
    assert (tok.vocab_size, tok.bos, tok.eod) == (500, 1, 2)
    ids = tok.tokenize(SAMPLE)
    assert ids == [1] + sp.encode(SAMPLE) and tok.detokenize(ids) == SAMPLE
    assert tok.tokenize_batch([SAMPLE, ""]) == [ids, [1]]
    assert "</s>" not in sp.id_to_piece(tok.tokenize("</s>")[1:])  # written text is never a special id


def _preprocess(argv, in_process=False):
    """tools/preprocess_data.py on the corpus with --append-eod: its own process, or its ``main`` here."""
    argv = ["--input", CORPUS, "--append-eod", "--quiet"] + argv
    if in_process:
        spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(ROOT, "tools",
                                                                                      "preprocess_data.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.main(argv)
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py")] + argv,
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_preprocess_and_train(files, tmp_path):
    texts = _texts()
    runs = {"Llama2Tokenizer": str(files / "sp.model"), "HuggingFaceTokenizer": str(files / "llama3"),
            "SentencePieceTokenizer": str(files / "sp.model")}
    for kind, model in runs.items():
        argv = ["--output-prefix", str(tmp_path / kind), "--tokenizer-type", kind, "--tokenizer-model", model]
        if kind == "Llama2Tokenizer":  # the script itself, with two workers
            proc = _preprocess(argv + ["--workers", "2"])
            assert proc.returncode == 0, proc.stderr
        else:
            assert _preprocess(argv, in_process=True) == 0
        tok = build_tokenizer(kind, tokenizer_model=model)
        ds = IndexedDataset(str(tmp_path / f"{kind}_text_document"))
        assert len(ds) == len(texts)
        for i in (0, len(texts) - 1):
            assert ds[i].tolist() == tok.tokenize(texts[i]) + [tok.eod]
    assert IndexedDataset(str(tmp_path / "Llama2Tokenizer_text_document"))[0][0] == 1  # <s> first, </s> last

    # the trainer reads the data with the same tokenizer flags (vocabulary 500 padded to 512)
    argv = gpt_args(str(tmp_path / "Llama2Tokenizer_text_document"), train_iters=3, num_layers=2,
                    global_batch_size=2, make_vocab_size_divisible_by=128, vocab_file=None, merge_file=None,
                    tokenizer_type="Llama2Tokenizer", tokenizer_model=str(files / "sp.model"))
    proc = run_pretrain(argv)
    assert "vocabulary 500 padded to 512" in proc.stdout
    its = parse_iterations(proc.stdout)
    assert sorted(its) == [1, 2, 3] and all(0 < its[i]["lm loss"] < 7.0 for i in its)  # ln(512) = 6.24


def test_missing_or_unreadable_tokenizer_model_is_one_line(files, tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    proc = _preprocess(["--output-prefix", str(tmp_path / "x"), "--tokenizer-type", "Llama2Tokenizer",
                        "--tokenizer-model", str(bad)])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "--tokenizer-model" in lines[0] and str(bad) in lines[0] and "not a SentencePiece model" in lines[0]
    assert not list(tmp_path.glob("x*"))  # nothing written
    for kind, model, why in (("SentencePieceTokenizer", tmp_path / "none.model", "no such file"),
                             ("HuggingFaceTokenizer", bad, "not a Hugging Face tokenizer.json")):
        with pytest.raises(ValueError, match=f"--tokenizer-model '{model}': {why}"):
            build_tokenizer(kind, tokenizer_model=str(model))
    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked.model"
        locked.write_bytes((files / "sp.model").read_bytes())
        locked.chmod(0)
        with pytest.raises(ValueError, match="--tokenizer-model .*locked.model.*cannot be read"):
            build_tokenizer("Llama2Tokenizer", tokenizer_model=str(locked))

    argv = gpt_args("unused", train_iters=1, lr_warmup_iters=0, vocab_file=None, merge_file=None, tokenizer_type="Llama2Tokenizer",
                    tokenizer_model=str(tmp_path / "none.model"), mock_data=True, data_path=None)
    proc = run_pretrain(argv, expect_ok=False)
    errors = [line for line in proc.stderr.splitlines() if "tokenizer-model" in line]
    assert proc.returncode != 0 and len(errors) == 1 and "none.model" in errors[0] and "no such file" in errors[0], \
        proc.stderr[-2000:]
