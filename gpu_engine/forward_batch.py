"""The step contract between the scheduler and a model backend.

One `ForwardBatch` describes one forward pass over a flat list of tokens drawn from several
sequences (chunked prefill and decode mixed, no phases): every sequence contributes a
contiguous run of tokens whose positions continue where its KV cache left off.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ForwardBatch:
    # token_ids: [T] int32, the tokens computed this step, sequence after sequence.
    token_ids: np.ndarray
    # positions: [T] int32, each token's position in its sequence (0-based).
    positions: np.ndarray
    # seq_starts: [S + 1] int32, sequence s owns tokens seq_starts[s]:seq_starts[s + 1].
    seq_starts: np.ndarray
    # context_lens: [S] int32, tokens in sequence s's KV cache once this step has written its
    # tokens (= positions[last token of s] + 1); attention of a token at position p reads 0..p.
    context_lens: np.ndarray
    # block_tables: [S, max_blocks] int32, the KV blocks of sequence s in order, -1 padded;
    # position p of s lives in block block_tables[s, p // block_size], row p % block_size.
    block_tables: np.ndarray
    # logit_seqs: [L] int32, indices s whose last token's logits are wanted (those that sample
    # this step; a prefill chunk that does not reach the prompt's end wants none).
    logit_seqs: np.ndarray

    @classmethod
    def of_chunks(cls, chunks, logit_seqs=None) -> ForwardBatch:
        """chunks: [(token_ids, start_position, block_table)], a sequence's run each, in batch
        order; logit_seqs: every sequence by default."""
        lens = [len(t) for t, _, _ in chunks]
        tables = np.full((len(chunks), max(len(bt) for _, _, bt in chunks)), -1, np.int32)
        for s, (_, _, bt) in enumerate(chunks):
            tables[s, :len(bt)] = bt
        return cls(
            token_ids=np.concatenate([t for t, _, _ in chunks]).astype(np.int32),
            positions=np.concatenate([np.arange(p, p + len(t)) for t, p, _ in chunks]).astype(
                np.int32),
            seq_starts=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
            context_lens=np.array([p + len(t) for t, p, _ in chunks], np.int32),
            block_tables=tables,
            logit_seqs=np.array(range(len(chunks)) if logit_seqs is None else logit_seqs,
                                np.int32))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_starts.shape[0]) - 1
