"""Hugging Face transformers behind Blink's ring: the benchmark's peer for what many users serve
with today (`model.generate`), measured through the same front end and client as Blink.

Static batching, as `generate` works: when the model is idle, up to max_num_seqs waiting
requests with the same sampling settings (FCFS from the oldest) form one batch, their prompts
left-padded, and `generate` runs it to the end; requests that arrive meanwhile wait for the next
batch. With static_cache (`--hf-static-cache`), transformers' fast path for batch-1 latency: one
request at a time through one StaticCache sized for the served context, reused (reset) for every
request; on a GPU, `generate` then compiles the decoding step itself (torch.compile, mode
reduce-overhead: CUDA graphs). Start-up runs two short requests through it, so the compile
happens before the engine serves. A stopping criterion, which transformers calls after every decoding step, publishes each
row's new token to the ring (the client streams as with the other engines), applies Blink's stop
rules (eos_finish: the model's own EOS handling is switched off), honours cancels, admits new
requests to the queue and beats the heartbeat. Sampled batches draw from torch's generator
seeded with the first request's seed (generate takes no per-row seeds).

torch and transformers are the test extra's (CPU build) or the GPU machine's; bf16 on CUDA,
fp32 on the CPU. `--load-format dummy` builds the model from its config with random weights on
the device, for benchmarks of real shapes without the weight files.
"""
from __future__ import annotations

import logging
import time

from blink.gpu_engine.checkpoint import ModelConfig
from blink.gpu_engine.reference_engine import EngineConfig, ReferenceEngine
from blink.gpu_engine.sequence import Sequence
from blink.ring.layout import EngineKind, FinishReason

log = logging.getLogger("blink.engine")


class HfTransformersEngine(ReferenceEngine):
    engine_kind = EngineKind.HF_TRANSFORMERS

    def __init__(self, config: EngineConfig, static_cache: bool = False):
        self.waiting: list[Sequence] = []
        self.running: dict[int, Sequence] = {}  # slot -> sequence of the batch in generate
        self.static_cache = static_cache
        self.cache = None  # the StaticCache, with static_cache
        super().__init__(config)

    def _load_model(self, cfg: ModelConfig) -> int:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
        self.torch = torch
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        t0 = time.monotonic()
        path = str(self.config.model_dir)
        if self.config.load_format == "dummy":
            with self.device:
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                         dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device)
        model.eval()
        # The request's settings alone: generate takes the checkpoint's generation_config.json
        # as its defaults, and applied what it sets beside them to every request (Qwen2.5's
        # instruct models ship repetition_penalty 1.05: greedy tokens were not the argmax);
        # no EOS either, eos_finish decides, per request
        model.generation_config = GenerationConfig(eos_token_id=None)
        self.model = model
        if self.static_cache:
            from transformers import StaticCache
            self.cache = StaticCache(config=model.config, max_cache_len=self.context_length)
            for _ in range(2):  # compile, then capture (reduce-overhead): before serving
                self._run_generate(torch.ones((1, 8), dtype=torch.long), None, 4, {})
        log.info("transformers engine: %s on %s (%s%s) ready in %.1f s", cfg.name, self.device,
                 dtype, ", static cache" if self.static_cache else "", time.monotonic() - t0)
        # No paged KV cache (each batch's cache lives inside generate): room for one
        # whole-context request is what admission checks.
        return -(-self.context_length // self.config.block_size)

    def _queue(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _drop(self, seq: Sequence) -> None:
        # by identity: Sequence compares by value (its prompt and output lists), per step
        self.waiting = [s for s in self.waiting if s is not seq]
        if self.running.get(seq.slot) is seq:
            del self.running[seq.slot]

    def _queue_stats(self) -> dict[str, int]:
        return dict(kv_blocks_total=0, kv_blocks_free=0, kv_block_size=0,
                    sequences_running=len(self.running), sequences_waiting=len(self.waiting))

    def step(self) -> bool:
        self._admit()
        if not self.waiting:
            self._publish_stats()
            return False
        first = self.waiting[0].params
        key = (first.temperature, first.top_p, first.top_k)
        batch = [s for s in self.waiting
                 if (s.params.temperature, s.params.top_p, s.params.top_k) == key]
        batch = batch[:1 if self.static_cache else self.config.max_num_seqs]
        taken = {id(seq) for seq in batch}
        self.waiting = [s for s in self.waiting if id(s) not in taken]
        self.running = {seq.slot: seq for seq in batch}  # shrinks as sequences retire
        started = time.perf_counter_ns()
        self._generate(batch)
        self.counters["busy_ns"] += time.perf_counter_ns() - started
        self.running = {}
        self._publish_stats()
        return True

    def _generate(self, batch: list[Sequence]) -> None:
        torch = self.torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        width = max(len(seq.prompt) for seq in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):  # left padding: every row's last token at the end
            ids[row, width - len(seq.prompt):] = torch.tensor(seq.prompt, dtype=torch.long)
            mask[row, width - len(seq.prompt):] = 1
        max_new = max(min(seq.params.max_tokens, self.context_length - len(seq.prompt))
                      for seq in batch)
        params = batch[0].params
        # Greedy also where logits / temperature may overflow float32 (a temperature of 1e-40
        # passes the ring's checks; generate's softmax of inf was NaN and its draw raised,
        # stopping the engine): below 1e-30 the distribution is the argmax, as Blink samples it
        sample = params.temperature > 1e-30
        options = dict(min_new_tokens=0, do_sample=sample)
        if sample:
            options.update(temperature=params.temperature, top_p=params.top_p,
                           top_k=params.top_k)  # 0: off, as in Blink
            torch.manual_seed(params.seed)
        engine, done = self, [False] * len(batch)

        class Publish(StoppingCriteria):
            """After each decoding step: every live row's new token to the ring."""

            def __call__(self, input_ids, scores, **kwargs):
                tokens = input_ids[:, -1].tolist()
                engine.counters["engine_steps"] += 1
                engine.counters["step_tokens"] += len(batch) - sum(done)
                for row, seq in enumerate(batch):
                    if not done[row]:
                        done[row] = engine._emit(seq, tokens[row])
                engine._admit()  # heartbeat; new requests queue for the next batch; cancels
                for row, seq in enumerate(batch):
                    done[row] = done[row] or engine.running.get(seq.slot) is not seq
                engine._publish_stats()
                return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

        self._run_generate(ids, mask, max_new, dict(
            stopping_criteria=StoppingCriteriaList([Publish()]), **options))
        for row, seq in enumerate(batch):  # generate ran out of steps before our stop rules
            if not done[row] and self.running.get(seq.slot) is seq:
                self._retire(seq, FinishReason.LENGTH, 0)

    def _run_generate(self, ids, mask, max_new: int, options: dict) -> None:
        """model.generate on ids [rows, width] (mask: their attention mask, None: all ones),
        through the static cache when there is one."""
        torch = self.torch
        if mask is None:
            mask = torch.ones_like(ids)
        with torch.inference_mode():  # the cache's tensors are inference tensors
            if self.cache is not None:
                self.cache.reset()
                options = dict(options, past_key_values=self.cache)
            self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                max_new_tokens=max_new, pad_token_id=0, eos_token_id=None,
                                **options)
