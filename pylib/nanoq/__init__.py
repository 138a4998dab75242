"""nanoq: train Llama-family language models from Python on a standalone C++ core.

    import nanoq
    config = nanoq.ModelConfig.from_pretrained("path/to/hf-model")
    options = nanoq.TrainOptions(backend="cpu", devices=2, batch_size=4, seq_len=256)
    with nanoq.Trainer(config, options) as trainer:
        trainer.import_weights("path/to/hf-model")
        trainer.step(inputs, targets)          # int32 [devices*batch_size, seq_len]
        stats = trainer.update(lr=3e-4)
"""
import ctypes as _ctypes
import os as _os

# Idle OpenMP threads sleep instead of spinning: a spinning pool loses up to
# 10x when anything else wants the cores (measured on 2 cores). Must be set
# before libgomp loads; a value the user set wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A core built with OpenBLAS links libscipy_openblas.so; load it globally
# first so the extension finds it wherever pip put the two packages. Without
# scipy-openblas32 the core must have been built without it, with nanoq's
# portable sgemm (nanoq.backends() says which the cpu backend runs).
try:
    import scipy_openblas32 as _openblas  # noqa: E402
except ImportError:
    _openblas = None
else:
    _ctypes.CDLL(_os.path.join(_openblas.get_lib_dir(), "libscipy_openblas.so"), mode=_ctypes.RTLD_GLOBAL)

from nanoq._core import NanoqError, OutOfMemoryError  # noqa: E402
from nanoq.backends import backends, new_comm_id  # noqa: E402
from nanoq.trainer_config import ModelConfig, TrainOptions  # noqa: E402
from nanoq.memory import MemoryEstimate, estimate_memory  # noqa: E402
from nanoq.trainer import StepStats, Trainer  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str):
    """nanoq's submodules on first use, so that after a plain ``import nanoq``
    ``nanoq.training.train``, ``nanoq.hf_export.export_adapter``, ... work
    as the docs write them."""
    import importlib
    import importlib.util

    if name.isidentifier() and not name.startswith("_") and \
            importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "MemoryEstimate",
    "ModelConfig",
    "NanoqError",
    "OutOfMemoryError",
    "StepStats",
    "TrainOptions",
    "Trainer",
    "backends",
    "estimate_memory",
    "new_comm_id",
]
