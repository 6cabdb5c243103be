"""docs/architecture.md draws the contracts that lint-imports checks: the picture cannot drift.

The page's diagram (the ``text`` code block after the ``layers contract`` comment) has one line per
layer naming its packages (``nbdist.bench`` and ``nbdist.memory`` side by side on one line); no other
line of the diagram names an ``nbdist.`` package. These tests read the layers, the forbidden
contracts and the deliberate exceptions from ``pyproject.toml`` and look for them on the page.
No Sphinx build: this runs in well under a second.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
MARKER = "<!-- the layers contract of pyproject.toml"
PACKAGE = re.compile(r"\bnbdist\.(\w+)")


def _contracts():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    config = tomllib.loads(pyproject)["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def _diagram() -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    assert MARKER in text, f"{PAGE.name}: no '{MARKER} ...' comment before the diagram"
    block = re.search(r"```text\n(.*?)\n```", text[text.index(MARKER):], re.S)
    assert block, f"{PAGE.name}: no ```text block after the layers comment"
    return block.group(1).splitlines()


def _layers_in_contract() -> list[set[str]]:
    layers = _contracts()["layers"]["layers"]
    return [{name.strip() for name in re.split(r"[|:]", layer)} for layer in layers]


def _layers_in_picture() -> list[set[str]]:
    rows = []
    for line in _diagram():
        names = {f"nbdist.{m}" for m in PACKAGE.findall(line)}
        if names:
            rows.append(names)
    return rows


def test_the_picture_names_the_layers_of_the_contract_in_the_same_order():
    contract, picture = _layers_in_contract(), _layers_in_picture()
    show = lambda rows: "\n".join(" | ".join(sorted(r)) for r in rows)  # noqa: E731
    assert picture == contract, (
        f"docs/architecture.md draws\n{show(picture)}\nbut pyproject.toml's layers are\n"
        f"{show(contract)}\nChange both together (one diagram line per layer, top to bottom).")


def test_every_package_of_nbdist_is_a_layer():
    """A new part is placed in the contract (and so in the picture), not left unchecked."""
    in_contract = set().union(*_layers_in_contract())
    packages = {f"nbdist.{p.parent.name}" for p in (ROOT / "nbdist").glob("*/__init__.py")}
    assert packages - in_contract == set(), "packages outside the layers contract"
    assert {"nbdist.errors", "nbdist.report"} <= in_contract


def test_the_page_names_every_contract_and_every_deliberate_exception():
    text = PAGE.read_text(encoding="utf-8")
    for contract in _contracts().values():
        assert contract["name"] in text, f"docs/architecture.md does not name {contract['name']!r}"
        for ignored in contract.get("ignore_imports", ()):
            assert f"`{ignored}`" in text, f"the exception {ignored!r} is not on the page"


def test_the_page_is_in_the_toctree_and_links_the_runtime_threading_model():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    toctrees = re.findall(r"```\{toctree\}\n(.*?)```", index, re.S)
    assert any(re.search(r"^architecture$", t, re.M) for t in toctrees), "not in docs/index.md's toctree"
    assert "{py:mod}`nbdist.runtime`" in PAGE.read_text(encoding="utf-8")
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert re.search(r"automodule:: nbdist\.runtime\b", api)
