"""Hugging Face BERT <-> our full BERT state dict (Megatron-Core's ``BertModel`` names).

Two Hugging Face layouts, chosen by the model's LayerNorm order (``--apply-residual-connection-post-layernorm``):

- pre-LN (Megatron's default) <-> ``MegatronBertForPreTraining`` (``model_type: megatron-bert``);
- post-LN (the original BERT) <-> ``BertForPreTraining`` (``model_type: bert``, bert-base style checkpoints).

A model trained with ``--bert-no-binary-head`` (no pooler, binary head or token-type embedding) is written as
``BertForMaskedLM`` / ``MegatronBertForMaskedLM`` with one zero token-type row. The tensor mapping itself is
``megatron/core/models/bert_hf_mapping.py`` (docs/checkpoints.md has the table); this module adds the sizes,
``config.json``, the vocabulary (padding rows removed) and the WordPiece tokenizer files. ``transformers`` is
imported only when a model folder is written.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.core.checkpoint_formats.common import dims_from_spec, spec_of_dims
from megatron.core.checkpoint_formats.hf_gpt2 import GPT2_OPTIONS, check_spec_options, read_hf_weights
from megatron.core.checkpoint_formats.layout import ModelDims, pad_vocab_size
from megatron.core.checkpoint_formats.safe_load import CheckpointFormatError
from megatron.core.model_spec import ModelSpec
from megatron.core.models.bert_hf_mapping import (encoder_to_hf_bert, has_binary_head, hf_to_megatron_bert,
                                                 megatron_to_hf_bert)

# Megatron's WordPiece tokenizer appends these two ordinary entries to vocab.txt (bert-base: 30,522 -> 30,524)
MEGATRON_EXTRA_TOKENS = ("[BOS]", "[EOS]")
_SPECIAL = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
            "mask_token": "[MASK]"}
_CLASSES = {(True, True): "BertForPreTraining", (True, False): "BertForMaskedLM",
            (False, True): "MegatronBertForPreTraining", (False, False): "MegatronBertForMaskedLM"}
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _is_norm_weight(name: str) -> bool:
    return name.endswith(("layernorm.weight", "layer_norm.weight"))


def read_wordpiece_vocab(vocab_file: str) -> List[str]:
    """The tokens of a ``vocab.txt`` in id order (one per line, as BERT's tokenizers read it)."""
    with open(vocab_file, encoding="utf-8") as f:
        return [line.rstrip("\n").rstrip("\r") for line in f if line.strip("\r\n") != ""]


def wordpiece_vocab_size(vocab_file: str) -> Tuple[int, Optional[int]]:
    """``(vocabulary size, [EOS] id)`` of our BERT tokenizer on ``vocab_file`` (Megatron's [BOS]/[EOS] appended
    when absent, as ``BertWordPieceTokenizer`` does)."""
    tokens = read_wordpiece_vocab(vocab_file)
    ids = {t: i for i, t in enumerate(tokens)}
    for extra in MEGATRON_EXTRA_TOKENS:
        ids.setdefault(extra, len(ids))
    return len(ids), ids["[EOS]"]


# ---- export -----------------------------------------------------------------------------------------------------
def to_hf_bert(full: Dict[str, torch.Tensor], dims: ModelDims, post_ln: bool) -> Dict[str, torch.Tensor]:
    """Our full BERT state dict -> a Hugging Face state dict (``_CLASSES`` names the model), real rows only."""
    if dims.vocab_size is None:
        raise CheckpointFormatError("the real vocabulary size is unknown (the checkpoint's arguments name no "
                                    "vocabulary file); pass --true-vocab-size or --vocab-file")
    one = 1.0 if dims.apply_layernorm_1p else 0.0  # --apply-layernorm-1p stores gamma - 1
    state = {k: (v + one if _is_norm_weight(k) else v) for k, v in full.items()}
    try:
        hf = megatron_to_hf_bert(state, dims.num_layers, dims.num_attention_heads, dims.vocab_size, post_ln)
    except (KeyError, ValueError) as exc:
        raise CheckpointFormatError(f"BERT export: {exc}") from exc
    if dims.tied_embeddings:
        hf.pop("cls.predictions.decoder.weight")  # tied to the word embeddings by transformers
    return {k: v.contiguous() for k, v in hf.items()}


def hf_bert_config(spec: ModelSpec, vocab_size: Optional[int], binary_head: bool, pad_id: Optional[int] = None,
                   dropout: Tuple[float, float] = (0.0, 0.0), init_std: float = 0.02) -> dict:
    """``config.json`` of the BERT ``spec`` describes (post-LN: ``BertForPreTraining``, pre-LN: Megatron-BERT),
    with ``vocab_size`` real rows (default: the spec's)."""
    options = dict(GPT2_OPTIONS, attention_mask_type="padding",
                   apply_residual_connection_post_layernorm=spec.apply_residual_connection_post_layernorm)
    options.pop("layernorm_zero_centered_gamma")  # exported as gamma (plus one)
    check_spec_options(spec, options, "BERT")
    post_ln = spec.apply_residual_connection_post_layernorm
    hidden_dropout, attention_dropout = dropout
    return {
        "model_type": "bert" if post_ln else "megatron-bert", "architectures": [_CLASSES[(post_ln, binary_head)]],
        "vocab_size": vocab_size or spec.padded_vocab_size, "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_attention_heads,
        "intermediate_size": spec.ffn_hidden_size, "hidden_act": "gelu", "hidden_dropout_prob": hidden_dropout,
        "attention_probs_dropout_prob": attention_dropout, "max_position_embeddings": spec.max_position_embeddings,
        "type_vocab_size": 2 if binary_head else 1, "initializer_range": init_std,
        "layer_norm_eps": spec.layernorm_epsilon, "pad_token_id": 0 if pad_id is None else pad_id,
        "position_embedding_type": "absolute", "tie_word_embeddings": spec.share_embeddings_and_output_weights,
    }


def spec_from_hf_bert_config(config: dict, make_vocab_size_divisible_by: int = 128) -> ModelSpec:
    """The ``ModelSpec`` of a BERT or Megatron-BERT ``config.json`` (post-LN for ``bert``; the vocabulary padded by
    Megatron's rule at TP 1)."""
    max_pos = int(config["max_position_embeddings"])
    return ModelSpec(num_layers=int(config["num_hidden_layers"]), hidden_size=int(config["hidden_size"]),
                     num_attention_heads=int(config["num_attention_heads"]),
                     ffn_hidden_size=int(config["intermediate_size"]), seq_length=max_pos,
                     max_position_embeddings=max_pos,
                     padded_vocab_size=pad_vocab_size(int(config["vocab_size"]), make_vocab_size_divisible_by, 1),
                     layernorm_epsilon=float(config.get("layer_norm_eps", 1e-12)),
                     share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", True)),
                     **dict(GPT2_OPTIONS, attention_mask_type="padding",
                            apply_residual_connection_post_layernorm=config.get("model_type") == "bert"))


def _write_tokenizer(out_dir: str, vocab_file: str, vocab_size: int, lower_case: bool, max_len: int) -> None:
    """vocab.txt with exactly the rows the model has (Megatron's [BOS]/[EOS] appended when the model has rows for
    them), tokenizer_config.json and special_tokens_map.json."""
    tokens = read_wordpiece_vocab(vocab_file)
    for extra in MEGATRON_EXTRA_TOKENS:
        if extra not in tokens and len(tokens) < vocab_size:
            tokens.append(extra)
    if len(tokens) > vocab_size:
        raise CheckpointFormatError(f"--vocab-file {vocab_file}: {len(tokens)} tokens, but the model has "
                                    f"{vocab_size} vocabulary rows")
    missing = [t for t in _SPECIAL.values() if t not in tokens]
    if missing:
        raise CheckpointFormatError(f"--vocab-file {vocab_file} lacks the BERT special token {missing[0]}")
    with open(os.path.join(out_dir, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in tokens))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "BertTokenizer", "do_lower_case": lower_case, "strip_accents": None,
                   "tokenize_chinese_chars": True, "model_max_length": max_len, **_SPECIAL}, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(_SPECIAL, f, indent=2)


def _pad_id(vocab_file: Optional[str]) -> Optional[int]:
    tokens = read_wordpiece_vocab(vocab_file) if vocab_file else []
    return tokens.index("[PAD]") if "[PAD]" in tokens else None


def _write_model_folder(model, out_dir: str, dims: ModelDims, vocab_file: Optional[str], lower_case: bool) -> List[str]:
    """Save the transformers ``model`` in the checkpoint's dtype, then the tokenizer files; the folder's files."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dims.params_dtype, torch.float32)
    os.makedirs(out_dir, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    if vocab_file:
        _write_tokenizer(out_dir, vocab_file, dims.vocab_size, lower_case, dims.max_position_embeddings)
    return sorted(os.listdir(out_dir))


def save_hf_bert(out_dir: str, full: Dict[str, torch.Tensor], dims: ModelDims, post_ln: bool,
                 vocab_file: Optional[str] = None, lower_case: bool = True,
                 dropout: Tuple[float, float] = (0.0, 0.0), init_std: float = 0.02) -> List[str]:
    """Write a folder ``BertForPreTraining`` / ``MegatronBertForPreTraining`` (and ``AutoModelForMaskedLM``)
    load offline: ``config.json``, ``model.safetensors`` and, given a ``vocab.txt``, the tokenizer files."""
    import transformers

    hf_sd = to_hf_bert(full, dims, post_ln)
    binary = "binary_head.weight" in full
    pad_id = _pad_id(vocab_file)
    cfg = hf_bert_config(spec_of_dims(dims, attention_mask_type="padding",
                                      apply_residual_connection_post_layernorm=post_ln),
                         dims.vocab_size, binary, pad_id, dropout, init_std)
    arch = cfg.pop("architectures")[0]
    cfg.pop("model_type")
    config_cls = transformers.BertConfig if post_ln else transformers.MegatronBertConfig
    model = getattr(transformers, arch)(config_cls(**cfg))
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    tied = {"cls.predictions.decoder.bias"} | ({"cls.predictions.decoder.weight"} if dims.tied_embeddings else set())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointFormatError(f"BERT export does not fit transformers' {arch}: missing {missing[:3]}, "
                                    f"unexpected {unexpected[:3]}")
    model.tie_weights()
    return _write_model_folder(model, out_dir, dims, vocab_file, lower_case)


# fine-tuned heads -> (Hugging Face head name, class suffix)
_FINETUNED_HEADS = {"classification_head": "ForSequenceClassification", "multichoice_head": "ForMultipleChoice"}


def save_hf_bert_finetuned(out_dir: str, full: Dict[str, torch.Tensor], dims: ModelDims, post_ln: bool,
                           vocab_file: Optional[str] = None, lower_case: bool = True,
                           dropout: Tuple[float, float] = (0.0, 0.0), init_std: float = 0.02,
                           labels: Optional[Sequence[str]] = None) -> List[str]:
    """Write a fine-tuned BERT (encoder, pooler and ``classification_head`` or ``multichoice_head``) as
    ``BertForSequenceClassification`` / ``BertForMultipleChoice`` (post-LN) or their ``MegatronBert`` classes
    (pre-LN): ``config.json`` (``num_labels``; ``labels``, the classes' names, as ``id2label``),
    ``model.safetensors`` and, given a ``vocab.txt``, the tokenizer."""
    import transformers

    heads = [h for h in _FINETUNED_HEADS if f"{h}.weight" in full]
    if len(heads) != 1 or "pooler.dense.weight" not in full:
        raise CheckpointFormatError("not a fine-tuned BERT: it needs the pooler and one of classification_head, "
                                    "multichoice_head")
    head = heads[0]
    if dims.vocab_size is None:
        raise CheckpointFormatError("the real vocabulary size is unknown; pass --vocab-file")
    one = 1.0 if dims.apply_layernorm_1p else 0.0  # --apply-layernorm-1p stores gamma - 1
    state = {k: (v + one if _is_norm_weight(k) else v) for k, v in full.items()}
    hf_sd = encoder_to_hf_bert(state, dims.num_layers, dims.num_attention_heads, dims.vocab_size, post_ln)
    hf_sd["classifier.weight"], hf_sd["classifier.bias"] = full[f"{head}.weight"], full[f"{head}.bias"]
    pad_id = _pad_id(vocab_file)
    cfg = hf_bert_config(spec_of_dims(dims, attention_mask_type="padding",
                                      apply_residual_connection_post_layernorm=post_ln),
                         dims.vocab_size, True, pad_id, dropout, init_std)
    cfg.pop("architectures"), cfg.pop("model_type"), cfg.pop("tie_word_embeddings")
    if head == "classification_head":
        cfg["num_labels"] = int(full[f"{head}.weight"].shape[0])
        if labels is not None:
            if len(labels) != cfg["num_labels"]:
                raise CheckpointFormatError(f"the classifier has {cfg['num_labels']} classes, the task's label names "
                                            f"are {len(labels)}: {', '.join(labels)}")
            cfg["id2label"] = dict(enumerate(labels))
            cfg["label2id"] = {name: i for i, name in enumerate(labels)}
    arch = ("Bert" if post_ln else "MegatronBert") + _FINETUNED_HEADS[head]
    config_cls = transformers.BertConfig if post_ln else transformers.MegatronBertConfig
    model = getattr(transformers, arch)(config_cls(**cfg))
    missing, unexpected = model.load_state_dict({k: v.contiguous() for k, v in hf_sd.items()}, strict=False)
    if missing or unexpected:
        raise CheckpointFormatError(f"fine-tuned BERT export does not fit transformers' {arch}: missing "
                                    f"{missing[:3]}, unexpected {unexpected[:3]}")
    return _write_model_folder(model, out_dir, dims, vocab_file, lower_case)


# ---- import -----------------------------------------------------------------------------------------------------
def _check_config(config: dict, where: str) -> Tuple[bool, List[str]]:
    """``(post_ln, notes)``; refuses BERT variants our model cannot express, naming the setting."""
    kind = config.get("model_type")
    if kind not in ("bert", "megatron-bert"):
        raise CheckpointFormatError(f"{where}: model_type {kind!r} is not supported (the Hugging Face loader reads "
                                    "BERT checkpoints: model_type 'bert' or 'megatron-bert')")
    for key, want in (("position_embedding_type", "absolute"), ("is_decoder", False), ("add_cross_attention", False)):
        if key in config and config[key] != want:
            raise CheckpointFormatError(f"{where}: {key}={config[key]!r} is not supported (needs {want!r})")
    act = config.get("hidden_act", "gelu")
    notes = []
    if act in _TANH_GELU:
        notes.append(f"hidden_act {act} (tanh GeLU) runs as our erf GeLU (differences up to ~1e-3 per activation)")
    elif act != "gelu":
        raise CheckpointFormatError(f"{where}: hidden_act {act!r} is not supported (gelu or gelu_new)")
    return kind == "bert", notes


def from_hf_bert(hf_sd: Dict[str, torch.Tensor], config: dict, make_vocab_size_divisible_by: int = 128,
                 where: str = "Hugging Face checkpoint") -> Tuple[Dict[str, torch.Tensor], ModelDims, bool, List[str]]:
    """A BERT state dict and its ``config.json`` -> ``(our full state dict, sizes, post_ln, notes)``."""
    post_ln, notes = _check_config(config, where)
    # checkpoints written by TensorFlow-era code name LayerNorm parameters gamma/beta
    sd = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
          for k, v in hf_sd.items() if not k.endswith(("position_ids", "token_type_ids"))}
    if any(k.startswith("embeddings.") for k in sd):  # a bare BertModel's keys carry no "bert." prefix
        sd = {("bert." + k if k.startswith(("embeddings.", "encoder.", "pooler.")) else k): v for k, v in sd.items()}
    layers, heads, vocab = (int(config[k]) for k in ("num_hidden_layers", "num_attention_heads", "vocab_size"))
    if "cls.predictions.bias" not in sd:
        notes = notes + _add_placeholder_heads(sd, int(config["hidden_size"]), vocab)
    binary = has_binary_head(sd)
    types = sd.get("bert.embeddings.token_type_embeddings.weight")
    if binary and types is not None and types.shape[0] != 2:
        raise CheckpointFormatError(f"{where}: type_vocab_size {types.shape[0]} is not supported (BERT with the "
                                    "binary head has 2 token types)")
    spec = spec_from_hf_bert_config(config, make_vocab_size_divisible_by)
    tied = spec.share_embeddings_and_output_weights
    if not tied and "cls.predictions.decoder.bias" in sd:  # untied, transformers adds the decoder's own bias
        sd["cls.predictions.bias"] = sd["cls.predictions.decoder.bias"]
    dims = dims_from_spec(spec, vocab_size=vocab, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                          params_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"))
    try:
        full = hf_to_megatron_bert(sd, layers, heads, dims.padded_vocab_size, tied=tied)
    except KeyError as exc:
        raise CheckpointFormatError(f"{where}: tensor {exc.args[0]} is missing") from exc
    except ValueError as exc:
        raise CheckpointFormatError(f"{where}: {exc}") from exc
    known = set(megatron_to_hf_bert(full, layers, heads, vocab, post_ln))
    unknown = sorted(set(sd) - known)
    if unknown:
        raise CheckpointFormatError(f"{where}: unknown tensor {unknown[0]} (not a {_CLASSES[(post_ln, binary)]} "
                                    "weight)")
    return {k: v.contiguous() for k, v in full.items()}, dims, post_ln, notes


def _add_placeholder_heads(sd: Dict[str, torch.Tensor], hidden: int, vocab: int) -> List[str]:
    """A bare ``BertModel`` (encoder and pooler, no pre-training heads): add heads that make it a complete
    ``BertForPreTraining`` - the masked-LM transform as identity with a zero vocabulary bias, a zero
    sentence-relationship head and, without a pooler, an identity pooler. Fine-tuning replaces them; the note says
    so."""
    word = sd["bert.embeddings.word_embeddings.weight"]
    eye, zeros = torch.eye(hidden, dtype=word.dtype), lambda *shape: torch.zeros(*shape, dtype=word.dtype)
    sd.update({"cls.predictions.bias": zeros(vocab), "cls.predictions.transform.dense.weight": eye,
               "cls.predictions.transform.dense.bias": zeros(hidden),
               "cls.predictions.transform.LayerNorm.weight": torch.ones(hidden, dtype=word.dtype),
               "cls.predictions.transform.LayerNorm.bias": zeros(hidden),
               "cls.seq_relationship.weight": zeros(2, hidden), "cls.seq_relationship.bias": zeros(2)})
    pooler = "bert.pooler.dense.weight" in sd
    if not pooler:
        sd.update({"bert.pooler.dense.weight": eye.clone(), "bert.pooler.dense.bias": zeros(hidden)})
    return ["a BertModel without pre-training heads: its masked-LM head is a placeholder (identity transform, zero "
            "vocabulary bias) and its sentence-relationship head zeros" + ("" if pooler else ", its pooler identity")
            + "; fine-tune it (tasks/main.py) - the pre-trained encoder" + (" and pooler" if pooler else "")
            + " are the real weights"]


def load_hf_bert(model_dir: str, make_vocab_size_divisible_by: int = 128):
    """``(full state dict, sizes, config dict, notes)`` of a Hugging Face BERT folder (no code is run)."""
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointFormatError(f"{model_dir} has no config.json: not a Hugging Face model folder")
    with open(cfg_path) as f:
        config = json.load(f)
    full, dims, _, notes = from_hf_bert(read_hf_weights(model_dir), config, make_vocab_size_divisible_by,
                                        where=model_dir)
    return full, dims, config, notes
