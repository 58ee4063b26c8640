"""``qjax quantize`` on a folder streams the decoder one block at a time (qjax/autoround/stream.py) and writes its
export from the progress folder (qjax/autoround/export.py): the same bits as a run on the loaded model, in both
formats, after an interruption and ``--resume`` too, with the streams on the host or on the device; the whole model
is never loaded and each block is freed before the next is read."""

from __future__ import annotations

import gc
import glob
import json
import os
import weakref

import numpy as np
import pytest

import qjax
from qjax.autoround import stream
from qjax.autoround.api import format_dirs, progress_dir_for, quantize_folder
from qjax.autoround.data import calibration_ids, load_tokenizer
from qjax.autoround.driver import AutoRound, AutoRoundConfig
from qjax.autoround.export import save_streamed
from qjax.checkpoint import loading
from qjax.checkpoint.hub import default_model_dir
from qjax.checkpoint.safetensors_io import SafetensorsFile
from qjax.convert import save_pretrained
from qjax.convert.autoround_writer import save_autoround

# nsamples = chunk × batch_size: a host-stream run's gathered chunk has the whole stream's shape, so both runs use one
# compiled tuning step (the test pays one compile per block kind)
CFG = AutoRoundConfig(bits=4, group_size=64, iters=2, nsamples=4, seqlen=32, batch_size=2, chunk=2,
                      layer_config={".*experts.*": {"bits": 2, "group_size": 32}})
FORMATS = "llm_compressor,auto_round"


def _tensors(folder) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        f = SafetensorsFile(path)
        out.update({k: np.array(f.get(k)) for k in f.keys()})
        f.close()
    return out


def _same(got: str, ref: str) -> None:
    a, b = _tensors(got), _tensors(ref)
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
           or not np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8))]
    assert not bad, bad[:5]


def _ids(folder):
    return calibration_ids(os.path.join(folder, "calib.txt"), load_tokenizer(folder), nsamples=CFG.nsamples,
                           seqlen=CFG.seqlen, seed=CFG.seed, vocab_size=4096)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """Today's run on the loaded built-in model, written in both formats by the writers."""
    folder = default_model_dir()
    tmp = tmp_path_factory.mktemp("whole")
    model = qjax.load_model(folder, text_only=True)
    ar = AutoRound(model, _ids(folder), CFG, progress=False)
    ar.run()
    qmodel = ar.quantized_model()
    return {"llm_compressor": save_pretrained(qmodel, tmp / "ct", source=folder),
            "auto_round": save_autoround(qmodel, tmp / "ar", layer_config=CFG.layer_config, source=folder)}


class Interrupted(Exception):
    pass


@pytest.mark.slow
def test_streamed_run_is_bit_identical_and_never_holds_the_model(whole, tmp_path, monkeypatch):
    """The folder run takes the bounded-memory mode: no load_model, each decoder layer read once and dead before
    the next is read, the final norm / LM head never read, the embedding read once; its export (both formats, one
    tuning run) equals the whole-model run's, bit for bit. Then an interrupted run resumed gives the same again."""
    folder = default_model_dir()

    def refuse(*a, **k):
        raise AssertionError("the folder run loaded the whole model")

    monkeypatch.setattr(qjax, "load_model", refuse)
    monkeypatch.setattr(loading, "load_model", refuse)
    live, reads = [], []
    layer, module, embedding = loading.ModelParts.layer, loading.ModelParts.module, loading.ModelParts.embedding

    def counted_layer(self, i):
        gc.collect()
        assert all(r() is None for r in live), f"a layer was still alive when layer {i} was read"
        out = layer(self, i)
        live.append(weakref.ref(out))
        reads.append(i)
        return out

    def counted_module(self, name):
        reads.append(name)
        return module(self, name)

    def counted_embedding(self):
        reads.append("embedding")
        return embedding(self)

    monkeypatch.setattr(loading.ModelParts, "layer", counted_layer)
    monkeypatch.setattr(loading.ModelParts, "module", counted_module)
    monkeypatch.setattr(loading.ModelParts, "embedding", counted_embedding)
    plans = []
    out = tmp_path / "streamed"
    quantize_folder(folder, str(out), CFG, dataset=os.path.join(folder, "calib.txt"), fmt=FORMATS, progress=False,
                    on_plan=plans.append)
    assert reads == ["embedding", *range(8)]
    assert plans[0].where == stream.DEVICE and plans[0].peak > 0
    for fmt, d in format_dirs(str(out), FORMATS).items():
        _same(d, whole[fmt])
    ref_cfg = json.load(open(os.path.join(whole["llm_compressor"], "config.json")))
    assert json.load(open(os.path.join(out, "llm-compressor", "config.json"))) == ref_cfg

    # interrupted after block 3 is saved (its progress file is written before on_block), then --resume
    out2 = tmp_path / "resumed"

    def stop(report):
        if report.index == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        quantize_folder(folder, str(out2), CFG, dataset=os.path.join(folder, "calib.txt"), fmt=FORMATS,
                        progress=False, on_block=stop)
    assert json.load(open(os.path.join(progress_dir_for(str(out2)), "state.json")))["done"] == 3
    quantize_folder(folder, str(out2), CFG, dataset=os.path.join(folder, "calib.txt"), fmt=FORMATS, progress=False,
                    resume=True)
    for fmt, d in format_dirs(str(out2), FORMATS).items():
        _same(d, whole[fmt])
    assert not os.path.exists(progress_dir_for(str(out2)))


@pytest.mark.slow
def test_host_streams_give_the_device_streams_result(whole, tmp_path):
    """Streams kept on the host (minibatches moved per forward and per tuning chunk) give the same bits."""
    folder = default_model_dir()
    source = stream.FolderBlocks(folder)
    try:
        ar = AutoRound(source, _ids(folder), CFG, progress=False, progress_dir=str(tmp_path / "progress"),
                       streams=stream.HOST)
        ar.run()
        with pytest.raises(RuntimeError, match="never holds the quantized model"):
            ar.quantized_model()
        out = tmp_path / "host"
        save_streamed(ar, folder, {"llm_compressor": str(out)})
    finally:
        source.close()
    _same(out, whole["llm_compressor"])


def test_a_folder_run_needs_a_progress_folder(tmp_path):
    folder = default_model_dir()
    source = stream.FolderBlocks(folder)
    try:
        with pytest.raises(ValueError, match="keeps its finished blocks in progress_dir"):
            AutoRound(source, np.zeros((2, 8), np.int32), CFG, progress=False)
        with pytest.raises(AttributeError, match="read one at a time"):
            source.layers  # noqa: B018
    finally:
        source.close()


def test_compiles_are_trimmed_only_inside_the_run(monkeypatch):
    """stream.trim_after_compiles: the heap is trimmed after a compile while the run's listener is registered, and
    the listener is gone after it (jax's listeners are process-wide: a lingering one would trim in later runs)."""
    import jax
    import jax.numpy as jnp

    calls = []
    monkeypatch.setattr(stream, "trim_host_memory", lambda: calls.append(1))
    with stream.trim_after_compiles(min_seconds=0.0):
        # a program no other test compiles: the session's persistent cache would load it, not compile it
        jax.jit(lambda x: x * 3.25 + 1.5)(jnp.ones(13)).block_until_ready()
    inside = len(calls)
    jax.jit(lambda x: x * 5 - 2)(jnp.ones(7)).block_until_ready()
    assert inside >= 1 and len(calls) == inside
