"""layers_for_stage: even, uneven (first/last stage) and interleaved layer assignment."""

import pytest

from megatron.core.pipeline_parallel.partition import layers_for_stage, layers_per_rank


def _cover(num_layers, pp, vpp=None, first=None, last=None):
    """All (offset, count) in virtual-stage order; checks they tile 0..num_layers-1 exactly."""
    spans = [layers_for_stage(num_layers, pp, r, vpp, v, first, last) for v in range(vpp or 1) for r in range(pp)]
    pos = 0
    for offset, count in spans:
        assert offset == pos and count >= 1
        pos += count
    assert pos == num_layers
    return spans


def test_even_split():
    assert _cover(8, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert layers_for_stage(6, 1, 0) == (0, 6)


def test_interleaved_megatron_assignment():
    # chunk v on rank r starts at (v * pp + r) * layers_per_virtual_stage
    for pp, vpp, per in [(2, 2, 2), (4, 2, 1), (2, 3, 2), (4, 3, 2)]:
        num_layers = pp * vpp * per
        _cover(num_layers, pp, vpp)
        for r in range(pp):
            for v in range(vpp):
                assert layers_for_stage(num_layers, pp, r, vpp, v) == ((v * pp + r) * per, per)


def test_uneven_first_last():
    assert _cover(10, 4, first=1, last=3) == [(0, 1), (1, 3), (4, 3), (7, 3)]
    assert _cover(7, 3, first=3) == [(0, 3), (3, 2), (5, 2)]
    assert _cover(5, 2, first=2, last=3) == [(0, 2), (2, 3)]
    assert layers_per_rank(9, 4, None, 3) == [2, 2, 2, 3]
    # uneven with interleaving: every rank's layers split into equal chunks, ordered as virtual stages
    assert _cover(12, 3, vpp=2, first=2, last=2) == [(0, 1), (1, 4), (5, 1), (6, 1), (7, 4), (11, 1)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_layers=7, pp_size=2, pp_rank=0), r"--num-layers \(7\) must be divisible by --pipeline-model-parallel-size \(2\)"),
    (dict(num_layers=8, pp_size=2, pp_rank=0, vpp_size=3), r"not divisible by --virtual-pipeline-model-parallel-size \(3\)"),
    (dict(num_layers=8, pp_size=2, pp_rank=2), "pipeline rank 2"),
    (dict(num_layers=8, pp_size=2, pp_rank=0, vpp_size=2, vpp_rank=2), "virtual pipeline rank 2"),
    (dict(num_layers=0, pp_size=2, pp_rank=0), "--num-layers must be >= 1"),
    (dict(num_layers=8, pp_size=1, pp_rank=0, first_stage_layers=2), "--decoder-first-pipeline-num-layers needs"),
    (dict(num_layers=8, pp_size=3, pp_rank=0, first_stage_layers=3), "split evenly"),
    (dict(num_layers=4, pp_size=2, pp_rank=0, first_stage_layers=2, last_stage_layers=3), "leave -1"),
    (dict(num_layers=8, pp_size=2, pp_rank=0, last_stage_layers=0), "--decoder-last-pipeline-num-layers must be >= 1"),
])
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        layers_for_stage(**kwargs)
