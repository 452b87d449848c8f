"""A tiny run of our trainer's pieces that saves with ``--ckpt-layout megatron``: shared by the CI test
(``test_megatron_layout_checkpoint.py``) and the generator of its golden values
(``fixtures/make_megatron_layout_golden.py``), so both see the same deterministic checkpoint.

Each case (fp32, bf16, fp16, bf16 with the distributed optimizer) trains our GPT (2 layers, hidden 32, vocabulary 100 padded to 104) for ``SAVE_AT``
iterations on seeded random tokens with our optimizer and scheduler, saves through the trainer's
``save_checkpoint`` in Megatron-LM's layout, then keeps training to ``SAVE_AT + RESUMED`` iterations (the
uninterrupted curve).
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch

from megatron.core.distributed import DDPConfig, DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpointing
from megatron.training.config import CheckpointConfig
from megatron.training.scheduler import OptimizerParamScheduler
from tests.unit.checkpoint.helpers import build_stage, tiny_dims

# FP32Optimizer (torch's state dict), the mixed-precision layout (+ fp16 loss scaler), the distributed optimizer
# (bf16, distrib_optim.pt)
CASES = ("fp32", "bf16", "fp16", "distopt")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "distopt": torch.bfloat16}
LOSS_SCALE = 4096.0  # fp16: the dynamic scaler's start (no overflow, so no skipped step in this tiny run)
SAVE_AT, RESUMED, TRAIN_ITERS = 3, 4, 10
MICRO, SEQ = 2, 16
LR, MIN_LR, WD, WARMUP = 1e-3, 1e-4, 0.01, 2


def batches(dims) -> torch.Tensor:
    """``[iterations, micro batch, seq + 1]`` tokens of the real vocabulary."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, dims.vocab_size, (SAVE_AT + RESUMED, MICRO, SEQ + 1), generator=g)


def plain_args(dims, case: str) -> Dict[str, object]:
    """The run's flags as the trainer stores them (``RunConfig.to_plain_dict`` names)."""
    return {"num_layers": dims.num_layers, "hidden_size": dims.hidden_size, "ffn_hidden_size": dims.ffn_hidden_size,
            "num_attention_heads": dims.num_attention_heads, "seq_length": SEQ,
            "max_position_embeddings": dims.max_position_embeddings,
            "make_vocab_size_divisible_by": dims.make_vocab_size_divisible_by, "vocab_size": dims.vocab_size,
            "tokenizer_type": "NullTokenizer", "norm_epsilon": 1e-5, "micro_batch_size": MICRO,
            "global_batch_size": MICRO, "train_iters": TRAIN_ITERS, "lr": LR, "min_lr": MIN_LR,
            "lr_warmup_iters": WARMUP, "lr_decay_style": "cosine", "weight_decay": WD, "clip_grad": 0.0,
            "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "seed": 7,
            "params_dtype": str(DTYPES[case]).replace("torch.", ""), "bf16": DTYPES[case] == torch.bfloat16,
            "fp16": case == "fp16", "initial_loss_scale": LOSS_SCALE, "use_distributed_optimizer": case == "distopt",
            "overlap_grad_reduce": False,
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02}


def build(case: str, seed: int = 3):
    """Our model, optimizer and scheduler for ``case`` (built from the run's flags, as the trainer does)."""
    dims = tiny_dims(vocab=100, layers=2)
    pstate = ParallelState.single()
    model = build_stage(dims, pstate, dtype=DTYPES[case], seed=seed)
    distributed = case == "distopt"
    if distributed:  # the trainer's wrapping: a contiguous fp32 grad buffer the distributed optimizer shards
        model = DistributedDataParallel(model, pstate=pstate,
                                        config=DDPConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, min_lr=MIN_LR, weight_decay=WD, clip_grad=0.0,
                                                 adam_beta1=0.9, adam_beta2=0.95,
                                                 bf16=DTYPES[case] == torch.bfloat16, fp16=case == "fp16",
                                                 initial_loss_scale=LOSS_SCALE, use_distributed_optimizer=distributed),
                                 [model], pstate)
    sched = OptimizerParamScheduler(opt, LR, MIN_LR, WARMUP, TRAIN_ITERS, "cosine", WD)
    return dims, model, opt, sched


def train(model, opt, sched, data: torch.Tensor, first: int, count: int) -> List[float]:
    pos = torch.arange(SEQ).unsqueeze(0).expand(MICRO, SEQ)
    model.train()
    out = []
    for it in range(first, first + count):
        loss = model(data[it, :, :-1], pos, labels=data[it, :, 1:]).float().mean()
        opt.zero_grad()
        (loss * opt.get_loss_scale()).backward()
        assert opt.step()[0]
        sched.step()
        out.append(loss.item())
    return out


def ckpt_config(save=None, load=None) -> CheckpointConfig:
    return CheckpointConfig(save=save, load=load, save_interval=None, no_save_optim=False, no_save_rng=False,
                            no_load_optim=False, no_load_rng=False, finetune=False, use_checkpoint_args=False,
                            exit_on_missing_checkpoint=False, ckpt_fallback_on_corruption=False,
                            keep_last_checkpoints=None, ckpt_layout="megatron")


def run_and_save(case: str, root: str) -> Dict[str, object]:
    """Train ``SAVE_AT`` iterations, save in Megatron-LM's layout under ``root``, train on; returns the data, the
    uninterrupted losses after the save and the path of the written rank file."""
    dims, model, opt, sched = build(case)
    data = batches(dims)
    train(model, opt, sched, data, 0, SAVE_AT)
    checkpointing.save_checkpoint(SAVE_AT, [model], opt, sched, ckpt_config(save=root), ParallelState.single(),
                                  SAVE_AT * MICRO, plain_args(dims, case))
    after = train(model, opt, sched, data, SAVE_AT, RESUMED)
    path = os.path.join(root, f"iter_{SAVE_AT:07d}", "mp_rank_00", "model_optim_rng.pt")
    return {"data": data, "losses_after_save": after, "path": path, "dims": dims}
