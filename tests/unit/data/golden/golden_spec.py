"""The inputs of the Megatron-Core golden file, shared by make_golden.py and the tests."""

import numpy

SHOW = 3  # items recorded in full per split

# data_path entries "A", "B" name the synthetic datasets below (replaced by their prefixes).
CONFIGS = {
    # one prefix; train needs ~4.3 epochs, the last one small -> shuffled separately
    "single_separate_last": {"data_path": ["A"], "split": "90,8,2", "seq_length": 32, "seed": 1234,
                             "sizes": [1500, 40, 5]},
    # one prefix; the last epoch is above 80% -> shuffled with the others
    "single_joint_last": {"data_path": ["A"], "split": "90,10", "seq_length": 16, "seed": 7,
                          "sizes": [1300, 30, 0]},
    # weighted blend of two prefixes (0.5% surplus per dataset)
    "weighted_blend": {"data_path": ["0.3", "A", "0.7", "B"], "split": "90,10,0", "seq_length": 16, "seed": 99,
                       "sizes": [500, 50, 0]},
    # two prefixes without weights: one epoch each, blended by size, capped at the request
    "unweighted_blend": {"data_path": ["A", "B"], "split": "80,20,0", "seq_length": 24, "seed": 5,
                         "sizes": [300, 20, 0]},
}


def synthetic_documents(name):
    """Documents (lists of sequences of token ids) of the synthetic dataset ``name``."""
    seed = {"A": 0, "B": 1, "W": 2}[name]
    rs = numpy.random.RandomState(seed)
    docs = []
    n_docs = {"A": 200, "B": 120, "W": 30}[name]
    high = 50257 if name != "W" else 100000
    for _ in range(n_docs):
        n_seq = 1 if name != "W" else int(rs.randint(1, 4))
        docs.append([rs.randint(0, high, size=int(rs.randint(1, 120))).tolist() for _ in range(n_seq)])
    return docs


def blend_case():
    """Weights and size of a larger weighted blend whose indices are recorded."""
    return [0.2, 0.13, 0.5, 0.17], 100003
