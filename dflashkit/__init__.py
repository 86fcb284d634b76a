"""dflashkit: DFlash block-diffusion speculative decoding, lossless, end to end."""

from .checkpoint import CheckpointError, load_drafter, save_drafter
from .decoding import GenerationResult, GenerationStats, speculative_generate
from .drafter import DFlashDrafter, DrafterConfig, config_for_target, init_drafter
from .lookup import ContextLookup
from .sampling import SamplingConfig
from .target import Target, TargetError, load_target

__all__ = [
    "CheckpointError", "ContextLookup", "DFlashDrafter", "DrafterConfig", "GenerationResult", "GenerationStats",
    "SamplingConfig", "Target", "TargetError", "config_for_target", "init_drafter",
    "load_drafter", "load_target", "save_drafter", "speculative_generate",
]
__version__ = "0.1.0"
