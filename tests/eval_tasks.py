"""Local lm-eval tasks built from the built-in model's held-out Austen text (shared by the lm-eval adapter's and the
server's tests): multiple choice, rolling perplexity and generation, every request ≤ 64 tokens."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from qjax.checkpoint.hub import default_model_dir


def austen_tasks(root: Path) -> dict[str, object]:
    """Three local tasks from the packaged heldout.txt, every request ≤ 64 tokens so that the run compiles one
    scoring program; returns what the checks need."""
    from tokenizers import Tokenizer

    root.mkdir(parents=True)
    tk = Tokenizer.from_file(os.path.join(default_model_dir(), "tokenizer.json"))
    text = (Path(default_model_dir()) / "heldout.txt").read_text(encoding="utf-8")
    rng = random.Random(0)
    mc, docs = [], []
    for sent in re.split(r"(?<=[.!?])\s+", text):
        w = sent.split()
        if 25 <= len(w) <= 40 and len(tk.encode(sent).ids) <= 60 and len(docs) < 8:
            docs.append(sent)
        if len(w) < 18 or len(mc) == 16:
            continue
        true = w[12:18]
        wrong: list[list[str]] = []
        while len(wrong) < 2:
            s = true[:]
            rng.shuffle(s)
            if s != true and s not in wrong:
                wrong.append(s)
        choices = [" ".join(c) for c in [true] + wrong]
        order = rng.sample(range(3), 3)
        mc.append({"context": " ".join(w[:12]), "choices": [choices[i] for i in order], "label": order.index(0)})
    gen = [{"context": d["context"], "target": " " + d["choices"][d["label"]]} for d in mc[:4]]
    ppl = [{"text": d} for d in docs]

    def write(name: str, rows: list[dict], body: str) -> None:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}metadata:\n  version: 1.0\n", encoding="utf-8")

    write("qjax_austen_mc", mc, 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\n'
          'doc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n')
    write("qjax_austen_ppl", ppl, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
          'metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n')
    write("qjax_austen_gen", gen, 'output_type: generate_until\ndoc_to_text: "{{context}}"\n'
          'doc_to_target: "{{target}}"\ngeneration_kwargs:\n  until: [".", "\\n"]\n  do_sample: false\n'
          '  max_gen_toks: 12\nmetric_list:\n  - metric: exact_match\n')
    return {"docs": docs, "tokenizer": tk}
