"""Parameter and FLOP counts of a model, as functions of its :class:`~megatron.core.model_spec.ModelSpec`.

One count serves the iteration log line and its TFLOP/s (``megatron/training/logging.py``), ``--dry-run``, the
planner (``megatron/core/planner/``) and the benchmarks in ``bench/``.

Parameters (:func:`chunk_param_numels`) are listed per tensor-parallel rank, in the order the models of
``megatron/core/models`` register them (the data-parallel buffer's layout follows from that order). Per layer:

==========================  ==========================================================================
input norm                  weight ``h`` (and bias ``h`` for LayerNorm; RMSNorm has none)
``linear_qkv``              ``(heads + 2 groups) d x h / tp``; bias ``(heads + 2 groups) d / tp`` with
                            ``add_bias_linear`` or ``add_qkv_bias``
``q_layernorm, k_layernorm``  ``qk_layernorm``: a norm of ``d`` channels each (replicated)
``linear_proj``             ``h x heads d / tp``; bias ``h`` (not split) with ``add_bias_linear``
pre-MLP norm                as the input norm
``linear_fc1``              ``(2 if gated) ffn x h / tp``; bias likewise with ``add_bias_linear``
``linear_fc2``              ``h x ffn / tp``; bias ``h`` with ``add_bias_linear``
==========================  ==========================================================================

with ``d = kv_channels`` and ``groups = num_query_groups``. FLOPs (:func:`flops_per_token`) count the matrix
multiplications only (2 FLOPs per multiply-add; biases, norms, activations and softmax are not counted, as in
Megatron-LM), forward plus backward = 3 x forward, no recomputation. Per token and layer, forward:
``2 h (heads + 2 groups) d`` (QKV) + ``4 s heads d`` (scores and the weighted sum over all ``s`` positions, as
Megatron-LM counts them) + ``2 heads d h`` (projection) + ``2 h ffn (2 if gated else 1) + 2 ffn h`` (MLP), and
``2 h V`` once for the output layer. For a GeLU MLP with ffn = 4h and one group per head this is Megatron's
``72 L h^2 + 12 L h s + 6 h V`` per token.
"""

from __future__ import annotations

from typing import List

from megatron.core.model_spec import ModelSpec


def _norm(spec: ModelSpec, size: int) -> List[int]:
    return [size, size] if spec.normalization == "LayerNorm" else [size]


def layer_param_numels(spec: ModelSpec, tp: int = 1) -> List[int]:
    """Element counts of one transformer layer's parameters on one TP rank, in registration order."""
    h, d, t = spec.hidden_size, spec.kv_channels, tp
    qkv = (spec.num_attention_heads + 2 * spec.num_query_groups) * d
    fc1 = spec.ffn_hidden_size * (2 if spec.gated_linear_unit else 1)
    out = _norm(spec, h) + [qkv // t * h] + ([qkv // t] if spec.qkv_bias else [])
    if spec.qk_layernorm:
        out += _norm(spec, d) + _norm(spec, d)
    out += [h * (spec.query_projection_size // t)] + ([h] if spec.add_bias_linear else [])
    out += _norm(spec, h) + [fc1 // t * h] + ([fc1 // t] if spec.add_bias_linear else [])
    out += [h * (spec.ffn_hidden_size // t)] + ([h] if spec.add_bias_linear else [])
    return out


def chunk_param_numels(spec: ModelSpec, tp: int, num_layers: int, pre: bool, post: bool, family: str = "gpt",
                       num_tokentypes: int = 0, bert_binary_head: bool = False) -> List[int]:
    """Element counts of the trainable parameters of one pipeline chunk on one TP rank, in registration order:
    the embeddings when ``pre``, ``num_layers`` layers, the final norm and output layer (and BERT's heads) when
    ``post``. ``spec.padded_vocab_size`` is the vocabulary padded for ``tp``. ``family``: ``gpt`` or ``bert``
    (token-type embeddings, the LM-head transform with its output bias, and with ``bert_binary_head`` the pooler
    and the binary head)."""
    h, t, v = spec.hidden_size, tp, spec.padded_vocab_size
    out: List[int] = []
    if pre:
        out.append(v // t * h)  # word embeddings (vocab-parallel)
        if spec.position_embedding_type == "learned_absolute":
            out.append(spec.max_position_embeddings * h)
        if family == "bert" and num_tokentypes:
            out.append(num_tokentypes * h)
    out.extend(layer_param_numels(spec, tp) * num_layers)
    if post:
        out.extend(_norm(spec, h))  # final norm
        if family == "bert":
            out.extend([h * h, h, h, h, v // t])  # LM-head dense, its LayerNorm, output bias (vocab-parallel)
        if not (pre and spec.share_embeddings_and_output_weights):
            out.append(v // t * h)  # output layer (its own copy of the tied embedding on a later stage)
        if family == "bert" and bert_binary_head:
            out.extend([h * h, h, 2 * h, 2])  # pooler dense, binary head
    return out


def num_parameters(spec: ModelSpec, family: str = "gpt", num_tokentypes: int = 0,
                   bert_binary_head: bool = False) -> int:
    """Parameters of the whole model (a tied output layer counted once)."""
    return sum(chunk_param_numels(spec, 1, spec.num_layers, pre=True, post=True, family=family,
                                  num_tokentypes=num_tokentypes, bert_binary_head=bert_binary_head))


def forward_flops_per_token(spec: ModelSpec) -> float:
    """Matrix-multiplication FLOPs of one token's forward pass (module docstring)."""
    h, s, d = spec.hidden_size, spec.seq_length, spec.kv_channels
    heads, groups, f = spec.num_attention_heads, spec.num_query_groups, spec.ffn_hidden_size
    layer = (2 * h * (heads + 2 * groups) * d + 4 * s * heads * d + 2 * heads * d * h
             + 2 * h * f * (2 if spec.gated_linear_unit else 1) + 2 * f * h)
    return float(spec.num_layers * layer + 2 * h * spec.padded_vocab_size)


def flops_per_token(spec: ModelSpec) -> float:
    """Model FLOPs of one token in a training iteration (forward + backward = 3 x forward, no recomputation)."""
    return 3.0 * forward_flops_per_token(spec)


def num_floating_point_operations(spec: ModelSpec, batch_size: int) -> float:
    """Model FLOPs of one training iteration of ``batch_size`` sequences of ``spec.seq_length`` tokens."""
    return flops_per_token(spec) * batch_size * spec.seq_length
