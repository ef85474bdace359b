#!/usr/bin/env python3
"""The README's options table, generated from bridge_fgo/options.py (OPTIONS).

  python3 scripts/docs_options_table.py           # print the table
  python3 scripts/docs_options_table.py --write   # replace it in README.md, between the markers

The table sits between `<!-- options-table -->` and `<!-- /options-table -->`; tests/test_docs.py
checks it against OPTIONS. Reads options.py from this checkout without importing the package (no
wrapt, torch or Megatron needed).
"""
import argparse
import ast
import importlib.util
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- options-table -->", "<!-- /options-table -->"


def load_options(root=ROOT):
    """bridge_fgo/options.py of `root`, loaded under a private package name (its relative imports
    resolve inside root/bridge_fgo; the package's __init__ is not run)."""
    pkg_name = "_bridge_fgo_docs_" + str(abs(hash(str(root))))
    if pkg_name + ".options" in sys.modules:
        return sys.modules[pkg_name + ".options"]
    pkg = types.ModuleType(pkg_name)
    pkg.__path__ = [str(root / "bridge_fgo")]
    sys.modules[pkg_name] = pkg
    spec = importlib.util.spec_from_file_location(pkg_name + ".options", root / "bridge_fgo" / "options.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def patch_keywords(root=ROOT):
    """The keyword-only parameters of `def patch(...)`, wherever it is defined in the package."""
    for path in sorted((root / "bridge_fgo").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "patch":
                return [a.arg for a in node.args.kwonlyargs]
    return []


def cells(opt, keywords):
    if opt.choices:
        value = "{" + ",".join(opt.choices) + "}"
    else:
        value = opt.metavar or ""
    flag = opt.flag if opt.is_flag else f"{opt.flag} {value}".strip()
    env = f"{opt.env}=1" if opt.is_flag else (f"{opt.env}={value}" if value else opt.env)
    keyword = f"`patch({opt.name}=...)`" if opt.name in keywords else "—"
    meaning = opt.help.replace("|", "\\|")
    return [f"`{opt.name}`", keyword, f"`{flag}`", f"`{env}`", f"`{opt.default!r}`", meaning]


def table(root=ROOT):
    options = load_options(root)
    keywords = patch_keywords(root)
    rows = ["| option | `patch()` | `bridge-fgo-run` flag | variable | default | meaning |",
            "|---|---|---|---|---|---|"]
    rows += ["| " + " | ".join(cells(opt, keywords)) + " |" for opt in options.OPTIONS]
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = ap.parse_args()
    text = table()
    if not args.write:
        print(text)
        return 0
    readme = README.read_text(encoding="utf-8")
    if BEGIN not in readme or END not in readme:
        print(f"README.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}", encoding="utf-8")
    print("README.md: options table updated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
