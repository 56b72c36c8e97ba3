"""Every fenced block of the docs, what it is and how CI checks it (issue 26: docs that stay true).

A block's kind comes from its fence (```python, ```bash, ```json) or, for a bare fence, from its first line
(``$ `` a shell session, ``>>> `` a Python session); an HTML comment on the line just above the fence says
how a shell or Python block is checked:

* ``<!-- snippet: prelude NAME -->``   a Python block run with the names ``tests/test_docs.py`` sets up for NAME
  (blocks of one document run in order in one namespace and one scratch directory, as a reader runs them);
* ``<!-- snippet: sample NAME -->``    a ``$`` session whose output ``tools/doc_samples.py NAME`` reproduces
  (``…`` in a line stands for any text, a line ``...`` for any lines);
* ``<!-- snippet: run by: WHERE -->``  run elsewhere in CI (``.ci/run`` or a named test), checked to be there;
* ``<!-- snippet: not run: REASON -->`` not runnable here (a GPU, a real vLLM server, the package index…).

A Python block without a marker runs as it stands. Shell blocks and sessions need a marker: a command line
that no test runs is the kind of snippet that rots. ``python tools/doc_snippets.py`` lists every block with
its status and prints the totals.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# docs/ and its folders (docs/benchmarks/ holds the measurement records the user docs link to).
DOCS = ["README.md", *sorted(os.path.relpath(os.path.join(d, f), ROOT)
                             for d, _, fs in os.walk(os.path.join(ROOT, "docs")) for f in fs if f.endswith(".md")),
        *sorted(f"spec/{f}" for f in os.listdir(os.path.join(ROOT, "spec")) if f.endswith(".md"))]
_FENCE = re.compile(r"^(`{3,})([\w+-]*)\s*$")
_MARK = re.compile(r"^<!--\s*snippet:\s*(prelude|sample|run by:|not run:)\s*(.*?)\s*-->$")
# Where a measured figure comes from: the command that printed it, when, and the commit of the code measured.
FIGURE = re.compile(r"<!--\s*figure:\s*measured (\d{4}-\d{2}-\d{2}) at ([0-9a-f]{7,40}):\s*(.*?)\s*-->")
SHELL = {"bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Snippet:
    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str | None = None  # prelude / sample / run by: / not run:
    arg: str = ""
    figure: tuple[str, str, str] | None = None  # (date, commit, command) of a figure marker just above

    @property
    def runs_a_tool(self) -> bool:
        """A block whose first line runs one of tools/ (a benchmark's output, printed under its command)."""
        first = self.text.lstrip("\n").split("\n", 1)[0]
        return bool(re.search(r"\btools/\w+\.py\b", first)) and self.kind == "text"

    @property
    def kind(self) -> str:
        first = self.text.lstrip("\n").split("\n", 1)[0]
        if self.lang in ("python", "py"):
            return "python-session" if first.startswith(">>> ") else "python"
        if self.lang in SHELL:
            return "shell-session" if first.startswith("$ ") else "shell"
        if self.lang == "json":
            return "json"
        if first.startswith("$ "):
            return "shell-session"
        if first.startswith(">>> "):
            return "python-session"
        return "text"

    @property
    def runnable_kind(self) -> bool:
        return self.kind in ("python", "python-session", "shell", "shell-session")

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def status(self) -> str:
        if not self.runnable_kind:
            return "checked (json parses)" if self.kind == "json" else "text"
        if self.mark == "not run:":
            return f"not run: {self.arg}"
        if self.mark == "run by:":
            return f"run by {self.arg}"
        if self.mark == "sample":
            return f"run (sample {self.arg})"
        if self.mark == "prelude":
            return f"run (prelude {self.arg})"
        return "run" if self.kind.startswith("python") else "UNMARKED"


def snippets(doc: str) -> list[Snippet]:
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        prev = lines[i - 1].strip() if i else ""
        mm = _MARK.match(prev)
        fm = FIGURE.fullmatch(prev)
        out.append(Snippet(doc, i + 1, lang, "\n".join(lines[i + 1:j]) + "\n",
                           mm.group(1) if mm else None, mm.group(2) if mm else "",
                           (fm.group(1), fm.group(2), fm.group(3)) if fm else None))
        i = j + 1
    return out


def all_snippets() -> list[Snippet]:
    return [s for d in DOCS for s in snippets(d)]


def match_output(expected: str, got: str) -> str | None:
    """None if ``got`` matches ``expected`` (``…`` = any text within a line, a line ``...`` = any lines), else
    the first line that differs."""
    exp = expected.rstrip("\n").split("\n")
    out = got.rstrip("\n").split("\n")

    def line_re(line: str) -> re.Pattern[str]:
        return re.compile("^" + ".*".join(re.escape(p.rstrip()) for p in line.split("…")) + r"\s*$")

    def rec(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(out)
        if exp[i].strip() == "...":
            return any(rec(i + 1, k) for k in range(j, len(out) + 1))
        return j < len(out) and bool(line_re(exp[i]).match(out[j].rstrip())) and rec(i + 1, j + 1)

    if rec(0, 0):
        return None
    for k, line in enumerate(exp):
        if line.strip() == "...":
            break
        if k >= len(out) or not line_re(line).match(out[k].rstrip()):
            return f"expected line {k + 1}: {line!r}, got {out[k] if k < len(out) else '<end>'!r}"
    return "the lines after an elision differ"


def main() -> int:
    rows = all_snippets()
    counts: dict[str, int] = {}
    for s in rows:
        key = s.status.split(":")[0].split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
        print(f"{s.where:<24} {s.kind:<15} {s.status}")
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    runnable = [s for s in rows if s.runnable_kind]
    ran = sum(1 for s in runnable if not s.status.startswith(("not run", "UNMARKED")))
    print(f"shell/Python blocks: {len(runnable)}, run in CI: {ran}, marked not runnable: "
          f"{sum(1 for s in runnable if s.status.startswith('not run'))}, unmarked: "
          f"{sum(1 for s in runnable if s.status == 'UNMARKED')}")
    return 1 if any(s.status == "UNMARKED" for s in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
