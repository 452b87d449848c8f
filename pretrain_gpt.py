"""Pretrain a GPT: the model provider, the batch and loss functions, then ``pretrain()``.

    torchrun --nproc_per_node N pretrain_gpt.py --num-layers 12 --hidden-size 768 ... --data-path PREFIX
"""

from functools import partial

import torch

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.init import initialize_model_parameters
from megatron.core.pipeline_parallel.partition import layers_for_stage
from megatron.core.transformer.config import TransformerConfig
from megatron.training.arguments import pad_vocab_size, params_dtype
from megatron.training.training import main_entry, print_rank_0


def _tokenizer(args):
    from megatron.core.tokenizer import build_tokenizer

    return build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                           tokenizer_model=args.tokenizer_model)


def model_provider(args, pstate):
    """Build this rank's model chunks (one per virtual pipeline stage), initialised layout-independently."""
    tokenizer = _tokenizer(args)
    args.eod_token = tokenizer.eod
    args.padded_vocab_size = pad_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by, pstate.tp_size)
    print_rank_0(f"> vocabulary {tokenizer.vocab_size} padded to {args.padded_vocab_size}")
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings, padded_vocab_size=args.padded_vocab_size,
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        layernorm_epsilon=args.layernorm_epsilon, layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        init_method_std=args.init_method_std, params_dtype=params_dtype(args),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        recompute_modules=tuple(args.recompute_modules),
        attention_backend=args.attention_backend,
        use_fused_kernels=not (args.no_bias_gelu_fusion or args.no_bias_dropout_fusion or args.no_persist_layer_norm),
        gradient_accumulation_fusion=not args.no_gradient_accumulation_fusion,
        fp8=args.fp8_format, fp8_margin=args.fp8_margin, fp8_recipe=args.fp8_recipe,
        fp8_amax_history_len=args.fp8_amax_history_len, fp8_amax_compute_algo=args.fp8_amax_compute_algo,
    )
    vpp = pstate.vpp_size or 1
    chunks = []
    for v in range(vpp):
        offset, count = layers_for_stage(
            args.num_layers, pstate.pp_size, pstate.pp_rank, vpp_size=pstate.vpp_size, vpp_rank=v,
            first_stage_layers=args.decoder_first_pipeline_num_layers,
            last_stage_layers=args.decoder_last_pipeline_num_layers)
        pre = pstate.is_pipeline_first_stage and v == 0
        post = pstate.is_pipeline_last_stage and v == vpp - 1
        model = GPTModel(config, pstate, pre_process=pre, post_process=post, num_layers=count, layer_offset=offset,
                         use_torch_compile=args.use_torch_compile, fused_cross_entropy=args.cross_entropy_loss_fusion)
        initialize_model_parameters(model, args.seed, config, pstate, layer_offset=offset)
        chunks.append(model)
    return chunks


def get_batch(data_iterator, args, pstate, needs_data: bool):
    """Tokens, labels, loss mask and positions ``[b, s]``; TP rank 0 reads, the TP group receives."""
    if not needs_data:
        return None, None, None, None
    data = next(data_iterator) if pstate.tp_rank == 0 else None
    text = tensor_parallel.broadcast_data(["text"], data, torch.int64, pstate)["text"]
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    text = text.to(device, non_blocking=True)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    loss_mask = torch.ones_like(labels, dtype=torch.float32)
    if args.eod_mask_loss:
        loss_mask[tokens == args.eod_token] = 0.0
    position_ids = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
    return tokens, labels, loss_mask, position_ids


def loss_func(loss_mask, output_tensor):
    """Mean per-token loss of the microbatch over unmasked tokens."""
    losses = output_tensor.float()
    loss = torch.sum(losses * loss_mask) / loss_mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def make_forward_step(args, pstate):
    def forward_step(data_iterator, model):
        inner = getattr(model, "module", model)
        needs = inner.pre_process or inner.post_process
        tokens, labels, loss_mask, position_ids = get_batch(data_iterator, args, pstate, needs)
        output = model(tokens, position_ids, labels=labels if inner.post_process else None)
        return output, partial(loss_func, loss_mask)

    return forward_step


def datasets_provider(args, pstate, num_samples):
    from megatron.core.datasets.builder import build_gpt_datasets
    import torch.distributed as dist

    print_rank_0(f"> building GPT datasets for {num_samples} (train, valid, test) samples")
    return build_gpt_datasets(
        args.data_path, args.split, args.seq_length, args.seed, num_samples, cache_dir=args.data_cache_path,
        is_rank_0=(pstate.rank == 0), barrier=(dist.barrier if dist.is_initialized() else None))


class _GPTForwardStep:
    """Binds args/pstate lazily: pretrain() parses the flags, the model provider sees them first."""

    def __init__(self):
        self.fn = None

    def __call__(self, data_iterator, model):
        return self.fn(data_iterator, model)


def main(argv=None):
    from megatron.training.training import pretrain

    step = _GPTForwardStep()

    def provider(args, pstate):
        step.fn = make_forward_step(args, pstate)
        return model_provider(args, pstate)

    return pretrain(provider, step, datasets_provider, argv=argv)


if __name__ == "__main__":
    main_entry(main)
