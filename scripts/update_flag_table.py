"""Rewrite the flag table in docs/cli.md from TrainConfig (`make docs`)."""

import pathlib
import re

from dpax.cli.flags import flags_markdown
from dpax.cli.job import TrainConfig

page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "cli.md"
text = page.read_text()
new = re.sub(r"(<!-- flags:start -->\n).*?(<!-- flags:end -->)",
             lambda m: m.group(1) + flags_markdown(TrainConfig) + "\n" + m.group(2), text,
             flags=re.S)
page.write_text(new)
print("docs/cli.md flag table", "updated" if new != text else "already current")
