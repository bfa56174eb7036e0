"""The README's model table lists exactly the registry's architectures, and an unsupported architecture
fails with an error naming it and the supported ones (issue 18)."""

from __future__ import annotations

import os
import re

import pytest

from pagedllm.model_executor.models import get_model_class, get_supported_archs

README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")


def readme_archs() -> list[str]:
    text = open(README, encoding="utf-8").read()
    start, end = text.index("<!-- models-table:start -->"), text.index("<!-- models-table:end -->")
    return re.findall(r"^\| `(\w+)` \|", text[start:end], flags=re.M)


def test_readme_table_matches_registry() -> None:
    listed = readme_archs()
    assert len(listed) == len(set(listed)), "an architecture is listed twice"
    assert sorted(listed) == sorted(get_supported_archs())


def test_every_registered_class_imports() -> None:
    for arch in get_supported_archs():
        assert get_model_class([arch]).__name__ == arch


def test_unknown_architecture_error_names_it_and_lists_supported() -> None:
    with pytest.raises(ValueError) as e:
        get_model_class(["FalconForCausalLM"])
    msg = str(e.value)
    assert "FalconForCausalLM" in msg
    assert all(a in msg for a in get_supported_archs())
