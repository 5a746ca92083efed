"""Rewrite the README's flag table from TrainConfig (`make docs`)."""

import pathlib
import re

from dpax.cli import flags_markdown

readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
text = readme.read_text()
new = re.sub(r"(<!-- flags:start -->\n).*?(<!-- flags:end -->)",
             lambda m: m.group(1) + flags_markdown() + "\n" + m.group(2), text, flags=re.S)
readme.write_text(new)
print("README flag table", "updated" if new != text else "already current")
