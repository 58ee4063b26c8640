"""The research room: instruments that look inside a forward pass of a float or packed quantized model.

- :mod:`.capture` — named sites (:data:`qjax.model.probe.SITES`) returned stacked over layers ``[L, B, T, …]``;
- :mod:`.patch` — replace, shift or edit sites (values + masks, deltas, JAX functions): block swaps between two
  models, expert ablations, gradients with respect to intermediates;
- :mod:`.routing` — routing of two models on the same tokens, layer by layer (``qjax compare --routing``);
- :mod:`.damage` — each block's share of a quantized model's divergence from its source, measured by patching, and
  the ``--layer_config`` it suggests; the logit lens.

Everything runs through the model's own forward (``forward(probe=…)``): one jitted program per (model structure,
probe), no host callback inside it; the plain forward is untouched when nothing is probed.
"""
