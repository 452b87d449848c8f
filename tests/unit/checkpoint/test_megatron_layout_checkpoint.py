"""``--ckpt-layout megatron``: the trainer's ``save_checkpoint`` writes files Megatron-LM resumes, and our ``--load``
reads them back exactly.

The golden values (``fixtures/megatron_layout_golden.json``) were produced once by Megatron-Core 0.16.1's own
``GPTModel``, optimizers and scheduler loading checkpoints written by this same code
(``fixtures/make_megatron_layout_golden.py`` says how); this test needs no Megatron-Core.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from megatron.core.checkpoint_formats import load_megatron_file
from megatron.core.checkpoint_formats.safe_load import PickledNamespace, to_plain
from megatron.core.parallel_state import ParallelState
from megatron.training import checkpointing
from tests.unit.checkpoint.megatron_layout_case import (CASES, RESUMED, SAVE_AT, build, ckpt_config, run_and_save,
                                                       train)

GOLDEN = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "megatron_layout_golden.json")))
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-4, "distopt": 1e-3}


@pytest.mark.parametrize("case", CASES)
def test_trainer_writes_what_megatron_core_resumes(case, tmp_path):
    golden = GOLDEN["cases"][case]
    run = run_and_save(case, str(tmp_path))
    raw = load_megatron_file(run["path"])
    # Megatron-LM's layout: a pickled argparse.Namespace (so not loadable with weights_only=True alone), the model
    # with Megatron-Core's keys in its order (the strict load of its GPTModel accepted exactly these), the
    # arguments Megatron-LM checks on resume, a per-rank RNG list, the optimizer and the sample-based scheduler
    with pytest.raises(Exception, match="argparse.Namespace"):
        torch.load(run["path"], weights_only=True)
    assert isinstance(raw["args"], PickledNamespace)
    assert list(raw["model"]) == golden["model_keys"]
    args = to_plain(raw["args"])
    assert {k: args.get(k) for k in golden["args"]} == golden["args"]
    assert raw["iteration"] == SAVE_AT and raw["checkpoint_version"] == 3.0
    assert isinstance(raw["rng_state"], list) and len(raw["rng_state"]) == 1
    assert set(raw["rng_state"][0]) >= {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state",
                                        "rng_tracker_states"}
    assert isinstance(raw["rng_state"][0]["np_rng_state"][1], np.ndarray)
    if case == "fp16":  # Megatron-LM's DynamicGradScaler state: the scale as a tensor
        assert set(raw["optimizer"]) == {"optimizer", "fp32_from_fp16_params", "grad_scaler"}
        scaler = raw["optimizer"]["grad_scaler"]
        assert torch.is_tensor(scaler["scale"]) and {k: float(v) for k, v in scaler.items()} == \
            golden["scaler_after_load"]
    if case == "distopt":  # param groups (step, and the keys Megatron-Core matches groups by) + distrib_optim.pt
        groups = raw["optimizer"]["optimizer"]["param_groups"]
        assert set(raw["optimizer"]) == {"optimizer"} and [g["step"] for g in groups] == [float(SAVE_AT)] * 2
        assert [(g["wd_mult"], g["lr_mult"], g["is_expert_parallel"], g["is_decoupled_lr"]) for g in groups] == [
            (1.0, 1.0, False, False), (0.0, 1.0, False, False)]
        distrib = load_megatron_file(os.path.join(os.path.dirname(run["path"]), "distrib_optim.pt"))
        entry = distrib[0][(torch.bfloat16, torch.float32)]
        assert distrib["buckets_coalesced"] and entry["param"].numel() == entry["numel_unpadded"]
    elif case != "fp32":
        assert set(raw["optimizer"]) - {"grad_scaler"} == {"optimizer", "fp32_from_fp16_params"}
        assert [len(g) for g in raw["optimizer"]["fp32_from_fp16_params"]] == [
            len(g["params"]) for g in raw["optimizer"]["optimizer"]["param_groups"]]
    else:
        assert set(raw["optimizer"]) == {"state", "param_groups"}
    assert raw["opt_param_scheduler"]["num_steps"] == SAVE_AT * 2  # samples, global batch 2

    # our --load: iteration, consumed samples, scheduler position, and the uninterrupted curve bit for bit
    dims, model, opt, sched = build(case, seed=99)
    assert checkpointing.load_checkpoint([model], opt, sched, ckpt_config(load=str(tmp_path)),
                                         ParallelState.single()) == (SAVE_AT, SAVE_AT * 2)
    assert opt.param_groups[0]["lr"] == pytest.approx(golden["lr_after_load"], rel=1e-12)
    if case == "fp16":
        assert opt.grad_scaler.state_dict() == golden["scaler_after_load"]
    ours = train(model, opt, sched, run["data"], SAVE_AT, RESUMED)
    assert ours == run["losses_after_save"]
    # Megatron-Core's own resume of the same file continues the same curve
    assert golden["first_iteration"] == SAVE_AT
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(golden["losses"]), atol=TOLERANCE[case], rtol=0)

    # the check can fail: without the optimizer state the curve leaves Megatron-Core's
    dims, model, opt, sched = build(case, seed=99)
    cfg = dataclasses.replace(ckpt_config(load=str(tmp_path)), no_load_optim=True)
    checkpointing.load_checkpoint([model], opt, sched, cfg, ParallelState.single())
    fresh = torch.tensor(train(model, opt, sched, run["data"], SAVE_AT, RESUMED))
    assert (fresh - torch.tensor(golden["losses"])).abs().max() > 2 * TOLERANCE[case]


def test_a_corrupted_megatron_layout_file_is_named(tmp_path):
    run = run_and_save("fp32", str(tmp_path))
    where = os.path.getsize(run["path"]) // 2  # inside a tensor's bytes: the file still unpickles
    with open(run["path"], "r+b") as f:  # same size, one byte changed: only the manifest's hash sees it
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))
    dims, model, opt, sched = build("fp32", seed=99)
    with pytest.raises(checkpointing.cio.CheckpointIOError, match="model_optim_rng.pt"):
        checkpointing.load_checkpoint([model], opt, sched, ckpt_config(load=str(tmp_path)), ParallelState.single())


def test_null_tokenizer_vocabulary_counts_its_end_of_document_id():
    from megatron.core.checkpoint_formats import dims_from_args

    args = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 16,
            "tokenizer_type": "NullTokenizer", "vocab_size": 64, "make_vocab_size_divisible_by": 64}
    # Megatron-LM's NullTokenizer(--vocab-size 64) has 65 ids: padded to 128, and to 256 at TP=4
    dims = dims_from_args(dict(args, padded_vocab_size=128))
    assert (dims.vocab_size, dims.padded_for(4)) == (65, 256)
    # a checkpoint whose rows cannot hold the end-of-document id keeps its 64 (the fixture's case)
    assert dims_from_args(dict(args, padded_vocab_size=64)).vocab_size == 64
