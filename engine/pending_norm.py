"""The add + norm after o_proj or down_proj left for the next GEMM to form (engine/triton_norm_gemm.py, where
GemmConfig.carry_norm asks for it): what the producer hands on, and the rule for when a call carries it (Triton-free,
so the loop pass can ask without importing Triton)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemm_dispatch import GemmConfig, carry_fits, tma_ok


@dataclass(frozen=True)
class PendingNorm:
    """x = rms(h + rms(y) w_branch) w_next and h' = h + rms(y) w_branch, not formed yet: the next GEMM forms them
    as it reads its input (triton_norm_gemm's consumers), or `resolve` does."""

    h: torch.Tensor  # [rows, n] the residual before the add
    y: torch.Tensor  # [rows, n] the producer's output, in the model dtype
    stats: torch.Tensor  # [4, tiles, rows] float32 row sums over each column tile (triton_norm_gemm's docstring)
    w_branch: torch.Tensor  # [n] the branch's norm weight (input_layernorm_2 / post_attention_layernorm_2)
    w_next: torch.Tensor  # [n] the next norm's weight (post_attention_layernorm / the next input_layernorm)
    eps: float

    def resolve(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(h', x) through the add + norm kernel (a consumer that cannot carry it)."""
        from . import triton_fused

        return triton_fused.add_rms_norm2(self.h, self.y, self.w_branch, self.w_next, self.eps)


def carries(cfg: GemmConfig | None, h: torch.Tensor, producer_w: torch.Tensor) -> bool:
    """gemm_dispatch.carry_fits for this call, on a CUDA device whose TMA can read h and the producer's weights."""
    return (carry_fits(cfg, h.shape[0], tuple(producer_w.shape)) and h.device.type == "cuda" and tma_ok(h)
            and tma_ok(producer_w))
