"""The forward and backward step of one microbatch, shared by every schedule.

``forward_step`` calls the user's ``forward_step_func`` on one model chunk; on the last pipeline stage it
hands the output to the returned ``loss_func`` and divides the loss by the number of microbatches, so that
the gradients accumulated over a step are those of the mean loss. ``backward_step`` runs autograd for one
microbatch: from the (optionally scaled) loss on the last stage, or from the output with the gradient
received from the next stage elsewhere, and returns the gradient of the stage's input.

``deallocate_output`` and ``custom_backward`` implement the memory trick of pipeline schedules: once a
stage has sent its output to the next stage, only the autograd graph behind that output is still needed,
so the output's storage is replaced by a one-element tensor; the backward pass is then started through
the autograd engine directly, which does not compare the (now tiny) output's shape with its gradient's.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


def forward_step(
    forward_step_func: Callable,
    data_iterator: Any,
    chunk: torch.nn.Module,
    num_microbatches: int,
    input_tensor: Optional[torch.Tensor],
    is_last_stage: bool,
    set_input: bool,
    stats: List[Dict],
) -> torch.Tensor:
    """Run one microbatch forward on ``chunk`` and return its output.

    ``input_tensor`` (``[s(/tp), b, h]``) is handed to ``chunk.set_input_tensor`` first when ``set_input``
    is true (every stage but the very first). On the last stage the output goes through ``loss_func``; the
    returned tensor is then the scalar loss divided by ``num_microbatches`` and the stats dict is appended
    to ``stats``.
    """
    if set_input:
        setter = getattr(chunk, "set_input_tensor", None)
        if setter is None:
            raise TypeError(
                f"model chunk {type(chunk).__name__} has no set_input_tensor(tensor) method, which every "
                "pipeline stage but the first needs to receive its input"
            )
        setter(input_tensor)
    output_tensor, loss_func = forward_step_func(data_iterator, chunk)
    if not is_last_stage:
        return output_tensor
    loss, stats_dict = loss_func(output_tensor)
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError(
            "loss_func must return (loss, stats_dict) with loss a one-element tensor (the microbatch mean), "
            f"got {type(loss).__name__}" + (f" of shape {tuple(loss.shape)}" if torch.is_tensor(loss) else "")
        )
    stats.append(stats_dict)
    return loss.reshape(()) / num_microbatches


def deallocate_output(output: Optional[torch.Tensor]) -> None:
    """Free the storage of a pipeline output that has been sent, keeping its autograd graph.

    The tensor's data becomes a one-element tensor; its ``grad_fn`` still links to the graph, so the
    stage can run backward later with ``custom_backward``. Views are left alone: freeing a view would not
    release the storage it shares with its base.
    """
    if output is None or output._base is not None or output.grad_fn is None:
        return
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``torch.autograd.backward(output, grad_output)`` that tolerates an output freed by ``deallocate_output``.

    ``torch.autograd.backward`` checks that the gradient has the output's shape, which a freed output no
    longer has; the autograd engine itself only needs the graph, so it is called directly.
    """
    if output.numel() == grad_output.numel() and output.shape == grad_output.shape:
        torch.autograd.backward(output, grad_tensors=grad_output)
        return
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def backward_step(
    input_tensor: Optional[torch.Tensor],
    output_tensor: torch.Tensor,
    output_tensor_grad: Optional[torch.Tensor],
    grad_scale_func: Optional[Callable],
) -> Optional[torch.Tensor]:
    """Backward of one microbatch on one stage; return the gradient of ``input_tensor`` (or None).

    On the last stage ``output_tensor`` is the loss (already divided by the number of microbatches) and
    ``output_tensor_grad`` is None: the loss is scaled by ``grad_scale_func`` (mixed-precision loss
    scaling) when one is given and differentiated. Elsewhere the gradient received from the next stage
    flows back through ``output_tensor``.
    """
    if output_tensor_grad is None:
        loss = grad_scale_func(output_tensor) if grad_scale_func is not None else output_tensor
        torch.autograd.backward(loss)
    else:
        custom_backward(output_tensor, output_tensor_grad)
    if input_tensor is None:
        return None
    return input_tensor.grad


def first_and_last_stage(pp_size: int, pp_rank: int, chunk: int, num_chunks: int) -> Tuple[bool, bool]:
    """Whether model chunk ``chunk`` on pipeline rank ``pp_rank`` is the first and/or the last stage.

    Chunk ``c`` of rank ``r`` is virtual stage ``c * pp_size + r`` of ``pp_size * num_chunks`` stages.
    """
    stage = chunk * pp_size + pp_rank
    return stage == 0, stage == pp_size * num_chunks - 1
