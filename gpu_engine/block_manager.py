"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-sequence block tables, and
the prefix cache that shares full blocks between sequences with the same prompt prefix.

A block is in one of three states:
  free       on the free list, holds nothing worth keeping
  in use     in the block tables of `refs[b]` >= 1 sequences (shared only when cached)
  evictable  cached, in no block table: kept, least recently released first, until a sequence
             needs a block and the free list is empty

A cached block is a full block of computed tokens, known by its identity: the uid of the cached
block before it in its sequence (for a sequence's first block, the sequence's root: 0, or its
request's cache salt with the top bit set) and its own tokens. A uid is given once, when a block
enters the cache, and never reused, so a block whose predecessor was evicted and reused can
never be matched through it: two sequences share block j only if they share every token up to
its end and their salt. A block computed twice (by sequences admitted before either had
computed it) is kept once: the later one gives its copy back and takes the cached one, so every
block table holds its cached blocks' predecessors too, and a prefix is never evicted before its
continuations. The GPU scheduler (csrc/scheduler.cuh) keys the same
identities by a 64-bit hash and compares the parent uid and the tokens of every candidate, so a
hash collision costs a probe, never a wrong block; this pool keys a dict by the identity itself.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from blink.gpu_engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


BlockIdentity = tuple[int, tuple[int, ...]]  # (the uid before it or the root, its tokens)


def prefix_root(seq: Sequence) -> int:
    """The uid seq's first block hangs from: 0, or its cache salt with the top bit set, which
    no uid reaches (they count up from 1). Requests of different salts share no cached block;
    requests of one salt share theirs as unsalted ones do (csrc/scheduler.cuh's prefix_root)."""
    return (seq.cache_salt | 1 << 63) if seq.cache_salt else 0


class KvBlockPool:
    """Free list, reference counts and the prefix cache. Without prefix caching no block is
    ever cached, so a block is either free or in exactly one sequence's block table."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs blocks: num_blocks={num_blocks} "
                             f"block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self.refs = [0] * num_blocks                   # block tables holding each block
        self.cached: dict[BlockIdentity, int] = {}     # identity -> the cached block
        self._identity: list[BlockIdentity | None] = [None] * num_blocks
        self._uid = [0] * num_blocks                   # 0: not cached
        self._next_uid = 1
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        # counters: prompt tokens looked up and found at admission, cached blocks evicted
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` tokens after taking free blocks."""
        return blocks_for(num_tokens, self.block_size) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError("grow() without can_grow(): KV pool exhausted")
        for _ in range(need):
            seq.block_table.append(self._take())

    def _take(self) -> int:
        """A block for new tokens: a free one, else the least recently released cached one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self.cached[self._identity[block]]
            self._identity[block], self._uid[block] = None, 0
            self.evicted_blocks += 1
        self.refs[block] = 1
        return block

    def release(self, seq: Sequence) -> None:
        """Drops seq's references, last block first: a freed block goes to the front of the
        free list (the table's first block ends first: the likeliest still in cache), a cached
        one to the back of the evictable queue (the table's first block evicted last: a prefix
        outlives its continuations)."""
        for block in reversed(seq.block_table):
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            if self._uid[block]:
                self._evictable[block] = None
            else:
                self._free.appendleft(block)
        del seq.block_table[:]
        del seq.block_uids[:]

    # -- the prefix cache ---------------------------------------------------------------------

    def _block_identity(self, seq: Sequence, j: int, parent_uid: int) -> BlockIdentity:
        bs = self.block_size
        return parent_uid, tuple(seq.token_range(j * bs, (j + 1) * bs))

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks of seq's longest cached prefix, at most num_tokens - 1 tokens (the
        last token is always computed: its logits give the next one). Empty when off."""
        if not self.prefix_caching:
            return []
        hit: list[int] = []
        parent = prefix_root(seq)
        while (len(hit) + 1) * self.block_size < seq.num_tokens:
            block = self.cached.get(self._block_identity(seq, len(hit), parent))
            if block is None:
                break
            hit.append(block)
            parent = self._uid[block]
        return hit

    def can_admit(self, seq: Sequence, hit: list[int], num_tokens: int) -> bool:
        """can_grow for a waiting sequence that would first take the cached blocks `hit`
        (those nobody holds stop being takeable)."""
        taken = sum(1 for b in hit if self.refs[b] == 0)
        return blocks_for(num_tokens, self.block_size) - len(hit) <= self.num_free - taken

    def _hold(self, block: int) -> None:
        """One more block table holds the cached `block` (no longer evictable if none did)."""
        if self.refs[block] == 0:
            del self._evictable[block]
        self.refs[block] += 1

    def admit(self, seq: Sequence, hit: list[int]) -> None:
        """seq (waiting: no blocks) takes the cached blocks of its prefix; its computed tokens
        start after them."""
        for block in hit:
            self._hold(block)
            seq.block_table.append(block)
            seq.block_uids.append(self._uid[block])
        seq.num_computed = len(hit) * self.block_size
        if seq.preemptions == 0:
            # a request's first admission alone, as vLLM counts its hit rate: a preempted
            # one's lookup finds its own blocks again, which saved no request any prefill
            seq.cached_tokens = min(seq.num_computed, len(seq.prompt))
            if self.prefix_caching:
                self.query_tokens += seq.num_tokens
                self.hit_tokens += seq.num_computed

    def register(self, seq: Sequence) -> None:
        """After a step: seq's newly full, computed blocks join the cache, in order. Where a
        block's identity is cached already (computed twice: requests of one prefix admitted
        before either had computed it), seq takes the cached block and frees its own copy (the
        same keys and values): each keeping its copy, a burst of one prompt held it once a
        request, and the cached copy, held by none of them once its request ended, went
        first when blocks ran short."""
        if not self.prefix_caching:
            return
        for j in range(len(seq.block_uids), seq.num_computed // self.block_size):
            identity = self._block_identity(seq, j,
                                            seq.block_uids[j - 1] if j else prefix_root(seq))
            block = self.cached.get(identity)
            own = seq.block_table[j]
            if block is None:
                block = own
                self.cached[identity] = block
                self._identity[block], self._uid[block] = identity, self._next_uid
                self._next_uid += 1
            else:  # own is seq's alone (uncached, computed by it): refs 1
                self._hold(block)
                seq.block_table[j] = block
                self.refs[own] = 0
                self._free.appendleft(own)
            seq.block_uids.append(self._uid[block])
