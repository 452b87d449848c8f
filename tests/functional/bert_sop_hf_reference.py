"""Hugging Face's BERT trained on the BERT batches pretrain_bert.py reads: the reference for the sentence-order
accuracy of a tiny BERT on real text (docs/bert.md, "The sentence-order head on real text").

    python tests/functional/bert_sop_hf_reference.py PREFIX_text_sentence vocab.txt [--iters 150] [--batch 64]
        [--seq-length 128] [--hidden-size 128] [--num-layers 2] [--num-heads 4] [--lr 2e-3] [--init-std 0.088]
        [--post-ln]

The model is ``MegatronBertForPreTraining`` (pre-LN, the order ``pretrain_bert.py`` trains by default), or with
``--post-ln`` the original ``BertForPreTraining`` (``--apply-residual-connection-post-layernorm``).

The batches come from ``bench/corpus.py``'s ``bert_batches`` (the library's BERT dataset and loader with
``--split 100,0,0 --seed 1234``: the samples of ``pretrain_bert.py`` with those flags). The model has dropout 0,
feed-forward width 4·hidden and every weight drawn from N(0, ``--init-std``) (Hugging Face's
``initializer_range``; ``pretrain_bert.py``'s ``--init-method-std``); AdamW (weight decay 0.01), 10 warm-up
iterations then cosine decay to lr/10, clip 1.0. The MLM head runs on the masked positions only (the same loss as
on every position under the loss mask). Prints the mean MLM loss and SOP accuracy per 25 iterations, then the
summary line.
"""

import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def main() -> None:
    import transformers

    from corpus import bert_batches
    from megatron.core.tokenizer import build_tokenizer
    from megatron.training.config import pad_vocab_size

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_prefix", help="a _text_sentence prefix (tools/preprocess_data.py --split-sentences)")
    ap.add_argument("vocab_file", help="the WordPiece vocab.txt the data was tokenised with")
    ap.add_argument("--iters", type=int, default=150)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--init-std", type=float, default=0.088, help="standard deviation of every initial weight")
    ap.add_argument("--post-ln", action="store_true", help="BertForPreTraining instead of MegatronBertForPreTraining")
    a = ap.parse_args()
    vocab = pad_vocab_size(build_tokenizer("BertWordPieceLowerCase", vocab_file=a.vocab_file).vocab_size, 128, 1)
    torch.manual_seed(1234)
    h = a.hidden_size
    name = "Bert" if a.post_ln else "MegatronBert"
    config_class, model_class = getattr(transformers, name + "Config"), getattr(transformers, name + "ForPreTraining")
    model = model_class(config_class(
        vocab_size=vocab, hidden_size=h, num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
        intermediate_size=4 * h, max_position_embeddings=a.seq_length, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=a.init_std))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    warm = 10
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: (i + 1) / warm if i < warm else
                                              0.1 + 0.45 * (1 + math.cos(math.pi * (i - warm) / (a.iters - warm))))
    data = bert_batches(a.data_prefix, a.vocab_file, a.seq_length, a.batch, a.iters, num_workers=0)
    acc, lm = [], []
    for it in range(a.iters):
        b = next(data)
        enc = model.bert(input_ids=b["text"], attention_mask=b["padding_mask"], token_type_ids=b["types"])
        sel = b["loss_mask"].bool()  # [b, s]
        mlm = F.cross_entropy(model.cls.predictions(enc.last_hidden_state[sel]), b["labels"][sel])
        binary = model.cls.seq_relationship(enc.pooler_output)  # [b, 2]
        (mlm + F.cross_entropy(binary, b["is_random"])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        acc.append((binary.argmax(-1) == b["is_random"]).float().mean().item())
        lm.append(mlm.item())
        if it % 25 == 24:
            print(f"iterations {it - 23}-{it + 1}: lm loss {np.mean(lm[-25:]):.3f}, sop accuracy "
                  f"{np.mean(acc[-25:]):.3f}", flush=True)
    print(f"lm loss {np.mean(lm[:5]):.3f} -> {np.mean(lm[-10:]):.3f}; sop accuracy over the last 50 iterations "
          f"{np.mean(acc[-50:]):.3f}")


if __name__ == "__main__":
    main()
