"""The global random states (python, numpy, torch CPU and CUDA), to store in a checkpoint and restore on resume.

Draws that matter for reproducibility use explicit generators (see seeding.py); this covers whatever still
uses the global streams (dropout, third-party code). The state holds only python scalars, lists, tuples and
tensors, so `torch.load(..., weights_only=True)` reads it back.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """The current state of python `random`, numpy's global RNG, torch CPU and (when available) every CUDA device."""
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": [int(k) for k in numpy_state["state"]["key"]],  # a list, not an ndarray: weights_only loading
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "cached_gaussian": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Puts back a state from capture_rng_state, so the next draws repeat those that followed the capture."""
    missing = {"python", "numpy", "torch"} - state.keys()
    if missing:
        raise ValueError(f"not an RNG state from capture_rng_state: missing {sorted(missing)}")
    random.setstate(_as_python_random_state(state["python"]))
    saved = state["numpy"]
    key = np.asarray(saved["key"], dtype=np.uint32)
    np.random.set_state((saved["bit_generator"], key, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = state.get("torch_cuda")
    if cuda_states is None:
        return
    if not torch.cuda.is_available():
        logger.warning("the saved CUDA RNG state is not restored: CUDA is not available here")
        return
    count = torch.cuda.device_count()
    if len(cuda_states) != count:
        logger.warning(
            "CUDA RNG states saved for %d devices, %d visible; restoring the first ones", len(cuda_states), count
        )
    for device, cuda_state in enumerate(cuda_states[:count]):
        torch.cuda.set_rng_state(cuda_state.cpu(), device)


def _as_python_random_state(saved: Any) -> tuple[Any, ...]:
    # random.setstate wants (version, tuple_of_ints, gauss); serialisers may hand back lists
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)
