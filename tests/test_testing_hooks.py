"""The testing interface: hooks are armed only through nanoq.testing.

The hooks' effects are tested where they are used (test_worker_pool.py:
a failing worker; test_checkpoint.py and test_faults.py: a save killed
mid-way). Here: the interface itself, and that product code reaches hooks
only through it.
"""

import pathlib
import re

import numpy as np
import pytest

import nanoq
from nanoq import testing
from conftest import open_trainer, random_batch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_core_hooks_are_listed_with_what_they_do():
    hooks = testing.core_hooks()
    assert "fail_next_step_in_worker" in hooks
    assert all(doc for doc in hooks.values())


def test_arming_checks_the_hook_and_its_value(checkpoints):
    with open_trainer(checkpoints.path("llama"), devices=2, batch_size=2) as tr:
        with pytest.raises(ValueError, match='unknown testing hook "nope"; the hooks are: fail_next_step_in_worker'):
            testing.arm_hook(tr, "nope", 1)
        with pytest.raises(TypeError, match="must be an int"):
            testing.arm_hook(tr, "fail_next_step_in_worker", 1.0)
        with pytest.raises(ValueError, match=r"device must be an integer in \[0, 2\)"):
            testing.fail_next_step(tr, 2)


def test_an_armed_fault_fires_once_in_the_named_worker(checkpoints):
    batch = random_batch(np.random.default_rng(3), rows=4)
    with open_trainer(checkpoints.path("llama"), devices=2, batch_size=2) as tr:
        testing.fail_next_step(tr, 1)
        tr.step(*batch)  # queues the work: the fault surfaces at the next call that waits for it
        with pytest.raises(nanoq.NanoqError, match="injected fault in worker 1"):
            tr.update(lr=1e-3)
    with open_trainer(checkpoints.path("llama"), devices=2, batch_size=2) as tr:
        tr.step(*batch)  # hooks belong to one trainer: a new one is disarmed


def test_product_code_reaches_hooks_only_through_the_testing_interface():
    package = ROOT / "pylib" / "nanoq"
    for path in list(package.rglob("*.py")) + list(package.rglob("*.pyx")):
        text = path.read_text()
        if path.parent.name != "testing":
            assert "NANOQ_TEST_" not in text, f"{path}: test environment hooks belong in nanoq/testing/hooks.py"
    core = ROOT / "cuda_core"
    users = sorted(p.relative_to(core).as_posix() for p in core.rglob("*.[ch]*")
                   if re.search(r"\bTestingHook::", p.read_text()))
    assert users == ["trainer.cpp"], users
