"""Print the pip requirements of CI's floor environment: `name==X` for each package whose floor CI tests, X being the
`>=` bound pyproject.toml declares (so the declared floor is the tested one)."""

import re
import tomllib
from pathlib import Path

FLOORED = ("transformers", "peft", "accelerate")

dependencies = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
pins = []
for name in FLOORED:
    spec = next(d for d in dependencies if re.match(rf"{name}\s*[><=]", d))
    floor = re.search(r">=\s*([\w.]+)", spec).group(1)
    pins.append(f"{name}=={floor}")
print(" ".join(pins))
