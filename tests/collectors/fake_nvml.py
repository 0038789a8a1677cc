"""The fake ``pynvml`` module, for tests on machines without a GPU.

It lives in the package (``oomcast.collectors.fake_nvml``) because ``oomcast bench agent``
uses it too; this module keeps the tests' import path.
"""

from oomcast.collectors.fake_nvml import *  # noqa: F403
