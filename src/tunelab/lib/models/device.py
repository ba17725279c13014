"""Where models compute: the torch device every stage puts a model on.

`compute_device() -> torch.device`: the current CUDA device (with its index) when
`tunelab.core.env.device_kind()` says cuda, else the CPU. Training, baseline, eval, smoke and
verify's fresh process put the model there.
"""

from __future__ import annotations

from tunelab.core.env import device_kind


def compute_device():
    """Where tunelab trains and evaluates (`tunelab.core.env.device_kind`: CUDA when present, or
    what TUNELAB_DEVICE says). Training, the baseline, `tunelab eval`, the smoke's reload and
    verify's fresh process all ask here, so that a checkpoint is evaluated again on the kind of
    device its recorded predictions came from."""
    import torch

    if device_kind() == "cuda":
        # with its index: some CUDA calls (set_per_process_memory_fraction) refuse a bare "cuda"
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
