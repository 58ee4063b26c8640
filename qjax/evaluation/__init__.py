"""The evaluation room: numbers about a model.

- :mod:`.evaluate` — perplexity of text files and fidelity of a quantized model against its original;
- :mod:`.compare` — the per-block numerics diff against transformers;
- :mod:`.lm_eval_adapter` — ``--model qjax`` for lm-evaluation-harness.
"""

# how `qjax eval ppl` scores a text, stated once (PerplexityReport carries it; the command's --help quotes it without
# importing JAX)
PERPLEXITY_METHOD = ("non-overlapping windows of seqlen inputs: every token but the first of the text is scored once, "
                     "from its own window's context only; the tail shorter than a window is not scored")
