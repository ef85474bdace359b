"""The README and docs/ kept in step with the code, the release list and the results files.

Fast and torch-free: reads bridge_fgo/options.py of this checkout through scripts/docs_options_table.py
(without running the package's __init__), requirements/releases.conf, README.md and docs/*.md. Each
failure says what to update.
"""
import ast
import importlib.util
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RELEASES_CONF = ROOT / "requirements" / "releases.conf"
MAX_README_LINES = 260

OPTIONS_MARKER = "<!-- options-table -->"
SUPPORT_MARKER = "<!-- support-matrix -->"
HEADLINE_MARKER = "<!-- headline-table -->"
REGENERATE = "regenerate it with `python3 scripts/docs_options_table.py --write`"


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _generator():
    """scripts/docs_options_table.py, the one reader of options.py and of patch()'s keywords that
    both the table's generator and this test use (loaded by path: scripts/ is not a package)."""
    name = "_bridge_fgo_docs_options_table"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "docs_options_table.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _load_options():
    return _generator().load_options(ROOT)


def _patch_keywords():
    return set(_generator().patch_keywords(ROOT))


def _cells(line: str):
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return [c.strip() for c in re.split(r"(?<!\\)\|", inner)]


def _plain(cell: str) -> str:
    return cell.replace("`", "").replace("**", "").strip()


def _table_after(text: str, marker: str, what: str):
    """The header and data rows (lists of cells) of the first table after `marker`."""
    assert marker in text, f"README.md lost its `{marker}` marker: put it on the line before the {what}"
    lines = text.split(marker, 1)[1].splitlines()
    rows, started = [], False
    for line in lines:
        if line.lstrip().startswith("|"):
            started = True
            rows.append(line)
        elif started or (line.strip() and not line.strip().startswith("<!--")):
            break
    assert len(rows) >= 3, f"README.md: no table right after `{marker}` (the {what})"
    header, data = _cells(rows[0]), [_cells(r) for r in rows[2:]]
    return header, data, rows[2:]


def _column(header, keyword: str, what: str) -> int:
    for i, title in enumerate(header):
        if keyword in title.lower():
            return i
    raise AssertionError(f"README.md {what}: no column whose title contains {keyword!r} (header: {header})")


def test_options_table_lists_every_option_with_flag_variable_and_default():
    options = _load_options()
    keywords = _patch_keywords()
    header, rows, _ = _table_after(README.read_text(encoding="utf-8"), OPTIONS_MARKER, "options table")
    col = {k: _column(header, k, "options table") for k in ("option", "patch", "flag", "variable", "default")}
    by_name = {}
    for row in rows:
        by_name[_plain(row[col["option"]])] = row
    defined = [o.name for o in options.OPTIONS]
    problems = []
    missing = [n for n in defined if n not in by_name]
    extra = [n for n in by_name if n not in defined]
    if missing:
        problems.append(f"no row for {missing}")
    if extra:
        problems.append(f"rows for {extra}, which bridge_fgo/options.py OPTIONS does not define")
    for opt in options.OPTIONS:
        row = by_name.get(opt.name)
        if row is None:
            continue
        flag = _plain(row[col["flag"]]).split(" ")[0]
        if flag != opt.flag:
            problems.append(f"{opt.name}: flag {flag!r}, OPTIONS says {opt.flag!r}")
        env = re.split(r"[ =]", _plain(row[col["variable"]]))[0]
        if env != opt.env:
            problems.append(f"{opt.name}: variable {env!r}, OPTIONS says {opt.env!r}")
        shown = _plain(row[col["default"]])
        try:
            default = ast.literal_eval(shown)
        except (ValueError, SyntaxError):
            problems.append(f"{opt.name}: default {shown!r} is not a Python literal (OPTIONS: {opt.default!r})")
        else:
            if default != opt.default or type(default) is not type(opt.default):
                problems.append(f"{opt.name}: default {shown}, OPTIONS says {opt.default!r}")
        says_keyword = f"patch({opt.name}=" in _plain(row[col["patch"]])
        if says_keyword != (opt.name in keywords):
            problems.append(f"{opt.name}: the patch() column says {'a' if says_keyword else 'no'} keyword, "
                            f"but patch() {'takes' if opt.name in keywords else 'does not take'} it")
    assert not problems, ("README.md's options table is out of step with bridge_fgo/options.py: "
                          + "; ".join(problems) + f". Update the table: {REGENERATE}")


def _releases():
    out = []
    for line in RELEASES_CONF.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line.split()[0])
    return out


def test_support_matrix_lists_exactly_the_releases_of_releases_conf():
    releases = _releases()
    assert releases, f"{_rel(RELEASES_CONF)} defines no release"
    _, rows, _ = _table_after(README.read_text(encoding="utf-8"), SUPPORT_MARKER, "support matrix")
    listed = [_plain(r[0]) for r in rows]
    missing = [r for r in releases if r not in listed]
    extra = [r for r in listed if r not in releases]
    todo = ([f"add a row for {missing}"] if missing else []) + ([f"remove the rows for {extra}"] if extra else [])
    assert not todo, (
        f"README.md's support matrix lists Megatron-Bridge {listed}, requirements/releases.conf defines "
        f"{releases}: {' and '.join(todo)} (say what was run on each release: docs/benchmarks.md, "
        "docs/compatibility.md)")
    assert len(listed) == len(set(listed)), f"README.md's support matrix lists a release twice: {listed}"


def _doc_files():
    return [README, *DOCS]


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


LINK = re.compile(r"\]\(([^)\s]+)\)")
RESULTS_MENTION = re.compile(r"(?<![\w/.])(?:\.\./)?benchmarks/results/[\w./*-]*")


def test_every_results_path_named_in_the_docs_exists():
    problems = []
    for doc in _doc_files():
        text = doc.read_text(encoding="utf-8")
        for target in LINK.findall(text):
            path = target.split("#", 1)[0]
            if "benchmarks/results" in path and not (doc.parent / path).resolve().exists():
                problems.append(f"{_rel(doc)} links to {target}, which does not exist from {_rel(doc.parent) or '.'}/")
        for mention in RESULTS_MENTION.findall(text):
            path = mention.rstrip(".")
            path = path[3:] if path.startswith("../") else path
            found = list(ROOT.glob(path)) if "*" in path else ([ROOT / path] if (ROOT / path).exists() else [])
            if not found:
                problems.append(f"{_rel(doc)} names {mention}, which matches nothing in this checkout")
    assert not problems, ("results files named in the docs are missing: " + "; ".join(sorted(set(problems)))
                          + ". Fix the path in the doc, or restore the file under benchmarks/results/")


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(doc: pathlib.Path):
    text = doc.read_text(encoding="utf-8")
    anchors = set(re.findall(r"<a id=\"([^\"]+)\"", text))
    seen = {}
    for line in _without_code_blocks(text).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            anchors.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return anchors


def test_every_link_between_the_docs_resolves():
    problems = []
    for doc in _doc_files():
        for target in LINK.findall(_without_code_blocks(doc.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue  # an URL
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                problems.append(f"{_rel(doc)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{_rel(doc)}: {target} (no heading or <a id> {anchor!r} in {_rel(dest)})")
    assert not problems, "broken links: " + "; ".join(sorted(set(problems))) + \
        ". Fix the link, or restore the heading / <a id=\"...\"> anchor it points at"


def test_readme_stays_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): it is for users; move details to "
        "docs/design.md, docs/benchmarks.md, docs/compatibility.md or docs/development.md")


FIGURE = re.compile(r"\d+(?:\.\d+)?\s*(?:GiB|GB|MB|s/step|s)\b")


def test_every_headline_figure_links_to_its_run():
    _, rows, lines = _table_after(README.read_text(encoding="utf-8"), HEADLINE_MARKER, "headline table")
    unlinked = [line for line in lines if FIGURE.search(line) and "](docs/benchmarks.md#" not in line]
    assert any(FIGURE.search(line) for line in lines), "README.md's headline table has no figures"
    assert not unlinked, (
        "README.md's headline table has figures in rows that do not link to their run: "
        + " / ".join(u[:80] for u in unlinked)
        + ". Link each row to its section of docs/benchmarks.md ([...](docs/benchmarks.md#anchor))")
