"""keel: fine-tune LLMs end to end from Python, with the CLI's trainer (docs/python.md).

    import keel
    config = keel.TrainingConfig(model_name="models/glm-4-9b", data_path="train.jsonl", max_steps=1000)
    summary = keel.Trainer(config).train()

keel.Dataset / keel.DataLoader feed keel's tokenize-once, prefetching data path to any PyTorch
loop. Errors are keel.Error, with the messages the CLI prints.
"""
from ._native import Error
from .api import generate, plan, prepare
from .config import TrainingConfig
from .data import DataLoader, Dataset, block_causal_mask
from .trainer import Trainer

# cann-recipes-train's names for the same classes (the reference article's code runs unchanged).
NPUDataset = Dataset
NPUDataLoader = DataLoader

try:
    from importlib.metadata import version as _version
    __version__ = _version("keel")
except Exception:  # the build tree, not an installed distribution
    __version__ = "0.3.0+build"

__all__ = ["Error", "TrainingConfig", "Trainer", "Dataset", "DataLoader", "NPUDataset", "NPUDataLoader",
           "block_causal_mask", "plan", "prepare", "generate"]
