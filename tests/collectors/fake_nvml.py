"""The fake ``pynvml`` module, for tests on machines without a GPU.

It lives in the package (``oomcast.bench.fake_nvml``) because ``oomcast bench agent``
uses it too; this module keeps the tests' import path.
"""

from oomcast.bench.fake_nvml import *  # noqa: F403
