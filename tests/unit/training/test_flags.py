"""Every Megatron-LM flag in exactly one class, command lines from Megatron's examples, docs/flags.md in sync."""

import importlib.util
import os

import pytest
import torch

from megatron.training import flag_table as ft
from megatron.training.arguments import make_parser, parse_config
from megatron.training.flag_docs import implemented_actions, render
from megatron.training.flag_table import ConfigError, rewrite_argv
from megatron.training.megatron_flags import MEGATRON_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
IMPLEMENTED = set(make_parser().known_flags())
HAVE_WANDB = importlib.util.find_spec("wandb") is not None

# examples/pretrain_gpt.sh of Megatron-LM (2021), paths filled in; nccl becomes gloo on this CPU machine
GPT_EXAMPLE = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --micro-batch-size 4 "
               "--global-batch-size 8 --seq-length 1024 --max-position-embeddings 1024 --train-iters 500000 "
               "--lr-decay-iters 320000 --save ckpt --load ckpt --data-path corpus_text_document "
               "--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --data-impl mmap --split 949,50,1 "
               "--distributed-backend gloo --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --weight-decay 1e-2 "
               "--clip-grad 1.0 --lr-warmup-fraction .01 --checkpoint-activations --log-interval 100 "
               "--save-interval 10000 --eval-interval 1000 --eval-iters 10 --fp16").split()
# a BERT-style command line of the same era (the model flags the GPT trainer shares)
BERT_STYLE = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --batch-size 4 --global-batch-size 8 "
              "--seq-length 512 --max-position-embeddings 512 --train-iters 2000000 --lr-decay-iters 990000 "
              "--data-path bert_text_sentence --vocab-file bert-vocab.txt --tokenizer-type BertWordPieceLowerCase "
              "--data-impl mmap --split 949,50,1 --lr 0.0001 --min-lr 0.00001 --lr-decay-style linear "
              "--warmup .01 --weight-decay 1e-2 --clip-grad 1.0 --log-interval 100 --save-interval 10000 "
              "--eval-interval 1000 --eval-iters 10 --fp16 --save ckpt --use-mcore-models").split()
SMALL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
         "--train-iters 10 --lr 1e-3 --data-path x").split()


def test_gpt_example_command_line():
    cfg, notes = parse_config(GPT_EXAMPLE)
    assert any("--checkpoint-activations is an older spelling; using --recompute-granularity full "
               "--recompute-method uniform" in n for n in notes)
    assert any(n.startswith("note: --data-impl mmap is an older spelling") for n in notes)
    m = cfg.model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 1)
    assert cfg.scheduler.lr_warmup_iters == 3200 and cfg.precision.fp16 and cfg.data.split == "949,50,1"
    assert cfg.training.check_for_nan_in_loss_and_grad  # on unless --no-check-for-nan-in-loss-and-grad, as in Megatron-LM


def test_bert_style_command_line():
    cfg, notes = parse_config(BERT_STYLE)
    assert cfg.training.micro_batch_size == 4 and cfg.scheduler.lr_warmup_iters == int(0.01 * 990000)
    assert cfg.data.tokenizer_type == "BertWordPieceLowerCase"
    assert len(notes) == 4 and any("--use-mcore-models has no effect here" in n for n in notes)
    with pytest.raises(ConfigError, match="--max-preds-per-seq is a Megatron-LM flag for BERT and T5 pretraining"):
        parse_config(BERT_STYLE + ["--max-preds-per-seq", "80"])


# (flags, class, what the parsed configuration or the note must show)
LEGACY = [
    (["--checkpoint-activations"], ft.TRANSLATED, lambda c: c.model.recompute_granularity == "full"),
    (["--activations-checkpoint-method", "block", "--activations-checkpoint-num-layers", "1"], ft.TRANSLATED,
     lambda c: (c.model.recompute_method, c.model.recompute_num_layers) == ("block", 1)),
    (["--data-impl", "mmap"], ft.TRANSLATED, None),
    (["--dataset-impl=mmap"], ft.TRANSLATED, None),
    (["--local-rank=1"], ft.TRANSLATED, lambda c: c.parallel.local_rank_from_launcher == 1),
    (["--local_rank", "0"], ft.TRANSLATED, lambda c: c.parallel.local_rank_from_launcher == 0),
    (["--layernorm-epsilon", "1e-6"], ft.TRANSLATED, lambda c: c.model.norm_epsilon == 1e-6),
    (["--norm-epsilon", "1e-6"], ft.IMPLEMENTED, lambda c: c.model.norm_epsilon == 1e-6),
    (["--model-parallel-size", "1"], ft.TRANSLATED, lambda c: c.parallel.tensor_model_parallel_size == 1),
    (["--log-validation-ppl-to-tensorboard"], ft.NO_EFFECT, None),
    (["--log-timers-to-tensorboard"], ft.NO_EFFECT, None),
    (["--timing-log-level", "2"], ft.NO_EFFECT, None),
    (["--DDP-impl", "local"], ft.NO_EFFECT, None),
    (["--mock-data"], ft.IMPLEMENTED, lambda c: c.data.mock_data and c.data.data_path is None),
    (["--exit-signal-handler"], ft.IMPLEMENTED, lambda c: c.training.exit_signal_handler),
    (["--exit-signal", "SIGUSR1"], ft.IMPLEMENTED, lambda c: c.training.exit_signal == "SIGUSR1"),
    (["--distributed-timeout-minutes", "0.5"], ft.IMPLEMENTED,
     lambda c: c.parallel.distributed_timeout_minutes == 0.5),
    (["--check-for-nan-in-loss-and-grad"], ft.IMPLEMENTED, lambda c: c.training.check_for_nan_in_loss_and_grad),
    (["--no-check-for-nan-in-loss-and-grad"], ft.IMPLEMENTED, lambda c: not c.training.check_for_nan_in_loss_and_grad),
    (["--tensorboard-queue-size", "7"], ft.IMPLEMENTED, lambda c: c.logging.tensorboard_queue_size == 7),
    (["--no-bias-gelu-fusion"], ft.IMPLEMENTED, lambda c: not c.model.bias_gelu_fusion and c.model.bias_dropout_fusion
     and c.model.persist_layer_norm),
    (["--no-persist-layer-norm"], ft.IMPLEMENTED, lambda c: not c.model.persist_layer_norm
     and c.model.bias_gelu_fusion),
    (["--use-cpu-initialization"], ft.NO_EFFECT, None),
    (["--use-checkpoint-args"], ft.IMPLEMENTED, "--use-checkpoint-args needs --load"),
    (["--num-experts", "8"], ft.REFUSED, "--num-experts is a Megatron-LM flag for mixture of experts"),
    (["--use-rotary-position-embeddings"], ft.TRANSLATED, lambda c: c.model.position_embedding_type == "rope"),
    (["--multi-query-attention"], ft.TRANSLATED,
     lambda c: c.model.spec(128).num_query_groups == 1 and c.model.group_query_attention),
    (["--no-position-embedding"], ft.TRANSLATED, lambda c: c.model.spec(128).position_embedding_type == "none"),
    (["--rope-type", "yarn"], ft.REFUSED, "other rotary position embedding variants"),
    (["--moe-router-topk", "2"], ft.REFUSED, "mixture of experts"),
    (["--data-impl", "lazy"], ft.TRANSLATED, "--data-impl lazy: only the memory-mapped"),
    (["--wandb-project", "p", "--wandb-exp-name", "e"], ft.IMPLEMENTED,
     (lambda c: c.logging.wandb_project == "p") if HAVE_WANDB else "needs the wandb package"),
]


@pytest.mark.parametrize("flags,cls,check", LEGACY, ids=[" ".join(x[0]) for x in LEGACY])
def test_legacy_flags_follow_the_table(flags, cls, check):
    flag = flags[0].split("=")[0]
    assert ft.classify(flag, IMPLEMENTED) == cls
    argv = SMALL + flags
    if flag == "--mock-data":
        argv = [a for a in SMALL if a not in ("--data-path", "x")] + flags
    if isinstance(check, str):
        with pytest.raises(ConfigError, match=check.replace("(", r"\(")):
            parse_config(argv)
        return
    cfg, notes = parse_config(argv)
    if cls in (ft.TRANSLATED, ft.NO_EFFECT):
        assert len(notes) == len([f for f in flags if f.split("=")[0] in (ft.TRANSLATED_FLAGS.keys()
                                                                          | ft.NO_EFFECT_FLAGS.keys())])
        assert all(n.startswith(f"note: {flag}") for n in notes[:1]) and all("\n" not in n for n in notes)
        word = "older spelling" if cls == ft.TRANSLATED else "has no effect here"
        assert word in notes[0]
    else:
        assert notes == []
    if check is not None:
        assert check(cfg)


def _value_for(flag: str) -> str:
    return "mmap" if flag in ("--data-impl", "--dataset-impl") else "1"


@pytest.mark.parametrize("flag", [f for f in MEGATRON_FLAGS if f not in IMPLEMENTED])
def test_every_megatron_flag_has_one_class_and_behaves_as_it_says(flag):
    cls = ft.classify(flag, IMPLEMENTED)
    in_tables = [flag in ft.TRANSLATED_FLAGS, flag in ft.NO_EFFECT_FLAGS, flag in ft.REFUSED_FLAGS]
    assert sum(in_tables) <= 1, f"{flag} is in more than one table"
    if cls == ft.REFUSED:
        feature, advice = ft.refused_reason(flag)
        with pytest.raises(ConfigError) as err:
            rewrite_argv([flag, "1"], IMPLEMENTED)
        assert str(err.value) == (f"{flag} is a Megatron-LM flag for {feature}, which this framework does not "
                                  f"implement; use {advice}")
        return
    takes = ft.TRANSLATED_FLAGS[flag].takes_value if cls == ft.TRANSLATED else ft.NO_EFFECT_FLAGS[flag][0]
    argv = [flag, _value_for(flag)] if takes else [flag]
    out, notes = rewrite_argv(argv + ["--lr", "1"], IMPLEMENTED)
    assert len(notes) == 1 and notes[0].startswith(f"note: {flag}")
    assert out[-2:] == ["--lr", "1"] and all(t.split("=")[0] in IMPLEMENTED for t in out if t.startswith("--"))


def test_tables_do_not_overlap_the_parser():
    for table in (ft.TRANSLATED_FLAGS, ft.NO_EFFECT_FLAGS, ft.REFUSED_FLAGS):
        assert not IMPLEMENTED & set(table)
    assert not set(ft.TRANSLATED_FLAGS) & set(ft.NO_EFFECT_FLAGS)
    assert set(ft.DEFAULT_DIFFERENCES) <= IMPLEMENTED


def test_every_flag_has_help():
    missing = [a.option_strings[0] for _, a in implemented_actions(make_parser()) if not (a.help or "").strip()]
    assert missing == []


def test_docs_flags_md_matches_the_parser():
    with open(os.path.join(ROOT, "docs", "flags.md")) as f:
        assert f.read() == render(), "regenerate with: python -m megatron.training.flag_docs > docs/flags.md"


@pytest.mark.parametrize("argv,needle", [
    (["--hiden-size", "8"], "unrecognized arguments: --hiden-size 8 (did you mean --hidden-size"),
    (["--tensor-model-paralel-size=2"], "did you mean --tensor-model-parallel-size"),
    (["--lr"], "argument --lr: expected one argument"),
    (["--distributed-backend", "nccl"], "--distributed-backend nccl needs CUDA GPUs"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be above 0, got 0"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--mock-data"], "give only one of --mock-data and --data-path"),
])
def test_configuration_errors_are_one_line(argv, needle):
    if "nccl" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as err:
        parse_config(SMALL + argv)
    assert needle in str(err.value) and "\n" not in str(err.value)


def _fake_checkpoint(root, args: dict, iteration=5, rank_dir="mp_rank_00"):
    path = os.path.join(root, f"iter_{iteration:07d}", rank_dir)
    os.makedirs(path)
    torch.save({"args": args, "iteration": iteration, "model": {"w": torch.zeros(2)}},
               os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def test_use_checkpoint_args_fills_what_the_command_line_leaves_out(tmp_path):
    # the older key name this project's checkpoints used for the LayerNorm epsilon
    _fake_checkpoint(str(tmp_path), {"num_layers": 6, "hidden_size": 48, "num_attention_heads": 3,
                                     "ffn_hidden_size": 100, "seq_length": 16, "max_position_embeddings": 20,
                                     "layernorm_epsilon": 1e-6, "untie_embeddings_and_output_weights": True,
                                     "tensor_model_parallel_size": 1}, rank_dir="mp_rank_00_000")
    argv = ["--use-checkpoint-args", "--load", str(tmp_path), "--micro-batch-size", "2", "--train-iters", "3",
            "--lr", "1e-3", "--data-path", "x", "--num-layers", "4"]
    m = parse_config(argv)[0].model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (4, 48, 3, 100)
    assert (m.max_position_embeddings, m.norm_epsilon, m.untie_embeddings_and_output_weights) == (20, 1e-6, True)
    with pytest.raises(ConfigError, match="--hidden-size is required"):
        parse_config([a for a in argv if a not in ("--use-checkpoint-args",)])


def test_stored_configuration_is_plain_and_loads_with_weights_only(tmp_path):
    cfg, _ = parse_config(SMALL + ["--recompute-granularity", "full", "--recompute-method", "uniform"])
    plain = cfg.to_plain_dict()
    torch.save({"args": plain}, tmp_path / "a.pt")
    back = torch.load(tmp_path / "a.pt", weights_only=True)["args"]
    assert back == plain and back["tensor_model_parallel_size"] == 1 and back["layernorm_epsilon"] == 1e-5
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_layers = 3


def test_an_entry_point_adds_its_own_section():
    import dataclasses

    from megatron.training.config import ExtraSection

    @dataclasses.dataclass(frozen=True)
    class Masking:
        mask_prob: float

    def add(parser):
        parser.add_argument_group("masking").add_argument("--mask-prob", type=float, default=0.15,
                                                          help="fraction of tokens masked")

    def check(ns):
        if not 0.0 < ns.mask_prob < 1.0:
            raise ConfigError(f"--mask-prob must be in (0, 1), got {ns.mask_prob}")

    section = ExtraSection("masking", Masking, add, check)
    # --mask-prob is also a Megatron-LM flag: the entry point's parser implements it, so it is not refused
    cfg, _ = parse_config(SMALL + ["--mask-prob", "0.2"], extra_sections=[section])
    assert cfg.extra["masking"] == Masking(0.2) and cfg.to_plain_dict()["mask_prob"] == 0.2
    with pytest.raises(ConfigError, match=r"--mask-prob must be in \(0, 1\), got 1.5"):
        parse_config(SMALL + ["--mask-prob", "1.5"], extra_sections=[section])


def test_save_interval_without_save_is_a_note():
    """Megatron-LM ignores --save-interval without --save; so does the trainer, with a note."""
    cfg, notes = parse_config(SMALL + ["--save-interval", "5"])
    assert cfg.checkpointing.save is None
    assert notes == ["note: --save-interval 5 has no effect without --save; nothing is saved"]
