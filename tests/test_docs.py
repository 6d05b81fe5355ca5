"""The documentation builds and its examples run.

The site builds with ``mkdocs build --strict``: no warning, no error.

Strict mode turns every warning into an error: a broken link or anchor, a nav entry whose page
(or notebook in ``examples/``) is missing, an unresolved cross-reference in a docstring, a
documented parameter that is not in the signature. The build reads the package statically
(griffe), renders the committed notebooks without executing them and needs no network; it
takes about 10 s. The examples in the docstrings and the README's recipe run as written.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    # mkdocs-material >= 9.7 prints a banner about MkDocs 2.0 that names this variable, whose
    # name contains "WARNING"; setting it drops the banner (it is not a build warning).
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "api" / "kernels" / "index.html").is_file()


def examples():
    """Every ``**Example**`` literal block in the package's docstrings: ``(where, code)``."""
    found = []
    for path in sorted((ROOT / "numpyro_sgmc").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"\*\*Example\*\*[^\n]*::\n\n((?:(?: {8}.*)?\n)+)", text):
            found.append(
                (
                    f"{path.relative_to(ROOT)}:{text[: match.start()].count(chr(10))}",
                    textwrap.dedent(match.group(1)),
                )
            )
    return found


@pytest.mark.slow
@pytest.mark.parametrize("where, code", examples(), ids=[w for w, _ in examples()])
def test_docstring_example_runs(where, code):
    exec(compile(code, where, "exec"), {"__name__": "__example__"})


@pytest.mark.slow
def test_readme_recipe_runs_as_pasted():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## The recipe") :]
    code = section[section.index("```python") + len("```python") : section.index("```\n\n")]
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
