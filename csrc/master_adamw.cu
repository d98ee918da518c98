// AdamW on float32 master weights from the model's gradients (bfloat16 as backward wrote them, or float32 once
// accumulated over micro-batches or reduced across ranks), writing the new weights back into the bfloat16 model, in
// one pass. It replaces three: gradients into float32 copies, torch's fused AdamW, weights back to bfloat16.
// The arithmetic is torch's fused AdamW's, so optimizer state and checkpoints are the same either way.
// Under ZeRO-1 a gradient can come as the equal-spaced bfloat16 parts the ranks sent (each rank's own), whose mean
// the kernel takes as it reads them: the pass that would write that mean in float32 and the read of it are saved.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>

namespace {

constexpr int kThreads = 512, kVec = 4, kMaxTensors = 400;
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

// kVec consecutive elements in one load or store: 16 bytes of float32, 8 of bfloat16.
__device__ __forceinline__ void load(const float* from, float to[kVec]) {
  const float4 x = *reinterpret_cast<const float4*>(from);
  to[0] = x.x, to[1] = x.y, to[2] = x.z, to[3] = x.w;
}
__device__ __forceinline__ void load(const __nv_bfloat16* from, float to[kVec]) {
  const uint2 x = *reinterpret_cast<const uint2*>(from);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.y));
  to[0] = a.x, to[1] = a.y, to[2] = b.x, to[3] = b.y;
}
__device__ __forceinline__ void store(float* to, const float from[kVec]) {
  *reinterpret_cast<float4*>(to) = make_float4(from[0], from[1], from[2], from[3]);
}
__device__ __forceinline__ void store(__nv_bfloat16* to, const float from[kVec]) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(from[0], from[1]), b = __floats2bfloat162_rn(from[2], from[3]);
  uint2 x;
  x.x = *reinterpret_cast<const unsigned*>(&a), x.y = *reinterpret_cast<const unsigned*>(&b);
  *reinterpret_cast<uint2*>(to) = x;
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// Each block updates one chunk of one tensor, each thread kVec consecutive elements at a time: as vector loads and
// stores where every array of the launch is aligned to them (`kAligned`), else element by element.
template <typename Grad, bool kAligned>
__global__ void master_adamw_kernel(const __grid_constant__ Batch batch, float beta1, float beta2, float eps,
                                    const float* __restrict__ grad_factor, int parts, int64_t part_stride) {
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
  const float inv_parts = 1.0f / parts;  // torch's mean multiplies by it too
  const float step_size = lr / (1.0f - powf(beta1, step));
  const float correction2_sqrt = sqrtf(1.0f - powf(beta2, step));
  const int64_t start = (blockIdx.x - batch.first_block[t]) * kChunk, end = min(start + kChunk, batch.numel[t]);
  for (int64_t base = start + threadIdx.x * kVec; base < end; base += kThreads * kVec) {
    float g[kVec] = {}, p[kVec] = {}, m[kVec] = {}, v[kVec] = {};
    const bool whole = kAligned && base + kVec <= end;
    if (whole) {
      load(grad + base, g);
      for (int q = 1; q < parts; ++q) {
        float h[kVec];
        load(grad + base + q * part_stride, h);
#pragma unroll
        for (int u = 0; u < kVec; ++u) g[u] += h[u];
      }
      load(master + base, p);
      load(exp_avg + base, m);
      load(exp_avg_sq + base, v);
    } else {
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        const int64_t i = base + u;
        if (i < end) {
          g[u] = to_float(grad[i]);
          for (int q = 1; q < parts; ++q) g[u] += to_float(grad[i + q * part_stride]);
          p[u] = master[i];
          m[u] = exp_avg[i];
          v[u] = exp_avg_sq[i];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      g[u] = g[u] * inv_parts * factor;
      p[u] -= lr * decay * p[u];
      m[u] = beta1 * m[u] + (1.0f - beta1) * g[u];
      v[u] = beta2 * v[u] + (1.0f - beta2) * g[u] * g[u];
      p[u] -= step_size * m[u] / (sqrtf(v[u]) / correction2_sqrt + eps);
    }
    if (whole) {
      store(master + base, p);
      store(exp_avg + base, m);
      store(exp_avg_sq + base, v);
      store(param + base, p);
    } else {
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        const int64_t i = base + u;
        if (i < end) {
          master[i] = p[u];
          exp_avg[i] = m[u];
          exp_avg_sq[i] = v[u];
          param[i] = __float2bfloat16(p[u]);
        }
      }
    }
  }
}

bool aligned(const void* pointer, size_t bytes) { return reinterpret_cast<uintptr_t>(pointer) % bytes == 0; }

void check_list(const std::vector<torch::Tensor>& tensors, size_t count, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(tensors.size() == count, "master AdamW: ", count, " tensors each, but ", tensors.size(), " ", name);
  for (const auto& t : tensors) {
    TORCH_CHECK(t.is_cuda() && t.is_contiguous() && t.scalar_type() == dtype, "master AdamW: ", name,
                " must be contiguous CUDA ", c10::toString(dtype));
  }
}

constexpr int kNormBlocks = 1024;  // a fixed grid: the same sum, in the same order, every step

__device__ __forceinline__ void load8(const __nv_bfloat16* from, float to[8]) {
  const uint4 x = *reinterpret_cast<const uint4*>(from);
  const unsigned words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 pair = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[k]));
    to[2 * k] = pair.x, to[2 * k + 1] = pair.y;
  }
}

// Each block's sum of squares of the mean of `parts` slices `length` apart, over a grid-strided range of elements:
// eight at a time in 16-byte loads where the slices are aligned to them (`kVectors`), else one at a time.
template <bool kVectors>
__global__ void parts_sum_of_squares_kernel(const __nv_bfloat16* __restrict__ flat, int parts, int64_t length,
                                            float* __restrict__ block_sums) {
  const float inv_parts = 1.0f / parts;
  const int64_t first = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  float sum = 0.0f;
  if (kVectors) {
    for (int64_t i = first * 8; i < length; i += stride * 8) {
      float g[8], h[8];
      load8(flat + i, g);
      for (int q = 1; q < parts; ++q) {
        load8(flat + i + q * length, h);
#pragma unroll
        for (int u = 0; u < 8; ++u) g[u] += h[u];
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) sum += (g[u] * inv_parts) * (g[u] * inv_parts);
    }
  } else {
    for (int64_t i = first; i < length; i += stride) {
      float g = __bfloat162float(flat[i]);
      for (int q = 1; q < parts; ++q) g += __bfloat162float(flat[i + q * length]);
      sum += (g * inv_parts) * (g * inv_parts);
    }
  }
  __shared__ float warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (threadIdx.x == 0) block_sums[blockIdx.x] = sum;
  }
}

}  // namespace

torch::Tensor parts_sum_of_squares_cuda(const torch::Tensor& flat, int64_t parts) {
  TORCH_CHECK(flat.is_cuda() && flat.is_contiguous() && flat.scalar_type() == at::kBFloat16 && flat.dim() == 1,
              "parts sum of squares: flat must be a contiguous 1-d CUDA bfloat16 tensor");
  TORCH_CHECK(parts >= 1 && flat.numel() % parts == 0, "parts sum of squares: ", flat.numel(),
              " elements do not split into ", parts, " equal parts");
  const c10::cuda::CUDAGuard guard(flat.device());
  auto block_sums = torch::zeros({kNormBlocks}, flat.options().dtype(at::kFloat));
  const int64_t length = flat.numel() / parts;
  if (length > 0) {
    const auto* data = reinterpret_cast<const __nv_bfloat16*>(flat.data_ptr());
    const auto stream = at::cuda::getCurrentCUDAStream();
    if (length % 8 == 0 && aligned(data, 16)) {
      parts_sum_of_squares_kernel<true><<<kNormBlocks, kThreads, 0, stream>>>(data, static_cast<int>(parts), length,
                                                                             block_sums.data_ptr<float>());
    } else {
      parts_sum_of_squares_kernel<false><<<kNormBlocks, kThreads, 0, stream>>>(data, static_cast<int>(parts), length,
                                                                              block_sums.data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return block_sums.sum();
}

void master_adamw_cuda(const std::vector<torch::Tensor>& grads, const std::vector<torch::Tensor>& params,
                       const std::vector<torch::Tensor>& masters, const std::vector<torch::Tensor>& exp_avgs,
                       const std::vector<torch::Tensor>& exp_avg_sqs, const std::vector<torch::Tensor>& steps,
                       const std::vector<double>& lrs, const std::vector<double>& decays, double beta1, double beta2,
                       double eps, const c10::optional<torch::Tensor>& grad_factor, int64_t parts,
                       int64_t part_stride) {
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
  TORCH_CHECK(parts >= 1 && (parts == 1 || !float_grads), "master AdamW: gradients in parts must be bfloat16");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(masters[0].device());
  for (size_t first = 0; first < n; first += kMaxTensors) {
    Batch batch;
    bool vectors = part_stride % kVec == 0;  // every array of the launch aligned to kVec elements
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
      vectors = vectors && aligned(batch.grad[t], kVec * grads[i].element_size()) &&
                aligned(batch.param[t], kVec * 2) && aligned(batch.master[t], kVec * 4) &&
                aligned(batch.exp_avg[t], kVec * 4) && aligned(batch.exp_avg_sq[t], kVec * 4);
    }
    const int blocks = batch.first_block[batch.count];
    if (blocks == 0) continue;
    const float* factor = grad_factor ? grad_factor->data_ptr<float>() : nullptr;
    const auto stream = at::cuda::getCurrentCUDAStream();
    const auto b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2), e = static_cast<float>(eps);
    const int p = static_cast<int>(parts);
    if (float_grads && vectors) {
      master_adamw_kernel<float, true><<<blocks, kThreads, 0, stream>>>(batch, b1, b2, e, factor, 1, 0);
    } else if (float_grads) {
      master_adamw_kernel<float, false><<<blocks, kThreads, 0, stream>>>(batch, b1, b2, e, factor, 1, 0);
    } else if (vectors) {
      master_adamw_kernel<__nv_bfloat16, true><<<blocks, kThreads, 0, stream>>>(batch, b1, b2, e, factor, p,
                                                                              part_stride);
    } else {
      master_adamw_kernel<__nv_bfloat16, false><<<blocks, kThreads, 0, stream>>>(batch, b1, b2, e, factor, p,
                                                                               part_stride);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
