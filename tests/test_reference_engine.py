"""The CPU engine's start-up arithmetic (gpu_engine/reference_engine.py): the KV cache it sizes
and allocates, the host-memory check and the short-cache warning at their boundaries, and the
configuration it refuses."""
from __future__ import annotations

import logging
import secrets

import numpy as np
import pytest

from blink.gpu_engine import reference_engine
from blink.gpu_engine.engine_layout import KvCacheTooLarge
from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine, check_host_kv_cache


def engine(model_dir, **config) -> ReferenceEngine:
    return ReferenceEngine(EngineConfig(model_dir, f"blink-test-{secrets.token_hex(6)}",
                                        num_slots=2, **config))


def test_kv_cache_bytes_are_the_most_blocks_whose_float32_keys_and_values_fit(checkpoints):
    """--kv-cache-mb: the cache the engine allocates (its K and V arrays, float32) is the most
    whole blocks that fit the bytes asked, and the pool and the ring's limits hold as many."""
    e = engine(checkpoints["llama"], kv_cache_bytes=100_000)
    try:
        model = e.model
        total = model.k_cache.nbytes + model.v_cache.nbytes
        assert model.k_cache.dtype == model.v_cache.dtype == np.float32
        per_block = total // model.num_blocks
        assert total <= 100_000 < total + per_block
        assert e.pool.num_blocks == model.num_blocks
        assert e.limits.kv_capacity_tokens == model.num_blocks * 16
    finally:
        e.close()


def test_a_cache_of_exactly_one_context_is_not_warned_and_one_token_short_is(checkpoints,
                                                                               caplog):
    with caplog.at_level(logging.WARNING, logger="blink.engine"):
        for max_model_len in (64, 65):
            engine(checkpoints["llama"], num_kv_blocks=4, max_model_len=max_model_len).close()
    short = [r.getMessage() for r in caplog.records if "the KV cache holds" in r.getMessage()]
    assert short == ["the KV cache holds 64 tokens (4 blocks of 16), fewer than the context of "
                     "65: a request of more is refused (--num-kv-blocks, --kv-cache-mb, "
                     "--gpu-memory-utilization, --max-model-len)"]


def test_the_host_memory_check_takes_a_cache_that_fills_it_exactly(monkeypatch):
    monkeypatch.setattr(reference_engine, "host_memory_available", lambda: 10 * 4096)
    check_host_kv_cache(10, 4096)
    with pytest.raises(KvCacheTooLarge, match="11 KV blocks need 0 MiB of host memory; 0 MiB "
                                              "is available, room for 10 blocks"):
        check_host_kv_cache(11, 4096)
    monkeypatch.setattr(reference_engine, "host_memory_available", lambda: None)
    check_host_kv_cache(10 ** 12, 4096)  # unknown: not refused


@pytest.mark.parametrize("field", ["num_slots", "block_size", "num_kv_blocks"])
def test_engine_config_takes_one_and_refuses_zero(field):
    assert getattr(EngineConfig("m", "ring", **{field: 1}), field) == 1
    with pytest.raises(ValueError, match=f"{field} must be >= 1|{field} .*must be >= 1"):
        EngineConfig("m", "ring", **{field: 0})


def test_the_kv_calibration_prefill_is_one_step_of_the_engine_s_budget(checkpoints):
    """--kv-cache-dtype fp8 with no scales in the checkpoint: the engine calibrates on
    fp8.calibration_count(max_num_batched_tokens, context, cache) tokens, the prompt a CUDA
    engine configured alike calibrates on: 32 here, not 512."""
    from blink.gpu_engine import fp8
    from blink.gpu_engine.checkpoint import load_config, load_weights
    from blink.gpu_engine.reference_model import ReferenceModel
    path = checkpoints["llama"]
    e = engine(path, kv_cache_dtype="fp8", max_num_batched_tokens=32, num_kv_blocks=64)
    try:
        scales = e.model.kv_scales
    finally:
        e.close()
    cfg = load_config(path)
    model = ReferenceModel(cfg, load_weights(path, cfg), 64, 16)
    want = model.calibrate_kv_scales(fp8.calibration_tokens(cfg.vocab_size, 32))
    np.testing.assert_array_equal(scales, want)
    longer = model.calibrate_kv_scales(fp8.calibration_tokens(cfg.vocab_size, 512))
    assert not np.array_equal(longer, want)
