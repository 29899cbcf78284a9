"""Scheduling logic (admission, token budget, chunked prefill, block allocation, preemption)
and sampling, as plain functions over plain state — the decisions the GPU kernel must repeat."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from test_scheduler_parity import PyReplay, adversarial_workload

from blink.gpu_engine.block_manager import KvBlockPool, blocks_for
from blink.gpu_engine.step_core import eos_finish
from blink.gpu_engine.sampling import sample_token, uniform
from blink.gpu_engine.scheduler import Scheduler, SchedulerConfig
from blink.gpu_engine.sequence import SamplingParams, SeqStatus, Sequence
from blink.ring.layout import FinishReason


def seq(i: int, prompt_len: int, max_tokens: int = 8, **kw) -> Sequence:
    return Sequence(slot=i, gen=1, arrival=i, prompt=list(range(1, prompt_len + 1)),
                    params=SamplingParams(max_tokens=max_tokens, **kw))


def run_step(sched: Scheduler, token: int = 7):
    """Applies a plan as the engine does: computed tokens advance, samplers append a token."""
    plan = sched.schedule_step()
    for s, n in plan.scheduled:
        s.num_computed += n
        if s.num_computed == s.num_tokens:
            s.output.append(token)
    return plan


def check_invariants(sched: Scheduler) -> None:
    owned = [b for s in sched.running for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is in two block tables"
    assert len(owned) + sched.pool.num_free == sched.pool.num_blocks, "blocks leaked"
    for s in sched.running:
        assert len(s.block_table) >= blocks_for(s.num_computed, sched.pool.block_size)
    for s in sched.waiting:
        assert len(s.block_table) == 0 and s.num_computed == 0 and s.status is SeqStatus.WAITING


def test_token_budget_and_chunked_prefill():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10),
                      KvBlockPool(64, 4))
    long, short = seq(0, 23), seq(1, 3)
    sched.add(long)
    sched.add(short)
    plan = run_step(sched)
    assert [(s.slot, n) for s, n in plan.scheduled] == [(0, 10)]  # FCFS, whole budget
    plan = run_step(sched)
    assert [(s.slot, n) for s, n in plan.scheduled] == [(0, 10)]
    plan = run_step(sched)  # the prompt's last 3 tokens, then the short one joins
    assert [(s.slot, n) for s, n in plan.scheduled] == [(0, 3), (1, 3)]
    assert long.output == [7] and short.output == [7]
    plan = run_step(sched)  # both decode: one token each
    assert [(s.slot, n) for s, n in plan.scheduled] == [(0, 1), (1, 1)]
    check_invariants(sched)


def test_max_num_seqs_limits_admission():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100),
                      KvBlockPool(64, 4))
    for i in range(4):
        sched.add(seq(i, 2))
    plan = run_step(sched)
    assert [s.slot for s, _ in plan.scheduled] == [0, 1]
    sched.finish(sched.running[0])
    plan = run_step(sched)
    assert [s.slot for s, _ in plan.scheduled] == [1, 2]
    check_invariants(sched)


def test_preemption_evicts_newest_and_recomputes():
    # 6 blocks of 4 tokens: two 12-token prompts fill them; the first decode needs a 7th.
    pool = KvBlockPool(6, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), pool)
    a, b = seq(0, 12, max_tokens=20), seq(1, 12, max_tokens=20)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert pool.num_free == 0 and a.num_computed == 12 and b.num_computed == 12
    run_step(sched)  # a needs a 4th block for position 12: b (newest) is evicted
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and b.preemptions == 1
    assert list(sched.waiting) == [b] and b.output == [7]
    check_invariants(sched)
    # run a to completion; b is readmitted and recomputes prompt + its output
    while a.status is not SeqStatus.FINISHED:
        run_step(sched)
        if len(a.output) >= 10:
            sched.finish(a)
    plan = run_step(sched)
    assert [(s.slot, n) for s, n in plan.scheduled] == [(1, 13)]
    check_invariants(sched)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_a_long_prompt_waits_for_room_rather_than_thrash(prefix_caching):
    """A long prompt that fits the KV cache alone but not beside the running decodes waits in
    the queue until all of it fits. Admitted on its first chunk's room, it prefilled a few
    chunks, could not grow, preempted itself (the newest) and was admitted again, over and
    over: with no prefix cache its 600-token prefill was computed many times over."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
                      KvBlockPool(64, 16, prefix_caching))  # 1,024 tokens of KV
    decodes = [seq(i, 160, max_tokens=60, ignore_eos=True) for i in range(4)]
    for d in decodes:
        sched.add(d)
    for _ in range(6):  # prefilled (640 tokens), decoding
        run_step(sched)
    long = seq(9, 600, max_tokens=16, ignore_eos=True)  # 600 + 16 fits the 1,024 alone
    sched.add(long)
    computed = 0
    for _ in range(400):
        for d in decodes:  # a decode that has its tokens leaves
            if d.status is SeqStatus.RUNNING and len(d.output) >= d.params.max_tokens:
                sched.running.remove(d)
                sched.pool.release(d)
                d.status = SeqStatus.FINISHED
        plan = run_step(sched)
        computed += sum(n for s, n in plan.scheduled if s is long)
        check_invariants(sched)
        if long.output:
            break
    assert long.output and long.preemptions == 0
    assert computed == 600  # its prefill, once
    assert all(d.preemptions == 0 for d in decodes)


def test_random_workload_never_leaks_or_deadlocks():
    rnd = random.Random(0)
    pool = KvBlockPool(24, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=16), pool)
    pending = [seq(i, rnd.randrange(1, 30), max_tokens=rnd.randrange(1, 40)) for i in range(60)]
    finished = 0
    for step in range(5000):
        while pending and rnd.random() < 0.3:
            sched.add(pending.pop(0))
        plan = run_step(sched, token=rnd.randrange(100))
        assert plan.num_tokens <= 16 and len(plan.scheduled) <= 6
        for s, _ in plan.scheduled:
            if s.status is SeqStatus.RUNNING and len(s.output) >= s.params.max_tokens:
                sched.finish(s)
                finished += 1
        if rnd.random() < 0.02 and sched.running:  # a cancel
            sched.finish(rnd.choice(sched.running))
            finished += 1
        check_invariants(sched)
        if not pending and sched.num_unfinished == 0:
            break
    assert finished == 60 and pool.num_free == pool.num_blocks


class InvariantReplay(PyReplay):
    """The parity test's Python replay, checked as it goes. The KV cache is emulated: each
    position of a block holds what the forward pass writes there (its tokens up to that
    position, tagged with the sequence's tenant), so a step that writes a block another
    sequence holds or the cache keeps, or whose attention reads a position holding anything but
    its own prefix (a wrong hit, another tenant's block, a block reused under a sequence), fails
    at once. Every lookup is checked against a brute-force oracle of the cache's contents, every
    eviction against the order the README states, the pool's bookkeeping after every event."""

    def _config(self, *fields):
        lines = super()._config(*fields)
        # (block, offset) -> what the forward pass wrote there (`written`)
        self.kv: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        # the eviction order as the README states it, kept apart from the pool's: cached blocks
        # no table holds, least recently released first, a table's last block before its first
        self.released: dict[int, None] = {}
        self.counts = Counter()
        pool, schedule = self.pool, self.core.schedule
        match, release, grow = pool.match, pool.release, pool.grow

        def checked_schedule():
            plan = schedule()
            self.check_plan(plan)
            return plan

        def checked_match(seq):
            hit = match(seq)
            self.check_hit(seq, hit)
            return hit

        def checked_release(seq):
            self.forget_held()
            table = list(seq.block_table)
            release(seq)
            self.released.update((b, None) for b in reversed(table)
                                 if not pool.refs[b] and pool._uid[b])

        def checked_grow(seq, num_tokens):
            self.forget_held()
            cached = set(pool.cached.values())
            grow(seq, num_tokens)
            evicted = cached - set(pool.cached.values())
            assert evicted == set(list(self.released)[:len(evicted)]), "eviction order"
            for block in evicted:
                del self.released[block]
            self.counts["evictions"] += len(evicted)
        pool.match, pool.release, pool.grow = checked_match, checked_release, checked_grow
        self.core.schedule = checked_schedule
        return lines

    def forget_held(self) -> None:
        """Blocks a table took again since their release (a hit) are not evictable."""
        for block in [b for b in self.released if self.pool.refs[b]]:
            del self.released[block]

    def run(self, line: str) -> list[str]:
        lines = super().run(line)
        if self.core is not None:
            self.check_pool()
        return lines

    @staticmethod
    def written(seq: Sequence, position: int) -> tuple[int, tuple[int, ...]]:
        """What computing seq's token at `position` writes into its block, tagged with its
        tenant: the salt word with its top bit set, or 0 (the README's rule, restated here)."""
        tenant = seq.cache_salt | 1 << 63 if seq.cache_salt else 0
        return tenant, tuple(seq.token_range(0, position + 1))

    def check_hit(self, seq: Sequence, hit: list[int]) -> None:
        """The hit is seq's longest prefix of whole blocks, at most num_tokens - 1 tokens, whose
        every block's contents the cache holds (none when caching is off: it holds nothing)."""
        bs = self.pool.block_size
        cached = {self.kv[block, bs - 1] for block in self.pool.cached.values()}
        longest = 0
        while ((longest + 1) * bs < seq.num_tokens
               and self.written(seq, (longest + 1) * bs - 1) in cached):
            longest += 1
        assert len(hit) == longest, (seq.slot, len(hit), longest)
        for j, block in enumerate(hit):
            assert self.kv[block, bs - 1] == self.written(seq, (j + 1) * bs - 1)
        self.counts["hits at the limit"] += hit != [] and (len(hit) + 1) * bs >= seq.num_tokens

    def check_plan(self, plan) -> None:
        sched, pool, bs = self.sched, self.pool, self.pool.block_size
        assert plan.num_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        assert len({seq.slot for seq, _ in plan.scheduled}) == len(plan.scheduled)
        for seq, n in plan.scheduled:
            assert 1 <= n <= seq.num_pending
            for p in range(seq.num_computed, seq.num_computed + n):
                block = seq.block_table[p // bs]
                assert pool.refs[block] == 1 and not pool._uid[block], \
                    f"slot {seq.slot} writes block {block}, shared or cached"
                self.kv[block, p % bs] = self.written(seq, p)
            for p in range(seq.num_computed + n):  # what its attention reads
                assert self.kv.get((seq.block_table[p // bs], p % bs)) == self.written(seq, p), \
                    f"slot {seq.slot} reads another prefix's keys and values at {p}"
        # an empty plan with sequences left: nothing runs, and the queue's head never fits
        assert plan.scheduled or plan.preempted or not sched.num_unfinished, "deadlock"
        self.counts["preemptions"] += len(plan.preempted)

    def check_pool(self) -> None:
        sched, pool, bs = self.sched, self.pool, self.pool.block_size
        held = Counter()
        for seq in sched.running:
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) == blocks_for(seq.num_computed, bs)
            held.update(seq.block_table)
            if pool.prefix_caching:  # its full blocks are the cached ones (one copy each)
                assert [pool._uid[b] for b in seq.block_table[:len(seq.block_uids)]] \
                    == seq.block_uids and len(seq.block_uids) == seq.num_computed // bs
        for seq in sched.waiting:
            assert not seq.block_table and not seq.block_uids and seq.num_computed == 0
        assert pool.refs == [held[b] for b in range(pool.num_blocks)], "reference counts"
        free, evictable = list(pool._free), list(pool._evictable)
        assert not any(pool.refs[b] or pool._uid[b] for b in free)
        assert all(pool._uid[b] and not pool.refs[b] for b in evictable)
        assert len(set(free)) + len(evictable) + len(held) == pool.num_blocks, "leaked blocks"
        assert all(pool._identity[b] == i for i, b in pool.cached.items())
        assert sum(map(bool, pool._uid)) == pool.num_cached
        if not sched.num_unfinished:
            assert pool.num_free == pool.num_blocks and not any(pool.refs)


def test_adversarial_workloads_keep_every_invariant():
    """The parity test's adversarial workloads (shared prefixes cut at and around block
    boundaries, chat turns of running sequences, salts, tight pools, cancels of preempted
    sequences), every event checked (InvariantReplay); each drains to an empty pool."""
    counts = Counter()
    for seed in range(300):
        replay = InvariantReplay()
        for event in adversarial_workload(seed):
            replay.run(event)
        assert not replay.active
        counts += replay.counts
    assert counts["preemptions"] > 300 and counts["hits at the limit"] > 700, counts
    assert counts["evictions"] > 10000, counts


def test_stop_checks():
    s = seq(0, 3, max_tokens=3, stop_ids=frozenset({42}))
    eos = frozenset({2})
    s.output = [5]
    assert eos_finish(s, 5, eos, 100) == (FinishReason.NONE, 0)
    s.output = [5, 2]
    assert eos_finish(s, 2, eos, 100) == (FinishReason.EOS, 2)
    s.output = [5, 42]
    assert eos_finish(s, 42, eos, 100) == (FinishReason.STOP_TOKEN, 42)
    s.output = [5, 6, 7]
    assert eos_finish(s, 7, eos, 100) == (FinishReason.LENGTH, 0)
    s.output = [5, 6]
    assert eos_finish(s, 6, eos, 5) == (FinishReason.CONTEXT_FULL, 0)
    ign = seq(0, 3, max_tokens=9, ignore_eos=True)
    ign.output = [2]
    assert eos_finish(ign, 2, eos, 100) == (FinishReason.NONE, 0)


# -- sampling ---------------------------------------------------------------------------------

def test_greedy_and_top_k_1_are_argmax():
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=50).astype(np.float32)
        want = int(np.argmax(logits))
        assert sample_token(logits, SamplingParams(1, temperature=0.0), 0) == want
        assert sample_token(logits, SamplingParams(1, temperature=1.3, top_k=1, seed=9), 3) == want


def test_same_seed_same_tokens_independent_of_order():
    logits = np.random.default_rng(1).normal(size=100).astype(np.float32)
    p = SamplingParams(1, temperature=0.8, seed=1234)
    a = [sample_token(logits, p, step) for step in range(50)]
    b = [sample_token(logits, p, step) for step in reversed(range(50))][::-1]
    assert a == b
    assert a != [sample_token(logits, SamplingParams(1, temperature=0.8, seed=1235), s)
                 for s in range(50)]


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.7),
])
def test_sampling_distribution(params):
    """Empirical frequencies over many seeds match the filtered softmax (fixed seeds)."""
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0], np.float32)
    t = params.get("temperature")
    probs = np.exp(logits / t) / np.exp(logits / t).sum()
    order = np.argsort(-probs)
    keep = np.ones(6, bool)
    if "top_k" in params:
        keep[order[params["top_k"]:]] = False
    if "top_p" in params:
        cum = np.cumsum(probs[order])
        n = int(np.searchsorted(cum, params["top_p"])) + 1
        keep[order[n:]] = False
    want = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    n = 20000
    counts = Counter(sample_token(logits, SamplingParams(1, seed=s, **params), 0)
                     for s in range(n))
    got = np.array([counts[i] / n for i in range(6)])
    assert np.all(got[~keep] == 0)
    assert np.abs(got - want).max() < 4 * np.sqrt(want.max() / n) + 1e-3


def test_ties_at_a_cut_off_are_kept_and_nan_never_wins():
    """Tokens tied with the last one top_k or top_p keeps are kept too: the GPU kernel cuts on
    a logit threshold (sampling.cuh), and transformers' TopKLogitsWarper and vLLM keep top-k
    ties; the CPU sampler kept exactly k tokens, the lower ids, so the two engines drew from
    different sets (tied logits are common: a checkpoint's reserved tokens share one row). A NaN
    logit counts as -inf, as in the kernels: greedy picked it, and sampling drew one token."""
    from blink.gpu_engine.sampling import sampling_distribution
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    logits = np.array([3.0, 2.0, 2.0, 2.0, 0.0], np.float32)
    order, probs = sampling_distribution(logits, SamplingParams(1, top_k=2))
    hf = transformers.TopKLogitsWarper(top_k=2)(None, torch.tensor(logits)[None])
    want = torch.softmax(hf, -1)[0].numpy()
    assert sorted(order.tolist()) == [0, 1, 2, 3]
    got = np.zeros(5)
    got[order] = probs
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # top_p 0.75 over [0.5, 0.25, 0.25]: the crossing token's tie comes along (the kernel's set)
    order, probs = sampling_distribution(np.log(np.array([.5, .25, .25], np.float32)),
                                         SamplingParams(1, top_p=0.75))
    assert sorted(order.tolist()) == [0, 1, 2]
    np.testing.assert_allclose(sorted(probs.tolist()), [0.25, 0.25, 0.5], rtol=1e-6)
    with_nan = np.array([0.0, np.nan, 1.0], np.float32)
    assert sample_token(with_nan, SamplingParams(1, temperature=0.0), 0) == 2
    draws = Counter(sample_token(with_nan, SamplingParams(1, seed=s), 0) for s in range(2000))
    assert draws[1] == 0 and 0.2 < draws[0] / 2000 < 0.34  # softmax([0, 1]): 0.269 and 0.731


def test_top_k_1_is_greedy_with_the_lowest_id_on_ties():
    """top_k 1 is the argmax, the lowest id among tied logits, as the GPU kernel takes it
    (sampling.cuh: greedy where top_k == 1): the sampler's tie rule would draw among the tied
    top logits instead, whatever the seed."""
    logits = np.array([0.0, 5.0, 5.0, 1.0], np.float32)
    assert {sample_token(logits, SamplingParams(1, top_k=1, seed=seed), step)
            for seed in range(64) for step in range(4)} == {1}


def test_the_n_th_token_is_drawn_with_uniform_of_seed_and_n():
    """The draw for step n is uniform(seed, n) through the inverse CDF (the first token whose
    cumulative probability exceeds it; the GPU kernel's rule): over two tokens of softmax
    probabilities p and 1 - p (torch's), token 0 exactly when uniform(seed, n) < p. The serving
    test of the step's number judges the engine with sample_token itself, so a sampler that
    drew step n + 1's number would pass it."""
    torch = pytest.importorskip("torch")
    logits = np.array([0.25, 0.0], np.float32)
    p = float(torch.softmax(torch.tensor(logits, dtype=torch.float64), -1)[0])
    for seed in (0, 1, 2 ** 63 + 5):
        params = SamplingParams(1, seed=seed)
        got = [sample_token(logits, params, n) for n in range(40)]
        assert got == [0 if uniform(seed, n) < p else 1 for n in range(40)], seed


def test_a_low_temperature_draws_from_the_softmax_of_logits_whose_exp_overflows():
    """temperature 1/16 over logits 75 and 74.875: logits / T are 1,200 and 1,198, whose exp
    overflows float64; the distribution is still torch's softmax(logits / T), 0.881 and 0.119
    (exp without the top logit subtracted would make every probability NaN, and every draw
    the top token), and the draws follow it."""
    from blink.gpu_engine.sampling import sampling_distribution
    torch = pytest.importorskip("torch")
    logits = np.array([75.0, 74.875, 0.0], np.float32)
    params = SamplingParams(1, temperature=0.0625)
    want = torch.softmax(torch.tensor(logits, dtype=torch.float64) / 0.0625, -1).numpy()
    order, probs = sampling_distribution(logits, params)
    got = np.zeros(3)
    got[order] = probs
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    n = 4000
    draws = Counter(sample_token(logits, SamplingParams(1, temperature=0.0625, seed=s), 0)
                    for s in range(n))
    assert draws[2] == 0
    assert abs(draws[1] / n - want[1]) < 4 * np.sqrt(want[1] * want[0] / n)


def test_top_p_1_keeps_every_token_even_past_float64_s_cumulative_sum():
    """top_p 1.0 is off (as in transformers and the GPU kernel, which skip the cut): every token
    stays drawable with its softmax probability, also those whose mass no longer moves the
    float64 cumulative sum (e^-40 next to 1), which a cut at the first sum reaching 1.0 drops."""
    from blink.gpu_engine.sampling import sampling_distribution
    torch = pytest.importorskip("torch")
    logits = np.array([0.0, -40.0, -50.0], np.float32)
    order, probs = sampling_distribution(logits, SamplingParams(1, top_p=1.0))
    assert sorted(order.tolist()) == [0, 1, 2]
    got = np.zeros(3)
    got[order] = probs
    want = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_a_draw_past_the_last_cumulative_sum_takes_the_last_token(monkeypatch):
    """uniform() reaches 1 - 2^-53, above a float64 cumulative sum that rounding left at
    1 - 2^-52: the draw is the last token of the draw order (the GPU kernel clamps its target
    the same way), not an IndexError that would stop the engine."""
    from blink.gpu_engine import sampling
    logits = np.array([-1.9, -3.0, 1.2], np.float32)
    params = SamplingParams(1, seed=5)
    order, probs = sampling.sampling_distribution(logits, params)
    top = 1 - 2.0 ** -53
    if np.cumsum(probs)[-1] >= top:  # the premise, on this platform's exp and sums
        pytest.skip(f"the cumulative sum reached {np.cumsum(probs)[-1]!r} here")
    monkeypatch.setattr(sampling, "uniform", lambda seed, step: top)
    assert sampling.sample_token(logits, params, 0) == int(order[-1]) == 1


def test_uniform_is_uniform():
    u = np.array([uniform(77, i) for i in range(20000)])
    assert 0 <= u.min() and u.max() < 1
    hist, _ = np.histogram(u, bins=10, range=(0, 1))
    assert np.abs(hist / 20000 - 0.1).max() < 0.01

# The scheduler's and the KV pool's constructors refuse exactly what `blink serve` refuses
# (cli.py's _check_engine_args: --block-size, --max-num-seqs, --max-batched-tokens and
# --num-kv-blocks >= 1, --max-model-len >= 2) and take its smallest values: the CLI checks first,
# so only an engine built as a library (EngineConfig checks nothing itself) meets these bounds.

def test_scheduler_config_takes_the_smallest_values_the_cli_allows():
    c = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=2)
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len) == (1, 1, 2)


@pytest.mark.parametrize("fields", [
    dict(max_num_seqs=0, max_num_batched_tokens=1, max_model_len=2),
    dict(max_num_seqs=1, max_num_batched_tokens=0, max_model_len=2),
    dict(max_num_seqs=1, max_num_batched_tokens=1, max_model_len=1),
], ids=["max_num_seqs=0", "max_num_batched_tokens=0", "max_model_len=1"])
def test_scheduler_config_refuses_one_below(fields):
    with pytest.raises(ValueError, match="invalid scheduler config"):
        SchedulerConfig(**fields)


def test_kv_pool_takes_one_block_of_one_token():
    pool = KvBlockPool(1, 1)
    assert pool.num_free == 1 and pool.block_size == 1


@pytest.mark.parametrize("num_blocks, block_size", [(0, 1), (1, 0)])
def test_kv_pool_refuses_no_blocks_or_empty_blocks(num_blocks, block_size):
    with pytest.raises(ValueError, match="KV pool needs blocks"):
        KvBlockPool(num_blocks, block_size)
