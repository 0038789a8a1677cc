"""Package discovery (everything else is in pyproject.toml).

The source folders at the top of the repository install as subpackages of ``oomcast``
(``model/`` as ``oomcast.model``, ...), so a training script's own ``model`` package never
clashes with ours. pyproject.toml alone cannot give found packages that prefix, so this
finds every package below those folders and maps it: a new subpackage can no longer be left
out of the wheel by a hand-written list (``tests/packaging`` checks it).
"""

from setuptools import find_packages, setup

TOP = ("model", "collectors", "service", "training", "preflight", "cli", "bench")

setup(
    packages=["oomcast." + p for p in find_packages(include=[*TOP, *(t + ".*" for t in TOP)])],
    package_dir={"oomcast." + t: t for t in TOP},
)
