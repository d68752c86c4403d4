"""MkDocs hook: the pages show the plots the experiments committed under examples/, without copies in docs/.

A page links a plot as GitHub renders it, relative to the page (`../examples/experiments/results/main_curves.png`).
MkDocs only publishes files inside docs/, so this hook adds every plot a page links as a generated file under
`repo/` and points the page's link there. Nothing is written into the repository.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

# a markdown image or link whose target climbs out of docs/ into the repository's examples/ folder
LINK = re.compile(r"(\]\()((?:\.\./)+)(examples/[^)\s]+\.(?:png|svg|jpg))(\))")
PREFIX = "repo"


def _repo_root(config) -> Path:
    return Path(config["docs_dir"]).resolve().parent


def on_files(files, config):
    docs = Path(config["docs_dir"])
    root = _repo_root(config)
    for page in docs.rglob("*.md"):
        depth = len(page.relative_to(docs).parts) - 1
        for _, ups, target, _ in LINK.findall(page.read_text(encoding="utf-8")):
            if ups.count("../") != depth + 1:  # not the repository root seen from this page: leave it to the validator
                continue
            src_uri = f"{PREFIX}/{target}"
            if files.get_file_from_path(src_uri) is None and (root / target).is_file():
                files.append(File.generated(config, src_uri, abs_src_path=str(root / target)))
    return files


def on_page_markdown(markdown, page, config, files):
    here = posixpath.dirname(page.file.src_uri)
    depth = len(Path(page.file.src_uri).parts) - 1

    def relink(match):
        ups, target = match.group(2), match.group(3)
        if ups.count("../") != depth + 1:
            return match.group(0)
        return match.group(1) + posixpath.relpath(f"{PREFIX}/{target}", here or ".") + match.group(4)

    return LINK.sub(relink, markdown)
