"""Sphinx configuration for the zerojax documentation.

Build: ``pip install -e ".[docs]"`` then ``sphinx-build -W --keep-going -b html docs
docs/_build/html`` (CI runs it; -W makes every warning an error). The pages are Markdown
(myst-parser); the API reference is autodoc over the public names, reading Google-style
docstrings (napoleon).
"""

import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# autodoc imports zerojax's modules, which import JAX: keep it on the CPU backend, so that a
# docs build on a machine with libtpu or a CUDA plugin neither prints nor claims a device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import zerojax  # noqa: E402

project = "zerojax"
copyright = "the zerojax authors"
author = "the zerojax authors"
version = release = zerojax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]

# Markdown: `#` links to headings as GitHub makes them, and ::: fences for directives.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# API reference: Google-style docstrings; `Attributes:` as fields of the class (dataclass fields
# are not documented twice), members in source order, type hints in the signature only.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False}

html_theme = "sphinx_book_theme"
html_title = "zerojax"
html_theme_options = {"show_toc_level": 2}


# The pages link the repository's files as GitHub shows them (`../BENCHMARKS.md`); in the
# built site BENCHMARKS.md is the page `benchmarks`, which includes it.
_BENCHMARKS_LINK = re.compile(r"\]\(\.\./BENCHMARKS\.md")


def _link_benchmarks_page(app, docname, source):
  source[0] = _BENCHMARKS_LINK.sub("](benchmarks.md", source[0])


def setup(app):
  app.connect("source-read", _link_benchmarks_page)
