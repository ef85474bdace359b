"""Summarise scripts/bridge_unit_tests.sh's junit XML: one line per way, then per patched way the
tests that pass unpatched (`none`) but not patched, each with its exception and the bridge_fgo frames it went through."""
import re
import sys
import xml.etree.ElementTree as ET

OUTCOMES = ("passed", "failed", "skipped", "errors")


def results(path):
    """test id -> (outcome, one-line message); an error in setup/teardown counts as `errors`."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name, file = case.get("classname", ""), case.get("name", ""), case.get("file", "")
        module = file[:-3].replace("/", ".")  # junit_family=xunit1 gives the file
        inner = cls[len(module) + 1:] if file and cls.startswith(module + ".") else ("" if file else cls)
        test = "::".join(p for p in (file, inner, name) if p)
        kind, msg = "passed", ""
        for tag, label in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                kind, msg = label, _cause(node)
                break
        if out.get(test, ("passed",))[0] == "passed":  # a teardown error after a pass is reported twice
            out[test] = (kind, msg)
    return out


FRAME = re.compile(r'File "[^"]*?bridge_fgo/([\w/]+\.py)", line (\d+), in (\w+)')


def _cause(node):
    """The exception's last line (--tb=native), and the bridge_fgo frames it passed through."""
    text = (node.text or "").strip()
    last = text.splitlines()[-1].strip() if text else node.get("message", "")
    frames = [f"{path.rsplit('/', 1)[-1][:-3]}.{func}:{line}" for path, line, func in FRAME.findall(text)]
    return last[:200] + (f"  [bridge_fgo: {' > '.join(frames)}]" if frames else "")


def main(out, ways):
    runs = {}
    for way in ways:
        runs[way] = results(f"{out}/{way}.xml")
        counts = {k: 0 for k in OUTCOMES}
        for kind, _ in runs[way].values():
            counts[kind] += 1
        with open(f"{out}/{way}.time") as f:
            took = f.read().split(": ", 1)[1].strip()
        print(f"{way:8} " + ", ".join(f"{counts[k]} {k}" for k in OUTCOMES) + f" ({len(runs[way])} tests, {took})")
    base = runs.get("none")
    if base is None:
        return
    for way in ways:
        if way == "none":
            continue
        worse = sorted(t for t, (k, _) in runs[way].items() if k in ("failed", "errors") and base.get(t, ("",))[0] == "passed")
        print(f"\npass unpatched, fail under offload={way}: {len(worse)}")
        for t in worse:
            print(f"  {t}\n      {runs[way][t][1]}")
        missing = sorted(set(base) - set(runs[way]))
        if missing:
            print(f"  ({len(missing)} tests of the unpatched run did not run: {', '.join(missing[:5])} ...)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
