"""Training: a corpus that needs no download, AdamW with an AttnRes learning-rate group, atomic checkpoints,
bit-exact resume, JSONL logs. `train(TrainConfig(...)) -> RunResult` runs one training in-process."""

from attnres.run_layout import latest_checkpoint
from attnres.training.checkpoint import load_checkpoint, save_checkpoint
from attnres.training.config import TrainConfig
from attnres.training.data import ByteTokenizer, WindowSampler, eval_batches, load_tokenizer, read_corpus, tokenize_and_split
from attnres.training.logs import read_log
from attnres.training.loop import RunResult, TrainingDiverged, build_model, train
from attnres.training.optim import build_optimizer, is_attn_res_param, lr_factor, param_groups
from attnres.training.run_folder import load_trained_model

__all__ = [
    "ByteTokenizer",
    "RunResult",
    "TrainConfig",
    "TrainingDiverged",
    "WindowSampler",
    "build_model",
    "build_optimizer",
    "eval_batches",
    "is_attn_res_param",
    "latest_checkpoint",
    "load_checkpoint",
    "load_tokenizer",
    "load_trained_model",
    "lr_factor",
    "param_groups",
    "read_corpus",
    "read_log",
    "save_checkpoint",
    "tokenize_and_split",
    "train",
]
