"""Run every CUDA op forward and backward once on small shapes; meant for `compute-sanitizer --tool memcheck`."""

import torch

from vitctl.trainer.models.swin import relative_position_index, shift_mask
from vitctl.trainer.ops import cuda

for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(2, 14, 21, 40, device="cuda", dtype=dtype, requires_grad=True)
    cuda.window_merge_op(cuda.window_partition_op(x, 7, 3), 7, 3, 14, 21).sum().backward()
    qkv = torch.randn(2 * 6, 49, 3 * 96, device="cuda", dtype=dtype, requires_grad=True)
    table = torch.randn(169, 3, device="cuda", requires_grad=True)
    for mask in (shift_mask(14, 21, 7, 3).cuda(), None):  # fp32: matmuls + softmax kernel; bf16: one kernel
        cuda.window_attention(qkv, 3, 32**-0.5, table, relative_position_index(7).cuda(), mask).sum().backward()
torch.cuda.synchronize()
print("all ops ran")
