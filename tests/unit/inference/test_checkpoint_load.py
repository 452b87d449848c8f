"""Loading training checkpoints for inference: any saved TP x PP layout into the asked TP, and clear errors."""

import json

import pytest
import torch

from megatron.core.inference import CheckpointLoadError, InferenceEngine, SamplingParams, load_gpt_for_inference
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed
from tests.unit.inference.tiny import random_prompts, tiny_args, tiny_model, write_checkpoint


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (1, 2)])
def test_any_saved_layout_loads_as_the_whole_model(tmp_path, tp, pp):
    args = tiny_args(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    write_checkpoint(str(tmp_path), args, iteration=7)
    loaded = load_gpt_for_inference(str(tmp_path))
    assert loaded.iteration == 7 and loaded.args["pipeline_model_parallel_size"] == pp
    want = tiny_model(args).state_dict()
    got = loaded.model.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("legacy_alias", [True, False])
def test_arguments_of_the_typed_configuration_load(tmp_path, legacy_alias):
    """The trainer stores its typed configuration's plain dict: ``norm_epsilon`` (with, for now, the older name
    ``layernorm_epsilon``) and no padded vocabulary, which the loader takes from the word embedding's shards."""
    from megatron.training.arguments import parse_config

    args = tiny_args(tensor_model_parallel_size=2, layernorm_epsilon=1e-3)
    cfg, _ = parse_config(["--mock-data", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "32",
                           "--num-attention-heads", "4", "--seq-length", "48", "--max-position-embeddings", "48",
                           "--norm-epsilon", "1e-3", "--micro-batch-size", "1", "--global-batch-size", "1",
                           "--train-iters", "1", "--tensor-model-parallel-size", "2"], world_size=2)
    stored = cfg.to_plain_dict()
    stored.pop("padded_vocab_size", None)
    if not legacy_alias:
        del stored["layernorm_epsilon"]
    write_checkpoint(str(tmp_path), args, stored=stored)
    loaded = load_gpt_for_inference(str(tmp_path))
    assert loaded.model.config.padded_vocab_size == 128 and loaded.model.config.layernorm_epsilon == 1e-3
    want = tiny_model(args).state_dict()
    got = loaded.model.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_untied_output_layer_and_dtype_override(tmp_path):
    args = tiny_args(untie_embeddings_and_output_weights=True, pipeline_model_parallel_size=2)
    write_checkpoint(str(tmp_path), args)
    loaded = load_gpt_for_inference(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.model.output_layer is not None
    assert loaded.model.output_layer.weight.dtype == torch.bfloat16
    want = tiny_model(args).state_dict()["output_layer.weight"].to(torch.bfloat16)
    assert torch.equal(loaded.model.state_dict()["output_layer.weight"], want)


def test_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointLoadError, match="does not exist"):
        load_gpt_for_inference(str(tmp_path / "absent"))
    with pytest.raises(CheckpointLoadError, match="latest_checkpointed_iteration.txt"):
        load_gpt_for_inference(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("oops")
    with pytest.raises(CheckpointLoadError, match="expected a non-negative iteration number"):
        load_gpt_for_inference(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(CheckpointLoadError, match="iter_0000003 does not exist"):
        load_gpt_for_inference(str(tmp_path))
    bad = tmp_path / "iter_0000003" / "mp_rank_00"
    bad.mkdir(parents=True)
    torch.save({"args": ParallelState.single()}, bad / "model_optim_rng.pt")  # a pickled class: refused
    with pytest.raises(CheckpointLoadError, match="refusing to load .*model_optim_rng.pt: .*ParallelState") as err:
        load_gpt_for_inference(str(tmp_path))
    assert "\n" not in str(err.value)
    (bad / "model_optim_rng.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointLoadError,
                       match=r"mp_rank_00/model_optim_rng.pt is not a complete torch file \(truncated") as err:
        load_gpt_for_inference(str(tmp_path))
    assert "\n" not in str(err.value)


def _generate_all(engine):
    prompts = random_prompts([3, 7, 5], seed=4)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_on_eod=False,
                                                     logprobs=True, top_logprobs=2))
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.9, seed=5,
                                                      stop_on_eod=False))
    return {"greedy": [o.tokens for o in greedy], "logprobs": [o.logprobs for o in greedy],
            "top": [o.top_logprobs for o in greedy], "sampled": [o.tokens for o in sampled]}


def _parallel_body(rank, world_size, ckpts, out_path):
    """TP=2 on both checkpoints, then PP=2, with the static decoding step (the default) and on the first
    checkpoint also the dynamic one (every rank writes what it got: all ranks must agree)."""
    results = []
    for sizes in ({"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}):
        pstate = ParallelState.build(**sizes)
        for ckpt in ckpts:
            model = load_gpt_for_inference(ckpt, pstate).model
            results.append(_generate_all(InferenceEngine(model, pstate, eod=0)))
            if ckpt == ckpts[0]:
                results.append(_generate_all(InferenceEngine(model, pstate, eod=0, static_decode=False)))
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)


def test_tp2_and_pp2_generation_equal_tp1(tmp_path):
    """Checkpoints saved at TP=1 and at TP=2 x PP=2, run at TP=2 (re-split, or read shard by shard) and at PP=2."""
    ckpts = [str(tmp_path / "ckpt_tp1"), str(tmp_path / "ckpt_tp2pp2")]
    write_checkpoint(ckpts[0], tiny_args())
    write_checkpoint(ckpts[1], tiny_args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    out_path = str(tmp_path / "parallel.json")
    run_distributed(_parallel_body, world_size=2, args=(ckpts, out_path))
    want = _generate_all(InferenceEngine(load_gpt_for_inference(ckpts[0]).model, eod=0))
    for rank in range(2):
        runs = json.load(open(f"{out_path}.{rank}"))
        assert len(runs) == 6
        for got in runs:
            assert got["greedy"] == want["greedy"] and got["sampled"] == want["sampled"]
            for a, b in zip(got["logprobs"], want["logprobs"]):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
            assert [[[t for t, _ in step] for step in seq] for seq in got["top"]] == \
                [[[t for t, _ in step] for step in seq] for seq in want["top"]]
