"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and per-sequence block tables."""
from __future__ import annotations

from collections import deque

from blink.gpu_engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class KvBlockPool:
    """Free list of KV-cache block ids. Blocks are not shared between sequences (no prefix
    caching yet), so a block is either free or in exactly one sequence's block table."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV pool needs blocks: num_blocks={num_blocks} block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` can hold `num_tokens` tokens after taking free blocks."""
        return blocks_for(num_tokens, self.block_size) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError("grow() without can_grow(): KV pool exhausted")
        for _ in range(need):
            seq.block_table.append(self._free.popleft())

    def release(self, seq: Sequence) -> None:
        # Freed blocks go to the front: a just-freed block is the most likely still in cache.
        self._free.extendleft(reversed(seq.block_table))
        del seq.block_table[:]
