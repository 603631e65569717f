"""Keep docs/benchmarks.md as named sections that each benchmark rewrites on its own."""

from __future__ import annotations

import json
import re
from pathlib import Path

HEADER = "# pdserve benchmarks\n\nEvery figure here was written by the command named in its section.\n"


def update_section(path: Path, name: str, title: str, body: str) -> None:
    """Replace (or append) the section between `<!-- name:start -->` and `<!-- name:end -->`."""
    text = path.read_text() if path.exists() else HEADER
    block = f"<!-- {name}:start -->\n## {title}\n\n{body.strip()}\n<!-- {name}:end -->"
    pattern = re.compile(rf"<!-- {re.escape(name)}:start -->.*?<!-- {re.escape(name)}:end -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def publish(results: dict, out: str, section: str, title: str, text: str) -> None:
    """Write a benchmark's JSON, print its table, and put the table into docs/benchmarks.md."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2))
    print(text)
    update_section(Path("docs/benchmarks.md"), section, title, text)
