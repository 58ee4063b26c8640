"""The runtime room: running a loaded model.

- :mod:`.generate` — cached generation (``generate``, ``stream``, ``extend``) and ``GenerationConfig``;
- :mod:`.sampling` — per-row sampling on the device (greedy, temperature, top-k, top-p, seeds);
- :mod:`.bench` and :mod:`.random_model` — prefill/decode timing of random-weight models of any config and recipe.

The continuous-batching engine and the HTTP server are :mod:`qjax.serving`.
"""
