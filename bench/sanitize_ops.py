"""Run every CUDA op forward and backward once on small shapes; meant for `compute-sanitizer --tool memcheck`."""

import torch

from vitctl.trainer.models.swin import relative_position_index, shift_mask
from vitctl.trainer.ops import cuda
from vitctl.trainer.precision import MasterWeights

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
x = torch.randn(2, 7, 24, device="cuda", dtype=torch.bfloat16, requires_grad=True)
mlp = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24)).cuda()
master = MasterWeights(mlp)  # casts mlp to bf16
optimizer = cuda.MasterAdamW([{"params": list(master.module.parameters())}], lr=1e-3)
for accumulate in (False, False, True):  # torch's step makes the state, then the kernel: bf16, then fp32 gradients
    cuda.mlp(x, mlp[0].weight, mlp[0].bias, mlp[1].weight, mlp[1].bias).sum().backward()
    if accumulate:
        master.accumulate()
    master.step(optimizer, max_norm=1.0)
# ZeRO-1's received buffer, two parts: of odd length (read element by element) and of a multiple of 8 (vector loads)
sizes = [m.numel() for m in master.module.parameters()]
for length in (sum(sizes) + 3, sum(sizes) + 8):
    received = torch.randn(2 * length, device="cuda").bfloat16()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    grads = [received[a:a + m.numel()].view_as(m) for a, m in zip(starts, master.module.parameters(), strict=True)]
    clip = (1.0 / cuda.parts_sum_of_squares(received, 2).sqrt()).clamp(max=1.0)
    assert optimizer.step_master_weights(list(zip(grads, mlp.parameters(), master.module.parameters(), strict=True)),
                                         clip, received, 2)
torch.cuda.synchronize()
print("all ops ran")
