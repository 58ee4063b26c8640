"""Multimodal inputs for the Qwen3.5/3.6-MoE vision-language model, in numpy and Pillow (no torch).

Submodules are imported by their users (``from qjax.multimodal import images``), not here, so that importing the
package stays cheap and one helper's module does not pull in another's dependencies.
"""
