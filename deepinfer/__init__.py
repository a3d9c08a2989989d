"""deepinfer: DeepSeek inference as a hardware-abstraction library."""

import os

# torch auto-loads torch_npu through an entry point, and a torch_npu without CANN breaks
# `import torch` itself; the ascend backend imports torch_npu explicitly when it is selected.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__version__ = "0.1.0"
