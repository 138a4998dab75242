"""nanoq.training: the training loop behind ``nanoq train``, usable from Python.

    from nanoq.training import TrainConfig, load_config, train
    config = load_config("configs/example.toml", overrides={"steps": 100})
    result = train(config)            # prints a line per step; returns a TrainResult
    print(result.model_dir, result.final_eval_loss)

- config:   TrainConfig, the schema of every setting (TOML file, flags, docs)
- schedule: learning_rate(step, ...), cosine / linear / wsd / constant with warmup
- loop:     train(config, resume=None | "auto" | path) -> TrainResult, evaluate(...):
            checkpoints, resuming (FIXED_ON_RESUME: what a resumed run may not change);
            the final model is written by nanoq.hf_export; under a launcher every
            process calls train and they train one world (processes=: a ProcessGroup)
- log:      the JSONL run log and console lines
- samples:  greedy samples every train.sample_every steps (``sample`` log lines)
- tracking: run.tracker, every log record also sent to TensorBoard or Weights & Biases
- run_lock: one trainer per run directory (RunInUse when another holds it)
"""
from nanoq.training.settings import TrainConfig, load_config, schema_markdown, settings
from nanoq.training.log import JsonlLog, read_log
from nanoq.training.loop import TrainResult, evaluate, train
from nanoq.training.resume import FIXED_ON_RESUME, config_changes
from nanoq.training.lr_schedule import learning_rate
from nanoq.training.run_lock import RunInUse
from nanoq.training.stop import TrainingHalted

__all__ = [
    "FIXED_ON_RESUME",
    "JsonlLog",
    "RunInUse",
    "TrainConfig",
    "TrainResult",
    "TrainingHalted",
    "config_changes",
    "evaluate",
    "learning_rate",
    "load_config",
    "read_log",
    "schema_markdown",
    "settings",
    "train",
]
