"""The README documents every config key (a key added without docs fails here)."""

from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from server.config import FedAsyncConfig


def _keys(cls, prefix=""):
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            yield from _keys(type(default), key + ".")
        else:
            yield key


def test_every_config_key_is_in_the_readme():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    missing = [k for k in _keys(FedAsyncConfig) if f"`{k}`" not in readme]
    assert not missing, f"README.md does not document: {missing}"


@pytest.mark.parametrize(
    "module, cls, heading",
    [
        ("trainers.rl.config", "RLConfig", "Asynchronous RL trainer"),
        ("trainers.pipeline.config", "PipelineConfig", "Pipeline-parallel trainer"),
    ],
)
def test_every_trainer_config_key_is_in_its_readme_section(module, cls, heading):
    import importlib

    schema = getattr(importlib.import_module(module), cls)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index(f"\n## {heading}")
    end = readme.find("\n## ", start + 5)
    section = readme[start : end if end > 0 else None]
    missing = [k for k in _keys(schema) if f"`{k}`" not in section]
    assert not missing, f"README.md's {heading} section does not document: {missing}"
