"""The checkpoint room: Hugging Face folders in, model variables out (file → reader → loader → packed arrays).

- :mod:`.safetensors_io` — a strict safetensors reader (headers, shards, the index) confined to its folder;
- :mod:`.loading` — ``load_model``: tensor names → model variables, the value checks, ``qjax inspect``'s checks;
- :mod:`.quant_plan` — which layers are packed and how (a ``QuantMeta`` per linear) from ``quantization_config``;
- :mod:`.auto_round` — auto-round's own ``auto_round`` / GPTQ / AWQ packings read as compressed-tensors tensors;
- :mod:`.dense_mtp` — a checkpoint whose recipe quantized the MTP head, read with the dense head qjax holds;
- :mod:`.source` — what an export copies from the checkpoint it was made from (MTP head, vision tower);
- :mod:`.hub` — where a folder comes from (a path or the local Hugging Face cache; never a download).
"""
