"""Our BERT against golden outputs of Megatron-Core's own ``BertModel`` (tests/unit/models/golden/, made once by
``make_megatron_core_bert_golden.py`` in a separate environment): the same state-dict names and shapes, and with
the same weights the same MLM logits, per-token loss and binary logits."""

import json
import os

import torch

from megatron.core.models.bert import BertModel
from megatron.core.parallel_state import ParallelState
from megatron.core.transformer.config import TransformerConfig
from tests.unit.models.golden.make_megatron_core_bert_golden import golden_weight

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "megatron_core_bert.json")


def test_matches_megatron_core_bert():
    with open(GOLDEN) as f:
        gold = json.load(f)
    c = gold["config"]
    cfg = TransformerConfig(num_layers=c["num_layers"], hidden_size=c["hidden_size"],
                            num_attention_heads=c["num_attention_heads"], seq_length=c["seq_length"],
                            padded_vocab_size=c["vocab_size"], attention_dropout=0.0, hidden_dropout=0.0,
                            layernorm_epsilon=c["layernorm_epsilon"], attention_mask_type="padding")
    model = BertModel(cfg, ParallelState.single()).eval()
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == {k: v for k, v in gold["state_dict_shapes"].items() if not k.endswith("_extra_state")}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(golden_weight(name, p.shape))
    ids, types, padding, labels = (torch.tensor(gold[k]) for k in ("input_ids", "tokentype_ids", "padding_mask",
                                                                    "lm_labels"))
    with torch.no_grad():
        logits, binary = model(ids, padding, tokentype_ids=types)
        loss, _ = model(ids, padding, tokentype_ids=types, lm_labels=labels)
    real = padding.bool()  # Megatron-Core also masks padded queries: only real tokens are comparable
    torch.testing.assert_close(logits[real], torch.tensor(gold["logits_at_real_tokens"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss[real], torch.tensor(gold["loss_at_real_tokens"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(binary, torch.tensor(gold["binary_logits"]), rtol=1e-5, atol=1e-5)
