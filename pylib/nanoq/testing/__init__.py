"""The testing interface of nanoq: what tests reach and product code never does.

- ``OpRunner``: single backend ops on numpy arrays, driven by the core's op
  table (nanoq.testing.ops), for op-level tests and backend parity.
- Hooks that make a run fail or pause where a healthy one never would, so
  that failure paths can be tested (nanoq.testing.hooks): ``arm_hook``,
  ``fail_next_step``, ``delay_next_step`` and ``delay_next_validate`` for
  the core's hooks, ``PAUSE_IN_SAVE_ENV`` for the checkpoint writer's;
  ``synchronous_reductions``, ``trace_communication`` and
  ``communication_trace`` for the overlap of gradient reductions with the
  backward.
"""

from nanoq.testing.hooks import (PAUSE_IN_SAVE_ENV, arm_hook, communication_trace, core_hooks, delay_next_step,
                                 delay_next_validate, fail_next_step, synchronous_reductions, trace_communication)

__all__ = ["OpRunner", "op_table", "PAUSE_IN_SAVE_ENV", "arm_hook", "communication_trace", "core_hooks",
           "delay_next_step", "delay_next_validate", "fail_next_step", "synchronous_reductions",
           "trace_communication"]


def __getattr__(name):
    # The op harness (extension nanoq._ops) loads on first use: the
    # checkpoint writer imports the hooks, and training never needs the ops.
    if name in ("OpRunner", "op_table"):
        from nanoq.testing import ops

        return getattr(ops, name)
    raise AttributeError(f"module 'nanoq.testing' has no attribute {name!r}")
