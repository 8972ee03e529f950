"""Registry-wide properties that need more than model.py: evaluation past the training length."""

import math
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import EXTRAPOLATING, VOCAB, tiny
from tqdm import tqdm

from compare.eval_length import evaluate


@pytest.mark.parametrize("pe", EXTRAPOLATING)
def test_evaluation_past_the_training_length(pe):
    """eval_length's nonoverlapping evaluation at 4x block_size runs for every encoding that
    extrapolates, and its loss is the mean cross-entropy of full forwards over the same windows."""
    model = tiny(pe, block_size=8)
    L = 32
    data = np.random.default_rng(0).integers(0, VOCAB, 5 * L + 1).astype(np.uint16)
    with tqdm(disable=True) as bar:
        got = evaluate(model, data, L, "nonoverlapping", L, 1e8, "cpu", nullcontext(), bar)
    x = torch.from_numpy(data[: 5 * L].astype(np.int64)).view(5, L)
    y = torch.from_numpy(data[1 : 5 * L + 1].astype(np.int64)).view(5, L)
    with torch.no_grad():
        expected = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item()
    assert math.isfinite(got["loss"]) and abs(got["loss"] - expected) < 1e-5
    assert got["tokens"] == 5 * L
