"""HF transformers references and the numerical-comparison policy shared by the correctness tests.

Policy: compare greedy tokens up to the first divergence; a divergence passes only if, at that step,
the reference's top-2 logprob gap (teacher-forced on the shared prefix) is below the dtype's tolerance
(1e-3 float32, 0.1 bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:  # noqa: ANN001
    """HF `generate`, greedy, one prompt, explicit all-ones attention mask, generation_config neutralized
    (no EOS stop, no repetition penalty etc.), exactly max_new_tokens tokens."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt_ids], device=model.device)
    gc = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # else generate() falls back to the model's EOS and stops
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    finally:
        model.generation_config.eos_token_id = saved
    assert out.shape[1] == len(prompt_ids) + max_new_tokens
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """Teacher-forced log-softmax at every position: [len(ids), vocab] float32."""
    t = torch.tensor([ids], device=model.device)
    logits = model(t, attention_mask=torch.ones_like(t)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@torch.inference_mode()
def hf_logprobs_fp32_head(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """As hf_logprobs, but the LM head multiplies the model's (16-bit) final hidden states in float32: the
    reference's own top-2 gaps without bf16 logit rounding (0.125 apart above 16). Reported, not judged."""
    t = torch.tensor([ids], device=model.device)
    hidden = model.model(t, attention_mask=torch.ones_like(t)).last_hidden_state[0]
    logits = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
    return torch.log_softmax(logits, dim=-1)


@dataclass
class Comparison:
    matched: int
    diverged_at: int | None
    gap: float | None

    def describe(self) -> str:
        if self.diverged_at is None:
            return f"identical ({self.matched} tokens)"
        return f"diverged at step {self.diverged_at} (top-2 gap {self.gap:.3g})"


def compare_greedy(
    model,
    prompt_ids: list[int],
    ours: list[int],
    ref: list[int],
    dtype: torch.dtype,  # noqa: ANN001
    logprobs_fn=None,
    tie_tol: float | None = None,
) -> Comparison:  # noqa: ANN001
    """Raises AssertionError unless `ours` equals `ref` up to a divergence the near-tie test excuses.
    `logprobs_fn` (default hf_logprobs) computes the reference's teacher-forced logprobs; `tie_tol` replaces the
    dtype's near-tie bound where the comparison itself tolerates larger logprob differences (an FP8 cache)."""
    n = min(len(ours), len(ref))
    assert len(ours) == len(ref), f"length differs: ours {len(ours)} vs ref {len(ref)}"
    for i in range(n):
        if ours[i] != ref[i]:
            lp = (logprobs_fn or hf_logprobs)(model, prompt_ids + ref[:i])[-1]
            top2 = lp.topk(2).values
            gap = float(top2[0] - top2[1])
            tol = NEAR_TIE[dtype] if tie_tol is None else tie_tol
            assert gap < tol, (
                f"greedy divergence at step {i}: ours {ours[i]} vs ref {ref[i]}, reference top-2 gap {gap:.4g} "
                f">= {tol} (not a near tie)"
            )
            return Comparison(i, i, gap)
    return Comparison(n, None, None)


def judge_all(
    model,
    prompts: list[list[int]],
    ours: list[list[int]],
    refs: list[list[int]],  # noqa: ANN001
    dtype: torch.dtype,
    logprobs_fn=None,
) -> list[str]:  # noqa: ANN001
    """Every prompt's verdict by the policy (`compare_greedy`), failures included as "FAIL <reason>", so a
    report counts them all."""
    res = []
    for p, o, r in zip(prompts, ours, refs):
        try:
            res.append(compare_greedy(model, p, o, r, dtype, logprobs_fn).describe())
        except AssertionError as e:
            res.append(f"FAIL {str(e).splitlines()[0]}")
    return res


def hf_from_gguf(path: str, dtype: torch.dtype, device: str = "cpu", **kw: str):  # noqa: ANN201
    """HF transformers' model from a GGUF file (dequantized to `dtype`), in eval mode on `device`."""
    import os

    from transformers import AutoModelForCausalLM

    return (
        AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype, **kw)
        .to(device)
        .eval()
    )


def hf_bf16_kernel_refs(path: str, prompts: list[list[int]], n: int, device: str = "cuda"):  # noqa: ANN201
    """The brief's bf16 rule needs HF bf16 three ways on the same prompts: its default attention kernel (the
    reference, and the judge `model`), FlashAttention SDPA, and eager. Returns (model, refs, refs_flash,
    refs_eager), n greedy tokens each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hf = hf_from_gguf(path, torch.bfloat16, device)
    refs = [hf_greedy(hf, p, n) for p in prompts]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        refs_flash = [hf_greedy(hf, p, n) for p in prompts]
    eager = hf_from_gguf(path, torch.bfloat16, device, attn_implementation="eager")
    refs_eager = [hf_greedy(eager, p, n) for p in prompts]
    del eager
    return hf, refs, refs_flash, refs_eager
