"""Datasets (RL prompts, SFT, preference), the resumable dataloader, built-in tasks and preprocessors."""

from hybridflow.data.build import build_rl_datasets, build_sft_datasets
from hybridflow.data.collate import collate_preference, collate_rl, collate_sft, position_ids_from_mask
from hybridflow.data.dataloader import ResumableBatchSampler, StatefulDataLoader, make_dataloader
from hybridflow.data.parquet_io import read_rows, write_rows
from hybridflow.data.preference_dataset import PreferenceDataset
from hybridflow.data.rl_dataset import RLHFDataset
from hybridflow.data.sft_dataset import SFTDataset
from hybridflow.data.tasks import TASKS, task_splits

__all__ = [
    "TASKS", "PreferenceDataset", "RLHFDataset", "ResumableBatchSampler", "SFTDataset", "StatefulDataLoader",
    "build_rl_datasets", "build_sft_datasets", "collate_preference", "collate_rl", "collate_sft",
    "make_dataloader", "position_ids_from_mask", "read_rows", "task_splits", "write_rows",
]
