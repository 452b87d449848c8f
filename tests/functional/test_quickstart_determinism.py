"""The quickstart's GPT step run twice on one machine gives the same output: two processes with different hash
seeds (so different set and dict orders of anything hashed by address or string) and two threads each (the
quickstart's OMP_NUM_THREADS), dropout on, print the same losses and grad norms to the last digit. The BERT step's
vocabulary is checked in tests/unit/data/test_learn_wordpiece_vocab.py."""

from tests.functional.harness import gpt_args, parse_iterations, preprocess_quickstart_corpus, run_pretrain


def test_gpt_step_twice_same_output(tmp_path):
    data = preprocess_quickstart_corpus(str(tmp_path))
    argv = gpt_args(data, num_layers=2, hidden_size=128, seq_length=64, max_position_embeddings=64,
                    micro_batch_size=4, global_batch_size=8, train_iters=12, attention_dropout=0.1,
                    hidden_dropout=0.1, attention_backend=None, lr=1e-3, lr_warmup_iters=4)
    runs = []
    for seed in ("1", "2"):
        proc = run_pretrain(argv, env={"OMP_NUM_THREADS": "2", "PYTHONHASHSEED": seed}, timeout=600)
        runs.append(parse_iterations(proc.stdout))
    assert sorted(runs[0]) == list(range(1, 13))
    assert runs[0] == runs[1]
