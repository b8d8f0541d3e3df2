"""Sphinx configuration of the API reference: ``python -m sphinx -W -b html docs docs/_build``.

The reference is generated from the package's docstrings (autodoc; napoleon reads the
NumPy-style "Parameters" / "Returns" sections). `API` below lists the public modules in
reading order; a module that is not in this tree (an optional part not installed) is left out
of the generated page, named in the build log, never a warning. The topic guides are the
Markdown files next to this one (design.md, program.md, ...), read on the repository page.
"""
import importlib
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tiga_numba  # noqa: E402

project = "tiga-numba"
release = version = tiga_numba.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build", "**/*.md"]
source_suffix = {".rst": "restructuredtext"}
html_theme = "alabaster"
html_static_path = []
autodoc_member_order = "bysource"
autodoc_typehints = "none"
#: classes built only by their classmethod constructors: no __init__ signature shown
PRIVATE_INIT = {"tiga_numba.graph.Graph"}
autodoc_default_options = {"undoc-members": False, "show-inheritance": False}
# optional array libraries the reference never needs to run: import them only if present
autodoc_mock_imports = [name for name in ("cupy", "torch", "dask", "distributed")
                        if importlib.util.find_spec(name) is None]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = True  # "Attributes" as fields: autodoc lists __slots__ members itself
nitpicky = False
# `name` in a docstring is code, as in the package's plain-text docstrings
default_role = "literal"

#: (module, section title, members or None for the module's __all__)
API = [
    ("tiga_numba", "Functional API",
     ["attention", "attention_backward", "attention_merge", "AttentionStats", "explain",
      "make_plan", "leaky_relu", "options", "Options"]),
    ("tiga_numba.graph", "Relations: Graph", ["Graph"]),
    ("tiga_numba.program", "Programs: MessagePassing", None),
    ("tiga_numba.nn", "Score networks: tiga_numba.nn", None),
    ("tiga_numba.layers", "GNN layers: tiga_numba.layers", None),
    ("tiga_numba.torch", "PyTorch autograd: tiga_numba.torch", None),
    ("tiga_numba.dask", "Scale-out: tiga_numba.dask", None),
    ("tiga_numba.reference", "float64 oracles: tiga_numba.reference",
     ["attention", "attention_backward", "pruned_attention"]),
    ("tiga_numba.precompile", "Compiling ahead: tiga_numba.precompile", ["precompile", "main"]),
]


def _write_reference(app):
    lines = ["API reference", "=============", "",
             "Generated from the docstrings. Arrays are node-major: ``q (num_dst, H, D)``, "
             "``k (num_src, Hkv, D)``, ``v (num_src, Hkv, Dv)``; see the design page "
             "(docs/design.md) for the full contract.", ""]
    from sphinx.ext.autodoc.mock import mock

    for module_name, title, members in API:
        try:
            with mock(autodoc_mock_imports):  # as autodoc will import it
                module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name):
                print(f"tiga_numba docs: {module_name} is not in this tree; left out")
                continue
            raise
        if members is not None:
            members = [m for m in members if hasattr(module, m)]
        lines += [title, "-" * len(title), "", f".. automodule:: {module_name}",
                  f"   :members: {', '.join(members)}" if members is not None else "   :members:",
                  ""]
    path = os.path.join(app.srcdir, "_api", "reference.rst")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = "\n".join(lines) + "\n"
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def _literal_blocks(app, what, name, obj, options, lines):
    """The package's docstrings follow the plain-text convention: an indented block after a
    blank line is an example, not a quotation. Mark each such block literal for reST (turn a
    paragraph's closing ':' into '::', or put a bare '::' line, which renders as nothing, before
    a block with no introducing colon). Runs before napoleon, whose NumPy sections have no blank
    line between a field and its indented description."""
    def indent(line):
        return len(line) - len(line.lstrip())

    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        starts_block = (not line.strip() and out[:-1] and out[-2].strip() and i + 1 < len(lines)
                        and lines[i + 1].strip() and indent(lines[i + 1]) > indent(out[-2])
                        and not out[-2].rstrip().endswith("::")
                        and not out[-2].lstrip().startswith((">>>", "..", ":")))
        if starts_block:
            previous = out[-2].rstrip()
            if previous.endswith(":"):
                out[-2] = previous + ":"
            else:
                out[-1:] = ["", " " * indent(out[-2]) + "::", ""]
        i += 1
    lines[:] = out


def _skip_slots(app, what, name, obj, skip, options):
    """__slots__ descriptors carry no docstring; the class's Attributes section documents them."""
    return True if isinstance(obj, types.MemberDescriptorType) else None


def _hide_private_init(app, what, name, obj, options, signature, return_annotation):
    return ("", return_annotation) if what == "class" and name in PRIVATE_INIT else None


def setup(app):
    app.connect("builder-inited", _write_reference)
    app.connect("autodoc-process-signature", _hide_private_init)
    app.connect("autodoc-skip-member", _skip_slots)
    app.connect("autodoc-process-docstring", _literal_blocks, priority=400)
