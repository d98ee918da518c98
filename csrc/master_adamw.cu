// AdamW on float32 master weights from the model's gradients (bfloat16 as backward wrote them, or float32 once
// accumulated over micro-batches or reduced across ranks), writing the new weights back into the bfloat16 model, in
// one pass. It replaces three: gradients into float32 copies, torch's fused AdamW, weights back to bfloat16.
// The arithmetic is torch's fused AdamW's, so optimizer state and checkpoints are the same either way.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>

namespace {

constexpr int kThreads = 512, kUnroll = 4, kMaxTensors = 400;
constexpr int64_t kChunk = 65536;  // elements per block

// The tensors of one launch, passed by value: a table in device memory needed a host-to-device copy from a pinned
// buffer each step, and measured slower. 27 KB, inside the 32 KB kernel parameter limit of CUDA 12.1+.
struct Batch {
  const void* grad[kMaxTensors];  // all bfloat16 or all float32: the kernel's template argument
  __nv_bfloat16* param[kMaxTensors];
  float* master[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  const float* step[kMaxTensors];  // torch's fused AdamW keeps the step count on the GPU
  int64_t numel[kMaxTensors];
  float lr[kMaxTensors];
  float decay[kMaxTensors];
  int first_block[kMaxTensors + 1];  // tensor t owns blocks [first_block[t], first_block[t + 1])
  int count;
};
static_assert(sizeof(Batch) <= 32764, "kernel parameters are limited to 32,764 bytes");

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// Each block updates one chunk of one tensor.
template <typename Grad>
__global__ void master_adamw_kernel(const __grid_constant__ Batch batch, float beta1, float beta2, float eps,
                                    const float* __restrict__ grad_factor) {
  int lo = 0, hi = batch.count - 1;  // the last tensor whose first block is at or before this one
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.first_block[mid] <= static_cast<int>(blockIdx.x)) lo = mid; else hi = mid - 1;
  }
  const int t = lo;
  const Grad* grad = static_cast<const Grad*>(batch.grad[t]);
  __nv_bfloat16* param = batch.param[t];
  float *master = batch.master[t], *exp_avg = batch.exp_avg[t], *exp_avg_sq = batch.exp_avg_sq[t];
  const float step = *batch.step[t], lr = batch.lr[t], decay = batch.decay[t];
  const float factor = grad_factor ? *grad_factor : 1.0f;  // the clip coefficient
  const float step_size = lr / (1.0f - powf(beta1, step));
  const float correction2_sqrt = sqrtf(1.0f - powf(beta2, step));
  const int64_t start = (blockIdx.x - batch.first_block[t]) * kChunk, end = min(start + kChunk, batch.numel[t]);
  for (int64_t base = start + threadIdx.x; base < end; base += kThreads * kUnroll) {
    float g[kUnroll], p[kUnroll], m[kUnroll], v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: four independent reads in flight per stream
      const int64_t i = base + u * kThreads;
      if (i < end) {
        g[u] = to_float(grad[i]) * factor;
        p[u] = master[i];
        m[u] = exp_avg[i];
        v[u] = exp_avg_sq[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < end) {
        p[u] -= lr * decay * p[u];
        m[u] = beta1 * m[u] + (1.0f - beta1) * g[u];
        v[u] = beta2 * v[u] + (1.0f - beta2) * g[u] * g[u];
        p[u] -= step_size * m[u] / (sqrtf(v[u]) / correction2_sqrt + eps);
        master[i] = p[u];
        exp_avg[i] = m[u];
        exp_avg_sq[i] = v[u];
        param[i] = __float2bfloat16(p[u]);
      }
    }
  }
}

void check_list(const std::vector<torch::Tensor>& tensors, size_t count, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(tensors.size() == count, "master AdamW: ", count, " tensors each, but ", tensors.size(), " ", name);
  for (const auto& t : tensors) {
    TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == dtype, "master AdamW: ", name,
                " must be contiguous CUDA ", c10::toString(dtype));
  }
}

}  // namespace

void master_adamw_cuda(const std::vector<torch::Tensor>& grads, const std::vector<torch::Tensor>& params,
                       const std::vector<torch::Tensor>& masters, const std::vector<torch::Tensor>& exp_avgs,
                       const std::vector<torch::Tensor>& exp_avg_sqs, const std::vector<torch::Tensor>& steps,
                       const std::vector<double>& lrs, const std::vector<double>& decays, double beta1, double beta2,
                       double eps, const c10::optional<torch::Tensor>& grad_factor) {
  const size_t n = masters.size();
  const bool float_grads = n > 0 && grads.size() == n && grads[0].scalar_type() == at::kFloat;
  check_list(grads, n, float_grads ? at::kFloat : at::kBFloat16, "gradients");
  check_list(params, n, at::kBFloat16, "parameters");
  check_list(masters, n, at::kFloat, "masters");
  check_list(exp_avgs, n, at::kFloat, "exp_avg");
  check_list(exp_avg_sqs, n, at::kFloat, "exp_avg_sq");
  check_list(steps, n, at::kFloat, "steps");
  TORCH_CHECK(lrs.size() == n && decays.size() == n, "master AdamW: one lr and weight decay per tensor");
  TORCH_CHECK(!grad_factor || (grad_factor->is_cuda() && grad_factor->scalar_type() == at::kFloat &&
                               grad_factor->numel() == 1),
              "master AdamW: grad_factor must be one CUDA float32");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(masters[0].device());
  for (size_t first = 0; first < n; first += kMaxTensors) {
    Batch batch;
    batch.count = static_cast<int>(std::min<size_t>(kMaxTensors, n - first));
    batch.first_block[0] = 0;
    for (int t = 0; t < batch.count; ++t) {
      const size_t i = first + t;
      TORCH_CHECK(grads[i].numel() == masters[i].numel() && params[i].numel() == masters[i].numel() &&
                      exp_avgs[i].numel() == masters[i].numel() && exp_avg_sqs[i].numel() == masters[i].numel(),
                  "master AdamW: tensor ", i, " has mismatched sizes");
      batch.grad[t] = grads[i].data_ptr();
      batch.param[t] = reinterpret_cast<__nv_bfloat16*>(params[i].data_ptr());
      batch.master[t] = masters[i].data_ptr<float>();
      batch.exp_avg[t] = exp_avgs[i].data_ptr<float>();
      batch.exp_avg_sq[t] = exp_avg_sqs[i].data_ptr<float>();
      batch.step[t] = steps[i].data_ptr<float>();
      batch.numel[t] = masters[i].numel();
      batch.lr[t] = static_cast<float>(lrs[i]);
      batch.decay[t] = static_cast<float>(decays[i]);
      batch.first_block[t + 1] = batch.first_block[t] + static_cast<int>((batch.numel[t] + kChunk - 1) / kChunk);
    }
    const int blocks = batch.first_block[batch.count];
    if (blocks == 0) continue;
    const float* factor = grad_factor ? grad_factor->data_ptr<float>() : nullptr;
    const auto stream = at::cuda::getCurrentCUDAStream();
    if (float_grads) {
      master_adamw_kernel<float><<<blocks, kThreads, 0, stream>>>(batch, static_cast<float>(beta1),
                                                                  static_cast<float>(beta2), static_cast<float>(eps),
                                                                  factor);
    } else {
      master_adamw_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(
          batch, static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(eps), factor);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
