"""The trainer's own checkpoint functions against the converter: a checkpoint saved by the trainer (distributed
optimizer, TP=1) is resharded to TP=2 by tools/checkpoint/convert.py and resumed by the trainer's load_checkpoint;
the next step's loss and weights equal those of the uninterrupted TP=1 run."""

from dataclasses import asdict

import torch

from megatron.core.checkpoint_formats import ModelDims, merge_tp_pp
from megatron.core.distributed import DDPConfig, DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpointing
from megatron.training.arguments import parse_config
from megatron.training.scheduler import OptimizerParamScheduler
from tests.dist_utils import run_distributed
from tests.unit.checkpoint.helpers import build_stage, random_full, tiny_dims
from tests.unit.checkpoint.test_convert import _run


def _setup(dims, pstate, state):
    model = build_stage(dims, pstate, state)
    ddp = DistributedDataParallel(model, pstate=pstate, config=DDPConfig(use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [ddp], pstate)
    sched = OptimizerParamScheduler(opt, 1e-2, 1e-3, 1, 10, "cosine", 0.1)
    return model, ddp, opt, sched


def _step(model, ddp, opt, sched, pstate, batch):
    pos = torch.arange(batch.shape[1] - 1).unsqueeze(0).expand(batch.shape[0], -1)
    model.train()
    opt.zero_grad()
    loss = ddp(batch[:, :-1], pos, labels=batch[:, 1:]).float().mean()
    loss.backward()
    finalize_model_grads([ddp], pstate)
    ok, _, _ = opt.step()
    assert ok
    sched.step()
    return loss.detach()


def _args(dims, tp, save=None, load=None):
    """The trainer's own configuration for this model: its checkpoint section and the arguments it stores (the
    typed configuration's plain dict, which holds no padded vocabulary: the converter derives it)."""
    argv = ["--mock-data", "--lr", "1e-2", "--num-layers", str(dims.num_layers), "--hidden-size",
            str(dims.hidden_size), "--num-attention-heads", str(dims.num_attention_heads), "--ffn-hidden-size",
            str(dims.ffn_hidden_size), "--seq-length", str(dims.seq_length), "--max-position-embeddings",
            str(dims.max_position_embeddings), "--make-vocab-size-divisible-by",
            str(dims.make_vocab_size_divisible_by), "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "10", "--tensor-model-parallel-size", str(tp)]
    argv += ["--save", save] if save else []
    # a resharded checkpoint has no RNG state (it belongs to the source ranks): resume with --no-load-rng
    argv += ["--load", load, "--no-load-rng"] if load else []
    cfg, _ = parse_config(argv, world_size=tp)
    plain = cfg.to_plain_dict()
    return cfg.checkpointing, plain


def _save_body(rank, world, dims_dict, full, batch, save_dir, out):
    dims = ModelDims(**dims_dict)
    pstate = ParallelState.build(1, 1)
    model, ddp, opt, sched = _setup(dims, pstate, full)
    for _ in range(2):
        _step(model, ddp, opt, sched, pstate, batch)
    args, plain = _args(dims, 1, save=save_dir)
    checkpointing.save_checkpoint(2, [ddp], opt, sched, args, pstate, 4, plain)
    loss = _step(model, ddp, opt, sched, pstate, batch)  # the uninterrupted run's third step
    torch.save({"loss": loss, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}, out)


def _resume_body(rank, world, dims_dict, load_dir, batch, out):
    dims = ModelDims(**dims_dict)
    pstate = ParallelState.build(tensor_model_parallel_size=world)
    model, ddp, opt, sched = _setup(dims, pstate, None)  # random weights: everything comes from the file
    args, _ = _args(dims, world, load=load_dir)
    iteration, consumed = checkpointing.load_checkpoint([ddp], opt, sched, args, pstate)
    assert (iteration, consumed, sched.num_steps) == (2, 4, 2)
    loss = _step(model, ddp, opt, sched, pstate, batch)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, state)
    if rank == 0:
        torch.save({"loss": loss, "shards": {(t, 0): [g] for t, g in enumerate(gathered)}}, out)


def test_trainer_checkpoint_resharded_by_the_tool_resumes_at_tp2(tmp_path, capsys):
    dims = tiny_dims(vocab=100, divisible_by=64)  # 128 padded rows at TP=1 and TP=2
    full = random_full(dims)
    batch = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(4))
    src, dst = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    ref = str(tmp_path / "ref.pt")
    run_distributed(_save_body, world_size=1, args=(asdict(dims), full, batch, src, ref))
    rc, out, err = _run(capsys, "--model-type", "GPT", "--loader", "ours", "--saver", "ours", "--load-dir", src,
                        "--save-dir", dst, "--target-tensor-parallel-size", "2", "--reshard-optimizer",
                        "--true-vocab-size", "100")
    assert rc == 0, err
    assert "iteration 2" in out and "RNG state dropped" in out
    got_path = str(tmp_path / "got.pt")
    run_distributed(_resume_body, world_size=2, args=(asdict(dims), dst, batch, got_path))
    want, got = torch.load(ref, weights_only=True), torch.load(got_path, weights_only=True)
    torch.testing.assert_close(got["loss"], want["loss"], atol=1e-5, rtol=1e-5)
    merged = merge_tp_pp(got["shards"])
    for name, t in want["state"].items():
        torch.testing.assert_close(merged[name], t, atol=2e-5, rtol=1e-4)
