"""No generic titan-train module names a model family: `titan_train.model_families` is the one module that
ties a name to a family, so a family added or renamed touches it alone, and nothing else branches on, or
documents, one family's quirks (a capability on the family does that).

The names looked for are every registered family's and every flavor's stem (llama, qwen, deepseek, gpt_oss,
written with a dash too; kimi from the `kimi_k2` flavor), read from the shipped families (`model_families.FAMILIES`, not the live registry, which other tests add
to), not typed here; planted
once: a comment naming "DeepSeek's YaRN" back in plan.py made the test fail.
"""

from __future__ import annotations

import re
from pathlib import Path

from titan_train.model_families import FAMILIES

SOURCE = Path(__file__).resolve().parents[1] / "src" / "titan_train"
THE_ONE_MODULE = SOURCE / "model_families.py"


def _stems() -> set[str]:
    """The alphabetic stem of each family name and flavor name ("qwen3_5" -> "qwen", "kimi_k2" -> "kimi"),
    debug and size flavors left out; gpt_oss whole, with a dash as prose writes it."""
    names = {family.name for family in FAMILIES}
    for family in FAMILIES:
        names |= set(family.flavors)
    stems = set()
    for name in names:
        if name in {"gpt_oss"}:
            stems |= {"gpt_oss", "gpt-oss"}
            continue
        stem = re.match(r"[a-z]+", name.lower())
        if stem and len(stem.group()) > 3 and not stem.group().startswith("debug"):
            stems.add(stem.group())
    return stems


def test_no_generic_module_names_a_family():
    stems = _stems()
    assert {"llama", "qwen", "deepseek", "gpt-oss", "kimi"} <= stems, stems
    pattern = re.compile("|".join(map(re.escape, sorted(stems))), re.IGNORECASE)
    hits = [
        f"{path.relative_to(SOURCE)}:{number}: {line.strip()}"
        for path in sorted(SOURCE.rglob("*.py"))
        if path != THE_ONE_MODULE
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == [], "family names belong in titan_train/model_families.py:\n" + "\n".join(hits)
