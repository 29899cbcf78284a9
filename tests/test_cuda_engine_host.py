"""What the CUDA engines' hosts do before CUDA does anything, on every machine: the CUDA runtime
and CudaForward are replaced by fakes (as test_cli.py fakes cuda_runtime), so CudaEngine's
argument checks, and what the host-driven engine hands CudaForward and its sampler, are checked
where tests/test_cuda_engine.py (GPU only) skips."""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from blink.gpu_engine import engine_layout as el
from blink.gpu_engine.checkpoint import load_config
from blink.gpu_engine.reference_engine import EngineConfig
from blink.gpu_engine.sequence import SamplingParams

ENGINES = ("blink.gpu_engine.cuda_engine", "blink.gpu_engine.host_cuda_engine")


class PastTheChecks(Exception):
    """Raised by the first thing past the checks (the checkpoint's config read)."""


@pytest.fixture
def faked(monkeypatch):
    """cuda_engine and host_cuda_engine, imported over a fake cuda_runtime and cuda_forward
    (FakeForward records what it is given); both taken out of sys.modules afterwards."""
    cr = types.ModuleType("blink.gpu_engine.cuda_runtime")
    cr.CSRC = Path(__file__).resolve().parents[1] / "gpu_engine" / "csrc"
    cr.primary_context = lambda: None
    cr.dmabuf_unsupported_reason = lambda: None
    fwd = types.ModuleType("blink.gpu_engine.cuda_forward")

    class FakeForward:
        def __init__(self, cfg, weights, **kw):
            self.args, self.num_blocks, self.graph_execs = (cfg, weights, kw), 123, {1: 0}

    fwd.CudaForward = FakeForward
    monkeypatch.setitem(sys.modules, cr.__name__, cr)
    monkeypatch.setitem(sys.modules, fwd.__name__, fwd)
    package = sys.modules["blink.gpu_engine"]
    saved = {n: sys.modules.pop(n, None) for n in ENGINES}
    try:
        yield types.SimpleNamespace(cr=cr, **{n.rsplit(".", 1)[1]: importlib.import_module(n)
                                              for n in ENGINES})
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module
            if hasattr(package, name.rsplit(".", 1)[1]):
                delattr(package, name.rsplit(".", 1)[1])


def test_cuda_engine_checks_its_arguments_before_anything_loads(faked, monkeypatch, tmp_path):
    def past(model_dir):
        raise PastTheChecks
    monkeypatch.setattr(faked.cuda_engine, "load_config", past)
    engine = faked.cuda_engine.CudaEngine

    def config(**kw):
        return EngineConfig(tmp_path, "never-made", **kw)
    with pytest.raises(ValueError, match=f"at most {el.MAX_SLOTS} slots"):
        engine(config(num_slots=el.MAX_SLOTS + 1))
    with pytest.raises(PastTheChecks):
        engine(config(num_slots=el.MAX_SLOTS))
    with pytest.raises(ValueError, match="ring_memory is host or gpu, not 'disk'"):
        engine(config(), ring_memory="disk")
    for memory in ("host", "gpu"):
        with pytest.raises(PastTheChecks):
            engine(config(), ring_memory=memory)
    # a GPU-memory ring handed to an RDMA export needs dma-buf, asked before anything loads
    monkeypatch.setattr(faked.cr, "dmabuf_unsupported_reason", lambda: "no dma-buf here")
    with pytest.raises(ValueError, match="--ring-memory gpu: no dma-buf here"):
        engine(config(), ring_memory="gpu", ring_export=object())
    for memory, export in (("gpu", None), ("host", object())):  # no dma-buf asked for
        with pytest.raises(PastTheChecks):
            engine(config(), ring_memory=memory, ring_export=export)


def test_host_driven_engine_hands_the_forward_pass_its_config(faked, checkpoints):
    """held_sms 0 (the host launches the graphs: no scheduler CTA), the served context length
    and the KV cache's settings; the KV blocks it reports are CudaForward's."""
    host = faked.host_cuda_engine.HostDrivenCudaEngine
    engine = host.__new__(host)
    engine.config = EngineConfig(checkpoints["llama"], "never-made", load_format="dummy",
                                 num_kv_blocks=77, block_size=32, max_num_seqs=5,
                                 max_num_batched_tokens=96)
    engine.gpu_memory_utilization, engine.context_length = 0.5, 300
    cfg = load_config(checkpoints["llama"])
    assert engine._load_model(cfg) == 123
    got_cfg, weights, kw = engine.forward.args
    assert got_cfg is cfg and weights is None  # dummy: CudaForward makes them
    assert {k: kw[k] for k in ("held_sms", "max_model_len", "num_blocks", "block_size",
                               "max_num_seqs", "max_num_batched_tokens",
                               "gpu_memory_utilization")} == dict(
        held_sms=0, max_model_len=300, num_blocks=77, block_size=32, max_num_seqs=5,
        max_num_batched_tokens=96, gpu_memory_utilization=0.5)


def test_host_driven_engine_samples_as_the_reference_engine_does(faked):
    """Each logits row's sampling parameters, and its step: the tokens its sequence has
    output so far (reference_engine's sample_token(row, params, len(seq.output)))."""
    host = faked.host_cuda_engine.HostDrivenCudaEngine
    engine = host.__new__(host)
    calls = []

    class Forward:
        def run(self, batch, **kw):
            calls.append((batch, kw))
            return None, np.array([11, 22], np.int32)
    engine.forward = Forward()
    seqs = [types.SimpleNamespace(params=SamplingParams(8, temperature=0.7, top_p=0.9, top_k=5,
                                                        seed=42), output=[1, 2, 3]),
            types.SimpleNamespace(params=SamplingParams(8, seed=7), output=[])]
    got = engine._forward_sample("batch", seqs)
    assert got == [11, 22] and all(type(t) is int for t in got)
    assert calls == [("batch", dict(temperature=[0.7, 1.0], top_p=[0.9, 1.0], top_k=[5, 0],
                                    seed=[42, 7], step=[3, 0], sampled_only=True))]
