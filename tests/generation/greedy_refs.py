"""Greedy references the vLLM engines' tests compare with: HF ``generate`` one prompt at a time,
and ``generation.sample`` through an engine, both ``MAX_NEW`` tokens and cut after EOS."""

from __future__ import annotations

import torch

from peergrade.generation import SamplerSettings, sample

MAX_NEW = 8


def hf_greedy(model, tokenizer, prompt_ids) -> list[list[int]]:
    """``model.generate`` (greedy) one prompt at a time, cut after the first EOS."""
    out = []
    with torch.no_grad():
        for p in prompt_ids:
            x = torch.tensor([p])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(p) :].tolist()
            if tokenizer.eos_token_id in y:
                y = y[: y.index(tokenizer.eos_token_id) + 1]
            out.append(y)
    return out


def engine_greedy(engine, model, tokenizer, prompt_ids) -> list[list[int]]:
    """Greedy replies through ``generation.sample(engine=engine)``: each ends at EOS or the
    length limit."""
    rows = [{"prompt": str(i)} for i in range(len(prompt_ids))]
    st = SamplerSettings(n=1, max_new_tokens=MAX_NEW, temperature=0.0)
    s = sample(model, tokenizer, rows, st, seed=0, prompt_ids=prompt_ids, engine=engine)
    assert set(s.finish_reason) <= {"eos", "length"}
    return s.completion_id_lists()
