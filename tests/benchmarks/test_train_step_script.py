"""benchmarks/train_step.py's projection of the published recipe's wall time, on the CPU."""

import importlib

import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.train_step")


def test_the_recipe_is_read_from_the_shipped_config(bench):
    assert bench.recipe_settings() == (3000, 100)


def test_the_projection_is_steps_times_the_step_and_a_checkpoint_per_interval(bench):
    assert bench.projected_recipe_s(1.41, 3000, 100, 0.02) == pytest.approx(3000 * 1.41 + 30 * 0.02)
    assert bench.projected_recipe_s(1.0, 250, 100, 0.5) == pytest.approx(250 + 2 * 0.5)  # no checkpoint at 250


def test_a_checkpoint_write_is_timed(bench):
    gates = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(gates.parameters())
    assert 0 < bench.checkpoint_seconds(gates, optimizer) < 5
