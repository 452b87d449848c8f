"""bench/bert_throughput.py: its peer reads the micro-batches pretrain_bert.py reads; the FLOP count; --help."""

import gzip
import json
import os
import subprocess
import sys
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _bench():
    sys.path.insert(0, BENCH)
    try:
        import bert_throughput
        import corpus
    finally:
        sys.path.remove(BENCH)
    return bert_throughput, corpus


@pytest.fixture(scope="module")
def sentence_data(tmp_path_factory):
    from tokenizers import BertWordPieceTokenizer

    _, corpus = _bench()
    d = tmp_path_factory.mktemp("bert_bench")
    with gzip.open(os.path.join(ROOT, "data", "tinyshakespeare.jsonl.gz"), "rt") as f:
        docs = [json.loads(line)["text"] for line in f]
    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(docs, vocab_size=2000, special_tokens=SPECIAL, show_progress=False)
    vocab = tok.save_model(str(d), "bench")[0]
    return corpus.prepare_bert_dataset(str(d), vocab), vocab


def test_peer_reads_the_batches_pretrain_bert_reads(sentence_data):
    import pretrain_bert
    from megatron.core.datasets.samplers import build_pretraining_data_loader
    from megatron.core.parallel_state import ParallelState
    from megatron.training.arguments import parse_config
    from megatron.training.setup import build_context

    bench, corpus = _bench()
    prefix, vocab = sentence_data
    iters, shape = 3, bench.SHAPES["tiny"]
    cmd = bench.ours_command(shape, iters - 1, 1, prefix, vocab, "")
    argv = cmd[cmd.index(os.path.join(ROOT, "pretrain_bert.py")) + 1:]
    cfg, _ = parse_config(argv, extra_sections=[pretrain_bert.BERT])
    ctx = build_context(cfg, ParallelState.single())
    mb = shape["micro_batch_size"]
    train, _, _ = pretrain_bert.datasets_provider(ctx, (cfg.training.train_iters * mb, 0, 0))
    ours = iter(build_pretraining_data_loader(train, 0, mb, 0, 1, num_workers=0))
    peer = corpus.bert_batches(prefix, vocab, shape["seq_length"], mb, iters, num_workers=0)
    for _ in range(iters):
        a, b = next(ours), next(peer)
        assert a["text"].shape == (mb, shape["seq_length"])
        for key in ("text", "types", "labels", "is_random", "loss_mask", "padding_mask"):
            assert torch.equal(a[key], b[key]), key
        assert len(torch.unique(a["text"])) > 20  # real text, not unknown tokens
    assert bench.padded_vocab(vocab) == ctx.padded_vocab_size


def test_flops_per_token_counts_the_bert_large_encoder_and_heads():
    bench, _ = _bench()
    L, h, s, V = 24, 1024, 512, 30592
    layer = 24 * h * h + 4 * h * s  # forward per token per layer: QKV, projection, 4h MLP (2 FLOPs per MAC), QK^T, AV
    k = 76  # floor(0.15 x 512): the positions per sample the masked-LM objective can need
    heads = (2 * h * V + 2 * h * h) * k / s  # forward: the MLM head's transform and vocabulary projection
    assert bench.flops_per_token(L, h, s, V) == pytest.approx(3 * (L * layer + heads), rel=1e-12)  # fwd + bwd (2x)


def test_help_starts():
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bert_throughput.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "--vocab-file" in proc.stdout, proc.stderr


def test_a_failing_trainer_leaves_its_error_in_the_results(sentence_data, tmp_path):
    prefix, vocab = sentence_data
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bert_throughput.py"), "--shapes", "tiny",
                           "--trainers", "ours-bert", "--iters", "1", "--warmup", "1", "--vocab-file", vocab,
                           "--data-prefix", prefix, "--results-dir", str(tmp_path), "--ours-args=--no-such-flag"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode != 0 and "failed rows: ours-bert/2x64" in proc.stderr, proc.stderr[-2000:]
    assert "[ours-bert] " in proc.stdout  # the trainer's output is echoed as it comes
    with open(tmp_path / "gpu_throughput.json") as f:
        results = json.load(f)
    assert results["rows"] == [] and "--no-such-flag" in results["extras"]["bert"]["errors"]["ours-bert/2x64"]


def test_variants_name_the_rows_and_bad_ones_are_one_line():
    bench, _ = _bench()
    assert bench.parse_variants([]) == [("", "")]
    assert bench.parse_variants(["eager:", "graph:--enable-cuda-graph --cuda-graph-warmup-steps 2"]) == [
        ("eager", ""), ("graph", "--enable-cuda-graph --cuda-graph-warmup-steps 2")]
    with pytest.raises(SystemExit, match="non-empty LABEL"):
        bench.parse_variants([":--enable-cuda-graph"])
    with pytest.raises(SystemExit, match="each LABEL once, got a, a"):
        bench.parse_variants(["a:", "a:--clip-grad 0"])
    cmd = bench.ours_command(bench.SHAPES["tiny"], 2, 1, "PREFIX", "VOCAB", "--enable-cuda-graph")
    assert cmd[-1] == "--enable-cuda-graph" and cmd[4].endswith("pretrain_bert.py")
