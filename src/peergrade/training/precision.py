"""The first step's bf16 check: did the update move the weights the bf16 compute sees far more
than it moved the float32 master weights?

Under ``model.autocast`` bf16 the weights stay float32 (the master copy the optimizer updates)
and every forward casts them to bfloat16. A float32 weight lying exactly halfway between two
bfloat16 values (a de-quantised GGUF has millions: issue 34) is cast by rounding half to even;
after any update, however small, it rounds the way the update pushed it, a full bfloat16 step.
When many weights sit there, a 1e-6 learning rate moves the computed model as a 1e-4 one
would. ``Bf16StepProbe`` measures it: before the first update it copies a strided sample of
every float32 trainable weight; after, ``metrics()`` gives ``precision/bf16_step_ratio``
(sum |change of the bf16 casts| / sum |change of the float32 weights| over the sample: about 1
for weights spread at random, far above 1 with ties) and ``precision/bf16_tie_frac`` (the
share of sampled weights exactly on a bfloat16 midpoint before the update). The detector
``bf16_update`` reads them.

This module does not change any weight, and measures nothing without bf16 autocast.
"""

from __future__ import annotations

import torch

#: sampled elements per parameter tensor (strided over the whole tensor)
SAMPLE = 65536


def bf16_ties(t: torch.Tensor) -> torch.Tensor:
    """Mask of the float32 values of ``t`` exactly halfway between two bfloat16 values (the
    16 bits bfloat16 drops are 0x8000)."""
    return (t.contiguous().view(torch.int32) & 0xFFFF) == 0x8000


class Bf16StepProbe:
    """A strided sample of every float32 trainable weight, taken before the first update."""

    def __init__(self, model, sample: int = SAMPLE):
        self.samples: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        for p in model.parameters():
            if not p.requires_grad or p.dtype != torch.float32 or type(p.data) is not torch.Tensor:
                continue  # bf16 weights, frozen ones, FSDP shards (DTensor): not measured
            stride = max(1, p.numel() // sample)
            self.samples.append((p, stride, p.detach().reshape(-1)[::stride].clone()))

    def metrics(self) -> dict[str, float]:
        """``precision/bf16_step_ratio`` and ``precision/bf16_tie_frac`` (empty when nothing
        was sampled or the float32 weights did not move)."""
        d32 = d16 = 0.0
        ties = total = 0
        for p, stride, old in self.samples:
            new = p.detach().reshape(-1)[::stride].float()
            d32 += float((new - old).abs().sum())
            d16 += float((new.bfloat16().float() - old.bfloat16().float()).abs().sum())
            ties += int(bf16_ties(old).sum())
            total += old.numel()
        if not total or d32 <= 0:
            return {}
        return {"precision/bf16_step_ratio": d16 / d32, "precision/bf16_tie_frac": ties / total}
