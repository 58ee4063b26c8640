"""The model room: ``qwen3_5_moe`` in Flax NNX, named like transformers' modules.

- :mod:`.config` — ``TextConfig`` (a frozen dataclass read from ``config.json``, bounds-checked);
- :mod:`.qwen3_5_moe` — the decoder (gated attention, Gated DeltaNet, the layer scan, the MTP head, logits);
- :mod:`.layers`, :mod:`.moe`, :mod:`.gdn`, :mod:`.rope` — linear layers and norms, routing and experts, the chunked
  gated delta rule, (M-)RoPE;
- :mod:`.cache` — the generation cache (K/V rows, GDN conv and recurrent states) and its row operations;
- :mod:`.sharding` — where each variable and cache array lives on a device mesh.

The model sees arrays only: checkpoint names and formats belong to :mod:`qjax.checkpoint`, the matmuls to
:mod:`qjax.kernels`.
"""
