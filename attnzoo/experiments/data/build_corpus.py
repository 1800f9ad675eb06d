"""How ``python-docs.txt.gz`` was made (kept for reproducibility; attnzoo never runs it).

    apt-get download python3.11-doc          # Debian bookworm, 3.11.2-6+deb12u8
    dpkg-deb -x python3.11-doc_*.deb pkg
    python attnzoo/experiments/data/build_corpus.py pkg/usr/share/doc/python3.11/html/_sources

It keeps the tutorial, HOWTOs, FAQ, language reference and glossary, in sorted file order, and removes reST
markup: directive and target lines (``.. x::``, ``.. _x:``) and their indented options, roles (``:func:`len``` →
``len``), ``|substitutions|``, and runs of more than two blank lines. The text is otherwise unchanged.
"""

import gzip
import re
import sys
from pathlib import Path

PARTS = ("tutorial", "howto", "faq", "reference", "glossary.rst.txt")


def clean(text: str) -> str:
    out, skipping = [], False
    for line in text.splitlines():
        if re.match(r"^\.\. ", line):
            skipping = True  # the directive's indented ":option:" lines follow
            continue
        if skipping and re.match(r"^\s+:\w[\w-]*:", line):
            continue
        skipping = False
        line = re.sub(r":[\w:.-]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", line)
        line = re.sub(r"\|(\w+)\|", r"\1", line)
        out.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def main(root: str) -> None:
    base = Path(root)
    files = []
    for part in PARTS:
        path = base / part
        files += sorted(path.rglob("*.rst.txt")) if path.is_dir() else [path]
    text = "".join(clean(f.read_text(encoding="utf-8")) + "\n" for f in files)
    target = Path(__file__).with_name("python-docs.txt.gz")
    with gzip.GzipFile(target, "wb", mtime=0) as f:
        f.write(text.encode("utf-8"))
    print(f"{len(files)} files, {len(text.encode()):,} bytes -> {target} ({target.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
