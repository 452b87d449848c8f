"""A checkpoint written by pretrain_gpt.py itself (a few CPU iterations on the bundled corpus, TP=2 so the
loader re-splits it): generation and both zero-shot tasks equal Hugging Face GPT-2 holding the loaded weights.
One written with ``--ckpt-layout megatron`` (Megatron-LM's files) scores as its conversion to our layout."""


import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams, load_gpt_for_inference
from megatron.core.inference.hf_gpt2 import to_hf_gpt2
from megatron.core.tokenizer import build_tokenizer
from megatron.training.config import pad_vocab_size
from tasks.main import parse_args, run
from tests.functional.harness import gpt_args, preprocess_quickstart_corpus, run_pretrain
from tests.unit.zeroshot.test_zeroshot import lambada_with_model_endings, reference_lambada, reference_wikitext
from tests.unit.inference.tiny import MERGES, VOCAB
from tests.unit.zeroshot.tp_body import WIKI

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    prefix = preprocess_quickstart_corpus(str(root))
    ckpt = str(root / "ckpt")
    run_pretrain(gpt_args(prefix, tp=2, num_layers=2, train_iters=4, save=ckpt, save_interval=4), nproc=2)
    return ckpt


def test_trained_checkpoint_matches_hf(trained, tmp_path):
    loaded = load_gpt_for_inference(trained)
    assert loaded.iteration == 4 and loaded.args["tensor_model_parallel_size"] == 2
    hf = to_hf_gpt2(loaded.model)
    tok = build_tokenizer(loaded.args["tokenizer_type"], vocab_file=loaded.args["vocab_file"],
                          merge_file=loaded.args["merge_file"])
    # the trainer stores no padded vocabulary: the loader takes it from the word embedding's two shards
    assert loaded.model.config.padded_vocab_size == pad_vocab_size(tok.vocab_size, 512 // 2, 2)
    engine = InferenceEngine(loaded.model, tokenizer=tok)
    prompt = tok.tokenize("To be, or not")
    out = engine.generate([prompt], SamplingParams(max_new_tokens=8, greedy=True, stop_on_eod=False))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.tokens == ref[0].tolist()

    seq = loaded.args["seq_length"]
    got = run(parse_args(["--load", trained, "--task", "WIKITEXT103", "--valid-data", WIKI,
                          "--overlapping-eval", "8"]))
    want = reference_wikitext(hf, tok, WIKI, seq, 8)
    assert abs(got["avg loss"] - want["avg loss"]) < 1e-4
    lambada = lambada_with_model_endings(trained, tok, str(tmp_path / "lambada.jsonl"), whole_words=False)
    got = run(parse_args(["--load", trained, "--task", "LAMBADA", "--valid-data", lambada]))
    correct, total = reference_lambada(hf, tok, lambada, False, seq=seq)
    assert (got["number correct"], got["total examples"]) == (correct, total)
    assert 0 < correct < total


def test_trained_checkpoint_converts_to_tp1(trained, tmp_path, capsys):
    """The converter reads the trainer's stored arguments (the typed configuration's, no padded vocabulary) and
    writes a TP=1 checkpoint holding the same real-vocabulary weights the inference loader re-splits."""
    from tests.unit.checkpoint.test_convert import _run

    out = str(tmp_path / "tp1")
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "ours", "--saver", "ours", "--load-dir", trained,
                      "--save-dir", out, "--target-tensor-parallel-size", "1")
    assert rc == 0, err
    direct, converted = load_gpt_for_inference(trained), load_gpt_for_inference(out)
    assert converted.args["tensor_model_parallel_size"] == 1
    want, got = direct.model.state_dict(), converted.model.state_dict()
    assert sorted(want) == sorted(got)
    vocab = build_tokenizer(direct.args["tokenizer_type"], vocab_file=direct.args["vocab_file"],
                            merge_file=direct.args["merge_file"]).vocab_size
    for name in want:
        if name == "embedding.word_embeddings.weight":  # the padding rows differ with the TP size
            assert torch.equal(got[name][:vocab], want[name][:vocab])
        else:
            assert torch.equal(got[name], want[name]), name


def test_megatron_layout_checkpoint_scores_as_our_layout(tmp_path_factory, tmp_path, capsys):
    """tasks/main.py reads a checkpoint the trainer wrote with --ckpt-layout megatron (a pickled Namespace of
    arguments) and gives the results of the same weights converted to our layout."""
    from tests.unit.checkpoint.test_convert import _run

    root = tmp_path_factory.mktemp("megatron_layout")
    prefix = preprocess_quickstart_corpus(str(root))
    megatron_ckpt, ours = str(root / "ckpt"), str(tmp_path / "ours")
    run_pretrain(gpt_args(prefix, num_layers=2, train_iters=2, save=megatron_ckpt, save_interval=2,
                          ckpt_layout="megatron"))
    rc, _, err = _run(capsys, "--model-type", "GPT", "--loader", "megatron", "--saver", "ours", "--load-dir",
                      megatron_ckpt, "--save-dir", ours)
    assert rc == 0, err
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    lambada = lambada_with_model_endings(ours, tok, str(tmp_path / "lambada.jsonl"), whole_words=False)
    results = {}
    for name, ckpt in (("megatron", megatron_ckpt), ("ours", ours)):
        results[name] = [run(parse_args(["--load", ckpt, "--task", "WIKITEXT103", "--valid-data", WIKI,
                                         "--overlapping-eval", "8"])),
                         run(parse_args(["--load", ckpt, "--task", "LAMBADA", "--valid-data", lambada]))]
    assert results["megatron"] == results["ours"]
    lam = results["ours"][1]
    assert 0 < lam["number correct"] < lam["total examples"]
