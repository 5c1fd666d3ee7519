"""Training: steps with gradient accumulation, batch placement, optimizer parallel, checkpoints."""

from jaxpar.train.checkpoint import (
    checkpoint_steps,
    latest_step,
    restore_checkpoint,
    save_checkpoint,
)
from jaxpar.train.data import parse_dataset_strategy, shard_batch
from jaxpar.train.optimizer_parallel import optimizer_parallel_specs
from jaxpar.train.step import accumulate_gradients, make_train_step, split_microbatches

__all__ = ["accumulate_gradients", "checkpoint_steps", "latest_step", "make_train_step",
           "optimizer_parallel_specs", "parse_dataset_strategy", "restore_checkpoint",
           "save_checkpoint", "shard_batch", "split_microbatches"]
