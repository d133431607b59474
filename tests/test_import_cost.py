"""MONAI loads without the packages it imports only for parts fedasync never uses
(medical_data.HIDDEN_FROM_MONAI: transformers, mlflow, matplotlib, pandas, scipy.signal,
scikit-learn: about half of every process's start-up), and each of them still works in the
same process afterwards (plots, the MLflow sink, the RL trainer's HF policy)."""

import json
import subprocess
import sys

import pytest

from medical_data import HIDDEN_FROM_MONAI

CODE = """
import json, sys
import medical_data.tasks  # imports MONAI, every module of it
assert "monai" in sys.modules
loaded = {h: h in sys.modules for h in %r}
from medical_data.networks import network_for  # MONAI's networks work
from medical_data.partition import apply_site_shift  # and its transforms
import importlib
after = {}
for h in loaded:
    try:
        importlib.import_module(h)  # and each hidden package, after
        after[h] = True
    except ImportError:
        after[h] = None  # not installed here
print(json.dumps({"loaded": loaded, "after": after}))
"""


def _installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_monai_loads_without_the_hidden_packages_and_each_loads_after():
    out = subprocess.run(
        [sys.executable, "-c", CODE % (HIDDEN_FROM_MONAI,)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == dict.fromkeys(HIDDEN_FROM_MONAI, False)
    for name in HIDDEN_FROM_MONAI:
        assert got["after"][name] is (True if _installed(name) else None), name


def test_transformers_still_builds_a_model_config_after_monai():
    pytest.importorskip("transformers")
    code = (
        "import medical_data.tasks, transformers\n"
        "print(transformers.BertConfig(hidden_size=8, num_attention_heads=2).hidden_size)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["8"]
