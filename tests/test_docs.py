"""The README documents every config key (a key added without docs fails here)."""

from dataclasses import fields, is_dataclass
from pathlib import Path

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


def test_every_rl_config_key_is_in_the_readmes_rl_section():
    from trainers.rl.config import RLConfig

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("\n## Asynchronous RL trainer")
    end = readme.find("\n## ", start + 5)
    section = readme[start : end if end > 0 else None]
    missing = [k for k in _keys(RLConfig) if f"`{k}`" not in section]
    assert not missing, f"README.md's RL section does not document: {missing}"


def test_every_pipeline_config_key_is_in_the_readmes_pipeline_section():
    from trainers.pipeline.config import PipelineConfig

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start = readme.index("\n## Pipeline-parallel trainer")
    end = readme.find("\n## ", start + 5)
    section = readme[start : end if end > 0 else None]
    missing = [k for k in _keys(PipelineConfig) if f"`{k}`" not in section]
    assert not missing, f"README.md's pipeline section does not document: {missing}"
