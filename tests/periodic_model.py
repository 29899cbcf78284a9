"""A test checkpoint with decisive greedy choices: the Llama test shape trained to continue a
periodic sequence.

Random weights give flat logits: most top-2 gaps lie within a few times FP8's rounding noise, so
an FP8 engine's greedy stream parts from the bf16 one's at a near-tie within a few tokens, and a
check of streams can only ask that it part at a near-tie. This model is trained (CPU torch, about
a minute on two cores) on sequences whose first PERIOD tokens, drawn from ALPHABET, repeat: the
next token is the one PERIOD positions back, which the model finds through attention over the KV
cache (RoPE's relative positions), with top-2 gaps of several logits. So its greedy streams are
known in advance (continue_period), and an engine whose weights, KV cache or attention are off by
more than rounding writes another stream.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from blink.gpu_engine.demo_model import write_random_checkpoint

PERIOD = 4
ALPHABET = np.arange(100, 164)  # ordinary tokens of the demo tokenizer's vocabulary
TRAIN_LENGTH = 128  # positions the model is trained on: a prompt and its stream fit in them
# the Llama shape of tests/test_cuda_forward.py (FORWARD_SHAPES["llama"], head dim 64)
SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=64, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64})


def periodic_prompt(rng: np.random.Generator, length: int) -> list[int]:
    """`length` tokens: PERIOD drawn from ALPHABET, repeated."""
    head = rng.choice(ALPHABET, PERIOD)
    return [int(head[i % PERIOD]) for i in range(length)]


def continue_period(prompt: list[int], n: int) -> list[int]:
    """The n tokens that continue a periodic prompt."""
    return [prompt[len(prompt) - PERIOD + i % PERIOD] for i in range(n)]


def write_periodic_checkpoint(out_dir: Path, steps: int = 400, seed: int = 0,
                              vocab_size: int | None = None) -> Path:
    """Trains the model (AdamW, full-vocabulary cross-entropy on every predictable position,
    batches of 16 sequences of TRAIN_LENGTH tokens, the rate warmed up then decayed to zero)
    and writes it as a bf16 Hugging Face checkpoint in out_dir (write_random_checkpoint's
    files, its weights replaced; vocab_size as it takes it)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out = write_random_checkpoint(out_dir, seed=seed, vocab_size=vocab_size, **SHAPE)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        seqs = torch.tensor(np.array([periodic_prompt(rng, TRAIN_LENGTH) for _ in range(16)]))
        logits = model(seqs).logits[:, PERIOD - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 seqs[:, PERIOD:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    weights = {name: t.detach().to(torch.bfloat16).contiguous()
               for name, t in model.state_dict().items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def greedy_streams(forward, prompts: list[list[int]], steps: int,
                   block_size: int) -> tuple[list[list[int]], np.ndarray]:
    """Every prompt's greedy continuation of `steps` tokens, as an engine serves them: one
    prefill step of all the prompts, then a decode step a token for all of them together, each
    sequence in blocks of its own (sequence s takes blocks s * per_seq onwards). forward(batch)
    -> logits [sequences, vocab] for a ForwardBatch (the CPU engine's or a CUDA engine's; the
    FP8 tests' greedy checks share this). Returns the streams and the logits each token was
    chosen from, [sequence, step, vocab]."""
    from blink.gpu_engine.forward_batch import ForwardBatch

    assert len({len(p) for p in prompts}) == 1, "prompts of one length"
    per_seq = -(-(len(prompts[0]) + steps) // block_size)
    tables = [np.arange(s * per_seq, (s + 1) * per_seq) for s in range(len(prompts))]
    ids = [list(p) for p in prompts]
    rows = [forward(ForwardBatch.of_chunks([(np.array(i), 0, t) for i, t in zip(ids, tables)]))]
    for step in range(steps):
        for i, row in zip(ids, rows[-1]):
            i.append(int(np.argmax(row)))
        if step + 1 < steps:  # (the last token's own logits are not needed)
            rows.append(forward(ForwardBatch.of_chunks([(np.array(i[-1:]), len(i) - 1, t)
                                                        for i, t in zip(ids, tables)])))
    return [i[len(p):] for i, p in zip(ids, prompts)], np.stack(rows, 1)


def smallest_top2_gap(logits: np.ndarray) -> float:
    """The smallest gap between the largest and the second-largest logit of any row."""
    top2 = np.sort(logits.reshape(-1, logits.shape[-1]), axis=-1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())
