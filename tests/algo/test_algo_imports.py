"""peergrade.algo is pure torch: importing it must not pull in transformers or the config."""

from __future__ import annotations

import json
import subprocess
import sys


def test_import_algo_pulls_in_neither_transformers_nor_config():
    code = (
        "import json, sys\n"
        "import peergrade.algo as a\n"
        "names = ['group_advantages', 'gae', 'kl_divergence', 'off_policy_weights', 'policy_loss', 'value_loss']\n"
        "print(json.dumps({\n"
        "    'transformers': sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'),\n"
        "    'config': 'peergrade.config' in sys.modules,\n"
        "    'missing': [n for n in names if not callable(getattr(a, n, None))],\n"
        "    'all': sorted(a.__all__),\n"
        "}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["transformers"] == [], result["transformers"][:5]
    assert result["config"] is False
    assert result["missing"] == []
    assert result["all"] == sorted(
        [
            # the policy loss's typed options and its registry (peergrade.algo.loss_options,
            # peergrade.algo.loss_registry)
            *("LOSS_TYPES", "LossBatch", "LossCounts", "LossOptions", "loss_options"),
            *("ClippedLoss", "DrGrpoLoss", "CispoLoss", "SapoLoss", "VespoLoss", "CustomLoss"),
            *("loss_names", "register_loss"),
            "adaptive_entropy_coef",
            "entropy_bonus",
            "group_advantages",
            "gae",
            "high_entropy_mask",
            "kl_divergence",
            "off_policy_sequence_mask",
            "off_policy_weights",
            "policy_loss",
            "value_loss",
            "vespo_weights",
        ]
    )


def test_algo_sources_import_only_torch_and_stdlib():
    import ast
    from pathlib import Path

    import peergrade.algo

    allowed = {"__future__", "numbers", "math", "torch", "peergrade"}
    allowed |= {"dataclasses", "typing", "collections"}  # the loss options' records
    pkg = Path(peergrade.algo.__file__).parent
    for path in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
                if roots == ["peergrade"]:
                    assert node.module.startswith("peergrade.algo"), (path.name, node.module)
            else:
                continue
            assert set(roots) <= allowed, (path.name, roots)
