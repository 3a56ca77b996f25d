"""Under NVSHARE_MEMORY_LIMIT (set by the caller, e.g. 2G): what PyTorch and NVML see inside the
process, and an allocation past the limit failing without killing the process. At most 1.5 GiB
is ever allocated at once."""

import json
import os

import pynvml
import torch

limit = int(os.environ["NVS_TEST_LIMIT_BYTES"])
result = {}
free, total = torch.cuda.mem_get_info()
result["mem_get_info"] = [free, total]
result["total_memory"] = torch.cuda.get_device_properties(0).total_memory
x = torch.empty(int(0.75 * limit), dtype=torch.uint8, device="cuda")
try:
    y = torch.empty(int(0.5 * limit), dtype=torch.uint8, device="cuda")
    result["over_limit"] = "allocated"
except torch.cuda.OutOfMemoryError:
    result["over_limit"] = "OutOfMemoryError"
pynvml.nvmlInit()
memory = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
result["nvml"] = [memory.total, memory.free, memory.used]
pynvml.nvmlShutdown()
del x
torch.cuda.empty_cache()
y = torch.empty(int(0.5 * limit), dtype=torch.uint8, device="cuda")
result["after_free"] = "allocated"
print(json.dumps(result))
