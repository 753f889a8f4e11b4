"""The new user's case (issue 55): one `convert` tool and its own reward."""

import re

TO_M = {"km": 1000.0, "m": 1.0, "cm": 0.01, "mm": 0.001, "mi": 1609.344, "ft": 0.3048, "in": 0.0254}


def fmt(x: float) -> str:
    return f"{x:.3f}".rstrip("0").rstrip(".")


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length from one unit to another.

    Args:
        value: the length to convert
        from_unit: its unit: km, m, cm, mm, mi, ft or in
        to_unit: the unit wanted: km, m, cm, mm, mi, ft or in
    """
    return fmt(float(value) * TO_M[from_unit] / TO_M[to_unit])


def correct(completions, answer, **kwargs):
    """1 when the last assistant message states the converted value."""
    out = []
    for c, a in zip(completions, answer):
        if isinstance(c, list):
            said = [m.get("content") or "" for m in c if m.get("role") == "assistant"]
            text = said[-1] if said else ""
        else:
            text = c
        nums = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
        out.append(1.0 if a in nums else 0.0)
    return out
