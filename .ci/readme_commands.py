"""Print the commands of the README's first ```bash block, one per line, comments stripped.

.ci/run runs exactly these, so the README and CI cannot drift apart."""

from __future__ import annotations

import sys
from pathlib import Path


def readme_commands(text: str) -> list[str]:
    """Non-empty lines of the first ```bash fence, each without its trailing `# ...` comment."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "```bash")
    except StopIteration:
        raise SystemExit("README: no ```bash block") from None
    out = []
    for line in lines[start + 1:]:
        if line.strip().startswith("```"):
            break
        command = line.split(" #", 1)[0].strip()
        if command:
            out.append(command)
    return out


if __name__ == "__main__":
    for command in readme_commands(Path(sys.argv[1]).read_text(encoding="utf-8")):
        print(command)
