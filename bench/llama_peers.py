"""The peers of ``bench/llama_throughput.py``: one Llama-shaped model of another library trained for a few steps.

Runs in the peer's own Python (``--python TRAINER=PATH`` of the driver), so it imports torch, ``minimal_gpt``'s
training loop (torch only) and the peer's package, never this repository's library. The tokens come from the
driver as a ``torch.save`` file of ``int64[iterations, micro_batch, seq + 1]``: the micro-batches our trainer reads.

Trainers (``--trainer``), all with fp32 parameters, bf16 autocast on CUDA, AdamW (fused on CUDA; lr 1e-4, betas
0.9/0.95, weight decay 0.1), clip-grad 1.0, dropout 0 and the loss over the same ``s`` targets per sample:
  hf-llama-compiled   transformers ``LlamaForCausalLM`` (SDPA attention) under ``torch.compile``
  megatron-core       Megatron-Core ``GPTModel`` with ``get_gpt_layer_local_spec`` (no Transformer Engine), RMSNorm,
                      SwiGLU (its fused SwiGLU, ``bias_activation_fusion``), RoPE, grouped-query attention, no
                      biases, untied output layer, Megatron-LM's causal mask; its own loss (the
                      vocabulary-parallel cross entropy) at TP 1
  torchtitan          torchtitan's Llama 3 model (``torchtitan.models.llama3``, flex attention with its
                      causal mask, each transformer block under ``torch.compile`` as torchtitan compiles them)
  torchtitan-fp8      the same with torchao's float8 training linears (tensorwise scaling) in every block,
                      the output layer left in bf16 as torchtitan's float8 converter leaves it
On the CPU (``--device cpu``, a smoke check) ``torch.compile`` uses the ``eager`` backend (Dynamo traces, no
Inductor) and everything runs in fp32.

Prints ``BENCH_RESULT {"ms_per_iter", "peak_mem_gib", "losses", "versions"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minimal_gpt import train_and_time  # noqa: E402  (torch only)

TRAINERS = ("hf-llama-compiled", "megatron-core", "torchtitan", "torchtitan-fp8")


def _compile(module, device: str):
    return torch.compile(module, backend="inductor" if device == "cuda" else "eager")


def _version(dist_name: str) -> str:
    from importlib.metadata import version

    return version(dist_name)


def hf_llama(a, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.groups, max_position_embeddings=a.seq,
                      rope_theta=a.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False, attention_dropout=0.0, use_cache=False)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        raise RuntimeError(f"transformers picked attention {model.config._attn_implementation!r}, not sdpa")
    forward = _compile(model, device)

    def step(idx, tgt):  # the loss over the same targets as the other trainers (labels= would shift them)
        logits = forward(input_ids=idx).logits  # [b, s, V]
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.reshape(-1))
    return model, step, {"transformers": _version("transformers")}


def megatron_core(a, device: str):
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if device == "cpu":  # CPU smoke check: Megatron-Core's RoPE table and dropout RNG fork assume CUDA
        import contextlib

        torch.cuda.current_device = lambda: "cpu"
        tensor_parallel.random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                            num_query_groups=a.groups, ffn_hidden_size=a.ffn, kv_channels=a.hidden // a.heads,
                            normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                            attention_dropout=0.0, bias_activation_fusion=True, masked_softmax_fusion=False,
                            apply_rope_fusion=False, gradient_accumulation_fusion=False,
                            use_cpu_initialization=device != "cuda")
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=a.vocab, max_sequence_length=a.seq, position_embedding_type="rope",
                     rotary_base=int(a.rope_theta), share_embeddings_and_output_weights=False).to(device)
    position_ids = torch.arange(a.seq, device=device).unsqueeze(0)
    # Megatron-LM's training mask: True above the diagonal (masked out), one for every sample
    causal = torch.ones(a.seq, a.seq, dtype=torch.bool, device=device).triu(1).view(1, 1, a.seq, a.seq)

    def step(idx, tgt):  # GPTModel returns the per-token loss [b, s] when given labels
        return model(idx, position_ids.expand_as(idx), causal, labels=tgt).float().mean()
    return model, step, {"megatron-core": _version("megatron-core")}


def torchtitan_llama(a, device: str, fp8: bool):
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    # the blocks as torchtitan's own Llama 3 configurations build them (llama3._1b, _3b), at these sizes, untied
    layers = llama3._build_llama3_layers(
        n_layers=a.layers, dim=a.hidden, n_heads=a.heads, n_kv_heads=a.groups, hidden_dim=a.ffn,
        rope=ComplexRoPE.Config(dim=a.hidden // a.heads, max_seq_len=a.seq, theta=a.rope_theta),
        attn_backend="flex", fuse_qkv=True)
    cfg = llama3.Llama3Model.Config(
        dim=a.hidden, vocab_size=a.vocab, enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=a.vocab, embedding_dim=a.hidden,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=a.hidden, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=a.hidden, out_features=a.vocab,
                              param_init=llama3._output_linear_init(a.hidden)),
        layers=layers)
    with torch.device(device):
        model = cfg.build()
        model.init_states(buffer_device=torch.device(device))
    versions = {"torchtitan": _version("torchtitan")}
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        if converted != 5 * a.layers:  # per block: fused QKV, output projection, w1, w2, w3
            raise RuntimeError(f"torchao converted {converted} linear layers to float8, not {5 * a.layers}")
        versions["torchao"] = _version("torchao")
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, _compile(block, device))
    positions = torch.arange(a.seq, device=device).unsqueeze(0)
    masks = {}  # one document per sample, as our trainer reads them: the same mask every step, built once

    def step(idx, tgt):
        pos = positions.expand_as(idx)
        if idx.shape not in masks:
            masks[idx.shape] = model.get_attention_masks(pos)
        logits = model(idx, pos, masks[idx.shape])
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.reshape(-1))
    return model, step, versions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer", required=True, choices=TRAINERS)
    ap.add_argument("--tokens", required=True, help="torch.save file of int64[iterations, micro_batch, seq + 1]")
    for flag in ("layers", "hidden", "heads", "groups", "ffn", "seq", "vocab", "iters", "warmup"):
        ap.add_argument(f"--{flag}", type=int, required=True)
    ap.add_argument("--rope-theta", type=float, default=500000.0)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU visible to this Python")
    tokens = torch.load(a.tokens)
    if tokens.shape[0] < a.iters + a.warmup or tokens.shape[2] != a.seq + 1:
        raise SystemExit(f"--tokens {a.tokens}: shape {tuple(tokens.shape)} does not hold {a.iters + a.warmup} "
                         f"micro-batches of {a.seq + 1} tokens")
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True
    if a.trainer == "hf-llama-compiled":
        model, step, versions = hf_llama(a, a.device)
    elif a.trainer == "megatron-core":
        model, step, versions = megatron_core(a, a.device)
    else:
        model, step, versions = torchtitan_llama(a, a.device, fp8=a.trainer == "torchtitan-fp8")
    res = train_and_time(model, step, ({"text": t} for t in tokens), a.iters, a.warmup)
    res["versions"] = {"torch": torch.__version__, **versions}
    print("BENCH_RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
