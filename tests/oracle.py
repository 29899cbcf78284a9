"""Hugging Face transformers as the independent oracle for generated tokens.

The near-tie rule: our engine (NumPy float32) and transformers (torch float32) compute the same
function with different summation orders, so their logits differ by float32 rounding only —
measured below 2e-5 on the test checkpoints (tests/test_reference_model.py). A greedy choice may
therefore differ only where the reference's own top-2 logits are closer than that could explain:
NEAR_TIE = 1e-4, five times the largest rounding difference seen. Every other step must agree.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

NEAR_TIE = 1e-4


@lru_cache(maxsize=8)
def hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate(); ends after an EOS token (which it includes)."""
    import torch
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: BOS may share its id with the pad token
        out = hf_model(model_dir).generate(ids, attention_mask=torch.ones_like(ids),
                                           do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def hf_next_logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """[len(tokens), vocab]: logits for the token after each prefix (teacher forcing)."""
    import torch
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([tokens])).logits[0].float().numpy()


def check_greedy(model_dir: Path, prompt: list[int], ours: list[int], ref: list[int]) -> str:
    """Asserts `ours` equals the reference greedy continuation `ref` up to the first step
    where they differ, and that this step is a near-tie of the reference (our token is its
    runner-up, the top-2 gap < NEAR_TIE). Returns "exact" or a description of the tie."""
    for k, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            logits = hf_next_logits(model_dir, prompt + ref[:k])[-1]
            _assert_near_tie(logits, a, f"step {k}: ours {a}, reference {b}")
            return f"near-tie at step {k}"
    assert len(ours) == len(ref), f"same prefix but lengths differ: {len(ours)} vs {len(ref)}"
    return "exact"


def check_teacher_forced(model_dir: Path, prompt: list[int], ours: list[int]) -> int:
    """Every token of `ours` is the reference's argmax after our own prefix, or its runner-up
    at a near-tie. One forward pass; returns how many steps were near-ties."""
    logits = hf_next_logits(model_dir, prompt + ours)[len(prompt) - 1:-1]
    ties = 0
    for k, (row, a) in enumerate(zip(logits, ours)):
        if a != int(np.argmax(row)):
            _assert_near_tie(row, a, f"step {k}: ours {a}")
            ties += 1
    return ties


def _assert_near_tie(logits: np.ndarray, ours: int, where: str) -> None:
    top2 = np.argsort(-logits)[:2]
    gap = float(logits[top2[0]] - logits[top2[1]])
    assert ours in top2.tolist() and gap < NEAR_TIE, (
        f"{where}; reference top-2 {top2.tolist()} gap {gap:.3g} is not a near-tie "
        f"(< {NEAR_TIE})")


# -- the bf16 reference for the CUDA engine (transformers in bf16 on the GPU) --------------------

def hf_bf16(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor([tokens], device="cuda")).logits[0].float().cpu().numpy()


def check_against_bf16_reference(model, prompt: list[int], ours: list[int], tol: float) -> int:
    """Every token is the reference argmax on our own prefix, or a runner-up within `tol`.
    Returns the number of near-tie steps."""
    logits = hf_logits(model, prompt + ours)[len(prompt) - 1:-1]
    ties = 0
    for k, (row, tok) in enumerate(zip(logits, ours)):
        best = int(np.argmax(row))
        if tok != best:
            gap = float(row[best] - row[tok])
            assert gap < tol, f"step {k}: ours {tok} (logit {row[tok]:.4f}), reference {best} " \
                              f"({row[best]:.4f}): gap {gap:.4f} is not within {tol:.4f}"
            ties += 1
    return ties
