"""Oracle builders: the PyTorch references the tests compare qjax against, built at test time.

- ``hf``: tiny transformers ``qwen3_5_moe`` models (seeded), their folders in both HF layouts, float32/float64 logits
  and greedy generation through transformers' pure-torch path.
- ``ct``: compressed-tensors checkpoints written by compressed-tensors itself (and llmcompressor-style recipes), with
  the decompressed float32 transformers model as the logits oracle.
- ``vllm_mtp``: a float64 numpy transcription of vLLM's ``Qwen3_5MoeMTP`` forward (transformers has no MTP head),
  for both ``mtp.*`` expert layouts.
- ``autoround``: auto-round 0.16.1 runs and auto-round checkpoints, each in a fresh interpreter (auto-round patches
  transformers for the rest of a process).

``test_oracles_*.py`` check the oracles themselves, so that a parity failure points at qjax.
"""
