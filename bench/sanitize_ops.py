"""Run every CUDA op forward and backward once on small shapes; meant for `compute-sanitizer --tool memcheck`."""

import torch

from vitctl.trainer.models.swin import relative_position_index, shift_mask
from vitctl.trainer.ops import cuda

for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(2, 14, 21, 40, device="cuda", dtype=dtype, requires_grad=True)
    cuda.window_merge_op(cuda.window_partition_op(x, 7, 3), 7, 3, 14, 21).sum().backward()
    for window, H, W in ((7, 14, 21), (8, 16, 24)):  # bf16: the one-kernel variants for N <= 56 and N = 64
        qkv = torch.randn(2 * (H // window) * (W // window), window**2, 3 * 96, device="cuda", dtype=dtype,
                          requires_grad=True)
        table = torch.randn((2 * window - 1) ** 2, 3, device="cuda", requires_grad=True)
        index = relative_position_index(window).cuda()
        for mask in (shift_mask(H, W, window, window // 2).cuda(), None):  # fp32: matmuls + softmax kernel
            cuda.window_attention(qkv, 3, 32**-0.5, table, index, mask).sum().backward()
torch.cuda.synchronize()
print("all ops ran")
