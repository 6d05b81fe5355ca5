"""MkDocs hook: serve the notebooks of ``examples/`` as pages ``examples/*.ipynb``.

The notebooks live in the repository's ``examples/`` folder, outside ``docs/``; this adds
each ``examples/*.ipynb`` to the site's files under the same path, before mkdocs-jupyter
turns notebooks into pages (hence the high priority), so the nav can list
``examples/01_quickstart.ipynb``. No symlink, no copy: the committed notebook (with its
outputs) is rendered as it is. A nav entry naming a notebook that does not exist stays a
strict-mode error.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

EXAMPLES = "examples"


@event_priority(100)
def on_files(files, config):
    root = Path(config["config_file_path"]).resolve().parent
    for notebook in sorted((root / EXAMPLES).glob("*.ipynb")):
        src_uri = f"{EXAMPLES}/{notebook.name}"
        if files.get_file_from_path(src_uri) is None:
            files.append(
                File(
                    src_uri,
                    src_dir=str(root),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files
