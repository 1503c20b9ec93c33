"""Run ``fairseq-train`` and, whenever it saves, also dump this rank's model weights.

fairseq writes checkpoints from rank 0 only; to check that data-parallel replicas stay
identical, every rank writes ``<EA_DUMP_DIR>/rank<R>.pt`` next to the normal save.
"""
import os

import torch
from fairseq import checkpoint_utils
from fairseq_cli.train import cli_main  # as the console script does: the plugin serves this command line

_save = checkpoint_utils.save_checkpoint


def save_and_dump(cfg, trainer, epoch_itr, val_loss):
    rank = trainer.data_parallel_rank
    state = {k: v.detach().clone() for k, v in trainer.get_model().state_dict().items()}
    torch.save(state, os.path.join(os.environ["EA_DUMP_DIR"], f"rank{rank}.pt"))
    return _save(cfg, trainer, epoch_itr, val_loss)


checkpoint_utils.save_checkpoint = save_and_dump

if __name__ == "__main__":
    cli_main()
