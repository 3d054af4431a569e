"""The explorers' pure functions, on real FashionMNIST, without a browser."""
import math

import pytest

from dpcourse.data import MEAN, STD, load_fashion_mnist
from dpcourse.widgets import lr_batch_explorer, sgd_softmax


@pytest.fixture(scope="module")
def xy(fashion_root):
    images, labels = load_fashion_mnist(fashion_root)
    X = ((images[:10_000].float() / 255 - MEAN) / STD).reshape(10_000, -1)
    return X, labels[:10_000]


def test_a_sensible_learning_rate_lowers_the_loss(xy):
    run = sgd_softmax(*xy, lr=0.05, batch_size=64, samples=6400)
    assert run["steps"] == 100 and run["samples_seen"][-1] == 6400
    assert run["train_loss"][0] == pytest.approx(math.log(10), rel=1e-3)  # zero weights: uniform
    assert run["train_loss"][-1] < 0.8


def test_too_large_a_learning_rate_diverges_and_stops_early(xy):
    run = sgd_softmax(*xy, lr=10.0, batch_size=1, samples=5000)
    assert run["steps"] < 5000 and (not math.isfinite(run["train_loss"][-1]) or run["train_loss"][-1] > 1e3)


def test_explorer_builds_with_two_sliders(xy):
    box = lr_batch_explorer(*xy, samples=640)
    lr, bs = box.children[0].children
    assert lr.description == "lr" and bs.value == 64
    bs.value = 256  # redraws without error
