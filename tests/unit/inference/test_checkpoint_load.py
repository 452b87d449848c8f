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


def test_untied_output_layer_and_dtype_override(tmp_path):
    args = tiny_args(untie_embeddings_and_output_weights=True, pipeline_model_parallel_size=2)
    write_checkpoint(str(tmp_path), args)
    loaded = load_gpt_for_inference(str(tmp_path), dtype=torch.bfloat16)
    assert loaded.model.output_layer is not None
    assert loaded.model.output_layer.weight.dtype == torch.bfloat16
    want = tiny_model(args).state_dict()["output_layer.weight"].to(torch.bfloat16)
    assert torch.equal(loaded.model.state_dict()["output_layer.weight"], want)


def test_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointLoadError, match="no such directory"):
        load_gpt_for_inference(str(tmp_path / "absent"))
    with pytest.raises(CheckpointLoadError, match="latest_checkpointed_iteration.txt"):
        load_gpt_for_inference(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("oops")
    with pytest.raises(CheckpointLoadError, match="expected an iteration number"):
        load_gpt_for_inference(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(CheckpointLoadError, match="iter_0000003 does not exist"):
        load_gpt_for_inference(str(tmp_path))
    bad = tmp_path / "iter_0000003" / "mp_rank_00"
    bad.mkdir(parents=True)
    torch.save({"args": ParallelState.single()}, bad / "model_optim_rng.pt")  # a pickled class: refused
    with pytest.raises(CheckpointLoadError, match="cannot read .*model_optim_rng.pt"):
        load_gpt_for_inference(str(tmp_path))


def _tp2_body(rank, world_size, ckpts, out_path):
    pstate = ParallelState.build(tensor_model_parallel_size=2)
    results = []
    for ckpt in ckpts:
        engine = InferenceEngine(load_gpt_for_inference(ckpt, pstate).model, pstate, eod=0)
        prompts = random_prompts([3, 7, 5], seed=4)
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_on_eod=False,
                                                         logprobs=True))
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.9, seed=5,
                                                          stop_on_eod=False))
        results.append({"greedy": [o.tokens for o in greedy], "logprobs": [o.logprobs for o in greedy],
                        "sampled": [o.tokens for o in sampled]})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def test_tp2_generation_equals_tp1(tmp_path):
    """Checkpoints saved at TP=1 (re-split on load) and at TP=2 (read shard by shard), run at TP=2."""
    ckpts = []
    for saved_tp in (1, 2):
        ckpts.append(str(tmp_path / f"ckpt_tp{saved_tp}"))
        write_checkpoint(ckpts[-1], tiny_args(tensor_model_parallel_size=saved_tp))
    out_path = str(tmp_path / "tp2.json")
    run_distributed(_tp2_body, world_size=2, args=(ckpts, out_path))
    for ckpt, tp2 in zip(ckpts, json.load(open(out_path))):
        _compare_with_tp1(ckpt, tp2)


def _compare_with_tp1(ckpt, tp2):
    engine = InferenceEngine(load_gpt_for_inference(ckpt).model, eod=0)
    prompts = random_prompts([3, 7, 5], seed=4)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=10, greedy=True, stop_on_eod=False,
                                                     logprobs=True))
    assert tp2["greedy"] == [o.tokens for o in greedy]
    for a, b in zip(tp2["logprobs"], greedy):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.3, top_p=0.9, seed=5,
                                                      stop_on_eod=False))
    assert tp2["sampled"] == [o.tokens for o in sampled]
