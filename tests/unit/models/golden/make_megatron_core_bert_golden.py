"""Golden outputs of Megatron-Core's own BertModel (local layer spec, CPU, fp32) for a tiny pre-LN BERT.

Run once in a separate environment that has Megatron-Core (never a dependency of this project):

    python -m venv --system-site-packages /tmp/mcore_venv && /tmp/mcore_venv/bin/pip install megatron-core==0.16.1
    /tmp/mcore_venv/bin/python tests/unit/models/golden/make_megatron_core_bert_golden.py

It writes ``megatron_core_bert.json`` next to itself: the configuration, the inputs, Megatron-Core's state-dict
names and shapes, and its outputs (MLM logits and per-token loss at the real tokens, binary logits). Every weight
is drawn by ``golden_weight(name, shape)`` below, a rule the test repeats on our model's names.
"""

import contextlib
import json
import os
import zlib

import torch
import torch.distributed as dist

CONFIG = dict(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=64, seq_length=8, batch=2,
              layernorm_epsilon=1e-5)


def golden_weight(name: str, shape) -> torch.Tensor:
    """LayerNorm weights 1 + 0.1 N(0, 1), everything else 0.1 N(0, 1), from a generator seeded by the name."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    w = 0.1 * torch.randn(shape, generator=g, dtype=torch.float32)
    if "layernorm.weight" in name or "layer_norm.weight" in name:
        w += 1.0
    return w


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    # Megatron-Core's attention scratch buffer is allocated on torch.cuda.current_device(); on a CPU-only torch
    # that device is the CPU (the computation itself is unchanged)
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    # its dropout RNG tracker keeps CUDA generator states; dropout is 0 here, so it forks nothing on the CPU
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    c = CONFIG
    cfg = TransformerConfig(num_layers=c["num_layers"], hidden_size=c["hidden_size"],
                            num_attention_heads=c["num_attention_heads"], use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=c["layernorm_epsilon"])
    model = BertModel(config=cfg, num_tokentypes=2, transformer_layer_spec=bert_layer_local_spec,
                      vocab_size=c["vocab_size"], max_sequence_length=c["seq_length"],
                      share_embeddings_and_output_weights=True, add_binary_head=True).eval()
    shapes = {k: list(v.shape) for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(golden_weight(name, p.shape))

    g = torch.Generator().manual_seed(0)
    b, s, v = c["batch"], c["seq_length"], c["vocab_size"]
    ids = torch.randint(0, v, (b, s), generator=g)
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0, 0]])
    padding = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    labels = torch.randint(0, v, (b, s), generator=g)
    with torch.no_grad():
        logits, binary = model(ids, padding, tokentype_ids=types)
        loss, _ = model(ids, padding, tokentype_ids=types, lm_labels=labels)
    real = padding.bool()
    out = {
        "command": "tests/unit/models/golden/make_megatron_core_bert_golden.py with megatron-core 0.16.1",
        "config": c, "state_dict_shapes": shapes,
        "input_ids": ids.tolist(), "tokentype_ids": types.tolist(), "padding_mask": padding.tolist(),
        "lm_labels": labels.tolist(),
        "logits_at_real_tokens": logits[real].tolist(),
        "loss_at_real_tokens": loss[real].tolist(),
        "binary_logits": binary.tolist(),
    }
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_core_bert.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
