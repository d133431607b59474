"""MONAI loads without Hugging Face transformers (4 s of every process's start), and
transformers still works in the same process afterwards (the RL trainer's HF policy)."""

import subprocess
import sys

import pytest

CODE = """
import sys
import medical_data.tasks  # imports MONAI, every network of it
assert "monai" in sys.modules
print("transformers" in sys.modules)
from medical_data.networks import network_for  # MONAI's networks work
import transformers  # and transformers, after
print(transformers.BertConfig(hidden_size=8, num_attention_heads=2).hidden_size)
"""


def test_monai_loads_without_transformers_and_transformers_still_loads_after():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "8"]
