"""Prefix caching: full KV blocks shared by prompt prefix (gpu_engine/block_manager.py and its
device twin in csrc/scheduler.cuh, checked against each other by tests/test_scheduler_parity.py).

The pool's own rules first (reference counts, eviction order, the identity chain, blocks
computed twice), then serving through a real gRPC port with the CPU reference engine (CI) and
the CUDA engine (marked `gpu`): shared prefixes and chat turns under concurrency, the same
prompt with and without the cache, KV pressure with shared blocks; every token is checked
against transformers and every block comes back.
"""
from __future__ import annotations

import asyncio
import random

import pytest
from gpu import requires_gpu
from test_serving_behaviour import wait_for

from blink.client.sdk import AsyncBlinkClient, BlinkClient, Sampling
from blink.gpu_engine.block_manager import KvBlockPool
from blink.gpu_engine.scheduler import Scheduler, SchedulerConfig
from blink.gpu_engine.sequence import SamplingParams, SeqStatus, Sequence

BS = 4  # block size of the pool tests


def seq(slot: int, prompt: list[int]) -> Sequence:
    return Sequence(slot, 1, slot, list(prompt), SamplingParams(max_tokens=8))


def computed(pool: KvBlockPool, s: Sequence, hit=()) -> Sequence:
    """s admitted with the cached blocks `hit`, then its whole prompt computed and registered."""
    pool.admit(s, list(hit))
    pool.grow(s, s.num_tokens)
    s.num_computed = s.num_tokens
    pool.register(s)
    return s


# -- the pool ---------------------------------------------------------------------------------

def test_a_finished_prompt_is_found_again_up_to_its_last_full_block():
    pool = KvBlockPool(16, BS, prefix_caching=True)
    first = computed(pool, seq(0, range(10)))        # blocks 0 (tokens 0-3), 1 (4-7) cached
    assert pool.num_cached == 2 and pool.num_free == 16 - 3
    pool.release(first)
    assert pool.num_free == 16 and pool.num_evictable == 2
    again = seq(1, range(10))
    hit = pool.match(again)
    assert hit == [0, 1] and pool.can_admit(again, hit, 10)
    pool.admit(again, hit)
    assert again.num_computed == 8 and again.cached_tokens == 8
    assert pool.num_evictable == 0 and pool.hit_tokens == 8 and pool.query_tokens == 20
    # the last token is always computed: a prompt of exactly 8 tokens reuses one block only
    assert pool.match(seq(2, range(8))) == [0]
    # a different first block shares nothing after it either
    assert pool.match(seq(3, [99, 1, 2, 3, 4, 5, 6, 7, 8])) == []


def test_a_preempted_sequence_s_readmission_is_not_counted_as_a_hit():
    """The hit rate counts each request's first lookup alone, as vLLM's does: a preempted
    sequence finds its own blocks again, which saved no request a prefill; the tokens its
    request took from the cache stay those of its first admission."""
    pool = KvBlockPool(16, BS, prefix_caching=True)
    s = computed(pool, seq(0, range(10)))           # no hit: 10 tokens looked up
    assert (pool.query_tokens, pool.hit_tokens, s.cached_tokens) == (10, 0, 0)
    pool.release(s)                                 # preempted (Scheduler._preempt)
    s.num_computed, s.preemptions = 0, 1
    hit = pool.match(s)
    assert hit == [0, 1]
    pool.admit(s, hit)
    assert s.num_computed == 8                      # it still skips the recompute
    assert (pool.query_tokens, pool.hit_tokens, s.cached_tokens) == (10, 0, 0)


def test_shared_blocks_are_counted_and_never_freed_while_held():
    pool = KvBlockPool(8, BS, prefix_caching=True)
    a = computed(pool, seq(0, range(9)))
    b = seq(1, list(range(8)) + [50, 51])
    hit = pool.match(b)
    assert hit == [0, 1] == list(a.block_table[:2])
    computed(pool, b, hit)
    assert [pool.refs[x] for x in hit] == [2, 2]
    pool.release(a)
    assert [pool.refs[x] for x in hit] == [1, 1] and pool.num_evictable == 0
    # every other block taken: the shared ones are not takeable
    c = seq(2, [7] * 20)
    assert pool.num_free == 5 and not pool.can_grow(c, 6 * BS)
    pool.grow(c, 5 * BS)
    assert not set(c.block_table) & set(b.block_table)
    pool.release(b)
    pool.release(c)
    assert pool.num_free == 8 and pool.num_evictable == 2 and not any(pool.refs)


def test_eviction_takes_the_least_recently_released_and_a_prefix_after_its_continuation():
    pool = KvBlockPool(6, BS, prefix_caching=True)
    old = computed(pool, seq(0, range(9)))              # blocks 0, 1 cached; 2 partial
    new = computed(pool, seq(1, range(100, 109)))       # blocks 3, 4 cached; 5 partial
    pool.release(old)
    pool.release(new)
    # each sequence's last block before its first, the older sequence's before the newer's
    assert list(pool._evictable) == [1, 0, 4, 3]
    taker = seq(2, [7] * 12)
    pool.grow(taker, 3 * BS)     # the 2 free blocks, then the least recently released cached one
    assert list(taker.block_table) == [5, 2, 1]
    assert pool.evicted_blocks == 1 and pool.num_cached == 3
    assert pool.match(seq(3, range(9))) == [0]          # its continuation is gone, it is not
    assert pool.match(seq(4, range(100, 109))) == [3, 4]


def test_a_block_is_matched_only_through_the_block_before_it():
    """A cached block names the uid of the block before it, not its memory: when that block is
    evicted and its memory cached again for other tokens, the old continuation is not reached
    through it (with block ids as parents, Y + Z would match Z's block, computed after X)."""
    pool = KvBlockPool(4, BS, prefix_caching=True)
    X, Z, Y = [0, 1, 2, 3], [4, 5, 6, 7], [10, 11, 12, 13]
    a = computed(pool, seq(0, X + Z + [8]))             # block 0: X, block 1: Z after X
    pool.release(a)
    pool._evictable.move_to_end(1)                      # evict X's block before Z's
    filler = seq(1, [9] * 8)
    pool.grow(filler, 2 * BS)                           # the free blocks 2 and 3
    b = computed(pool, seq(2, Y))                       # X evicted: its memory now holds Y
    assert list(b.block_table) == [0] and pool.evicted_blocks == 1
    assert pool.num_cached == 2                         # Y's block, and Z's (after X) still
    assert pool.match(seq(3, Y + Z + [1])) == [0]
    assert pool.match(seq(4, X + Z + [1])) == []


def test_a_block_computed_twice_is_cached_once_and_its_chain_goes_on():
    """Two sequences of one prompt admitted before either computed it: the second to register
    takes the first's cached blocks and gives its own copies back (the same keys and values),
    so the prompt is held once and its chain goes on from the cached blocks."""
    pool = KvBlockPool(16, BS, prefix_caching=True)
    a, b = seq(0, range(13)), seq(1, range(13))
    for s in (a, b):                                    # both admitted before either registers
        pool.admit(s, pool.match(s))
        pool.grow(s, s.num_tokens)
    assert pool.num_free == 16 - 8
    for s in (a, b):
        s.num_computed = s.num_tokens
        pool.register(s)
    assert pool.num_cached == 3 and b.block_uids == a.block_uids
    assert list(b.block_table[:3]) == list(a.block_table[:3])   # its copies went back
    assert b.block_table[3] != a.block_table[3]
    assert [pool.refs[x] for x in a.block_table[:3]] == [2, 2, 2] and pool.num_free == 16 - 5
    b.output += [13, 14, 15, 16]                        # b goes on: its 4th block is cached
    pool.grow(b, b.num_tokens)
    b.num_computed = b.num_tokens
    pool.register(b)
    assert pool.num_cached == 4
    a_blocks, b_fourth = list(a.block_table[:3]), b.block_table[3]
    pool.release(a)
    assert pool.num_evictable == 0                      # b holds the prefix its 4th block needs
    pool.release(b)
    assert pool.num_evictable == 4 and pool.num_free == 16 and not any(pool.refs)
    assert list(pool._evictable) == [b_fourth] + a_blocks[::-1]  # the continuation goes first
    assert pool.match(seq(2, range(18))) == a_blocks + [b_fourth]


def test_a_burst_of_one_prefix_holds_it_once_and_keeps_it_while_in_use():
    """Eight requests of one 64-token system prompt arrive together (none finds it cached):
    all compute it in one step, and after it they hold it once (4 blocks + a block each, not
    8 x 5). When the first ends, the prefix stays held by the other seven, so blocks taken
    for other work evict nothing of it and a late request still finds it. (Each kept its own
    copy before: the cached one, held by the first request alone, was the first evicted.)"""
    pool = KvBlockPool(64, 16, prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                      max_model_len=256), pool)
    system = list(range(64))
    burst = [seq(i, system + [100 + i] * 8) for i in range(8)]
    for s in burst:
        sched.add(s)
    plan = sched.schedule_step()
    assert plan.num_admitted == 8 and all(s.cached_tokens == 0 for s in burst)
    for s, n in plan.scheduled:
        s.num_computed += n
    sched.register(plan)
    prefix = list(burst[0].block_table[:4])
    assert all(list(s.block_table[:4]) == prefix for s in burst)
    assert pool.num_blocks - pool.num_free == 4 + 8 and pool.num_cached == 4
    sched.finish(burst[0])
    assert pool.num_evictable == 0
    other = seq(9, [7] * 16 * pool.num_free)            # every block that can be taken
    pool.grow(other, other.num_tokens)
    late = seq(10, system + [55] * 8)
    assert pool.match(late) == prefix


def test_a_salted_sequence_meets_only_its_own_salt_s_blocks():
    pool = KvBlockPool(32, BS, prefix_caching=True)

    def salted(slot, salt, prompt=range(10)):
        s = seq(slot, prompt)
        s.cache_salt = salt
        return s
    unsalted = computed(pool, seq(0, range(10)))
    a = salted(1, 7)
    assert pool.match(a) == []  # the unsalted blocks hang from another root
    computed(pool, a)
    assert pool.num_cached == 4 and pool.match(salted(2, 7)) == list(a.block_table[:2])
    # the word with or without its top bit is the same namespace (the root sets it)
    assert pool.match(salted(3, 7 | 1 << 63)) == list(a.block_table[:2])
    assert pool.match(salted(4, 8)) == []
    assert pool.match(seq(5, range(10))) == list(unsalted.block_table[:2])
    # a salted chain grows past its first blocks as an unsalted one does: a longer prompt
    # takes a's two blocks and caches its third after them, under the salt alone
    longer = salted(6, 7, range(14))
    longer = computed(pool, longer, pool.match(longer))
    assert list(longer.block_table[:2]) == list(a.block_table[:2])
    assert pool.match(salted(7, 7, range(14))) == list(longer.block_table[:3])
    assert pool.match(seq(8, range(14))) == list(unsalted.block_table[:2])


def test_off_means_nothing_is_cached():
    pool = KvBlockPool(8, BS)
    s = computed(pool, seq(0, range(9)))
    pool.release(s)
    assert pool.num_cached == 0 and pool.match(seq(1, range(9))) == []
    assert pool.query_tokens == pool.hit_tokens == 0


def test_scheduler_admits_a_long_cached_prompt_within_a_small_budget():
    """The token budget counts only the tokens computed: a 40-token prompt whose first 36 are
    cached is admitted in one 4-token step."""
    pool = KvBlockPool(32, BS, prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4,
                                      max_model_len=64), pool)
    pool.release(computed(pool, seq(0, range(40))))
    s = seq(1, range(40))
    sched.add(s)
    plan = sched.schedule_step()
    assert [(x.slot, n) for x, n in plan.scheduled] == [(1, 4)] and plan.num_admitted == 1
    assert s.cached_tokens == 36 and s.num_computed == 36


# -- serving ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpu()])])
def engine(request) -> str:
    return request.param


def check_tokens(engine: str, model_dir, prompt: list[int], tokens: list[int]) -> int:
    """Every token is the reference's argmax after its own prefix or a near-tie of it:
    transformers float32 for the CPU engine, bf16 for the CUDA engine (tests/oracle.py).
    Returns the near-tie steps."""
    from oracle import check_against_bf16_reference, check_teacher_forced, hf_bf16
    if engine == "cpu":
        return check_teacher_forced(model_dir, prompt, tokens)
    return check_against_bf16_reference(hf_bf16(model_dir), prompt, tokens, 0.25)


def stack_for(engine, make_stack, model_dir, *args: str):
    extra = ["--num-kv-blocks", "2048"] if engine == "cuda" and "--num-kv-blocks" not in args \
        else []
    stack = make_stack(model_dir, engine_args=["--engine", engine, *extra, *args])
    stack.wait_serving(timeout=120)
    return stack


def assert_all_blocks_back(client) -> dict:
    """Every KV block free (or cached, unreferenced) and no ring slot in use. The stats' engine
    counts are the front end's last read of the ring header, up to its idle poll (20 ms) old
    once the last request has finished (a freshly started CUDA engine's first request read 7
    blocks in use for 20 ms, then none): so they are polled for up to 2 s, and a leaked block
    still fails."""
    def all_back() -> bool:
        nonlocal s
        s = client.stats()
        return s["kv_blocks_free"] == s["kv_blocks_total"] and s["ring_slots_in_use"] == 0
    s: dict = {}
    assert wait_for(all_back, timeout=2.0, interval=0.005), s
    return s


def test_shared_prefixes_and_chat_turns_under_concurrency(engine, checkpoints, make_stack):
    """Streams that share three system prompts (and a chat whose turns resend the conversation)
    run together: every token follows the reference, the cache serves the shared prefixes,
    and every block comes back."""
    model_dir = checkpoints["llama"]
    stack = stack_for(engine, make_stack, model_dir)
    rnd = random.Random(3)
    systems = [[rnd.randrange(8, 2000) for _ in range(40 + 8 * k)] for k in range(3)]
    n = 64 if engine == "cuda" else 12
    prompts = [rnd.choice(systems) + [rnd.randrange(8, 2000) for _ in range(rnd.randint(1, 20))]
               for _ in range(n)]
    greedy = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def together(batch):
        async with AsyncBlinkClient(stack.target) as client:
            return await asyncio.gather(*(client.generate(p, greedy, return_token_ids=True,
                                                          timeout=120) for p in batch))
    done = asyncio.run(together(prompts))
    done += asyncio.run(together(prompts[:4]))      # the same prompts again: cached whole
    ties = 0
    for prompt, d in zip(prompts + prompts[:4], done):
        assert len(d.token_ids) == 12
        ties += check_tokens(engine, model_dir, prompt, list(d.token_ids))
    assert all(d.cached_prompt_tokens >= 16 for d in done[-4:])
    # a chat: each turn resends the conversation so far and adds to it. A later turn is served
    # every full block the turn before computed (nothing is evicted here): its reply's blocks,
    # keyed as its decode filled them, and its prompt's, keyed as it was admitted (the CUDA
    # scheduler computes a new prompt's keys a thread a block), must chain to the same keys.
    conversation = list(systems[0])
    with BlinkClient(stack.target) as client:
        computed = 0  # tokens the turn before computed (its reply's last one never is)
        for turn in range(3):
            conversation += [rnd.randrange(8, 2000) for _ in range(6)]
            d = client.generate(conversation, greedy, return_token_ids=True)
            ties += check_tokens(engine, model_dir, conversation, list(d.token_ids))
            if turn == 0:  # the system prompt's two full blocks, which the streams cached
                assert d.cached_prompt_tokens >= 32
            else:
                assert d.cached_prompt_tokens == computed // 16 * 16
            computed = len(conversation) + len(d.token_ids) - 1
            conversation += list(d.token_ids)
        s = assert_all_blocks_back(client)
    print(f"engine prefix cache ({engine}): {n} streams over 3 system prompts + a 3-turn chat, "
          f"{s['prefix_hit_tokens']} of {s['prefix_query_tokens']} prompt tokens from the "
          f"cache, {s['kv_blocks_cached']} blocks cached, {ties} near-tie steps")
    assert s["prefix_hit_tokens"] > 0 and s["kv_blocks_cached"] > 0


def test_same_prompt_twice_with_and_without_the_cache(engine, checkpoints, make_stack):
    """The second run of a prompt takes its full blocks from the cache and computes only the
    rest; its tokens are the first run's (the CPU engine computes each row alone: exactly;
    bf16 sums depend on the step's shape, so the CUDA engine's may part at a near-tie) and an
    engine without the cache gives the same."""
    model_dir = checkpoints["llama"]
    rnd = random.Random(4)
    prompt = [rnd.randrange(8, 2000) for _ in range(83)]
    greedy = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for flags in ((), ("--no-prefix-caching",)):
        stack = stack_for(engine, make_stack, model_dir, *flags)
        with BlinkClient(stack.target) as client:
            runs[flags] = [client.generate(prompt, greedy, return_token_ids=True)
                           for _ in range(2)]
            assert_all_blocks_back(client)
        stack.stop()
    (cold, warm), (off1, off2) = runs[()], runs[("--no-prefix-caching",)]
    assert (cold.cached_prompt_tokens, warm.cached_prompt_tokens) == (0, 80)
    assert off1.cached_prompt_tokens == off2.cached_prompt_tokens == 0
    ties = 0
    for other in (warm, off1, off2):
        if engine == "cpu":
            assert other.token_ids == cold.token_ids
        elif other.token_ids != cold.token_ids:
            ties += check_tokens(engine, model_dir, prompt, list(other.token_ids))
    print(f"engine prefix cache twice ({engine}): an 83-token prompt, cached tokens 0 then 80; "
          f"{sum(o.token_ids == cold.token_ids for o in (warm, off1, off2))} of 3 other runs "
          f"(cached, and twice without the cache) give the first run's 24 tokens, the rest "
          f"follow the reference ({ties} near-tie steps)")


def test_cache_salts_keep_prefixes_apart(engine, checkpoints, make_stack):
    """A request reuses the prefixes that requests of its own cache salt left (unsalted ones:
    unsalted ones'), never another salt's; the tokens do not depend on the salt."""
    model_dir = checkpoints["llama"]
    rnd = random.Random(5)
    prompt = [rnd.randrange(8, 2000) for _ in range(83)]
    greedy = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)
    stack = stack_for(engine, make_stack, model_dir)
    salts = ["", "tenant-a", "tenant-a", "tenant-b", "", "tenant-b"]
    with BlinkClient(stack.target) as client:
        runs = [client.generate(prompt, greedy, return_token_ids=True, cache_salt=salt)
                for salt in salts]
        s = assert_all_blocks_back(client)
    assert [r.cached_prompt_tokens for r in runs] == [0, 0, 80, 0, 80, 80]
    assert s["kv_blocks_cached"] >= 3 * 5  # each salt's own copy of the prompt's 5 blocks
    ties = 0
    for r in runs[1:]:
        if engine == "cpu":
            assert r.token_ids == runs[0].token_ids
        elif r.token_ids != runs[0].token_ids:
            ties += check_tokens(engine, model_dir, prompt, list(r.token_ids))
    print(f"engine prefix cache salts ({engine}): an 83-token prompt under no salt and two "
          f"salts, cached tokens {[r.cached_prompt_tokens for r in runs]}, {ties} near-tie steps")


def test_kv_pressure_with_shared_blocks(engine, checkpoints, make_stack):
    """Greedy requests sharing a 32-token prefix (2 blocks) in too few KV blocks for all of them
    (the CPU engine: 6 in 12 blocks; the CUDA engine, whose steps are so short that requests
    sent together may barely overlap: 12 longer ones in 12 blocks, where any two that run
    together run out, each needing 9 at its end; in 24 blocks one H200 run had 22 preemptions
    and the next none): they are preempted and recomputed
    while others hold the shared blocks; every token follows the reference and every block
    comes back, none freed while held (a freed shared block would be overwritten by another
    sequence and its holders' tokens would leave the reference)."""
    model_dir = checkpoints["llama"]
    n, blocks, out = (12, 12, 100) if engine == "cuda" else (6, 12, 34)
    stack = stack_for(engine, make_stack, model_dir, "--num-kv-blocks", str(blocks),
                      "--block-size", "16", "--max-num-seqs", "16", "--max-batched-tokens", "64")
    rnd = random.Random(12)
    shared = [rnd.randrange(8, 2000) for _ in range(32)]
    prompts = [shared + [rnd.randrange(8, 2000) for _ in range(6)] for _ in range(n)]
    greedy = Sampling(max_tokens=out, temperature=0.0, ignore_eos=True)

    async def run():
        async with AsyncBlinkClient(stack.target) as client:
            return await asyncio.gather(*(client.generate(p, greedy, return_token_ids=True,
                                                          timeout=120) for p in prompts))
    with BlinkClient(stack.target) as client:  # the shared prefix cached first
        client.generate(shared + [1], Sampling(max_tokens=1), return_token_ids=True)
    done = asyncio.run(run())
    assert sum(d.preemptions for d in done) > 0
    assert sum(d.cached_prompt_tokens for d in done) >= n * 32
    ties = 0
    for prompt, d in zip(prompts, done):
        assert len(d.token_ids) == out
        ties += check_tokens(engine, model_dir, prompt, list(d.token_ids))
    with BlinkClient(stack.target) as client:
        s = assert_all_blocks_back(client)
    print(f"engine prefix cache kv pressure ({engine}): {n} x (32 shared + 6 + {out}) tokens in "
          f"{blocks} blocks, {s['preemptions']} preemptions, {s['prefix_evicted_blocks']} cached "
          f"blocks evicted, {ties} near-tie steps, blocks free "
          f"{s['kv_blocks_free']}/{s['kv_blocks_total']}")
    assert s["kv_blocks_total"] == blocks and s["prefix_evicted_blocks"] > 0


def _run_step(sched: Scheduler, token: int = 99):
    """A step as the engines make it (StepCore.commit): counts, then the prefix cache, then a
    token for each sequence that reached its end."""
    plan = sched.schedule_step()
    for s, n in plan.scheduled:
        s.num_computed += n
    sched.register(plan)
    for s, _ in plan.scheduled:
        if s.num_computed == s.num_tokens:
            s.output.append(token)
    return plan


def test_a_sequence_preempted_this_step_is_not_readmitted_in_it():
    """No admission in a step that preempted (scheduler.cuh's schedule_step says so), also
    where the prefix cache would let the preempted sequence fit again at once. Two requests of
    one 12-token prompt in a 6-block pool (blocks of 4), budget 14: the first is prefilled whole,
    the second admitted on a 2-token chunk (all 12 of its tokens fit then). Next step the
    first's decode takes a block and the second cannot grow: it preempts itself.
    The first's 3 prompt blocks are cached by now, so the second would fit again at once (2 of
    its blocks cached, 1 to take, 2 free): the rule says it waits for the next step all the
    same, and is admitted then on its cache hit."""
    pool = KvBlockPool(6, BS, prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=14,
                                      max_model_len=32), pool)
    prompt = list(range(12))
    a = Sequence(0, 1, 0, list(prompt), SamplingParams(max_tokens=8))
    b = Sequence(1, 1, 1, list(prompt), SamplingParams(max_tokens=8))
    sched.add(a)
    sched.add(b)

    plan = _run_step(sched)
    assert [(s.slot, n) for s, n in plan.scheduled] == [(0, 12), (1, 2)]
    assert pool.num_cached == 3 and pool.num_free == 2

    plan = _run_step(sched)
    # b could not grow (it needs 2 blocks, 1 is left after a's): the newest, itself, preempted
    assert plan.preempted == [b] and b.preemptions == 1
    # ... and no one is admitted in this step, b included, though b would fit now
    assert [(s.slot, n) for s, n in plan.scheduled] == [(0, 1)]
    assert plan.num_admitted == 0
    assert b.status is SeqStatus.WAITING and list(sched.waiting) == [b]
    assert not b.block_table and b.num_computed == 0
    assert sched.running == [a]
    assert not any(s is b for s, _ in plan.scheduled)  # never both preempted and scheduled

    # the next step admits it on its hit: 2 cached blocks (8 tokens), 4 left to compute
    plan = _run_step(sched)
    assert [(s.slot, n) for s, n in plan.scheduled] == [(0, 1), (1, 4)]
    assert plan.num_admitted == 1 and not plan.preempted
    assert list(b.block_table[:2]) == list(a.block_table[:2])
