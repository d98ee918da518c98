// Swin's window attention core after q k^T: softmax(logits + relative-position bias[head] + shift mask[window]).
// The bias comes straight from the ((2w-1)^2, heads) table through the (N, N) index and the mask from its
// (nW, N, N) buffer: neither is expanded to (B*nW, heads, N, N). Forward: one warp per row. Backward: the logits'
// gradient, and the bias gradient summed over windows in registers before one atomic add per (head, i, j).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

namespace {

constexpr int kWarp = 32;
constexpr int kMaxPerLane = 8;  // rows up to 256 tokens (Swin uses 49 and 144)
constexpr int kWarpsPerBlock = 8;
constexpr int kWindowsPerChunk = 32;

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_max(acc_t v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}

// Arithmetic in acc_t: float for half, bfloat16 and float; double for double.
template <typename scalar_t, typename acc_t>
__global__ void softmax_forward_kernel(const scalar_t* __restrict__ logits, scalar_t* __restrict__ probs,
                                       const acc_t* __restrict__ table, const int* __restrict__ index,
                                       const acc_t* __restrict__ mask, int64_t rows, int heads, int N, int n_windows) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row = blockIdx.x * (int64_t)kWarpsPerBlock + threadIdx.x / kWarp;
  if (row >= rows) return;
  const int i = row % N;
  const int h = (row / N) % heads;
  const int64_t window = row / ((int64_t)N * heads);
  const scalar_t* in = logits + row * N;
  const acc_t* mask_row = mask ? mask + ((window % n_windows) * N + i) * (int64_t)N : nullptr;
  acc_t vals[kMaxPerLane];
  acc_t top = -INFINITY;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int j = lane + k * kWarp;
    if (j < N) {
      acc_t v = static_cast<acc_t>(in[j]) + table[index[i * N + j] * heads + h];
      if (mask_row) v += mask_row[j];
      vals[k] = v;
      top = max(top, v);
    }
  }
  top = warp_max(top);
  acc_t total = 0;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    if (lane + k * kWarp < N) {
      vals[k] = exp(vals[k] - top);
      total += vals[k];
    }
  }
  const acc_t inv = acc_t(1) / warp_sum(total);
  scalar_t* out = probs + row * N;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int j = lane + k * kWarp;
    if (j < N) out[j] = static_cast<scalar_t>(vals[k] * inv);
  }
}

// grad_logits = P * (G - sum_j P G), row by row; each warp owns one (head, i) and walks a chunk of windows,
// summing grad_logits for the bias in registers.
template <typename scalar_t, typename acc_t>
__global__ void softmax_backward_kernel(const scalar_t* __restrict__ probs, const scalar_t* __restrict__ grad,
                                        scalar_t* __restrict__ grad_logits, acc_t* __restrict__ grad_bias,
                                        int64_t n_windows_total, int heads, int N) {
  const int lane = threadIdx.x % kWarp;
  const int pair = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;  // h * N + i
  if (pair >= heads * N) return;
  const int64_t first = blockIdx.y * (int64_t)kWindowsPerChunk;
  const int64_t last = min(first + kWindowsPerChunk, n_windows_total);
  acc_t acc[kMaxPerLane] = {0};
  for (int64_t b = first; b < last; ++b) {
    const int64_t offset = (b * heads * N + pair) * N;
    acc_t p[kMaxPerLane], g[kMaxPerLane];
    acc_t dot = 0;
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int j = lane + k * kWarp;
      if (j < N) {
        p[k] = static_cast<acc_t>(probs[offset + j]);
        g[k] = static_cast<acc_t>(grad[offset + j]);
        dot += p[k] * g[k];
      }
    }
    dot = warp_sum(dot);
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int j = lane + k * kWarp;
      if (j < N) {
        const acc_t d = p[k] * (g[k] - dot);
        grad_logits[offset + j] = static_cast<scalar_t>(d);
        acc[k] += d;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int j = lane + k * kWarp;
    if (j < N) atomicAdd(grad_bias + (int64_t)pair * N + j, acc[k]);
  }
}

void check_logits(const torch::Tensor& logits) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 4 && logits.size(2) == logits.size(3),
              "window softmax expects CUDA logits (B*nW, heads, N, N), got ", logits.sizes());
  TORCH_CHECK(logits.size(3) <= kWarp * kMaxPerLane, "window softmax supports up to ", kWarp * kMaxPerLane,
              " tokens per window, got ", logits.size(3));
}

}  // namespace

torch::Tensor window_softmax_forward_cuda(const torch::Tensor& logits, const torch::Tensor& table,
                                          const torch::Tensor& index, const c10::optional<torch::Tensor>& mask) {
  check_logits(logits);
  const int64_t B = logits.size(0), heads = logits.size(1), N = logits.size(2);
  TORCH_CHECK(table.dim() == 2 && table.size(1) == heads, "bias table must be (entries, ", heads, "), got ",
              table.sizes());
  TORCH_CHECK(index.sizes() == torch::IntArrayRef({N, N}), "bias index must be (", N, ", ", N, "), got ",
              index.sizes());
  int64_t n_windows = 1;
  if (mask) {
    TORCH_CHECK(mask->dim() == 3 && mask->size(1) == N && mask->size(2) == N && B % mask->size(0) == 0,
                "shift mask must be (nW, ", N, ", ", N, ") with nW dividing ", B, ", got ", mask->sizes());
    n_windows = mask->size(0);
  }
  c10::cuda::CUDAGuard guard(logits.device());
  auto in = logits.contiguous();
  auto out = torch::empty_like(in);
  const auto acc_type = at::toOpMathType(in.scalar_type());
  auto table_f = table.to(acc_type).contiguous();
  auto index_i = index.to(torch::kInt).contiguous();
  auto mask_f = mask ? mask->to(acc_type).contiguous() : torch::Tensor();
  const int64_t rows = B * heads * N;
  if (rows == 0) return out;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "window_softmax_forward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    softmax_forward_kernel<scalar_t, acc_t><<<blocks, kWarpsPerBlock * kWarp, 0, at::cuda::getCurrentCUDAStream()>>>(
        in.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), table_f.data_ptr<acc_t>(), index_i.data_ptr<int>(),
        mask ? mask_f.data_ptr<acc_t>() : nullptr, rows, heads, N, n_windows);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::vector<torch::Tensor> window_softmax_backward_cuda(const torch::Tensor& probs, const torch::Tensor& grad) {
  check_logits(probs);
  TORCH_CHECK(grad.sizes() == probs.sizes(), "gradient shape ", grad.sizes(), " != probabilities ", probs.sizes());
  const int64_t B = probs.size(0), heads = probs.size(1), N = probs.size(2);
  c10::cuda::CUDAGuard guard(probs.device());
  auto p = probs.contiguous();
  auto g = grad.to(probs.scalar_type()).contiguous();
  auto grad_logits = torch::empty_like(p);
  auto grad_bias = torch::zeros({heads, N, N}, p.options().dtype(at::toOpMathType(p.scalar_type())));
  if (B == 0) return {grad_logits, grad_bias};
  const dim3 blocks((heads * N + kWarpsPerBlock - 1) / kWarpsPerBlock, (B + kWindowsPerChunk - 1) / kWindowsPerChunk);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.scalar_type(), "window_softmax_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    softmax_backward_kernel<scalar_t, acc_t><<<blocks, kWarpsPerBlock * kWarp, 0, at::cuda::getCurrentCUDAStream()>>>(
        p.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), grad_logits.data_ptr<scalar_t>(),
        grad_bias.data_ptr<acc_t>(), B, heads, N);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_logits, grad_bias};
}
