"""The device parameter of tests/gpu: "cpu" always runs (it proves the test logic in CI),
"cuda" is marked gpu and skipped, with the reason, where no CUDA device is visible."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device visible (tests/gpu run their CUDA half on a GPU machine: make gpu-check)"

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
    ),
]
