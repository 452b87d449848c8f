"""A checkpoint written by pretrain_gpt.py itself (a few CPU iterations on the bundled corpus, TP=2 so the
loader re-splits it): generation and both zero-shot tasks equal Hugging Face GPT-2 holding the loaded weights."""


import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams, load_gpt_for_inference
from megatron.core.inference.hf_gpt2 import to_hf_gpt2
from megatron.core.tokenizer import build_tokenizer
from megatron.training.config import pad_vocab_size
from tasks.main import parse_args, run
from tests.functional.harness import gpt_args, preprocess_quickstart_corpus, run_pretrain
from tests.unit.zeroshot.test_zeroshot import reference_lambada, reference_wikitext
from tests.unit.zeroshot.tp_body import LAMBADA, WIKI

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    prefix = preprocess_quickstart_corpus(str(root))
    ckpt = str(root / "ckpt")
    run_pretrain(gpt_args(prefix, tp=2, num_layers=2, train_iters=4, save=ckpt, save_interval=4), nproc=2)
    return ckpt


def test_trained_checkpoint_matches_hf(trained):
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
    got = run(parse_args(["--load", trained, "--task", "LAMBADA", "--valid-data", LAMBADA, "--strict-lambada"]))
    assert got["number correct"] == reference_lambada(hf, tok, LAMBADA, True, seq=seq)[0]


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
