"""Combining loaders: a weighted mixture per batch, and a curriculum of stages in sequence.

Both keep their randomness countable so that a state_dict is a few integers:
mixture draw k uses ``np.random.default_rng([seed, k, _MIXTURE_STREAM])``,
so resuming needs only the draw counter, never a replay.
"""
from __future__ import annotations

import math
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from nanoq.data.loader import Batch, check_seed, check_state, positive_int

# Keeps mixture draws independent of DataLoader permutations made from the same seed.
_MIXTURE_STREAM = 0x6D6978


def _load_all(loaders, states) -> None:
    """Loads every loader's state, or none: a rejected state leaves all loaders as they were."""
    before = [loader.state_dict() for loader in loaders]
    try:
        for loader, state in zip(loaders, states):
            loader.load_state_dict(state)
    except BaseException:
        for loader, state in zip(loaders, before):
            loader.load_state_dict(state)
        raise


def _common_part(loaders, who: str) -> Tuple[int, int]:
    """The one ``part`` (index, count) that all ``loaders`` serve (a loader
    without the attribute serves whole batches, (0, 1))."""
    parts = {tuple(getattr(loader, "part", (0, 1))) for loader in loaders}
    if len(parts) != 1:
        raise ValueError(f"{who} must serve the same part (index, count) of each batch; got {sorted(parts)}")
    return parts.pop()


class MixtureLoader:
    """Endless global batches, each drawn whole from one sub-loader.

    loaders_and_weights: [(loader, weight), ...]; weights are positive and
    need not sum to 1 (only their ratios matter), but their sum must be a
    finite float (ValueError otherwise). Every loader must serve the same batch shape
    (batch_rows, seq_len) and the same ``part`` (see DataLoader: under a
    launcher each process mixes its part of every loader). Batch k comes from loader i with probability
    weight_i / sum(weights), decided by the k-th draw of the mixture's seed;
    the chosen loader advances, the others do not. ``draws`` counts batches served.
    """

    def __init__(self, loaders_and_weights: Sequence[Tuple[object, float]], seed: int):
        pairs = list(loaders_and_weights)
        if not pairs:
            raise ValueError("MixtureLoader needs at least one (loader, weight) pair")
        self.loaders = [loader for loader, _ in pairs]
        self.weights = []
        for index, (_, weight) in enumerate(pairs):
            if isinstance(weight, bool) or not isinstance(weight, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(weight) or weight <= 0:
                raise ValueError(f"weight of loader {index} must be a finite positive number, got {weight!r}")
            self.weights.append(float(weight))
        total = sum(self.weights)
        if not math.isfinite(total):
            raise ValueError(f"the weights {self.weights} of a mixture sum past the largest float; only their "
                             f"ratios matter: scale them down (e.g. divide each by the largest)")
        shapes = {(loader.batch_rows, loader.seq_len) for loader in self.loaders}
        if len(shapes) != 1:
            raise ValueError(f"all loaders of a mixture must serve one batch shape (batch_rows, seq_len); "
                             f"got {sorted(shapes)}")
        self.batch_rows, self.seq_len = shapes.pop()
        self.part = _common_part(self.loaders, "all loaders of a mixture")
        self.seed = check_seed(seed)
        self.draws = 0
        self._cumulative = np.cumsum(self.weights) / total

    def _choose(self, draw: int) -> int:
        uniform = np.random.default_rng([self.seed, draw, _MIXTURE_STREAM]).random()
        return min(int(np.searchsorted(self._cumulative, uniform, side="right")), len(self.loaders) - 1)

    def next_batch(self) -> Batch:
        """This part's rows of the next global batch (drawn whole from one
        loader): inputs, targets int32 [batch_rows // part count, seq_len]."""
        loader = self.loaders[self._choose(self.draws)]
        self.draws += 1
        return loader.next_batch()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict:
        """JSON-serialisable: seed, weights, draw counter and every sub-loader's state."""
        return {"kind": "MixtureLoader", "seed": self.seed, "weights": list(self.weights),
                "draws": self.draws, "loaders": [loader.state_dict() for loader in self.loaders]}

    def load_state_dict(self, state: dict) -> None:
        """Continues exactly where the saving mixture stopped. The seed, the weights
        and the number of loaders must match (ValueError); each sub-loader checks its own state."""
        check_state(state, "MixtureLoader", ("seed", "weights", "draws", "loaders"))
        if state["seed"] != self.seed:
            raise ValueError(f"MixtureLoader state was saved with seed {state['seed']}, this one has {self.seed}")
        if len(state["loaders"]) != len(self.loaders):
            raise ValueError(f"MixtureLoader state has {len(state['loaders'])} loaders, this one has "
                             f"{len(self.loaders)}")
        if [float(w) for w in state["weights"]] != self.weights:
            raise ValueError(f"MixtureLoader state has weights {state['weights']}, this one has {self.weights}")
        draws = state["draws"]
        if not isinstance(draws, int) or draws < 0:
            raise ValueError(f"MixtureLoader state has an invalid draw counter {draws!r}")
        _load_all(self.loaders, state["loaders"])
        self.draws = draws


class Curriculum:
    """Stages trained one after another, each for a fixed number of optimizer steps.

    stages: [(train_loader, eval_loader or None, steps), ...]; train_loader is
    anything with next_batch/state_dict/load_state_dict (DataLoader,
    MixtureLoader). One optimizer step takes batches_per_step batches (the
    trainer's grad_accum), so stage i serves steps_i * batches_per_step batches.

    ``current_stage`` is the stage of the latest batch (0 before the first):
    it moves on when the first batch of the next stage is drawn, so after a
    stage's last step ``eval_loader()`` still returns that stage's eval loader
    and ``stage_complete`` is True. ``next_batch()`` raises StopIteration once
    the last stage is complete; iterating yields every remaining batch.
    Under a launcher every stage's loaders serve this process's ``part``
    (see DataLoader); they must all serve the same one.
    """

    def __init__(self, stages: Sequence[Tuple[object, Optional[object], int]], batches_per_step: int = 1):
        self.stages = []
        for index, stage in enumerate(stages):
            if len(stage) != 3:
                raise ValueError(f"curriculum stage {index} must be (train_loader, eval_loader or None, steps), "
                                 f"got {len(stage)} items")
            train, evaluation, steps = stage
            self.stages.append((train, evaluation, positive_int(f"steps of curriculum stage {index}", steps)))
        if not self.stages:
            raise ValueError("a curriculum needs at least one stage")
        self.part = _common_part([loader for train, evaluation, _ in self.stages
                                  for loader in (train, evaluation) if loader is not None],
                                 "the train and eval loaders of a curriculum")
        self.batches_per_step = positive_int("batches_per_step", batches_per_step)
        self.current_stage = 0
        self.batches_in_stage = 0

    def _stage_batches(self, stage: int) -> int:
        return self.stages[stage][2] * self.batches_per_step

    @property
    def stage_complete(self) -> bool:
        """True when every batch of the current stage has been served."""
        return self.batches_in_stage == self._stage_batches(self.current_stage)

    @property
    def finished(self) -> bool:
        return self.current_stage == len(self.stages) - 1 and self.stage_complete

    @property
    def total_steps(self) -> int:
        return sum(steps for _, _, steps in self.stages)

    @property
    def batch_rows(self) -> int:
        """Rows of the current stage's batches (the global batch)."""
        return self.stages[self.current_stage][0].batch_rows

    def next_batch(self) -> Batch:
        """This part's rows of the next global batch of the current stage
        (moving to the next stage when this one is complete): inputs, targets
        int32 [batch_rows // part count, seq_len]."""
        if self.finished:
            raise StopIteration("the curriculum is finished")
        if self.stage_complete:
            self.current_stage += 1
            self.batches_in_stage = 0
        self.batches_in_stage += 1
        return self.stages[self.current_stage][0].next_batch()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def eval_loader(self):
        """The current stage's eval loader, or None if it has none."""
        return self.stages[self.current_stage][1]

    def state_dict(self) -> dict:
        """JSON-serialisable: stage, batches served in it, and every stage's train-loader state."""
        return {"kind": "Curriculum", "stage": self.current_stage, "batches_in_stage": self.batches_in_stage,
                "batches_per_step": self.batches_per_step,
                "steps": [steps for _, _, steps in self.stages],
                "loaders": [train.state_dict() for train, _, _ in self.stages]}

    def load_state_dict(self, state: dict) -> None:
        """Continues exactly where the saving curriculum stopped; its stage
        lengths (in optimizer steps) must match (ValueError). Another
        batches_per_step (a resume with another grad_accum) is taken: the
        stage continues from the same optimizer step, its remaining steps
        taking this curriculum's batches each."""
        check_state(state, "Curriculum", ("stage", "batches_in_stage", "batches_per_step", "steps", "loaders"))
        steps: List[int] = [steps for _, _, steps in self.stages]
        if state["steps"] != steps:
            raise ValueError(f"Curriculum state has stage steps {state['steps']}; this curriculum has {steps}")
        stage, served, per_step = state["stage"], state["batches_in_stage"], state["batches_per_step"]
        if per_step != self.batches_per_step:
            if not (isinstance(per_step, int) and per_step >= 1 and isinstance(served, int) and served >= 0
                    and served % per_step == 0):
                raise ValueError(f"Curriculum state has batch count {served!r} with batches_per_step {per_step!r}: "
                                 f"only a state saved after whole optimizer steps continues with another "
                                 f"batches_per_step ({self.batches_per_step})")
            served = served // per_step * self.batches_per_step
        if not (isinstance(stage, int) and 0 <= stage < len(self.stages) and 0 <= served <= self._stage_batches(stage)):
            raise ValueError(f"Curriculum state has an invalid stage {stage!r} or batch count {served!r}")
        if len(state["loaders"]) != len(self.stages):
            raise ValueError(f"Curriculum state has {len(state['loaders'])} loader states for "
                             f"{len(self.stages)} stages")
        _load_all([train for train, _, _ in self.stages], state["loaders"])
        self.current_stage, self.batches_in_stage = stage, served
