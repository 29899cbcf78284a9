"""An engine without a model, for measuring the front end alone (`--engine synthetic`).

It serves the ring with the reference engine's loop and scheduler (admission, batching, KV-block
bookkeeping, stops, cancels), but a step's "forward pass" only waits `step_ms` and returns a
token per sequence: ordinary ids from the middle of the vocabulary (never EOS), a function of
the sequence and its position. The front end then streams as fast as it can take tokens from
the ring, so `blink bench --systems synthetic` gives the front end's capacity and its CPU per
streamed token with no model in the way.
"""
from __future__ import annotations

import time

from dataclasses import dataclass

from blink.gpu_engine.checkpoint import ModelConfig
from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine
from blink.gpu_engine.scheduler import StepPlan
from blink.gpu_engine.sequence import Sequence
from blink.gpu_engine.step_core import plan_samplers
from blink.ring.layout import EngineKind


@dataclass
class StepTokens:
    """What is left of a ForwardBatch where no model reads it: its token count (the step
    counters)."""
    num_tokens: int


class SyntheticEngine(ReferenceEngine):
    engine_kind = EngineKind.SYNTHETIC

    def __init__(self, config: EngineConfig, *, step_ms: float = 0.0):
        self.step_s = step_ms / 1e3
        super().__init__(config)

    def _load_model(self, cfg: ModelConfig) -> int:
        self.vocab = cfg.vocab_size
        self.avoid = set(cfg.eos_token_ids)
        self.lo, self.span = self.vocab // 4, self.vocab // 2  # its tokens: the middle half
        if all(t in self.avoid for t in range(self.lo, self.lo + self.span)):
            raise ValueError(f"a vocabulary of {self.vocab} has no id in its middle half that "
                             "is not EOS: the synthetic engine has no token to send")
        # KV blocks only bound admission here: room for every slot's whole context
        return self.config.num_kv_blocks or (
            self.config.num_slots * -(-self.context_length // self.config.block_size))

    def _build_batch(self, plan: StepPlan) -> tuple[StepTokens, list[Sequence]]:
        # no token, position or block-table arrays: nothing computes on them (they were a
        # quarter of this engine's time a step, which sets the pace of a front-end benchmark)
        return StepTokens(plan.num_tokens), plan_samplers(plan)

    def _forward_sample(self, batch: StepTokens, samplers: list[Sequence]) -> list[int]:
        if self.step_s:
            time.sleep(self.step_s)
        lo, span = self.lo, self.span
        out = []
        for seq in samplers:
            token = lo + (seq.slot * 7919 + len(seq.output) * 104729) % span
            while token in self.avoid:  # the next id that is none (EOS ids may sit side by side)
                token = lo + (token + 1 - lo) % span
            out.append(token)
        return out
