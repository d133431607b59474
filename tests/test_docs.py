"""The docs document every config key (a key added without docs fails here), and the README
links every page of docs/ and no relative link in README.md or docs/ is broken."""

import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from server.config import FedAsyncConfig

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def _keys(cls, prefix=""):
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            yield from _keys(type(default), key + ".")
        else:
            yield key


def test_every_config_key_is_in_the_configuration_page():
    page = (DOCS / "configuration.md").read_text()
    missing = [k for k in _keys(FedAsyncConfig) if f"`{k}`" not in page]
    assert not missing, f"docs/configuration.md does not document: {missing}"


@pytest.mark.parametrize(
    "module, cls, page, heading",
    [
        ("trainers.rl.config", "RLConfig", "rl.md", "Every RL config key"),
        ("trainers.pipeline.config", "PipelineConfig", "pipeline.md", "Every pipeline config key"),
        ("trainers.market.config", "MarketConfig", "market.md", "Every market config key"),
    ],
)
def test_every_trainer_config_key_is_in_its_page(module, cls, page, heading):
    import importlib

    schema = getattr(importlib.import_module(module), cls)
    text = (DOCS / page).read_text()
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 5)
    section = text[start : end if end > 0 else None]
    missing = [k for k in _keys(schema) if f"`{k}`" not in section]
    assert not missing, f"docs/{page}'s {heading} section does not document: {missing}"


def _pages():
    return sorted(DOCS.glob("*.md"))


_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _relative_links(path):
    """Targets of the Markdown links and images in path, outside code, without #anchors."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # fenced blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # https:, mailto:, ... or an anchor in the same page
        yield target.split("#", 1)[0]


def test_the_readme_links_every_docs_page():
    assert _pages(), "docs/ has no pages"
    linked = {(ROOT / t).resolve() for t in _relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in _pages() if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link: {unlinked}"


@pytest.mark.parametrize("path", [ROOT / "README.md", *_pages()], ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    broken = [t for t in _relative_links(path) if not (path.parent / t).exists()]
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"
