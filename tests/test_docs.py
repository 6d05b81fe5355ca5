"""The documentation site builds with ``mkdocs build --strict``: no warning, no error.

Strict mode turns every warning into an error: a broken link or anchor, a nav entry whose page
(or notebook in ``examples/``) is missing, an unresolved cross-reference in a docstring, a
documented parameter that is not in the signature. The build reads the package statically
(griffe), renders the committed notebooks without executing them and needs no network; it
takes about 10 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
