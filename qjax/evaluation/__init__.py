"""The evaluation room: numbers about a model.

- :mod:`.evaluate` — perplexity of text files and fidelity of a quantized model against its original;
- :mod:`.compare` — the per-block numerics diff against transformers;
- :mod:`.lm_eval_adapter` — ``--model qjax`` for lm-evaluation-harness.
"""
