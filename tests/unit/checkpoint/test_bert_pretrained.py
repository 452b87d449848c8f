"""A real pretrained post-LN BERT through the converter: AntiBERTy (8 layers, hidden 512, a 25-token WordPiece
vocabulary of amino acids, MIT licence), whose weights ship inside the PyPI wheel ``antiberty==0.1.3``
(``pip install --no-deps antiberty==0.1.3``, about 100 MB; the test skips without it and never imports its code).

Its checkpoint is Hugging Face's ``BertModel`` with the masked-LM head plus three classifiers on the pooled output;
the 2-way chain-type classifier stands in for the next-sentence head (same shape, same input), so the whole
pretrained network is a ``BertForPreTraining``. HF -> ours (TP=2) -> HF must keep every weight and give the same
hidden states and MLM logits.
"""

import importlib.util
import json
import os
import shutil

import pytest
import torch

from megatron.core.checkpoint_formats import BERT, ModelDims, merge_tp_pp, read_our_checkpoint
from tests.unit.checkpoint.bert_helpers import bert_model
from tests.unit.checkpoint.test_convert import _run

transformers = pytest.importorskip("transformers")


def _antiberty_dir():
    spec = importlib.util.find_spec("antiberty")
    if spec is None or spec.origin is None:
        pytest.skip("antiberty==0.1.3 (a PyPI wheel shipping pretrained BERT weights) is not installed")
    folder = os.path.join(os.path.dirname(spec.origin), "trained_models")
    if not os.path.isfile(os.path.join(folder, "AntiBERTy_md_smooth", "pytorch_model.bin")):
        pytest.skip("this antiberty version ships no weights (0.1.3 does)")
    return folder


def test_pretrained_antiberty_round_trip(tmp_path, capsys):
    folder = _antiberty_dir()
    raw = torch.load(os.path.join(folder, "AntiBERTy_md_smooth", "pytorch_model.bin"), map_location="cpu",
                     weights_only=True)
    config = json.load(open(os.path.join(folder, "AntiBERTy_md_smooth", "config.json")))
    sd = {k: v for k, v in raw.items() if k.startswith(("bert.", "cls.predictions.")) and "position_ids" not in k}
    sd["cls.seq_relationship.weight"], sd["cls.seq_relationship.bias"] = raw["cls.chain.weight"], raw["cls.chain.bias"]
    cfg = transformers.BertConfig(**{k: v for k, v in config.items() if k not in ("architectures", "_name_or_path")},
                                  attn_implementation="eager")
    hf = transformers.BertForPreTraining(cfg).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"cls.predictions.decoder.bias"}
    hf_dir, ours, back = tmp_path / "hf", str(tmp_path / "ours"), str(tmp_path / "back")
    hf.save_pretrained(str(hf_dir))
    shutil.copyfile(os.path.join(folder, "vocab.txt"), hf_dir / "vocab.txt")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))  # amino acids: upper case

    rc, out, err = _run(capsys, "--model-type", "BERT", "--loader", "hf", "--saver", "ours", "--load-dir",
                        str(hf_dir), "--save-dir", ours, "--target-tensor-parallel-size", "2",
                        "--make-vocab-size-divisible-by", "8")
    assert rc == 0, err
    assert "8 layers, hidden 512, 8 heads, FFN 2048, vocabulary 25 padded to 32" in out
    loaded = read_our_checkpoint(ours)
    assert loaded.args_dict["tokenizer_type"] == "BertWordPieceCase"
    full = merge_tp_pp(loaded.model_state_per_rank, BERT)

    # an antibody heavy chain with two conserved residues masked (a glycine, the cysteine); token types 0
    vocab = open(os.path.join(folder, "vocab.txt")).read().split()
    seq = "EVQLVESGGGLVQPGGSLRLSCAASGFTFSSYAMS"
    ids = torch.tensor([[vocab.index("[CLS]")] + [vocab.index(a) for a in seq] + [vocab.index("[SEP]")]])
    masked = [8, 22]  # seq[7] "G" and seq[21] "C" after [CLS]
    assert [seq[i - 1] for i in masked] == ["G", "C"]
    ids[0, masked] = vocab.index("[MASK]")
    padding = torch.ones_like(ids)
    dims = ModelDims(num_layers=8, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                     max_position_embeddings=512, padded_vocab_size=full["output_layer.bias"].shape[0],
                     layernorm_epsilon=1e-12)
    model = bert_model(dims, post_ln=True)
    model.load_state_dict(full, strict=True)
    captured = {}
    model.encoder.register_forward_hook(lambda m, i, o: captured.update(hidden=o))  # returns None: no change
    with torch.no_grad():
        logits, binary = model(ids, padding)
        ref = hf(input_ids=ids, attention_mask=padding, output_hidden_states=True)
    torch.testing.assert_close(captured["hidden"].transpose(0, 1), ref.hidden_states[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[..., :25], ref.prediction_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(binary, ref.seq_relationship_logits, rtol=1e-5, atol=1e-5)
    # a pretrained model: the masked residues are predicted as the sequence's own
    predicted = logits[0, masked, :25].argmax(-1).tolist()
    assert [vocab[i] for i in predicted] == ["G", "C"]

    rc, _, err = _run(capsys, "--model-type", "BERT", "--loader", "ours", "--saver", "hf", "--load-dir", ours,
                      "--save-dir", back)
    assert rc == 0, err
    again = transformers.BertForPreTraining.from_pretrained(back, local_files_only=True).eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    tok = transformers.AutoTokenizer.from_pretrained(back, local_files_only=True)
    assert tok(" ".join(seq))["input_ids"][1:6] == [vocab.index(a) for a in seq[:5]]
