"""Activation checkpointing: telling a recompute from the forward it repeats.

``torch.utils.checkpoint`` (and everything built on it: Hugging Face's
``gradient_checkpointing_enable()``, FSDP's checkpoint wrapper) runs a region's forward a second
time during the backward pass. That recompute must repeat the original forward bit for bit and
change no state: Transformer Engine stashes the delayed-scaling scales and amax history before
the first forward of a checkpointed region and swaps them back in for the recompute, which
neither records amaxes nor updates scales
(``FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute`` /
``get_old_fp8_meta_tensors_for_recompute`` / ``restore_fp8_meta_tensors`` in
``transformer_engine/pytorch/quantization.py``, called from ``TransformerEngineBaseModule.prepare_forward``
and ``end_forward`` in ``module/base.py`` when ``in_fp8_activation_recompute_phase()``, a flag set by
``activation_recompute_forward`` in ``distributed.py``). TE knows the phase because its own
``te.distributed.checkpoint`` sets that flag; ``torch.utils.checkpoint`` sets none, so a recompute
is recognised by where it runs: a forward inside a backward pass.

* Non-reentrant (``use_reentrant=False``): the first forward runs with grad enabled and outside
  backward; the recompute runs inside backward (from a saved tensor's unpack hook).
* Reentrant (``use_reentrant=True``): the first forward runs under ``no_grad`` (inside an autograd
  Function), so it is an inference forward to the layers; the recompute, inside backward with
  grad enabled, is the only forward that builds a graph, and is treated as the step's forward.

Hence the rule both the emulated backend and the monitor follow: a forward inside backward
repeats the oldest forward of the same layer that is still waiting for its backward, if there
is one; otherwise (reentrant) it is the training forward itself.
"""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """Whether the calling code runs inside an autograd backward pass (a graph task).

    ``torch._C._current_graph_task_id()`` is what ``torch.utils.checkpoint`` itself reads to key
    its recomputations (``_checkpoint_hook.unpack_hook``); it is -1 outside backward. Torch builds
    without it answer False (recomputes are then not recognised).
    """
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is not None and graph_task_id() != -1
