"""Writers of qjax models to checkpoint formats other tools load (installed as ``qjax.convert``)."""

from qjax.checkpoint.layout import checkpoint_tensors

from .autoround_writer import save_autoround
from .hf_writer import save_pretrained

__all__ = ["checkpoint_tensors", "save_autoround", "save_pretrained"]
