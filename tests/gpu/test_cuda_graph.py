"""--enable-cuda-graph (the whole iteration captured once and replayed) trains like the eager trainer (GPU only).

The reference is the same pretrain_gpt.py (or pretrain_bert.py) run without the flag: same seed, same data. The
graph run does its warm-up iterations eagerly, then captures and replays; every iteration's loss and grad norm
must agree with the eager run, and a resume from a checkpoint the graph run saved must continue the same curve.
With hidden dropout on, the replays draw from the same generator offsets as the eager kernels, so the curves
still agree.
"""

import re

import pytest
import torch

from tests.functional.harness import assert_same_losses, gpt_args, losses, preprocess_quickstart_corpus, run_pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    return preprocess_quickstart_corpus(str(tmp_path_factory.mktemp("cuda_graph")))


def _args(prefix, **kw):
    base = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
                micro_batch_size=4, global_batch_size=8, train_iters=12, attention_backend="auto", num_workers=1)
    base.update(kw)
    return gpt_args(prefix, **base)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_matches_eager(prefix, precision):
    extra = {"bf16": True} if precision == "bf16" else {}
    eager = losses(_args(prefix, **extra))
    graph = losses(_args(prefix, enable_cuda_graph=True, cuda_graph_warmup_steps=2, **extra))
    # fp32: only the learning rate's rounding to a float32 tensor differs; bf16 adds rounding of the params
    rel = 1e-4 if precision == "fp32" else 2e-3
    assert_same_losses(eager, graph, rel=rel, keys=("lm loss", "grad norm"))
    assert graph[12]["lm loss"] < graph[1]["lm loss"] - 0.5


def test_graph_resume_continues_the_curve(prefix, tmp_path):
    straight = losses(_args(prefix, enable_cuda_graph=True, cuda_graph_warmup_steps=2))
    ckpt = str(tmp_path / "ckpt")
    first = losses(_args(prefix, enable_cuda_graph=True, cuda_graph_warmup_steps=2, save=ckpt, exit_interval=6))
    second = losses(_args(prefix, enable_cuda_graph=True, cuda_graph_warmup_steps=2, load=ckpt))
    resumed = {**first, **second}
    assert_same_losses(straight, resumed, rel=1e-4, keys=("lm loss",))


def test_graph_with_gradient_accumulation_and_compile(prefix):
    eager = losses(_args(prefix, micro_batch_size=2, use_torch_compile=True))
    graph = losses(_args(prefix, micro_batch_size=2, use_torch_compile=True, enable_cuda_graph=True))
    assert_same_losses(eager, graph, rel=1e-4, keys=("lm loss", "grad norm"))


def test_eager_checkpoint_resumes_under_the_graph(prefix, tmp_path):
    """A checkpoint written without the graph (non-capturable fused AdamW) resumes with --enable-cuda-graph: the
    loaded optimizer takes this run's capturable flag, and the curve continues."""
    straight = losses(_args(prefix))
    ckpt = str(tmp_path / "ckpt")
    first = losses(_args(prefix, save=ckpt, exit_interval=6))
    second = losses(_args(prefix, enable_cuda_graph=True, cuda_graph_warmup_steps=2, load=ckpt))
    assert_same_losses(straight, {**first, **second}, rel=1e-4, keys=("lm loss",))


def test_running_ahead_stops_for_evaluation_and_checkpoints(prefix, tmp_path):
    """The graph launches step n + 1 before reading step n, except after steps that evaluate, save or exit:
    with evaluation every 5 and checkpoints every 4 iterations, the training curve, every validation loss and
    the resumed run agree with the eager trainer."""
    import re

    from tests.functional.harness import parse_iterations, run_pretrain

    def run(**kw):
        out = run_pretrain(_args(prefix, split="90,10,0", eval_interval=5, eval_iters=2, **kw)).stdout
        valid = {int(m.group(1)): float(m.group(2))
                 for m in re.finditer(r"validation loss at iteration (\d+) \| lm loss value: ([-+0-9.eE]+)", out)}
        return parse_iterations(out), valid

    eager, eager_valid = run(save=str(tmp_path / "eager"), save_interval=4)
    graph, graph_valid = run(enable_cuda_graph=True, cuda_graph_warmup_steps=2, save=str(tmp_path / "graph"),
                             save_interval=4)
    assert_same_losses(eager, graph, rel=1e-4, keys=("lm loss", "grad norm"))
    assert sorted(eager_valid) == sorted(graph_valid) == [5, 10, 12]
    for it, value in eager_valid.items():
        assert abs(value - graph_valid[it]) <= 1e-4 * abs(value), (it, value, graph_valid[it])
    # the checkpoint of iteration 8 (saved while no step ran ahead) resumes on the same curve
    with open(tmp_path / "graph" / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("8")
    resumed, _ = run(enable_cuda_graph=True, cuda_graph_warmup_steps=2, load=str(tmp_path / "graph"))
    assert sorted(resumed) == list(range(9, 13))
    assert_same_losses({i: graph[i] for i in resumed}, resumed, rel=1e-4, keys=("lm loss",))


# ---- BERT ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    from tests.functional.test_bert_training import shakespeare_bert_data

    return shakespeare_bert_data(tmp_path_factory.mktemp("cuda_graph_bert"))


BERT_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([-+0-9.eE]+) \|(?: sop loss: ([-+0-9.eE]+) \|)?"
                       r".*? grad norm: ([-+0-9.eE]+) \|")


def _bert_args(shakespeare, tmp_path, **kw):
    """A tiny BERT on the bundled corpus (real sentence pairs, padded batches), two microbatches per step."""
    prefix, vocab = shakespeare
    opts = {"num-layers": 2, "hidden-size": 128, "num-attention-heads": 4, "seq-length": 128,
            "max-position-embeddings": 128, "micro-batch-size": 8, "global-batch-size": 16, "train-iters": 12,
            "lr": 2e-3, "min-lr": 2e-4, "lr-decay-style": "cosine", "lr-warmup-iters": 2, "weight-decay": 0.01,
            "clip-grad": 1.0, "attention-dropout": 0.0, "hidden-dropout": 0.0, "seed": 1234, "log-interval": 1,
            "eval-iters": 0, "split": "100,0,0", "tokenizer-type": "BertWordPieceLowerCase", "vocab-file": vocab,
            "data-path": prefix, "data-cache-path": str(tmp_path / "cache"), "num-workers": 1,
            "attention-backend": "auto"}
    opts.update({k.replace("_", "-"): v for k, v in kw.items()})
    argv = []
    for key, value in opts.items():
        if value is None or value is False:
            continue
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def _bert_losses(argv):
    out = run_pretrain(argv, script="pretrain_bert.py").stdout
    its = {int(m.group(1)): {"lm loss": float(m.group(2)), "sop loss": float(m.group(3) or "nan"),
                             "grad norm": float(m.group(4))} for m in BERT_LINE.finditer(out)}
    assert sorted(its) == list(range(1, 13)), out[-3000:]
    return its


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["dropout_off", "dropout_on"])
def test_bert_graph_matches_eager(shakespeare, tmp_path, precision, dropout):
    """The BERT step (padding mask, the masked-LM head's static selection, binary head) captured and replayed
    gives every iteration's MLM loss, sentence-order loss and grad norm of the eager trainer. The eager run drops
    the attention mask for batches without padding; the graph always passes it (the same attention)."""
    extra = {"bf16": True} if precision == "bf16" else {}
    eager = _bert_losses(_bert_args(shakespeare, tmp_path, hidden_dropout=dropout, **extra))
    graph = _bert_losses(_bert_args(shakespeare, tmp_path, hidden_dropout=dropout, enable_cuda_graph=True,
                                    cuda_graph_warmup_steps=2, **extra))
    rel = 1e-4 if precision == "fp32" else 2e-3
    assert_same_losses(eager, graph, rel=rel, keys=("lm loss", "sop loss", "grad norm"))
    assert graph[12]["lm loss"] < graph[1]["lm loss"] - 0.2


def test_bert_graph_without_binary_head_resumes_on_the_curve(shakespeare, tmp_path):
    """--bert-no-binary-head under the graph: the MLM loss alone, and a checkpoint saved by the graph run at
    iteration 6 resumes (warm-up, capture, replays again) on the uninterrupted graph curve."""
    base = dict(bert_no_binary_head=True, enable_cuda_graph=True, cuda_graph_warmup_steps=2)
    eager = _bert_losses(_bert_args(shakespeare, tmp_path, bert_no_binary_head=True))
    straight = _bert_losses(_bert_args(shakespeare, tmp_path, **base))
    assert_same_losses(eager, straight, rel=1e-4, keys=("lm loss", "grad norm"))
    ckpt = str(tmp_path / "ckpt")
    first = run_pretrain(_bert_args(shakespeare, tmp_path, save=ckpt, exit_interval=6, **base),
                         script="pretrain_bert.py").stdout
    second = _bert_losses_from(run_pretrain(_bert_args(shakespeare, tmp_path, load=ckpt, **base),
                                            script="pretrain_bert.py").stdout)
    resumed = {**_bert_losses_from(first), **second}
    assert_same_losses(straight, resumed, rel=1e-4, keys=("lm loss",))


def _bert_losses_from(out):
    return {int(m.group(1)): {"lm loss": float(m.group(2))} for m in BERT_LINE.finditer(out)}


def _bert_batch(seed: int, s: int, b: int, vocab: int, k: int, padded: bool) -> dict:
    """A masked-LM batch on the CPU (as the loader gives it): some samples padded, each masking 0..k positions."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(s // 2, s + 1, (b,), generator=g) if padded else torch.full((b,), s)
    padding = (torch.arange(s).unsqueeze(0) < lengths.unsqueeze(1)).long()  # [b, s], 1 = token
    loss_mask = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        count = [k, 0, 1, int(torch.randint(1, k + 1, (1,), generator=g))][i % 4]
        loss_mask[i, torch.randperm(int(lengths[i]), generator=g)[:count]] = 1
    labels = torch.where(loss_mask.bool(), torch.randint(5, vocab, (b, s), generator=g), -1)
    text = torch.randint(5, vocab, (b, s), generator=g) * padding  # [b, s], 0 = [PAD]
    types = (torch.arange(s) >= s // 3).long().unsqueeze(0) * padding  # [b, s], segment B from s/3
    return dict(text=text, types=types, labels=labels, is_random=torch.randint(0, 2, (b,), generator=g),
                loss_mask=loss_mask, padding_mask=padding)


def test_bert_step_captures_and_replays_new_batches():
    """The BERT forward step, loss and backward (static masked-LM selection, padding mask, binary head, no host
    read) captured once as a CUDA graph; replayed on new batches (other padding, other masked positions, a sample
    with nothing masked, one masking the bound k) it gives the eager step's loss statistics and every gradient."""
    from megatron.core.models.bert import BertModel, initialize_bert_parameters
    from megatron.core.models.bert_loss import make_bert_forward_step, max_masked_positions
    from megatron.core.parallel_state import ParallelState
    from megatron.core.tensor_parallel import model_parallel_seed
    from megatron.core.transformer.config import TransformerConfig

    ps = ParallelState.single()
    model_parallel_seed(1234, ps)
    s, b, vocab = 64, 8, 256
    k = max_masked_positions(0.15, s)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=s,
                            max_position_embeddings=s, padded_vocab_size=vocab, attention_dropout=0.0,
                            hidden_dropout=0.0, attention_mask_type="padding")
    model = BertModel(cfg, ps)
    initialize_bert_parameters(model, 5, cfg, ps)
    batches = [_bert_batch(i, s, b, vocab, k, padded=i != 2) for i in range(4)]

    def run(step, batch):
        output, loss_func = step(iter([batch]), model)
        loss, stats = loss_func(output)
        loss.backward()
        return loss, stats

    eager_step = make_bert_forward_step(ps, max_masked=k)
    expected = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss, stats = run(eager_step, batch)
        expected.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))

    graph_step = make_bert_forward_step(ps, max_masked=k, capturable=True)
    static = {key: value.cuda() for key, value in batches[0].items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels chosen and memory allocated outside the capture
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            run(graph_step, static)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, _ = run(graph_step, static)
    for i in (1, 2, 3, 0):
        for key, value in batches[i].items():
            static[key].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        loss, grads = expected[i]
        assert abs(static_loss.item() - loss) <= 1e-5 * abs(loss), (i, static_loss.item(), loss)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=f"batch {i}: {name}")
