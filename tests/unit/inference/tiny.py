"""A tiny GPT and its checkpoint, written in the training layout, for the inference tests."""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron.core.inference import save_gpt_checkpoint
from megatron.core.models.gpt import GPTModel
from megatron.core.models.init import initialize_model_parameters
from megatron.core.parallel_state import ParallelState
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.transformer.config import TransformerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VOCAB = os.path.join(ROOT, "data", "gpt2-vocab.json")
MERGES = os.path.join(ROOT, "data", "gpt2-merges.txt")


def tiny_args(**kw) -> dict:
    """Training arguments as the trainer stores them (a plain dict); ``init_method_std`` large enough that a
    random model's greedy choices vary from step to step."""
    args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=None, seq_length=48,
                max_position_embeddings=48, padded_vocab_size=128, layernorm_epsilon=1e-5, apply_layernorm_1p=False,
                untie_embeddings_and_output_weights=False, params_dtype="float32", tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                init_method_std=0.3, seed=11, tokenizer_type="GPT2BPETokenizer", vocab_file=VOCAB,
                merge_file=MERGES)
    args.update(kw)
    return args


def tiny_config(args: dict, attention_backend: str = "sdpa") -> TransformerConfig:
    return TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"], ffn_hidden_size=args["ffn_hidden_size"],
        seq_length=args["seq_length"], max_position_embeddings=args["max_position_embeddings"],
        padded_vocab_size=args["padded_vocab_size"], attention_dropout=0.0, hidden_dropout=0.0,
        layernorm_epsilon=args["layernorm_epsilon"], init_method_std=args["init_method_std"],
        share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"],
        attention_backend=attention_backend, gradient_accumulation_fusion=False)


def tiny_model(args: dict, pstate: Optional[ParallelState] = None) -> GPTModel:
    """The whole model at ``pstate``'s TP size (layout-independent initialisation from ``args['seed']``)."""
    pstate = pstate or ParallelState.single()
    cfg = tiny_config(args)
    model = GPTModel(cfg, pstate)
    initialize_model_parameters(model, args["seed"], cfg, pstate)
    return model.eval()


def write_checkpoint(root: str, args: dict, iteration: int = 5, stored: Optional[dict] = None) -> None:
    """Write every rank's file of a TP x PP checkpoint from one process (no process group is needed to build
    the shards: each is the layout-independent initialisation sliced for its rank). ``stored``: the arguments
    written into the files (default ``args``)."""
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    cfg = tiny_config(args)
    for p in reversed(range(pp)):  # rank (0, 0) last: it writes the tracker file
        for t in reversed(range(tp)):
            ps = ParallelState(world_size=tp * pp, tp_size=tp, pp_size=pp, tp_rank=t, pp_rank=p,
                               tp_ranks=list(range(tp)), pp_ranks=list(range(pp)))
            offset, count = layers_for_stage(args["num_layers"], pp, p)
            chunk = GPTModel(cfg, ps, pre_process=p == 0, post_process=p == pp - 1, num_layers=count,
                             layer_offset=offset)
            initialize_model_parameters(chunk, args["seed"], cfg, ps, layer_offset=offset)
            save_gpt_checkpoint(root, iteration, [chunk], args if stored is None else stored, tp_rank=t,
                                pp_rank=p)


def random_prompts(lengths, vocab: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
