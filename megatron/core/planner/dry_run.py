"""``--dry-run`` for the entry points: the planner's prediction for a trainer command line, no GPU touched.

    text, fits = dry_run(sys.argv[1:], num_gpus=world_size, model="gpt")
    print(text)          # then exit 0 whether it fits or not: the text says which, and by how much
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from megatron.core.planner.flags import inputs_from_argv
from megatron.core.planner.predict import format_prediction, predict
from megatron.core.planner.timing import calibrated_gpu_memory_gb, load_calibration


def dry_run(argv: List[str], num_gpus: int, model: str = "gpt", gpu_memory_gb: Optional[float] = None,
            gpus_per_node: int = 8, gpu_kind: str = "h200", calibration: Optional[str] = None) -> Tuple[str, bool]:
    """``(report, fits)`` for the trainer flags ``argv`` on ``num_gpus`` GPUs (unknown flags are ignored).

    ``gpu_memory_gb`` defaults to the calibration's (``timing.calibrated_gpu_memory_gb``); ``model``
    is ``bert`` for ``pretrain_bert.py``.
    """
    cal = load_calibration(calibration or gpu_kind)
    memory = gpu_memory_gb if gpu_memory_gb is not None else calibrated_gpu_memory_gb(cal)
    argv = list(argv) + (["--model", "bert"] if model == "bert" and "--model" not in argv else [])
    shape, layout, cluster, gbs = inputs_from_argv(argv, num_gpus, memory, gpus_per_node, gpu_kind)
    pred = predict(shape, layout, cluster, cal, gbs)
    head = (f"dry run: {shape.model.upper()} on {num_gpus} x {gpu_kind} ({memory:g} GB each), calibration "
            f"{cal['_path']}")
    return head + "\n" + format_prediction(pred), pred.fits
