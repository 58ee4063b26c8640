"""llm-compressor's AWQ and GPTQ on a tiny random ``qwen3_5_moe``, recorded: runs in llm-compressor's own venv.

Started by ``benchmarks/llmc_oracle.py`` (which builds that venv); never imports qjax (llm-compressor pins
transformers ≤ 5.17 and auto-round ≤ 0.15, qjax's venv has newer ones). Writes into ``argv[1]``:

* ``model.safetensors`` + ``config.json``: the float32 source model (text only, per-expert keys, transformers names);
* ``calib.json``: the calibration token ids;
* per run ``<run>.safetensors`` + ``<run>.json``: what the algorithm saw and chose, tensor keys indexed by the JSON.

AWQ runs record, per mapping and in the order llm-compressor smooths them: the parent's cached input
(``hidden_states``), the unquantized parent output, the balance weights as the grid search starts, the per-grid-point
losses, the chosen scales, and the smooth layer's weight after smoothing; then every packed weight / scale / zero point
of the compressed checkpoint and the final norms. GPTQ runs record every ``quantize_weight`` call: weight, normalised
Hessian, observer scale / zero point, the quantized weight; plus the raw inputs of a few modules' Hessian hooks.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}
SEED = 0
NUM_SAMPLES, SEQ_LEN = 4, 16
NORM_NOISE_STD = 0.3  # as tests/oracles/hf.py: a (1 + w) vs w mistake must show

IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$"]
W8G32 = dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=32)
W4G32_ASYM = dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32)
W4G32 = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
W4_CHANNEL_ASYM = dict(num_bits=4, type="int", symmetric=False, strategy="channel")
# run name → (algorithm, weight args, modifier options, moe_calibrate_all_experts)
RUNS = {
    "awq_w8g32": ("awq", W8G32, {}, True),  # seed 002's scheme, llm-compressor's defaults
    "awq_w4g32_asym": ("awq", W4G32_ASYM, {}, True),
    "awq_w4g32_both": ("awq", W4G32, {"duo_scaling": "both", "n_grid": 10}, True),  # its checkpoint not kept
    "gptq_w4g32_static": ("gptq", W4G32, {"block_size": 16}, False),  # actorder default: static
    "gptq_w4g32_noact": ("gptq", W4G32, {"block_size": 16, "actorder": None}, False),
    "gptq_w4ch_asym_weight": ("gptq", W4_CHANNEL_ASYM, {"block_size": 32, "actorder": "weight"}, False),
    "gptq_w8g32_all": ("gptq", W8G32, {}, True),
}
# modules whose Hessian-hook inputs are recorded (the rest only through their Hessians)
# GPTQ calls recorded (each module is quantized alone: batched_quantization needs CUDA to batch): enough to cover
# every shape and input kind while keeping the fixtures small
GPTQ_KEEP = ("model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_b",
             "model.layers.0.linear_attn.out_proj", "model.layers.0.mlp.experts.1.gate_proj",
             "model.layers.0.mlp.experts.2.down_proj", "model.layers.1.self_attn.q_proj",
             "model.layers.1.mlp.shared_expert.down_proj", "model.layers.1.mlp.experts.3.up_proj")
HOOK_INPUTS = ("model.layers.0.mlp.experts.1.gate_proj", "model.layers.1.self_attn.q_proj",
               "model.layers.0.mlp.shared_expert.down_proj")


def timed_oneshot(model, recipe, ids, calib_all: bool) -> float:
    """llm-compressor's ``oneshot`` of ``recipe`` on the calibration ids (sequential pipeline); its seconds."""
    from llmcompressor import oneshot

    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tokenizer(), dataset=dataset(ids), recipe=recipe, num_calibration_samples=len(ids),
            max_seq_length=SEQ_LEN, moe_calibrate_all_experts=calib_all, pipeline="sequential")
    return time.perf_counter() - t0


def make_model(folder: str | None = None):
    """The seeded float32 model; ``folder``: where its config was saved (oneshot re-reads the config from
    ``config.name_or_path`` to refuse already-quantized models). Its randomisation follows tests/oracles/hf.py's
    ``make_hf_model`` (norm offsets, dt_bias, A_log), restated here because that module imports qjax and this worker
    runs in llm-compressor's own venv, without it."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(**CONFIG)
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Qwen3_5MoeForCausalLM(cfg)
    gen = torch.Generator().manual_seed(SEED + 7919)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or leaf == "dt_bias":
                noise = torch.randn(p.shape, generator=gen)
                p.add_((noise - noise.mean()) / noise.std() * NORM_NOISE_STD)
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.01, 16, generator=gen).log())
    if folder is not None:
        model.config.name_or_path = folder
    return model.float().eval()


def calibration_ids() -> list[list[int]]:
    rng = np.random.default_rng(SEED + 1)
    return rng.integers(3, CONFIG["vocab_size"], size=(NUM_SAMPLES, SEQ_LEN)).tolist()


def dataset(ids):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]})


def tokenizer():
    """A word-level tokenizer over the vocabulary: oneshot wants a processor even for a pre-tokenized dataset."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(CONFIG["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


def saved_checkpoint(model, folder: str) -> dict[str, torch.Tensor]:
    """``model`` written compressed to ``folder`` by llm-compressor, then read back: every tensor of its files."""
    model.save_pretrained(folder, save_compressed=True)
    saved = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(folder, f)))
    return saved


def np32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).cpu().contiguous().clone()


def run_awq(name, wargs, opts, calib_all, src, ids, out):
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    model = make_model(src)
    tensors: dict[str, torch.Tensor] = {}
    mappings: list[dict] = []
    orig_best = AWQModifier._compute_best_scale
    orig_loss = AWQModifier._compute_loss
    losses: list[float] = []

    def compute_loss(self, fp16_outputs, int_w_outputs):
        v = orig_loss(self, fp16_outputs, int_w_outputs)
        losses.append(v)
        return v

    def compute_best_scale(self, mapping, fp16_outputs, orig_layer_weights):
        losses.clear()
        x_sum, count = self._smooth_activation_stats[mapping.smooth_name]
        cache = self._parent_args_cache[mapping.parent]
        batches = [b for b in cache]
        i = len(mappings)
        rec = {"smooth": mapping.smooth_name, "balance": list(mapping.balance_names), "parent": mapping.parent_name,
               "count": int(count), "grid": [list(g) for g in self._get_grid_search_params()]}
        tensors[f"m{i}.x_sum"] = np32(x_sum)
        # the parent's first argument (hidden_states of a mixer / the MoE block, input of a Linear)
        firsts = [next(v for v in b.values() if isinstance(v, torch.Tensor)) for b in batches]
        rec["parent_arg"] = next(k for k, v in batches[0].items() if isinstance(v, torch.Tensor))
        tensors[f"m{i}.hidden_states"] = torch.cat([np32(x).reshape(-1, x.shape[-1]) for x in firsts])
        tensors[f"m{i}.fp_out"] = torch.cat([np32(o).reshape(-1, o.shape[-1]) for o in fp16_outputs])
        for j, layer in enumerate(mapping.balance_layers):
            tensors[f"m{i}.balance{j}"] = np32(orig_layer_weights[layer])
        tensors[f"m{i}.smooth_before"] = np32(mapping.smooth_layer.weight)
        best = orig_best(self, mapping, fp16_outputs, orig_layer_weights)
        rec["losses"] = list(losses)
        # kept in their own dtype: with duo scaling llm-compressor's weight means are float64 (get_high_precision),
        # so are the scales, and W * s is computed in float64 before the float32 parameter stores it
        tensors[f"m{i}.scales"] = best.detach().cpu().contiguous().clone()
        mappings.append(rec)
        return best

    AWQModifier._compute_best_scale = compute_best_scale
    AWQModifier._compute_loss = compute_loss
    try:
        recipe = [AWQModifier(**opts),
                  QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": wargs}},
                                       ignore=IGNORE)]
        seconds = timed_oneshot(model, recipe, ids, calib_all)
    finally:
        AWQModifier._compute_best_scale = orig_best
        AWQModifier._compute_loss = orig_loss
    # the smooth layers' weights after smoothing, in the model's own (1 + w) convention
    named = dict(model.named_modules())
    for i, rec in enumerate(mappings):
        tensors[f"m{i}.smooth_after"] = np32(named[rec["smooth"]].weight)
    folder = os.path.join(out, f"_{name}_ckpt")
    saved = saved_checkpoint(model, folder)
    for k, v in saved.items():
        if name != "awq_w4g32_both" and k.startswith("model.layers.") and ("weight_" in k or k.endswith("norm.weight")
                                               or k.endswith("mlp.gate.weight") or k.endswith("shared_expert_gate.weight")):
            tensors["ckpt." + k] = v.contiguous().clone()
    qc = json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    return tensors, {"algorithm": "awq", "weights": wargs, "options": opts, "moe_calibrate_all_experts": calib_all,
                     "mappings": mappings, "seconds": seconds, "quantization_config": qc}


def run_gptq(name, wargs, opts, calib_all, src, ids, out):
    import llmcompressor.modifiers.gptq.base as gptq_base
    import llmcompressor.modifiers.gptq.helpers as gptq_helpers
    from llmcompressor.modifiers.gptq import GPTQModifier

    model = make_model(src)
    names: dict = {}  # module → name, filled after oneshot has linearized the experts (new Linear modules)

    def name_of(m):
        if m not in names:
            names.update({mod: n for n, mod in model.named_modules()})
        return names[m]

    tensors: dict[str, torch.Tensor] = {}
    calls: list[dict] = []
    hook_inputs: dict[str, list[torch.Tensor]] = {}
    orig_quantize = gptq_base.quantize_weight
    orig_accumulate = gptq_base.accumulate_hessian
    orig_prepare = gptq_base.prepare_batch
    pending: dict = {}

    def accumulate(inp, module, hessian, num_samples):
        n = name_of(module)
        if n in HOOK_INPUTS:
            hook_inputs.setdefault(n, []).append(np32(inp).reshape(-1, inp.shape[-1]))
        return orig_accumulate(inp, module, hessian, num_samples)

    def prepare(batch, batch_qparams, hessians, num_samples):
        pending["names"] = [name_of(m) for m in batch]
        pending["num_samples"] = [float(num_samples[m]) for m in batch]
        return orig_prepare(batch, batch_qparams, hessians, num_samples)

    def quantize(weights, hessians, scale, zero_point, global_scale, quant_args, blocksize=128, percdamp=0.01):
        if not set(pending["names"]) & set(GPTQ_KEEP):
            return orig_quantize(weights, hessians, scale, zero_point, global_scale, quant_args, blocksize, percdamp)
        i = len(calls)
        tensors[f"c{i}.weight"] = np32(weights)
        tensors[f"c{i}.hessian"] = np32(hessians)
        tensors[f"c{i}.scale"] = np32(scale)
        tensors[f"c{i}.zero_point"] = np32(zero_point)
        q, loss, fallback = orig_quantize(weights.clone(), hessians.clone(), scale, zero_point, global_scale,
                                          quant_args, blocksize, percdamp)
        tensors[f"c{i}.quantized"] = np32(q)
        calls.append({"names": list(pending["names"]), "num_samples": list(pending["num_samples"]),
                      "blocksize": blocksize, "percdamp": percdamp, "actorder": str(quant_args.actorder),
                      "loss": loss.tolist(), "rtn_fallback": fallback.tolist()})
        return q, loss, fallback

    gptq_base.quantize_weight = quantize
    gptq_base.accumulate_hessian = accumulate
    gptq_base.prepare_batch = prepare
    try:
        recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": wargs}}, ignore=IGNORE,
                              **opts)
        seconds = timed_oneshot(model, recipe, ids, calib_all)
    finally:
        gptq_base.quantize_weight = orig_quantize
        gptq_base.accumulate_hessian = orig_accumulate
        gptq_base.prepare_batch = orig_prepare
    for n, xs in hook_inputs.items():
        tensors[f"inputs.{n}"] = torch.cat(xs)
    # llm-compressor's behaviour for an expert that no token reaches: its hook still fires, with a [0, in] input
    # (LinearExperts2D runs every expert on its token slice); what GPTQ then makes of that Hessian
    lin = torch.nn.Linear(64, 32, bias=False)
    torch.manual_seed(SEED + 3)
    w = torch.randn(1, 32, 64) * 0.1
    h = gptq_helpers.make_empty_hessian(lin)
    h, count = gptq_helpers.accumulate_hessian(torch.zeros(0, 64), lin, h, torch.zeros(()))
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    qa = QuantizationArgs(**wargs)
    mn, mx = torch.aminmax(w.reshape(1, 32, -1, qa.group_size or 64), dim=-1)
    s, zp = calculate_qparams(mn[0], mx[0], qa)
    q, _, fb = orig_quantize(w.clone(), (h / count)[None], s[None], zp[None], None, qa, 128, 0.01)
    tensors["empty.weight"], tensors["empty.hessian"], tensors["empty.quantized"] = w, (h / count)[None], np32(q)
    return tensors, {"algorithm": "gptq", "weights": wargs, "options": {k: (None if v is None else v)
                                                                         for k, v in opts.items()},
                     "moe_calibrate_all_experts": calib_all, "calls": calls, "seconds": seconds,
                     "empty_expert": {"count": float(count), "rtn_fallback": fb.tolist()}}


def main():
    from llmcompressor.pipelines.cache import IntermediatesCache

    # AWQ pins its cached activations for faster host-to-device copies; with no accelerator torch refuses to pin
    # ("Cannot access accelerator device"). Pinning moves no value, so on this CPU-only oracle it is skipped.
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    out = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else list(RUNS)
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = make_model()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out, "model.safetensors"))
    src = os.path.join(out, "_source")
    model.save_pretrained(src)
    json.dump(model.config.to_dict(), open(os.path.join(out, "config.json"), "w"), indent=1, default=str)
    ids = calibration_ids()
    json.dump({"input_ids": ids}, open(os.path.join(out, "calib.json"), "w"))
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")}
    for name in only:
        algo, wargs, opts, calib_all = RUNS[name]
        fn = run_awq if algo == "awq" else run_gptq
        tensors, meta = fn(name, wargs, opts, calib_all, src, ids, out)
        meta["versions"] = versions
        save_file(tensors, os.path.join(out, f"{name}.safetensors"))
        json.dump(meta, open(os.path.join(out, f"{name}.json"), "w"), indent=1, default=str)
        print(f"[worker] {name}: {meta['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
