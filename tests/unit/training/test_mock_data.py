"""--mock-data: deterministic synthetic samples shaped like the GPT dataset's."""

import numpy as np
import pytest

from megatron.training.mock_data import MockGPTDataset, mock_gpt_datasets


def test_samples_are_deterministic_in_range_and_differ_by_split():
    train, valid, test = mock_gpt_datasets((10, 4, 0), seq_length=8, vocab_size=50, seed=3)
    assert test is None and (len(train), len(valid)) == (10, 4)
    a = train[7]["text"]
    assert a.dtype == np.int64 and a.shape == (9,) and a.min() >= 0 and a.max() < 50
    assert np.array_equal(a, MockGPTDataset(10, 8, 50, 3, "train")[7]["text"])  # same seed and index
    assert not np.array_equal(train[0]["text"], valid[0]["text"])
    assert not np.array_equal(train[0]["text"], MockGPTDataset(10, 8, 50, 4, "train")[0]["text"])
    with pytest.raises(IndexError):
        train[10]
