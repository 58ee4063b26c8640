"""Writers of qjax models to checkpoint formats other tools load (installed as ``qjax.convert``)."""

from .hf_writer import checkpoint_tensors, save_pretrained

__all__ = ["checkpoint_tensors", "save_pretrained"]
